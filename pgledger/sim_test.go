package pgledger

import (
	"flag"
	"fmt"
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
)

var simSeeds = flag.Int("pg.seeds", 40, "simulation seeds run on the PostgreSQL journal")

// The project's simulation — random workloads of launches, events in and
// out of order, cancels, closures, extends, failing notifiers and aborts,
// crashes and restarts, checking every invariant bgtask promises after
// each step — runs on this journal: every process life opens the member
// again (the crashed life's lease taken over), and replays it from the
// database.
func TestSimulationOnPostgres(t *testing.T) {
	f := newFixture(t)
	if err := Migrate(ctx(t), f.pool); err != nil {
		t.Fatal(err)
	}
	for seed := range uint64(*simSeeds) {
		// A ledger per seed: each run's ids start again from 1.
		ledger, member := fmt.Sprintf("%s-%d", f.ledger, seed), "sim"
		_, err := bgtasktest.Simulate(bgtasktest.SimOptions{Seed: seed, Steps: 120, Journal: func() (bgtask.Journal, error) {
			// The crashed life's lease has run out.
			if _, err := f.pool.Exec(ctx(t), `UPDATE bgtask_members SET expires_at = now() WHERE ledger = $1`, ledger); err != nil {
				return nil, err
			}
			return Open(ctx(t), f.pool, Options{Ledger: ledger, Member: member})
		}})
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
	}
}
