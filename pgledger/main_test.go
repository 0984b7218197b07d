package pgledger_test

import (
	"context"
	"fmt"
	"os"
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
	if os.Getenv(benchWorkerEnv) != "" {
		if err := benchWorker(); err != nil {
			fmt.Fprintln(os.Stderr, "bench worker:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	pgtest.Main(m, "pgledger", pgledger.DBURL)
}

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
	rep, err := fleetdemo.Run(c, fleetdemo.Config{DB: *pgledger.DBURL, Ledger: "fleet-" + t.Name(), Worker: os.Args[0], Lease: time.Second, Out: logWriter{t}})
	require.NoError(t, err)
	assert.Equal(t, 13, rep.Tasks)
	assert.Equal(t, 9, rep.Completed, "6 answered through another process, 3 of the killed one's")
	assert.Equal(t, 3, rep.TakenOver)
	assert.Equal(t, 3, rep.Cancelled, "the branch across the three")
}
