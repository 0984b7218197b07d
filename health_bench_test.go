package bgtask

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
)

// throttledErr is a provider's 429 with its Retry-After.
type throttledErr struct{ after time.Duration }

func (e throttledErr) Error() string             { return "429 Too Many Requests" }
func (e throttledErr) RetryAfter() time.Duration { return e.after }

// BenchmarkHealthChain is issue 32's goal: 1,000 tasks launched over 10 s
// of fake time (100 every second, not waiting for each other), whose
// chains start with a model that fails — "throttled": 429 with
// Retry-After 30s for its first 60 s; "missing": 404 model not found —
// and go on to one that answers. It reports the attempts spent on the
// first model per 1,000 tasks, with health (WithHealth, defaults) and
// without, side by side, and with health the bound the issue sets: the
// attempts in flight (admitted) when its first cooldown began, plus the
// probes let through. It fails when an attempt on the first model was
// admitted after its first cooldown began and was no probe.
//
//	go test -run '^$' -bench 'HealthChain|HealthOverhead|Lifecycle3' -benchtime 3x .
func BenchmarkHealthChain(b *testing.B) {
	for _, kind := range []string{"throttled", "missing"} {
		b.Run(kind, func(b *testing.B) {
			var with, without, inflight, probes float64
			for b.Loop() {
				r := healthChainRun(b, kind, true)
				with += float64(r.first)
				inflight += float64(r.inflight)
				probes += float64(r.probes)
				without += float64(healthChainRun(b, kind, false).first)
			}
			n := float64(b.N)
			b.ReportMetric(with/n, "first-model-attempts-health")
			b.ReportMetric(inflight/n, "in-flight-at-first-cooldown")
			b.ReportMetric(probes/n, "probes")
			b.ReportMetric(without/n, "first-model-attempts-nohealth")
		})
	}
}

// chainRun is what one healthChainRun saw on the first model.
type chainRun struct {
	first    int64 // attempts started on it
	inflight int64 // of those, admitted before its first cooldown began
	probes   int64 // probes let through (Metrics: probing)
}

// probeCount counts the probes let through on provider "a"'s models.
type probeCount struct {
	NopMetrics
	n atomic.Int64
}

func (p *probeCount) HealthChanged(h Health) {
	if h.State == HealthProbing && h.Model.Provider == "a" {
		p.n.Add(1)
	}
}

// healthChainRun runs the 1,000 tasks once.
func healthChainRun(b *testing.B, kind string, health bool) chainRun {
	start := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	clk := clock.NewFake(start)
	var first, inflight atomic.Int64
	var late atomic.Int64 // admitted after the first cooldown began and no probe
	probes := &probeCount{}
	host := &benchHost{onStart: func(m *Manager, req SessionRequest, sid string) {
		ev := Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"}
		if req.Model.Provider == "a" {
			first.Add(1)
			if health {
				// The run's admission stamp: the count of cooldowns begun
				// when it was let through (0: before the first).
				m.mu.Lock()
				e := m.led.tasks[req.TaskID]
				admitted, probe := e.rt.admitted, false
				for _, x := range m.calls.health.of {
					probe = probe || x.probe == e.cur().Token
				}
				m.mu.Unlock()
				switch {
				case admitted == 0:
					inflight.Add(1)
				case !probe:
					late.Add(1)
				}
			}
			switch {
			case kind == "missing":
				ev = Event{AttemptID: req.AttemptID, Kind: SessionError, Err: errors.New("404 model not found")}
			case clk.Now().Before(start.Add(60 * time.Second)):
				ev = Event{AttemptID: req.AttemptID, Kind: SessionError, Err: throttledErr{after: 30 * time.Second}}
			}
		}
		if err := m.Observe(ev); err != nil {
			panic(err)
		}
	}}
	opts := []Option{WithClock(clk), WithMetrics(probes)}
	if health {
		opts = append(opts, WithHealth(HealthPolicy{}))
	}
	m := mustOpen(host, opts...)
	host.m = m
	defer func() { _ = m.Shutdown(context.Background()) }()
	ctx := context.Background()
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}}}
	ids := make([]string, 0, 1000)
	for s := 0; s < 10; s++ {
		for range 100 {
			task, err := m.Launch(ctx, spec)
			if err != nil {
				b.Fatal(err)
			}
			ids = append(ids, task.ID)
		}
		clk.Advance(time.Second)
	}
	for _, id := range ids {
		got, err := m.Wait(ctx, id)
		if err != nil || got.Status != StatusCompleted {
			b.Fatalf("%v %+v", err, got)
		}
	}
	r := chainRun{first: first.Load(), inflight: inflight.Load(), probes: probes.n.Load()}
	if n := late.Load(); n > 0 {
		b.Fatalf("%s: %d attempts on the first model were admitted during its cooldown and were no probe (%+v)", kind, n, r)
	}
	if health && r.first > r.inflight+r.probes {
		b.Fatalf("%s: %d attempts on the first model > %d in flight at its first cooldown + %d probes", kind, r.first, r.inflight, r.probes)
	}
	return r
}

// BenchmarkHealthOverhead is one task on a healthy model, launched and
// waited for, with health off and on: the difference is the health
// check's cost per attempt (compare with BenchmarkLifecycle3's in the
// same run).
func BenchmarkHealthOverhead(b *testing.B) {
	for _, health := range []bool{false, true} {
		name := "off"
		if health {
			name = "on"
		}
		b.Run(name, func(b *testing.B) {
			host := &benchHost{onStart: func(m *Manager, req SessionRequest, sid string) {
				if err := m.Observe(Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"}); err != nil {
					panic(err)
				}
			}}
			var opts []Option
			if health {
				opts = append(opts, WithHealth(HealthPolicy{}))
			}
			m := mustOpen(host, opts...)
			host.m = m
			b.Cleanup(func() { _ = m.Shutdown(context.Background()) })
			if health { // a model elsewhere in the book cools: the check looks, not skips
				m.mu.Lock()
				x := m.calls.health.get(modelKey(Model{Provider: "z", ID: "9"}), Model{Provider: "z", ID: "9"}, false)
				x.pub.State, x.pub.Until = HealthCooling, time.Now().Add(time.Hour)
				m.mu.Unlock()
			}
			ctx := context.Background()
			spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}}}
			b.ReportAllocs()
			for b.Loop() {
				task, err := m.Launch(ctx, spec)
				if err != nil {
					b.Fatal(err)
				}
				if got, err := m.Wait(ctx, task.ID); err != nil || got.Status != StatusCompleted {
					b.Fatalf("%v %+v", err, got)
				}
			}
		})
	}
}
