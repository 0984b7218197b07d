package bgtask

import (
	"os"
	"strings"
	"testing"

	"github.com/bgtask/bgtask/internal/jwire"
)

// BGTASK_TEST_JOURNAL=unix:/path/to/socket runs every newHarness Manager
// on a journal served there, one connection (one journal) per Manager:
// pgledger's TestRootScenariosOnPostgres serves its PostgreSQL journal so
// and runs this package's tests on it. Unset, Managers are memory-only.
func remoteJournal(t *testing.T, opts []Option) []Option {
	addr := os.Getenv("BGTASK_TEST_JOURNAL")
	if addr == "" {
		return nil
	}
	var cfg config
	for _, o := range opts {
		o.apply(&cfg)
	}
	if cfg.journal != nil {
		return nil // the test's own
	}
	network, address, ok := strings.Cut(addr, ":")
	if !ok {
		t.Fatalf("BGTASK_TEST_JOURNAL=%q: want network:address", addr)
	}
	c, err := jwire.Dial(network, address)
	if err != nil {
		t.Fatalf("dialing the test journal: %v", err)
	}
	j := wireJournal{c}
	t.Cleanup(func() { _ = j.Close() }) // if the Manager did not (a second Close does nothing)
	return []Option{WithJournal(j)}
}

// wireJournal is a Journal on a jwire.Client.
type wireJournal struct{ c *jwire.Client }

type wireCommit struct{ err func() error }

func (w wireCommit) Wait() error { return w.err() }

func toWire(recs []Record) []jwire.Rec {
	out := make([]jwire.Rec, len(recs))
	for i, r := range recs {
		out[i] = jwire.Rec{Seq: r.Seq, Kind: r.Kind, TaskID: r.TaskID, AttemptID: r.AttemptID, Token: r.Token,
			SessionID: r.SessionID, ParentSessionID: r.ParentSessionID, Data: r.Data} // Usage: a copy of Data's
	}
	return out
}

func (j wireJournal) Append(batch []Record) Commit {
	p := j.c.Send(jwire.OpAppend, toWire(batch))
	return wireCommit{func() error { _, err := jwire.Result(p); return err }}
}

func (j wireJournal) Replay(fn func(Record) error) error {
	recs, err := jwire.Result(j.c.Send(jwire.OpReplay, nil))
	if err != nil {
		return err
	}
	for _, r := range recs {
		if err := fn(Record{Seq: r.Seq, Kind: r.Kind, TaskID: r.TaskID, AttemptID: r.AttemptID, Token: r.Token,
			SessionID: r.SessionID, ParentSessionID: r.ParentSessionID, Data: r.Data}); err != nil {
			return err
		}
	}
	return nil
}

func (j wireJournal) Compact(keep []Record) error {
	_, err := jwire.Result(j.c.Send(jwire.OpCompact, toWire(keep)))
	return err
}

func (j wireJournal) Close() error { return j.c.Close() }
