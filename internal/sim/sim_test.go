package sim

import (
	"flag"
	"fmt"
	"runtime"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	seed  = flag.Int64("sim.seed", -1, "replay this one seed")
	seeds = flag.Int("sim.seeds", 100, "how many seeds to run")
	steps = flag.Int("sim.steps", 150, "steps per seed")
	trace = flag.Bool("sim.trace", false, "log the trace of every run")
)

func TestSim(t *testing.T) {
	run := func(t *testing.T, s uint64) {
		tr, err := Run(Options{Seed: s, Steps: *steps, Health: *health, Budget: *budget})
		if *trace {
			t.Logf("seed %d:\n%s", s, strings.Join(tr, "\n"))
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if *seed >= 0 {
		run(t, uint64(*seed))
		return
	}
	// The seeds are independent: one worker per processor takes every
	// n-th of them.
	n := runtime.GOMAXPROCS(0)
	for w := range n {
		t.Run(fmt.Sprintf("worker %d of %d", w+1, n), func(t *testing.T) {
			t.Parallel()
			for s := w; s < *seeds; s += n {
				run(t, uint64(s))
			}
		})
	}
}

var (
	health = flag.Bool("sim.health", false, "turn health on (throttling providers) in every run")
	budget = flag.Bool("sim.budget", false, "turn budgets and usage-reporting runs on in every run")
)

// TestSimBudget runs seeds with budgets on in each: runs report usage,
// trees spend their budgets, and spent ≤ limit + what was in flight.
func TestSimBudget(t *testing.T) {
	n := *seeds / 4
	for s := range n {
		if _, err := Run(Options{Seed: uint64(2000 + s), Steps: *steps, Budget: true}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSimHealth runs seeds with health on in each: providers throttle and
// recover, and no skip or wait breaks the policy.
func TestSimHealth(t *testing.T) {
	n := *seeds / 4
	for s := range n {
		if _, err := Run(Options{Seed: uint64(1000 + s), Steps: *steps, Health: true}); err != nil {
			t.Fatal(err)
		}
	}
}
