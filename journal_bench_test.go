package bgtask

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/wal"
)

// lifecycles runs n single-attempt lifecycles (launch → the child answers
// at once → Wait) on m, from 32 goroutines; each task has a parent session
// of its own, as a harness's many chats do.
func lifecycles(b *testing.B, m *Manager, n int) {
	b.Helper()
	ctx := context.Background()
	var wg sync.WaitGroup
	var next atomic.Uint64
	per := (n + 31) / 32
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range per {
				spec := Spec{ParentSessionID: "p-" + strconv.FormatUint(next.Add(1), 10), Models: []Model{{Provider: "a", ID: "1"}}}
				task, err := m.Launch(ctx, spec)
				if err != nil {
					b.Error(err)
					return
				}
				if _, err := m.Wait(ctx, task.ID); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

func answeringHost() *benchHost {
	return &benchHost{onStart: func(m *Manager, req SessionRequest, sid string) {
		if err := m.Observe(Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"}); err != nil {
			panic(err)
		}
	}}
}

// BenchmarkJournaledThroughput: single-attempt lifecycles from 32
// concurrent callers, memory-only and with the file journal (group
// commit), in the same run. Report tasks/s of each, and their ratio.
//
// "ratio" runs the two alternately, five times each, and reports the median
// of the five journal/memory ratios: this machine's speed drifts by a
// quarter from one second to the next, and a pair taken together drifts
// less than two runs taken apart.
func BenchmarkJournaledThroughput(b *testing.B) {
	for _, mode := range []string{"memory", "journal"} {
		b.Run(mode, func(b *testing.B) {
			b.ReportMetric(throughput(b, mode == "journal", b.N), "tasks/s")
		})
	}
	b.Run("ratio", func(b *testing.B) {
		var ratios []float64
		for range 5 {
			mem := throughput(b, false, b.N)
			ratios = append(ratios, throughput(b, true, b.N)/mem)
		}
		slices.Sort(ratios)
		b.ReportMetric(ratios[len(ratios)/2], "journal/memory")
	})
}

// throughput runs n single-attempt lifecycles from 32 callers on a fresh
// Manager, memory-only or with a file journal, and returns tasks/s.
func throughput(b *testing.B, journaled bool, n int) float64 {
	host := answeringHost()
	opts := []Option{}
	if journaled {
		j, err := OpenFileJournal(b.TempDir())
		if err != nil {
			b.Fatal(err)
		}
		opts = append(opts, WithJournal(j))
	}
	m, err := Open(context.Background(), host, opts...)
	if err != nil {
		b.Fatal(err)
	}
	host.m = m
	defer func() { _ = m.Shutdown(context.Background()) }()
	b.ResetTimer()
	start := time.Now()
	lifecycles(b, m, n)
	return float64(n) / time.Since(start).Seconds()
}

// BenchmarkFsync1KiB is the floor a durable hop is measured against: a
// bare write of 1 KiB and an fsync.
func BenchmarkFsync1KiB(b *testing.B) {
	f, err := os.Create(filepath.Join(b.TempDir(), "f"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1024)
	for b.Loop() {
		if _, err := f.Write(buf); err != nil {
			b.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDurableHop: one Launch made durable, alone (no other commit
// to share its fsync with): the latency a durable hop adds.
func BenchmarkDurableHop(b *testing.B) {
	j, err := OpenFileJournal(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	m, err := Open(context.Background(), &benchHost{}, WithJournal(j))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = m.Shutdown(context.Background()) }()
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}}
	for b.Loop() {
		if _, err := m.Launch(context.Background(), spec); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkReplay: Open on a journal of 1M records (250k single-attempt
// tasks, four records each), written directly; -benchtime 1x.
func BenchmarkReplay(b *testing.B) {
	const tasks = 250_000
	dir := b.TempDir()
	l, err := wal.Open(dir, wal.Options{})
	if err != nil {
		b.Fatal(err)
	}
	led := newLedger(SequentialIDs())
	led.keepLog = true
	t0 := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	batch := make([][]byte, 0, 4096)
	flush := func() {
		if err := l.Append(batch).Wait(); err != nil {
			b.Fatal(err)
		}
		batch = batch[:0]
	}
	for i := range tasks {
		info := &taskInfo{id: fmt.Sprintf("task-%d", i+1), parent: fmt.Sprintf("p%d", i%1000), models: []Model{{Provider: "a", ID: "1"}}, maxAttempts: 1, launchedAt: t0}
		e, err := led.launch(info)
		if err != nil {
			b.Fatal(err)
		}
		a := e.cur().ID
		if err := led.bindSession(e, a, fmt.Sprintf("ses-%d", i+1), t0); err != nil {
			b.Fatal(err)
		}
		if err := led.finalize(e, a, StatusCompleted, "", "ok", t0); err != nil {
			b.Fatal(err)
		}
		payloads, err := encodePayloads(led.log)
		if err != nil {
			b.Fatal(err)
		}
		batch = append(batch, payloads...)
		led.log = led.log[:0]
		if len(batch) >= 4000 {
			flush()
		}
	}
	flush()
	if err := l.Close(); err != nil {
		b.Fatal(err)
	}
	goruntime.GC()
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		j, err := OpenFileJournal(dir)
		if err != nil {
			b.Fatal(err)
		}
		m, err := Open(context.Background(), &benchHost{}, WithJournal(j), WithRetention(Retention{MaxEnded: -1}))
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(time.Since(start).Seconds(), "s/replay")
		// The settled tasks are frozen on a goroutine of the Manager's
		// once Open returned: how long until they all are.
		if err := m.life.group.Wait(context.Background()); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(time.Since(start).Seconds(), "s/frozen")
		if n := len(m.Snapshot().Tasks); n != tasks {
			b.Fatalf("%d tasks after replay", n)
		}
		b.StopTimer()
		_ = m.Shutdown(context.Background())
		b.StartTimer()
	}
}

// BenchmarkHeapFlat: 1M single-attempt tasks through one Manager with the
// default retention; reports the heap in use at 100k, 500k and 1M
// (-benchtime 1x), and what a retained 3-attempt task costs.
func BenchmarkHeapFlat(b *testing.B) {
	heap := func() float64 {
		goruntime.GC()
		var ms goruntime.MemStats
		goruntime.ReadMemStats(&ms)
		return float64(ms.HeapAlloc) / (1 << 20)
	}
	for range b.N {
		host := answeringHost()
		m := mustOpen(host)
		host.m = m
		done := 0
		for _, at := range []int{100_000, 500_000, 1_000_000} {
			lifecycles(b, m, at-done)
			done = at
			b.ReportMetric(heap(), fmt.Sprintf("MiB@%dk", at/1000))
		}
		_ = m.Shutdown(context.Background())
	}
}

// BenchmarkRetained3: the heap a retained, ended 3-attempt task costs;
// "replayed" is the same tasks after a restart on their journal (once
// they are frozen, as a live Manager keeps them), in the same run.
func BenchmarkRetained3(b *testing.B) {
	const n = 10_000
	host := &benchHost{onStart: func(m *Manager, req SessionRequest, sid string) {
		ev := Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"}
		if req.AttemptNumber < 3 {
			ev = Event{AttemptID: req.AttemptID, Kind: SessionError, Err: errRateLimited}
		}
		_ = m.Observe(ev)
	}}
	keep := WithRetention(Retention{MaxEnded: -1})
	heap := func() uint64 {
		var ms goruntime.MemStats
		goruntime.GC()
		goruntime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	settled := func(m *Manager) {
		if err := m.life.group.Wait(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("live", func(b *testing.B) {
		for range b.N {
			host.m = nil // the last run's Manager goes before the heap is measured
			before := heap()
			m := mustOpen(host, keep)
			host.m = m
			retained3(m, n)
			settled(m)
			b.ReportMetric(float64(heap()-before)/n, "B/task")
			goruntime.KeepAlive(m)
			_ = m.Shutdown(context.Background())
		}
	})
	b.Run("replayed", func(b *testing.B) {
		for range b.N {
			dir := b.TempDir()
			j, err := OpenFileJournal(dir)
			if err != nil {
				b.Fatal(err)
			}
			m, err := Open(context.Background(), host, keep, WithJournal(j))
			if err != nil {
				b.Fatal(err)
			}
			host.m = m
			retained3(m, n)
			_ = m.Shutdown(context.Background())
			host.m = nil
			before := heap()
			if j, err = OpenFileJournal(dir); err != nil {
				b.Fatal(err)
			}
			if m, err = Open(context.Background(), host, keep, WithJournal(j)); err != nil {
				b.Fatal(err)
			}
			host.m = m
			settled(m)
			b.ReportMetric(float64(heap()-before)/n, "B/task")
			goruntime.KeepAlive(m)
			_ = m.Shutdown(context.Background())
		}
	})
}

// retained3 runs n tasks on m whose first two models fail.
func retained3(m *Manager, n int) {
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}, {Provider: "c", ID: "3"}}}
	for range n {
		task, _ := m.Launch(context.Background(), spec)
		_, _ = m.Wait(context.Background(), task.ID)
	}
}

// blockingHost's starts never return before the Manager's context ends.
type blockingHost struct{}

func (blockingHost) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	<-ctx.Done()
	return "", ctx.Err()
}
func (blockingHost) AbortSession(ctx context.Context, sid string) error { return nil }

// BenchmarkDurableHopAlone: one Launch with nothing else committing (its
// start never returns, so no bind commit shares the fsync), memory-only
// and durable, in the same run: the latency a durable hop adds is the
// difference, compared with BenchmarkFsync1KiB.
func BenchmarkDurableHopAlone(b *testing.B) {
	for _, mode := range []string{"memory", "journal"} {
		b.Run(mode, func(b *testing.B) {
			var opts []Option
			if mode == "journal" {
				j, err := OpenFileJournal(b.TempDir())
				if err != nil {
					b.Fatal(err)
				}
				opts = append(opts, WithJournal(j))
			}
			m, err := Open(context.Background(), blockingHost{}, opts...)
			if err != nil {
				b.Fatal(err)
			}
			defer func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				_ = m.Shutdown(ctx)
			}()
			spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}}
			for b.Loop() {
				if _, err := m.Launch(context.Background(), spec); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
