package pgledger

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// answering is a host whose sessions answer at once, from inside
// StartSession (the event is held until the start returns).
type answering struct {
	m atomic.Pointer[bgtask.Manager]
	n atomic.Int64
}

func (h *answering) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	if err := h.m.Load().Observe(bgtask.Event{AttemptID: req.AttemptID, Kind: bgtask.SessionIdle, Text: "ok"}); err != nil {
		return "", err
	}
	return "s-" + strconv.FormatInt(h.n.Add(1), 10) + "-" + req.AttemptID, nil
}

func (h *answering) AbortSession(ctx context.Context, id string) error { return nil }

// benchPool is a pool on the package's database, closed at the end.
func benchPool(b *testing.B) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

// run32 runs n single-attempt lifecycles (launch, start, idle, Wait) from
// 32 concurrent callers and returns how long they took.
func run32(b *testing.B, m *bgtask.Manager, n int) time.Duration {
	ctx := context.Background()
	var wg sync.WaitGroup
	var next atomic.Int64
	start := time.Now()
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "p-" + strconv.FormatInt(next.Load(), 10), Models: []bgtask.Model{{Provider: "a", ID: "1"}}})
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
	return time.Since(start)
}

var benchLedgers atomic.Int64

// BenchmarkLifecycles3Members: the same from three Managers (three
// members of one ledger, 32 concurrent callers each) in one process, on
// one database: what three workers of a fleet would write.
func BenchmarkLifecycles3Members(b *testing.B) {
	pool := benchPool(b)
	ledger := fmt.Sprintf("bench-%d", benchLedgers.Add(1))
	var ms []*bgtask.Manager
	for i := range 3 {
		j, err := Open(context.Background(), pool, Options{Ledger: ledger, Member: fmt.Sprintf("w%d", i)})
		if err != nil {
			b.Fatal(err)
		}
		host := &answering{}
		m, err := bgtask.Open(context.Background(), host, bgtask.WithJournal(j), bgtask.WithIDs(bgtask.UUIDs()))
		if err != nil {
			b.Fatal(err)
		}
		host.m.Store(m)
		ms = append(ms, m)
	}
	defer func() {
		for _, m := range ms {
			_ = m.Shutdown(context.Background())
		}
	}()
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for _, m := range ms {
		wg.Add(1)
		go func() { defer wg.Done(); run32(b, m, b.N/3) }()
	}
	wg.Wait()
	b.ReportMetric(float64(b.N/3*3)/time.Since(start).Seconds(), "tasks/s")
}

// BenchmarkLifecycles: single-attempt lifecycles per second from 32
// concurrent callers, memory-only and on PostgreSQL (one member, group
// commit), in one run.
func BenchmarkLifecycles(b *testing.B) {
	for _, mode := range []string{"memory", "postgres"} {
		b.Run(mode, func(b *testing.B) {
			host := &answering{}
			var opts []bgtask.Option
			if mode == "postgres" {
				j, err := Open(context.Background(), benchPool(b), Options{Ledger: fmt.Sprintf("bench-%d", benchLedgers.Add(1)), Member: "w"})
				if err != nil {
					b.Fatal(err)
				}
				opts = append(opts, bgtask.WithJournal(j))
			}
			m, err := bgtask.Open(context.Background(), host, opts...)
			if err != nil {
				b.Fatal(err)
			}
			host.m.Store(m)
			defer func() { _ = m.Shutdown(context.Background()) }()
			b.ResetTimer()
			took := run32(b, m, b.N)
			b.ReportMetric(float64(b.N)/took.Seconds(), "tasks/s")
		})
	}
}

// BenchmarkObserveLatency: an event applied through the database — Observe
// of a running task's idle until its record is durable — one at a time,
// with p50 and p99.
func BenchmarkObserveLatency(b *testing.B) {
	j, err := Open(context.Background(), benchPool(b), Options{Ledger: fmt.Sprintf("bench-%d", benchLedgers.Add(1)), Member: "w"})
	if err != nil {
		b.Fatal(err)
	}
	svc := newService()
	m, err := bgtask.Open(context.Background(), svc, bgtask.WithJournal(j))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = m.Shutdown(context.Background()) }()
	ctx := context.Background()
	spec := bgtask.Spec{ParentSessionID: "p", Models: []bgtask.Model{{Provider: "a", ID: "1"}}}
	lat := make([]time.Duration, 0, b.N)
	for b.Loop() {
		b.StopTimer()
		task, err := m.Launch(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		running, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
		if err != nil {
			b.Fatal(err)
		}
		a := running.Attempts[0]
		b.StartTimer()
		t0 := time.Now()
		// Observe returns once the event's records are durable.
		if err := m.Observe(bgtask.Event{AttemptID: a.ID, SessionID: a.SessionID, Kind: bgtask.SessionIdle, Text: "ok"}); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}

// BenchmarkBareCommit is the floor: one INSERT committed, one at a time.
func BenchmarkBareCommit(b *testing.B) {
	pool := benchPool(b)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS bench_floor (id bigserial, data bytea)`); err != nil {
		b.Fatal(err)
	}
	data := make([]byte, 256)
	for b.Loop() {
		if _, err := pool.Exec(ctx, `INSERT INTO bench_floor (data) VALUES ($1)`, data); err != nil {
			b.Fatal(err)
		}
	}
}

// benchNodes joins n nodes of a fresh ledger, each on a pool of its own
// (as n processes would be), with host(i) as node i's Host.
func benchNodes(b *testing.B, n int, host func(i int) bgtask.Host) []*Node {
	ledger := fmt.Sprintf("bench-%d", benchLedgers.Add(1))
	out := make([]*Node, n)
	for i := range out {
		node, err := Join(context.Background(), benchPool(b), NodeOptions{Ledger: ledger, Member: fmt.Sprintf("w%d", i), Host: host(i)})
		if err != nil {
			b.Fatal(err)
		}
		closeAtEnd(b, node)
		out[i] = node
	}
	return out
}

// BenchmarkNodeLifecycles: single-attempt lifecycles per second through
// Node.Launch (its fence check included) and the change stream's
// publisher, from 1 node and from 3 (32 concurrent callers each, a pool
// each, in this one process), on one database.
func BenchmarkNodeLifecycles(b *testing.B) {
	for _, nodes := range []int{1, 3} {
		b.Run(strconv.Itoa(nodes), func(b *testing.B) {
			hosts := make([]*answering, nodes)
			ns := benchNodes(b, nodes, func(i int) bgtask.Host { hosts[i] = &answering{}; return hosts[i] })
			for i, n := range ns {
				hosts[i].m.Store(n.Manager())
			}
			b.ResetTimer()
			start := time.Now()
			var wg sync.WaitGroup
			for _, n := range ns {
				wg.Add(1)
				go func() { defer wg.Done(); run32node(b, n, b.N/nodes) }()
			}
			wg.Wait()
			b.ReportMetric(float64(b.N/nodes*nodes)/time.Since(start).Seconds(), "tasks/s")
		})
	}
}

// run32node is run32 through a node.
func run32node(b *testing.B, n *Node, count int) {
	if err := lifecycles32(context.Background(), n, count); err != nil {
		b.Error(err)
	}
}

// lifecycles32 runs count single-attempt lifecycles through n.Launch and
// Wait from 32 concurrent callers, and returns the first error.
func lifecycles32(ctx context.Context, n *Node, count int) error {
	var wg sync.WaitGroup
	var next atomic.Int64
	var once sync.Once
	var first error
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1); i <= int64(count); i = next.Add(1) {
				task, err := n.Launch(ctx, bgtask.Spec{ParentSessionID: "p-" + strconv.FormatInt(i, 10), Models: []bgtask.Model{{Provider: "a", ID: "1"}}})
				if err == nil {
					_, err = n.Manager().Wait(ctx, task.ID)
				}
				if err != nil {
					once.Do(func() { first = err })
					return
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// BenchmarkRoutedObserve: an event sent to a process that does not own
// its session — checked in the database, put in the owner's inbox, the
// owner woken by NOTIFY, applied there — until the owner's Wait sees the
// task end: p50 and p99.
func BenchmarkRoutedObserve(b *testing.B) {
	svc := newService()
	ns := benchNodes(b, 2, func(int) bgtask.Host { return svc })
	ctx := context.Background()
	spec := bgtask.Spec{ParentSessionID: "p", Models: []bgtask.Model{{Provider: "a", ID: "1"}}}
	lat := make([]time.Duration, 0, b.N)
	for b.Loop() {
		b.StopTimer()
		task, err := ns[0].Launch(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		running, err := bgtasktest.WaitStatus(ctx, ns[0].Manager(), task.ID, bgtask.StatusRunning)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := ns[0].Launch(ctx, spec); err != nil { // the binding is durable: commits land in order
			b.Fatal(err)
		}
		b.StartTimer()
		t0 := time.Now()
		if err := ns[1].Observe(bgtask.Event{SessionID: running.SessionID, Kind: bgtask.SessionIdle, Text: "ok"}); err != nil {
			b.Fatal(err)
		}
		if _, err := ns[0].Manager().Wait(ctx, task.ID); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
}

// BenchmarkCloseBranch1000: CloseBranch, from one node, of a branch of
// 1,000 running tasks spread over three nodes (a pool each), until every
// run is terminal in the database.
func BenchmarkCloseBranch1000(b *testing.B) {
	svc := newService()
	ns := benchNodes(b, 3, func(int) bgtask.Host { return svc })
	ctx := context.Background()
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		root := fmt.Sprintf("chat-%d", i)
		var ids []string
		for k := range 1000 {
			n := ns[k%3]
			task, err := n.Launch(ctx, bgtask.Spec{ParentSessionID: root, Models: []bgtask.Model{{Provider: "a", ID: "1"}}})
			if err != nil {
				b.Fatal(err)
			}
			ids = append(ids, task.ID)
		}
		for k, id := range ids {
			if _, err := bgtasktest.WaitStatus(ctx, ns[k%3].Manager(), id, bgtask.StatusRunning); err != nil {
				b.Fatal(err)
			}
		}
		for _, n := range ns { // every binding durable
			if _, err := n.Launch(ctx, bgtask.Spec{ParentSessionID: "barrier", Models: []bgtask.Model{{Provider: "a", ID: "1"}}}); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
		rep, err := ns[0].CloseBranch(ctx, root)
		if err != nil {
			b.Fatal(err)
		}
		if len(rep.Stopped) != 1000 {
			b.Fatalf("stopped %d runs, want 1000", len(rep.Stopped))
		}
	}
}
