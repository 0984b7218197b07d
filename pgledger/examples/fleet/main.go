// Command fleet runs three harness processes on one PostgreSQL ledger and
// one loopback session service: tasks launched in all three, events sent
// to processes that do not own their sessions, a closure in one process
// stopping runs the other two own, and one process killed mid-run, its
// runs taken over by another. It checks every task ended with the evidence
// it had and every final summary was delivered once, and says so.
//
//	cd pgledger && go run ./examples/fleet
//
// It starts a throwaway PostgreSQL server (the Debian postgresql package's
// initdb and pg_ctl), or uses BGTASK_PG_URL: the database it names, as it
// is (the demo migrates it and plays on a ledger of its own), or, if it
// names none, a database bgtask_fleet it makes afresh on that server.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/bgtask/bgtask/pgledger/internal/fleetdemo"
	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
)

func main() {
	if fleetdemo.IsWorker() {
		fleetdemo.WorkerMain() // this binary, re-executed by the coordinator
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "fleet:", err)
		os.Exit(1)
	}
}

func run() error {
	srv, err := server()
	if err != nil {
		return err
	}
	defer srv.Stop()
	return demo(srv.URL, os.Stdout)
}

// server is where the demo plays: BGTASK_PG_URL's database, if it names
// one, or a fresh one (pgtest.Open).
func server() (*pgtest.Server, error) { return pgtest.Open("bgtask_fleet") }

// demo plays the scenario on database url, telling out what it does.
func demo(url string, out io.Writer) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	rep, err := fleetdemo.Run(ctx, fleetdemo.Config{DB: url, Ledger: fmt.Sprintf("fleet-%d", time.Now().UnixNano()),
		Worker: self, Lease: 2 * time.Second, Out: out})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "done in %s\n", rep.Took.Round(time.Millisecond))
	return nil
}
