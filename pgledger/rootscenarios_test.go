package pgledger

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/jwire"
)

var (
	rootScenarios = flag.Bool("pg.root", true, "run the root package's tests with every harness Manager on this journal")
	rootRun       = flag.String("pg.root.run", "", "the -run pattern of the root package's tests run on this journal")
	rootVerbose   = flag.Bool("pg.root.v", false, "show the root package's test output")
)

// backend serves a Journal over jwire.
type backend struct{ j *Journal }

// records is recs as the journal takes them.
func records(recs []jwire.Rec) []bgtask.Record {
	out := make([]bgtask.Record, len(recs))
	for i, r := range recs {
		out[i] = bgtask.Record{Seq: r.Seq, Kind: r.Kind, TaskID: r.TaskID, AttemptID: r.AttemptID, Token: r.Token,
			SessionID: r.SessionID, ParentSessionID: r.ParentSessionID, Data: r.Data} // no Usage: the root's scenarios keep no fleet budget
	}
	return out
}

func (b backend) Append(recs []jwire.Rec) func() error { return b.j.Append(records(recs)).Wait }

func (b backend) Replay(fn func(jwire.Rec) error) error {
	return b.j.Replay(func(r bgtask.Record) error {
		return fn(jwire.Rec{Seq: r.Seq, Kind: r.Kind, TaskID: r.TaskID, AttemptID: r.AttemptID, Token: r.Token,
			SessionID: r.SessionID, ParentSessionID: r.ParentSessionID, Data: r.Data})
	})
}

func (b backend) Compact(keep []jwire.Rec) error { return b.j.Compact(records(keep)) }

func (b backend) Close() error { return b.j.Close() }

// The root package's own scenario tests — every test built on its
// harness, which is most of them — run with each Manager on a journal of
// its own here: a ledger per Manager, served to the test binary over a
// Unix socket (the root module cannot import this one). A Manager the
// database refuses, or that behaves otherwise on it, fails them.
func TestRootScenariosOnPostgres(t *testing.T) {
	if !*rootScenarios {
		t.Skip("-pg.root=false")
	}
	f := newFixture(t)
	if err := Migrate(ctx(t), f.pool); err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "bgj") // short: a socket path has a limit
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "j")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var served, failed sync.Map
	wg.Add(1)
	go func() {
		defer wg.Done()
		for n := 0; ; n++ {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				ledger := fmt.Sprintf("%s-%d", f.ledger, n)
				j, err := Open(context.Background(), f.pool, Options{Ledger: ledger, Member: "m"})
				if err != nil {
					failed.Store(ledger, err)
					_ = conn.Close()
					return
				}
				served.Store(ledger, true)
				_ = jwire.Serve(conn, backend{j})
			}()
		}
	}()
	args := []string{"test", "-count=1", "-timeout=10m"}
	if *rootRun != "" {
		args = append(args, "-v", "-run", *rootRun)
	}
	cmd := exec.Command("go", append(args, ".")...)
	cmd.Dir = ".."
	cmd.Env = append(os.Environ(), "BGTASK_TEST_JOURNAL=unix:"+sock)
	out, err := cmd.CombinedOutput()
	_ = l.Close()
	wg.Wait()
	failed.Range(func(k, v any) bool { t.Errorf("opening the journal of %v: %v", k, v); return true })
	n := 0
	served.Range(func(any, any) bool { n++; return true })
	if err != nil {
		var exit *exec.ExitError
		if !errors.As(err, &exit) {
			t.Fatalf("running the root tests: %v", err)
		}
		t.Fatalf("the root tests failed on PostgreSQL (%d journals served):\n%s", n, out)
	}
	if *rootVerbose {
		t.Logf("%s", out)
	}
	if n < 100 && *rootRun == "" {
		t.Fatalf("only %d Managers ran on the journal: is BGTASK_TEST_JOURNAL read?\n%s", n, out)
	}
	t.Logf("%d root-package Managers ran on PostgreSQL", n)
}
