package sim

import (
	"flag"
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
	run := func(s uint64) {
		tr, err := Run(Options{Seed: s, Steps: *steps})
		if *trace {
			t.Logf("seed %d:\n%s", s, strings.Join(tr, "\n"))
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if *seed >= 0 {
		run(uint64(*seed))
		return
	}
	for s := range *seeds {
		run(uint64(s))
	}
}
