package pgledger_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask/pgledger"
	"github.com/bgtask/bgtask/pgledger/internal/fleetdemo"
	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMain runs the package's tests on a throwaway server — or, when
// TestFleetOfProcesses re-executed this binary as one of its workers, the
// worker.
func TestMain(m *testing.M) {
	if fleetdemo.IsWorker() {
		fleetdemo.WorkerMain()
	}
	if os.Getenv(pgledger.CrashChildEnv) != "" { // TestACrashAtEachPointOfDelivery's child
		if err := pgledger.CrashChild(); err != nil {
			fmt.Fprintln(os.Stderr, "crash child:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if os.Getenv(benchWorkerEnv) != "" {
		if err := benchWorker(); err != nil {
			fmt.Fprintln(os.Stderr, "bench worker:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	pgtest.Main(m, "pgledger", pgledger.DBURL)
}

// fleetRuns numbers the runs of TestFleetOfProcesses in this process.
var fleetRuns atomic.Int64

// logWriter writes a test's log.
type logWriter struct{ t *testing.T }

func (w logWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

// Three OS processes — this test binary, re-executed as workers — share
// the database and one loopback session service: tasks launched in all
// three, events sent to processes that do not own their sessions, a
// closure in one stopping runs owned by the other two, one killed mid-run
// and its runs taken over. Every task ends with the evidence it had, and
// every final summary and all_complete is delivered once (fleetdemo.Run
// checks each, and fails on the first that is not so).
func TestFleetOfProcesses(t *testing.T) {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// A fresh ledger each run (-count N): the session service numbers its
	// sessions from 1 again, and an earlier run's bindings of them would
	// make this run's events stale.
	ledger := fmt.Sprintf("fleet-%s-%d", t.Name(), fleetRuns.Add(1))
	rep, err := fleetdemo.Run(c, fleetdemo.Config{DB: *pgledger.DBURL, Ledger: ledger, Worker: os.Args[0], Lease: time.Second, Out: logWriter{t}})
	require.NoError(t, err)
	assert.Equal(t, 17, rep.Tasks, "12 answered or stopped, 2 on a budget, 3 barriers")
	assert.Equal(t, 9, rep.Completed, "6 answered through another process, 3 of the killed one's")
	assert.Equal(t, 3, rep.TakenOver)
	assert.Equal(t, 3, rep.Cancelled, "the branch across the three")
	assert.Equal(t, 2, rep.BudgetStopped, "a tree spent by two processes: both runs stopped by its budget")
	assert.Equal(t, 3, rep.Interrupted+rep.Live, "the barriers: running, or the killed one's start cut")
	assert.Equal(t, rep.Tasks, rep.Completed+rep.Cancelled+rep.BudgetStopped+rep.Interrupted+rep.Live, "every task counted once, by how it ended")
	assert.Equal(t, 1, rep.BudgetRefused)
}

var chaosRun = flag.Bool("pg.chaos", false, "run TestChaosOfAFleet: three worker processes, several hundred tasks, a kill -9, a server restart, a 10 s stop and a lock (about 2 minutes)")

// Three worker processes on a server of the test's own, and several
// hundred tasks; mid-run, in turn: one worker is killed (kill -9), the
// server is restarted (pg_ctl restart -m fast), stopped for 10 s, and the
// members table is locked for longer than a launch's deadline. After
// each, launches work again in every worker; at the end every task
// launched ended exactly once, every final summary and all_complete was
// delivered (again only with the same ID), nothing is left in the inbox,
// outbox or launching tables, and no launch overran its deadline by more
// than a second (fleetdemo.Chaos checks each). A second run stalls the
// server (SIGSTOP) for 10 s four times and then makes it read-only for
// 10 s: the same, and nothing is delivered twice, since nothing crashed.
func TestChaosOfAFleet(t *testing.T) {
	if !*chaosRun {
		t.Skip("the chaos run is long: -pg.chaos runs it (.ci/run does)")
	}
	for _, stalls := range []bool{false, true} {
		name := map[bool]string{false: "crashes", true: "stalls"}[stalls]
		t.Run(name, func(t *testing.T) {
			srv, err := pgtest.StartOwn("chaos")
			require.NoError(t, err)
			defer srv.Stop()
			c, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			rep, err := fleetdemo.Chaos(c, fleetdemo.ChaosConfig{
				Config: fleetdemo.Config{DB: srv.URL, Ledger: "chaos", Worker: os.Args[0], Lease: 15 * time.Second, Heartbeat: time.Second, Out: logWriter{t}},
				Faults: fleetdemo.Faults{Restart: srv.Restart, Halt: srv.Halt, Resume: srv.Resume,
					Freeze: srv.Freeze, Thaw: srv.Thaw, ReadOnly: srv.ReadOnly},
				Stalls: stalls,
			})
			require.NoError(t, err)
			t.Logf("%+v", rep)
			assert.GreaterOrEqual(t, rep.Tasks, 300, "several hundred tasks")
			for fault, back := range rep.Back {
				assert.Less(t, back, 10*time.Second, "launches work again within a few seconds of %s", fault)
			}
			if stalls {
				assert.Zero(t, rep.Duplicates, "exactly once: nothing crashed")
			}
		})
	}
}
