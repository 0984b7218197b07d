package bgtask

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// benchHost starts sessions at once, named after the attempt, and lets a
// script report events from inside StartSession (early events, held until
// the bind).
type benchHost struct {
	m       *Manager
	onStart func(m *Manager, req SessionRequest, sid string)
	n       atomic.Uint64
}

func (h *benchHost) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	sid := "ses-" + strconv.FormatUint(h.n.Add(1), 10)
	if h.onStart != nil {
		h.onStart(h.m, req, sid)
	}
	return sid, nil
}

func (h *benchHost) AbortSession(ctx context.Context, sid string) error { return nil }

// runningTasks returns a Manager with n running tasks; with superseded, each
// task's first attempt failed and its second runs. It returns the current
// and the superseded session of every task.
func runningTasks(b *testing.B, n int, superseded bool) (m *Manager, current, old []string) {
	b.Helper()
	host := &benchHost{}
	m = mustOpen(host, WithIDs(SequentialIDs()))
	host.m = m
	b.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	ids := make([]string, n)
	for i := range n {
		task, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}}})
		if err != nil {
			b.Fatal(err)
		}
		ids[i] = task.ID
	}
	if err := m.life.group.Wait(context.Background()); err != nil {
		b.Fatal(err)
	}
	if superseded {
		for _, id := range ids {
			task, _ := m.Task(id)
			if err := m.Observe(Event{SessionID: task.SessionID, Kind: SessionError, Err: errRateLimited}); err != nil {
				b.Fatal(err)
			}
		}
		if err := m.life.group.Wait(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
	for _, id := range ids {
		task, _ := m.Task(id)
		if task.Status != StatusRunning {
			b.Fatalf("task %s is %s", id, task.Status)
		}
		current = append(current, task.SessionID)
		if superseded {
			old = append(old, task.Attempts[0].SessionID)
		}
	}
	return m, current, old
}

var sizes = []int{1_000, 10_000, 100_000}

// shuffled returns a copy of ss in a fixed random order: events arrive for
// tasks in no particular order, so the benchmarks do not walk memory in
// allocation order.
func shuffled(ss []string) []string {
	out := slices.Clone(ss)
	r := rand.New(rand.NewPCG(1, 2))
	r.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// BenchmarkObserveApplied: a busy event applied to the current attempt.
func BenchmarkObserveApplied(b *testing.B) {
	for _, n := range sizes {
		b.Run(fmt.Sprintf("tasks=%d", n), func(b *testing.B) {
			m, cur, _ := runningTasks(b, n, false)
			evs := make([]Event, len(cur))
			for i, s := range shuffled(cur) {
				evs[i] = Event{SessionID: s, Kind: SessionBusy}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				if err := m.Observe(evs[i%len(evs)]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkObserveStale: an event from a superseded attempt's session.
func BenchmarkObserveStale(b *testing.B) {
	for _, n := range sizes {
		b.Run(fmt.Sprintf("tasks=%d", n), func(b *testing.B) {
			m, _, old := runningTasks(b, n, true)
			evs := make([]Event, len(old))
			for i, s := range shuffled(old) {
				evs[i] = Event{SessionID: s, Kind: SessionError, Err: errRateLimited}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				if err := m.Observe(evs[i%len(evs)]); err != ErrStaleEvent {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkObserveUnknown: an event for a session no task knows.
func BenchmarkObserveUnknown(b *testing.B) {
	for _, n := range sizes {
		b.Run(fmt.Sprintf("tasks=%d", n), func(b *testing.B) {
			m, _, _ := runningTasks(b, n, false)
			ev := Event{SessionID: "ses-nobody", Kind: SessionBusy}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if err := m.Observe(ev); err != ErrUnknownSession {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkLifecycle: launch → the first model fails → retry on the second
// → it completes, with a host that answers at once; the events come early,
// from inside StartSession, and are held until each bind.
func BenchmarkLifecycle(b *testing.B) {
	host := &benchHost{onStart: func(m *Manager, req SessionRequest, sid string) {
		ev := Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"}
		if req.AttemptNumber == 1 {
			ev = Event{AttemptID: req.AttemptID, Kind: SessionError, Err: errRateLimited}
		}
		if err := m.Observe(ev); err != nil {
			panic(err)
		}
	}}
	m := mustOpen(host)
	host.m = m
	b.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}}}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		task, err := m.Launch(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		got, err := m.Wait(ctx, task.ID)
		if err != nil || got.Status != StatusCompleted || len(got.Attempts) != 2 {
			b.Fatalf("%v %+v", err, got)
		}
	}
}

// BenchmarkBaselineMapUpdate is the floor Observe is measured against: a
// bare mutex-protected map lookup and field write, with the same keys and
// the same access pattern as BenchmarkObserveApplied.
func BenchmarkBaselineMapUpdate(b *testing.B) {
	type rec struct {
		status string
		last   int64
	}
	for _, n := range sizes {
		b.Run(fmt.Sprintf("tasks=%d", n), func(b *testing.B) {
			var mu sync.Mutex
			m := make(map[string]*rec, n)
			keys := make([]string, n)
			for i := range n {
				keys[i] = "ses-" + strconv.Itoa(i+1)
				m[keys[i]] = &rec{status: "running"}
			}
			keys = shuffled(keys)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				mu.Lock()
				r := m[keys[i%n]]
				if r.status == "running" {
					r.last = int64(i)
				}
				mu.Unlock()
			}
		})
	}
}

// BenchmarkBaselineTwoProbe is the floor the issue measures Observe
// against: a mutex, a probe of a session→attempt map and one of an
// attempt→task map, and a field write, with the same key count and access
// pattern as BenchmarkObserveApplied. Its records are as small as they can
// be; a task's are not.
func BenchmarkBaselineTwoProbe(b *testing.B) {
	type rec struct {
		status string
		last   int64
	}
	for _, n := range sizes {
		b.Run(fmt.Sprintf("tasks=%d", n), func(b *testing.B) {
			var mu sync.Mutex
			bySession := make(map[string]string, n)
			byAttempt := make(map[string]*rec, n)
			keys := make([]string, n)
			for i := range n {
				keys[i] = "ses-" + strconv.Itoa(i+1)
				att := "att-" + strconv.Itoa(i+1)
				bySession[keys[i]] = att
				byAttempt[att] = &rec{status: "running"}
			}
			keys = shuffled(keys)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				mu.Lock()
				r := byAttempt[bySession[keys[i%n]]]
				if r.status == "running" {
					r.last = int64(i)
				}
				mu.Unlock()
			}
		})
	}
}

// BenchmarkFanOut measures the cost of one applied change delivered to 1, 8
// and 64 subscribers (each drained by its own goroutine).
func BenchmarkFanOut(b *testing.B) {
	for _, n := range []int{1, 8, 64} {
		b.Run(fmt.Sprintf("subscribers=%d", n), func(b *testing.B) {
			m, cur, _ := runningTasks(b, 1, false)
			ctx, cancel := context.WithCancel(context.Background())
			var drained sync.WaitGroup
			for range n {
				sub, err := m.Subscribe(ctx, 1<<16)
				if err != nil {
					b.Fatal(err)
				}
				drained.Add(1)
				go func() {
					defer drained.Done()
					for range sub.C {
					}
				}()
			}
			// Each event flips the activity: one change per Observe.
			evs := [2]Event{{SessionID: cur[0], Kind: SessionWaiting}, {SessionID: cur[0], Kind: SessionBusy}}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				if err := m.Observe(evs[i%2]); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			cancel()
			drained.Wait()
		})
	}
}

// BenchmarkLaunch: Launch alone (the session start it sets off runs on its
// own goroutine and is not waited for).
func BenchmarkLaunch(b *testing.B) {
	host := &benchHost{}
	m := mustOpen(host)
	host.m = m
	b.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := m.Launch(ctx, spec); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkQueueThroughput runs 10,000 tasks through a limit of 4 with a
// host that completes each at once; it reports the cost per task.
func BenchmarkQueueThroughput(b *testing.B) {
	const n = 10_000
	host := &benchHost{onStart: func(m *Manager, req SessionRequest, sid string) {
		_ = m.Observe(Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"})
	}}
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}}
	ctx := context.Background()
	b.ReportAllocs()
	var total time.Duration
	for i := 0; i < b.N; i++ {
		m := mustOpen(host, WithModelLimits(ModelLimits{Default: 4}))
		host.m = m
		start := time.Now()
		ids := make([]string, n)
		for j := range n {
			task, err := m.Launch(ctx, spec)
			if err != nil {
				b.Fatal(err)
			}
			ids[j] = task.ID
		}
		for _, id := range ids {
			if got, err := m.Wait(ctx, id); err != nil || got.Status != StatusCompleted {
				b.Fatalf("%v %s", err, got.Status)
			}
		}
		total += time.Since(start)
		b.StopTimer()
		_ = m.Shutdown(ctx)
		b.StartTimer()
	}
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N*n), "ns/task")
}

// BenchmarkLifecycle3: launch → the first two models fail → the third
// completes: three session starts, two aborts of the failed sessions, and
// Wait, with a host that answers at once. The events come early, from
// inside StartSession, and are held until each bind. Compare it with
// BenchmarkFloorAsync3, measured in the same run.
//
// "steady" starts a fresh Manager every 1024 tasks (outside the timer), so
// it measures the lifecycle at a steady ledger size; "accumulating" keeps
// every task for the whole run, as a Manager without retention does, and
// pays for its ever-growing indexes too.
func BenchmarkLifecycle3(b *testing.B) {
	for _, mode := range []struct {
		name  string
		every int
	}{{"steady", 1024}, {"accumulating", 0}} {
		b.Run(mode.name, func(b *testing.B) { benchLifecycle3(b, mode.every, nil) })
	}
	// Usage accounting's cost: the same lifecycle, each attempt's end
	// carrying the usage it reports (a usage record each), and that in a
	// tree with a budget it counts against (Spec.Budget, never reached).
	b.Run("steady/usage", func(b *testing.B) {
		benchLifecycle3(b, 1024, &Usage{InputTokens: 1200, OutputTokens: 80, Requests: 1, Cost: 900})
	})
	b.Run("steady/budget", func(b *testing.B) {
		benchLifecycle3(b, 1024, &Usage{InputTokens: 1200, OutputTokens: 80, Requests: 1, Cost: 900}, func(s *Spec) {
			s.Budget = &Budget{Tokens: math.MaxInt64, Cost: Cost(math.MaxInt64), Requests: math.MaxInt64}
		})
	})
}

func benchLifecycle3(b *testing.B, every int, usage *Usage, opts ...func(*Spec)) {
	host := &benchHost{onStart: func(m *Manager, req SessionRequest, sid string) {
		ev := Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"}
		if req.AttemptNumber < 3 {
			ev = Event{AttemptID: req.AttemptID, Kind: SessionError, Err: errRateLimited}
		}
		if usage != nil {
			ev.Usage = *usage
		}
		if err := m.Observe(ev); err != nil {
			panic(err)
		}
	}}
	ctx := context.Background()
	fresh := func() *Manager {
		m := mustOpen(host)
		host.m = m
		return m
	}
	m := fresh()
	b.Cleanup(func() { _ = m.Shutdown(ctx) })
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}, {Provider: "c", ID: "3"}}}
	for _, o := range opts {
		o(&spec)
	}
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		if n++; every > 0 && n%every == 0 {
			b.StopTimer()
			_ = m.Shutdown(ctx)
			m = fresh()
			b.StartTimer()
		}
		task, err := m.Launch(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		got, err := m.Wait(ctx, task.ID)
		if err != nil || got.Status != StatusCompleted || len(got.Attempts) != 3 {
			b.Fatalf("%v %+v", err, got)
		}
	}
}

// BenchmarkFloorAsync3 is the floor BenchmarkLifecycle3 is measured
// against: three goroutine hand-offs, one after the other.
func BenchmarkFloorAsync3(b *testing.B) { floorHandOffs(b, 3) }

// floorHandOffs measures n goroutine hand-offs, one after the other.
func floorHandOffs(b *testing.B, n int) {
	ch := make(chan int)
	b.ReportAllocs()
	for b.Loop() {
		for i := range n {
			go func() { ch <- i }()
			<-ch
		}
	}
}

// BenchmarkExtendRoundTrip: one supplemental prompt admitted and the
// answer before it released: Extend(n) hands prompt n to a FuncHost
// function, which answers invocation n-1 (keeping the task open), and
// WaitAnswer(n-1) returns. Compare it with BenchmarkFloorHandOff2.
func BenchmarkExtendRoundTrip(b *testing.B) {
	running := make(chan struct{})
	m := mustOpen(NewFuncHost(func(ctx context.Context, run Run) (string, error) {
		close(running)
		for {
			select {
			case p := <-run.Prompts():
				run.Answer(p.Invocation-1, "ok")
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
	}), WithIDs(SequentialIDs()))
	b.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	ctx := context.Background()
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	if err != nil {
		b.Fatal(err)
	}
	<-running
	b.ReportAllocs()
	for b.Loop() {
		n, err := m.Extend(ctx, task.ID, "more")
		if err != nil {
			b.Fatal(err)
		}
		if _, err := m.WaitAnswer(ctx, task.ID, n-1); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFloorHandOff2 is the floor BenchmarkExtendRoundTrip is measured
// against: two goroutine hand-offs, one after the other.
func BenchmarkFloorHandOff2(b *testing.B) { floorHandOffs(b, 2) }

// BenchmarkGateInert: what the children gate costs a turn end of a task
// whose sessions launched nothing (the decision alone, under the lock).
func BenchmarkGateInert(b *testing.B) {
	m, cur, _ := runningTasks(b, 1, false)
	m.mu.Lock()
	ref := m.led.bySession[cur[0]]
	m.mu.Unlock()
	t := turnEnd{token: ref.attempt().Token, text: "ok"}
	b.ReportAllocs()
	for b.Loop() {
		m.mu.Lock()
		gated := m.atGate(ref.e, t)
		m.mu.Unlock()
		if gated {
			b.Fatal("gated with no child")
		}
	}
}
