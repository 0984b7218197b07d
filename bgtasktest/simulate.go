package bgtasktest

import (
	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/sim"
)

// SimOptions configure one run of the seeded simulation (Simulate).
type SimOptions struct {
	// Seed picks the workload: the same seed runs the same steps.
	Seed uint64
	// Steps is how many steps it takes (0: 150).
	Steps int
	// Host, if set, is put between the Manager and the simulated session
	// service: your host adapter, given the service as a bgtask.Host
	// (which also implements bgtask.Prompter and bgtask.StatusHost; pass
	// those on to keep what they exercise).
	Host func(service bgtask.Host) bgtask.Host
	// Check, if set, is an invariant of yours, asked after every step
	// with the Manager and its tasks: an error fails the run.
	Check func(m *bgtask.Manager, tasks []bgtask.Task) error
	// Journal, if set, opens your journal for each process life: every
	// run then crashes and restarts on it. It is called at the start and
	// after each crash, once the crashed life's journal was closed (what
	// that life appended after the crash is lost, as in a real one).
	Journal func() (bgtask.Journal, error)
}

// Simulate runs bgtask's seeded simulation: a random workload of launches,
// events (in and out of order, for current and stale attempts), cancels,
// branch closures, extends, clock moves, failing notifiers and aborts, and
// restarts from a journal, against a simulated session service whose
// calls block and answer in a random order — checking after every step the
// invariants bgtask promises (one live attempt per task, terminal attempts
// frozen, cancelled only after a confirmed stop, answers once and in
// order, closures exact, limits kept, replay exact) and yours. It returns
// the trace of what it did, and the first broken invariant as an error
// that names the seed, the step and what broke. Run many seeds:
//
//	for seed := range uint64(200) {
//		if _, err := bgtasktest.Simulate(bgtasktest.SimOptions{Seed: seed, Host: myAdapter}); err != nil {
//			t.Fatal(err)
//		}
//	}
func Simulate(o SimOptions) (trace []string, err error) {
	return sim.Run(sim.Options{Seed: o.Seed, Steps: o.Steps, Wrap: o.Host, Check: o.Check, Journal: o.Journal})
}
