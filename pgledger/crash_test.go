package pgledger

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The outbox across a kill -9. A child process (this test binary, run as
// crashChild) launches tasks that end at once, each from a parent of its
// own, and kills itself with SIGKILL at one point of the delivery path:
//
//   - mid-append: while a commit that writes notifications is in flight
//     (it may land or not);
//   - mid-delivery: inside a Notifier call, before the delivery counts;
//   - after-delivery: once a Notifier call returned, before the next round
//     deletes the row.
//
// A rescuer node in this process then takes the dead member over, ends
// its runs (their sessions report their answers) and delivers what is
// owed. Every landed task's final summary and every parent's all_complete
// is delivered, under one ID each; only a notification the child
// delivered before it died is delivered again (at least once across a
// crash), and after-delivery's last delivery is.
func TestACrashAtEachPointOfDelivery(t *testing.T) {
	for _, point := range []string{"mid-append", "mid-delivery", "after-delivery"} {
		t.Run(point, func(t *testing.T) {
			f := newFixture(t)
			require.NoError(t, Migrate(ctx(t), f.pool))
			out := filepath.Join(t.TempDir(), "delivered")
			c, cancel := context.WithTimeout(context.Background(), time.Minute) // failure detection only
			defer cancel()
			cmd := exec.CommandContext(c, os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), CrashChildEnv+"="+point, crashDBEnv+"="+dbURL, crashLedgerEnv+"="+f.ledger, crashOutEnv+"="+out)
			cmd.Stdout, cmd.Stderr = tlog{t}, tlog{t}
			err := cmd.Run()
			var exit *exec.ExitError
			require.ErrorAs(t, err, &exit, "the child dies")
			require.Equal(t, syscall.SIGKILL, exit.Sys().(syscall.WaitStatus).Signal(), "by SIGKILL, at its crash point")
			before := readDeliveries(t, out)

			box := newInbox()
			rescuer, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "rescuer", Host: endedHost{}, Poll: 100 * time.Millisecond,
				Notifier: box, Lease: 2 * time.Second, claimFor: 2 * time.Second, marked: tell(f.marked)})
			require.NoError(t, err)
			closeAtEnd(t, rescuer)
			// Settled once no task is live and the outbox is empty: checked at
			// each delete the rescuer makes, its last among them.
			settle := time.After(45 * time.Second) // failure detection only
			for f.count("bgtask_tasks", "NOT ended")+f.count("bgtask_notes", "") > 0 {
				select {
				case <-f.marked:
				case <-settle:
					t.Fatalf("the rescuer did not settle: %d live tasks, %d notes left", f.count("bgtask_tasks", "NOT ended"), f.count("bgtask_notes", ""))
				}
			}
			require.NoError(t, rescuer.Close(ctx(t)))
			box.mu.Lock()
			after := make([]delivery, 0, len(box.got))
			for _, n := range box.got {
				after = append(after, deliveryOf(n))
			}
			box.mu.Unlock()

			// Each landed task's summary and each parent's all_complete, under
			// one ID each.
			byKey := map[string]string{} // kind and task (or parent) → ID
			for _, d := range append(append([]delivery{}, before...), after...) {
				key := d.Kind + " " + d.Task
				if d.Kind == string(bgtask.NotifyAllComplete) {
					key = d.Kind + " " + d.Parent + " " + strings.Join(d.Tasks, ",") // a round: its parent and tasks
				}
				if id, ok := byKey[key]; ok {
					assert.Equal(t, id, d.ID, "%s is delivered under one ID", key)
				}
				byKey[key] = d.ID
			}
			rows, err := f.pool.Query(ctx(t), `SELECT task_id, parent_session FROM bgtask_tasks WHERE ledger = $1`, f.ledger)
			require.NoError(t, err)
			landed, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Task, Parent string }])
			require.NoError(t, err)
			require.NotEmpty(t, landed)
			rounds := map[string]bool{} // parent and task, in a delivered all_complete
			for _, d := range append(append([]delivery{}, before...), after...) {
				for _, task := range d.Tasks {
					rounds[d.Parent+" "+task] = true
				}
			}
			for _, l := range landed {
				assert.Contains(t, byKey, "final_summary "+l.Task, "the summary of a landed task")
				assert.True(t, rounds[l.Parent+" "+l.Task], "task %s is in an all_complete of its parent %s", l.Task, l.Parent)
			}
			// Twice only what the child delivered before it died.
			told := map[string]bool{}
			for _, d := range before {
				assert.False(t, told[d.ID], "the child delivered %s twice", d.ID)
				told[d.ID] = true
			}
			again := map[string]bool{}
			for _, d := range after {
				assert.False(t, again[d.ID], "the rescuer delivered %s twice", d.ID)
				again[d.ID] = true
			}
			var twice []string
			for id := range again {
				if told[id] {
					twice = append(twice, id)
				}
			}
			if point == "after-delivery" {
				require.NotEmpty(t, before)
				assert.Contains(t, twice, before[len(before)-1].ID, "the delivery the crash left undeleted is made again, with its ID")
			}
			t.Logf("%s: %d landed tasks, %d delivered before the crash, %d after, %d of them again", point, len(landed), len(before), len(after), len(twice))
		})
	}
}

// delivery is one notification a Notifier was given, as the child writes
// it down (Tasks: an all_complete's).
type delivery struct {
	ID, Kind, Task, Parent string
	Tasks                  []string
}

// deliveryOf is n as the child writes it down.
func deliveryOf(n bgtask.Notification) delivery {
	d := delivery{ID: n.ID, Kind: string(n.Kind), Task: n.TaskID, Parent: n.ParentSessionID}
	for _, t := range n.Tasks {
		d.Tasks = append(d.Tasks, t.ID)
	}
	return d
}

func readDeliveries(t *testing.T, path string) []delivery {
	t.Helper()
	file, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	require.NoError(t, err)
	defer file.Close()
	var out []delivery
	s := bufio.NewScanner(file)
	for s.Scan() {
		var d delivery
		require.NoError(t, json.Unmarshal(s.Bytes(), &d))
		out = append(out, d)
	}
	require.NoError(t, s.Err())
	return out
}

// endedHost is the rescuer's host: every session it is asked about ended
// with an answer.
type endedHost struct{}

func (endedHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	return "", errors.New("the rescuer starts nothing")
}
func (endedHost) AbortSession(context.Context, string) error { return nil }
func (endedHost) SessionStatus(context.Context, string) (bgtask.SessionReport, error) {
	return bgtask.SessionReport{State: bgtask.SessionStateEnded, End: bgtask.Event{Kind: bgtask.SessionIdle, Text: "ok"}}, nil
}
func (endedHost) FindSession(context.Context, bgtask.SessionRequest) (string, error) { return "", nil }

// The child's environment: CrashChildEnv names its crash point.
const (
	CrashChildEnv  = "BGTASK_PG_CRASH_CHILD"
	crashDBEnv     = "BGTASK_PG_CRASH_DB"
	crashLedgerEnv = "BGTASK_PG_CRASH_LEDGER"
	crashOutEnv    = "BGTASK_PG_CRASH_OUT"
	crashAfter     = 40 // the deliveries (or appends with notes) before the crash
)

// CrashChild is TestACrashAtEachPointOfDelivery's child (TestMain runs
// it when CrashChildEnv is set): it launches until it kills itself.
func CrashChild() error {
	point := os.Getenv(CrashChildEnv)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv(crashDBEnv))
	if err != nil {
		return err
	}
	die := func() { _ = syscall.Kill(os.Getpid(), syscall.SIGKILL); select {} }
	var appends atomic.Int64
	if point == "mid-append" {
		cfg.ConnConfig.Tracer = appendKiller{func(d pgx.TraceQueryStartData) {
			// A commit that writes notes: its arguments' last is their bodies.
			if d.SQL == appendSQL && len(d.Args) == 23 {
				if bodies, ok := d.Args[22].([]string); ok && len(bodies) > 0 && appends.Add(1) == crashAfter/4 {
					go func() { time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond); die() }()
				}
			}
		}}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	file, err := os.OpenFile(os.Getenv(crashOutEnv), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	var mu sync.Mutex
	var told int
	note := notifierFunc(func(_ context.Context, n bgtask.Notification) error {
		mu.Lock()
		defer mu.Unlock()
		told++
		if point == "mid-delivery" && told == crashAfter {
			die()
		}
		line, _ := json.Marshal(deliveryOf(n))
		if _, err := file.Write(append(line, '\n')); err != nil {
			return err
		}
		if err := file.Sync(); err != nil {
			return err
		}
		if point == "after-delivery" && told == crashAfter {
			die()
		}
		return nil
	})
	host := &answering{}
	node, err := Join(ctx, pool, NodeOptions{Ledger: os.Getenv(crashLedgerEnv), Member: "victim", Host: host, Poll: 100 * time.Millisecond,
		Notifier: note, Lease: 2 * time.Second, claimFor: 2 * time.Second})
	if err != nil {
		return err
	}
	host.m.Store(node.Manager())
	for i := 0; ; i++ { // until the crash: three tasks a parent, launched together (a round of one to three)
		errs := make(chan error, 3)
		for range 3 {
			go func() {
				_, err := node.Launch(ctx, bgtask.Spec{ParentSessionID: "p-" + strconv.Itoa(i), Prompt: "do it", Models: spec.Models})
				errs <- err
			}()
		}
		for range 3 {
			if err := <-errs; err != nil {
				return fmt.Errorf("launch %d: %w", i, err)
			}
		}
	}
}

// notifierFunc is a Notifier of a function.
type notifierFunc func(context.Context, bgtask.Notification) error

func (f notifierFunc) Notify(ctx context.Context, n bgtask.Notification) error { return f(ctx, n) }

// appendKiller is a pool's tracer that hands each statement to f as it
// starts.
type appendKiller struct{ f func(pgx.TraceQueryStartData) }

func (k appendKiller) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	k.f(d)
	return ctx
}

func (appendKiller) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
