package pgledger

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/jackc/pgx/v5"
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

// benchPool is a pool on the package's database, closed at the end. Its
// statements and transactions are counted (benchCount).
func benchPool(b *testing.B) *pgxpool.Pool { return benchPoolOf(b, 8) }

// benchPoolOf is benchPool with size connections at most.
func benchPoolOf(b *testing.B, size int32) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		b.Fatal(err)
	}
	cfg.MaxConns = size
	cfg.ConnConfig.Tracer = counting{}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool
}

// benchCount counts what the benchmarks' pools send: every statement
// (BEGIN and COMMIT included), and every transaction (an explicit one, or
// a statement outside one, read-only or not).
var benchCount struct{ stmts, xacts atomic.Int64 }

// counting is the benchmarks' pools' tracer (benchCount).
type counting struct{}

func (counting) TraceQueryStart(ctx context.Context, c *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	benchCount.stmts.Add(1)
	if c.PgConn().TxStatus() == 'I' { // not in a transaction: this statement begins one
		benchCount.xacts.Add(1)
	}
	return ctx
}

func (counting) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// dbCounts is a moment's counts: the transaction ids the server has
// handed out — one per transaction that wrote anything (whoever's: the
// benchmarks run alone on the package's server), so one per commit the
// server makes durable, where pg_stat_database's xact_commit also counts
// the read-only ones, and backends report it lazily (a second late) —
// and benchCount's, and CPU time.
type dbCounts struct {
	xids, stmts, xacts int64
	wal                int64         // the server's WAL position, in bytes
	busy, all          int64         // the machine's CPU time, busy and in all (/proc/stat, in ticks; 0 elsewhere)
	self               time.Duration // this process's CPU time
	db                 time.Duration // the server's CPU time, if it runs on this machine (-1 if not)
}

// serverCPU is the CPU time of the server pool is on — its postmaster,
// the children it reaped and those alive — if it runs on this machine,
// else -1.
func serverCPU(pool *pgxpool.Pool) time.Duration {
	var backend int
	if pool.QueryRow(context.Background(), `SELECT pg_backend_pid()`).Scan(&backend) != nil {
		return -1
	}
	stat := func(pid string) []string {
		data, err := os.ReadFile("/proc/" + pid + "/stat")
		if err != nil {
			return nil
		}
		_, rest, ok := strings.Cut(string(data), ") ") // after the command, which may hold spaces
		if !ok {
			return nil
		}
		return strings.Fields(rest) // [0] is field 3, the state
	}
	ticks := func(f []string, fields ...int) (t int64) {
		for _, i := range fields {
			v, _ := strconv.ParseInt(f[i-3], 10, 64)
			t += v
		}
		return t
	}
	f := stat(strconv.Itoa(backend))
	if f == nil || !strings.Contains(readComm(strconv.Itoa(backend)), "postgres") {
		return -1
	}
	pm := f[1]
	pf := stat(pm)
	if pf == nil {
		return -1
	}
	total := ticks(pf, 14, 15, 16, 17) // its own, and its reaped children's
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		if c := stat(d.Name()); len(c) > 13 && c[1] == pm {
			total += ticks(c, 14, 15)
		}
	}
	return time.Duration(total) * time.Second / 100 // USER_HZ
}

func readComm(pid string) string {
	data, _ := os.ReadFile("/proc/" + pid + "/comm")
	return string(data)
}

// cpuTicks reads the machine's CPU time from /proc/stat: busy, and in all.
func cpuTicks() (busy, all int64) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	for i, f := range strings.Fields(line)[1:] {
		v, _ := strconv.ParseInt(f, 10, 64)
		all += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
	}
	return busy, all
}

func countsNow(b *testing.B, pool *pgxpool.Pool) dbCounts {
	var c dbCounts
	// pg_snapshot_xmax of a fresh snapshot is the next id to be handed
	// out; reading it hands none out.
	if err := pool.QueryRow(context.Background(), `SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`).Scan(&c.xids, &c.wal); err != nil {
		b.Fatal(err)
	}
	c.stmts, c.xacts = benchCount.stmts.Load(), benchCount.xacts.Load()
	c.busy, c.all = cpuTicks()
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		c.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	c.db = serverCPU(pool)
	return c
}

// report reports, per op (n of them), what the run cost between from and
// to: write transactions (writes/op: each a commit the server makes
// durable), all the transactions the benchmark's pools began (xacts/op:
// read-only ones too) and their statements (stmts/op), WAL bytes, and
// CPU time.
func (to dbCounts) report(b *testing.B, from dbCounts, n int) {
	b.ReportMetric(float64(to.xids-from.xids)/float64(n), "writes/op")
	b.ReportMetric(float64(to.xacts-from.xacts)/float64(n), "xacts/op")
	b.ReportMetric(float64(to.stmts-from.stmts)/float64(n), "stmts/op")
	// The WAL the server wrote meanwhile (whoever's: the benchmarks run
	// alone on the package's server).
	b.ReportMetric(float64(to.wal-from.wal)/float64(n), "wal-B/op")
	if to.all > from.all {
		// The whole machine's (this process, the server, anyone else's).
		b.ReportMetric(100*float64(to.busy-from.busy)/float64(to.all-from.all), "cpu-busy-%")
	}
	// This process's CPU time (the Managers, the nodes, pgx), per op.
	b.ReportMetric(float64((to.self-from.self).Microseconds())/float64(n), "go-cpu-µs/op")
	if from.db >= 0 && to.db >= 0 {
		// The server's, its backends' included.
		b.ReportMetric(float64((to.db-from.db).Microseconds())/float64(n), "db-cpu-µs/op")
	}
}

// floorRows is how many commits a floor measurement makes.
const floorRows = 3000

// floor32 is the floor: INSERT of one small row and its COMMIT, from 32
// connections at once, count of them in all; it returns commits per
// second.
func floor32(b *testing.B, count int) float64 {
	pool := benchPoolOf(b, 32)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS bench_floor (id bigserial, data bytea)`); err != nil {
		b.Fatal(err)
	}
	data := make([]byte, 256)
	conns := make([]*pgxpool.Conn, 32)
	for i := range conns { // connected before the clock starts
		c, err := pool.Acquire(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer c.Release()
		conns[i] = c
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(count) {
				if _, err := c.Exec(ctx, `INSERT INTO bench_floor (data) VALUES ($1)`, data); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	return float64(count) / time.Since(start).Seconds()
}

// BenchmarkFloor32 is the floor of the lifecycle benchmarks: an INSERT of
// one small row committed, from 32 connections at once.
func BenchmarkFloor32(b *testing.B) {
	pool := benchPool(b)
	from := countsNow(b, pool)
	b.ReportMetric(floor32(b, b.N), "commits/s")
	countsNow(b, pool).report(b, from, b.N)
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
		m, err := bgtask.Open(context.Background(), host, bgtask.WithJournal(j))
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
			var stats *pgxpool.Pool
			var from dbCounts
			if mode == "postgres" {
				stats = benchPool(b)
				from = countsNow(b, stats)
			}
			b.ResetTimer()
			took := run32(b, m, b.N)
			b.ReportMetric(float64(b.N)/took.Seconds(), "tasks/s")
			if stats != nil {
				countsNow(b, stats).report(b, from, b.N)
			}
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
// (as n processes would be), with host(i) as node i's Host and notifier
// (if not nil) as each node's Notifier.
func benchNodes(b *testing.B, n int, host func(i int) bgtask.Host, notifier ...bgtask.Notifier) []*Node {
	ledger := fmt.Sprintf("bench-%d", benchLedgers.Add(1))
	out := make([]*Node, n)
	for i := range out {
		o := NodeOptions{Ledger: ledger, Member: fmt.Sprintf("w%d", i), Host: host(i)}
		if len(notifier) > 0 {
			o.Notifier = notifier[0]
		}
		node, err := Join(context.Background(), benchPool(b), o)
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
// publisher, without a Notifier, from 1 node and from 3 (nodeCallers
// concurrent callers each, a pool each, in this one process), on one
// database; and
// that rate as a multiple of the floor (floor32, measured just before on
// the same server), with what a lifecycle costs the database.
func BenchmarkNodeLifecycles(b *testing.B) {
	for _, nodes := range []int{1, 3} {
		b.Run(strconv.Itoa(nodes), func(b *testing.B) { nodeLifecycles(b, nodes, false) })
	}
}

// BenchmarkNodeLifecyclesNotified: the same with a Notifier, counted to
// the last delivery: every lifecycle's final summary and its parent's
// all_complete (each lifecycle has a parent of its own) delivered.
func BenchmarkNodeLifecyclesNotified(b *testing.B) {
	for _, nodes := range []int{1, 3} {
		b.Run(strconv.Itoa(nodes), func(b *testing.B) { nodeLifecycles(b, nodes, true) })
	}
}

// nodeLifecycles is BenchmarkNodeLifecycles and
// BenchmarkNodeLifecyclesNotified: b.N lifecycles from nodes nodes.
func nodeLifecycles(b *testing.B, nodes int, notified bool) {
	floor := floor32(b, floorRows)
	hosts := make([]*answering, nodes)
	var box *tally
	var ns []*Node
	if notified {
		box = newTally(b.N / nodes * nodes)
		ns = benchNodes(b, nodes, func(i int) bgtask.Host { hosts[i] = &answering{}; return hosts[i] }, box)
	} else {
		ns = benchNodes(b, nodes, func(i int) bgtask.Host { hosts[i] = &answering{}; return hosts[i] })
	}
	for i, n := range ns {
		hosts[i].m.Store(n.Manager())
	}
	stats := benchPool(b)
	from := countsNow(b, stats)
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for i, n := range ns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := lifecyclesFrom(context.Background(), n, b.N/nodes, fmt.Sprintf("w%d-p-", i), nodeCallers); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	ended := time.Now()
	if box != nil {
		select {
		case <-box.all:
		case <-time.After(5 * time.Minute):
			b.Fatalf("not everything was delivered: %s", box)
		}
		// How long the deliveries went on after the last lifecycle ended.
		b.ReportMetric(float64(time.Since(ended).Milliseconds()), "after-ms")
	}
	took := time.Since(start)
	b.StopTimer()
	to := countsNow(b, stats)
	count := b.N / nodes * nodes
	rate := float64(count) / took.Seconds()
	b.ReportMetric(rate, "tasks/s")
	b.ReportMetric(floor, "floor-commits/s")
	b.ReportMetric(rate/floor, "x-floor")
	to.report(b, from, count)
	if box != nil {
		box.mu.Lock()
		defer box.mu.Unlock()
		if box.dups > 0 {
			b.Errorf("%d notifications delivered twice", box.dups)
		}
	}
}

// tally is a Notifier that counts the final summaries and all_completes
// delivered, and closes all once want of each came.
type tally struct {
	mu        sync.Mutex
	want      int
	summaries int
	rounds    int
	dups      int
	seen      map[string]bool
	all       chan struct{}
}

func newTally(want int) *tally {
	t := &tally{want: want, seen: map[string]bool{}, all: make(chan struct{})}
	if want == 0 {
		close(t.all)
	}
	return t
}

func (t *tally) Notify(_ context.Context, n bgtask.Notification) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.seen[n.ID] {
		t.dups++
		return nil
	}
	t.seen[n.ID] = true
	switch n.Kind {
	case bgtask.NotifyFinalSummary:
		t.summaries++
	case bgtask.NotifyAllComplete:
		t.rounds++
	default:
		return nil
	}
	if t.summaries == t.want && t.rounds == t.want {
		close(t.all)
	}
	return nil
}

func (t *tally) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return fmt.Sprintf("%d final summaries and %d all_complete of %d", t.summaries, t.rounds, t.want)
}

// lifecycles32 runs count single-attempt lifecycles through n.Launch and
// Wait from 32 concurrent callers, and returns the first error.
func lifecycles32(ctx context.Context, n *Node, count int) error {
	return lifecyclesUnder(ctx, n, count, "p-")
}

// lifecyclesUnder is lifecycles32 with the parents named prefix + a
// number: one parent per lifecycle.
func lifecyclesUnder(ctx context.Context, n *Node, count int, prefix string) error {
	return lifecyclesFrom(ctx, n, count, prefix, 32)
}

// nodeCallers is how many lifecycles the node benchmarks keep in flight
// on each node. The floor saturates the server with 32 connections of
// one commit each; a lifecycle spends most of its time waiting for the
// group commits it rides in (four in a row), so 32 in flight leave the
// server idle a fifth of the time, and the node benchmarks measure the
// rate at saturation, as the floor does, with more.
const nodeCallers = 256

// lifecyclesFrom is lifecyclesUnder from callers concurrent callers.
func lifecyclesFrom(ctx context.Context, n *Node, count int, prefix string, callers int) error {
	var wg sync.WaitGroup
	var next atomic.Int64
	var once sync.Once
	var first error
	for range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1); i <= int64(count); i = next.Add(1) {
				task, err := n.Launch(ctx, bgtask.Spec{ParentSessionID: prefix + strconv.FormatInt(i, 10), Models: []bgtask.Model{{Provider: "a", ID: "1"}}})
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
		if err := ns[1].Observe(context.Background(), bgtask.Event{SessionID: running.SessionID, Kind: bgtask.SessionIdle, Text: "ok"}); err != nil {
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

// BenchmarkCloseBranch1000: Node.Stop of a session, from one node, of a
// branch of 1,000 running tasks spread over three nodes (a pool each), until
// every run is terminal in the database.
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
		rep, err := ns[0].Stop(ctx, bgtask.Target{Session: root})
		if err != nil {
			b.Fatal(err)
		}
		if len(rep.Stopped) != 1000 {
			b.Fatalf("stopped %d runs, want 1000", len(rep.Stopped))
		}
	}
}
