package pgledger

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The database goes away under a node and comes back, as an operator's
// restart, stop and lock make it do, on a server of the test's own. The
// node's journal rides out what is shorter than its lease (the same
// fence, no new life), opens its member again after what is longer, fails
// calls fast with ErrUnavailable meanwhile, keeps every call to its
// deadline, and launches again overrun a few seconds of the database
// answering; every task it launched ends exactly once.

// outage is a test's own server and a fixture on it.
type outage struct {
	*fixture
	srv   *pgtest.Server
	url   string
	beats chan struct{} // a heartbeat renewed a lease
	aways chan error    // a statement of a journal found the database away
	clk   leaseClock    // the lease clock of the nodes (node)
}

func newOutage(t *testing.T) *outage {
	t.Helper()
	srv, err := pgtest.StartOwn("outage")
	require.NoError(t, err)
	t.Cleanup(srv.Stop) // last: after the nodes and the pool
	return &outage{fixture: newFixtureOn(t, srv.URL), srv: srv, url: srv.URL,
		beats: make(chan struct{}, 1), aways: make(chan error, 1)}
}

// node joins member w0 with lease, on svc. Its lease is kept by o.clk;
// its heartbeat is at most half a second, so that it finds the database
// back soon after it answers.
func (o *outage) node(svc *service, lease time.Duration) *Node {
	o.t.Helper()
	n, err := Join(context.Background(), o.pool, NodeOptions{Ledger: o.ledger, Member: "w0", Lease: lease, Heartbeat: min(lease/10, 500*time.Millisecond), Host: svc,
		Poll: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(tlog{o.t}, nil)),
		took: func(m string) { tell(o.took)(took{0, m}) }, beat: func() { tell(o.beats)(struct{}{}) }, away: tell(o.aways), now: o.clk.now})
	require.NoError(o.t, err)
	closeAtEnd(o.t, n)
	return n
}

// admin runs statements on a connection of its own (not the pool's).
func (o *outage) admin(sql ...string) *pgx.Conn {
	o.t.Helper()
	conn, err := pgx.Connect(ctx(o.t), o.url)
	require.NoError(o.t, err)
	for _, q := range sql {
		_, err := conn.Exec(ctx(o.t), q)
		require.NoError(o.t, err, q)
	}
	return conn
}

// overrun is how far past its deadline a call may return.
const overrun = time.Second

// launcher launches on n until stopped, each call with a deadline of its
// own, and checks each: it returns overrun its deadline (and a second),
// and fails, if it does, as a retryable call does — ErrUnavailable, or
// its durability unknown when the database went away under it. After a
// failure it waits for the database to answer a heartbeat again.
type launcher struct {
	t        *testing.T
	n        *Node
	beats    <-chan struct{}
	stop     chan struct{}
	done     sync.WaitGroup
	mu       sync.Mutex
	ok, fail int
	worst    time.Duration // the longest overrun of a deadline
}

func (o *outage) launching(n *Node) *launcher {
	l := &launcher{t: o.t, n: n, beats: o.beats, stop: make(chan struct{})}
	l.done.Add(1)
	go func() {
		defer l.done.Done()
		for {
			select {
			case <-l.stop:
				return
			default:
			}
			err := l.once(500 * time.Millisecond)
			if err == nil {
				continue
			}
			select {
			case <-l.stop:
				return
			case <-l.beats:
			}
		}
	}()
	return l
}

// once is one launch with deadline d.
func (l *launcher) once(d time.Duration) error {
	c, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	asked := time.Now()
	_, err := l.n.Launch(c, spec)
	over := time.Since(asked) - d
	l.mu.Lock()
	defer l.mu.Unlock()
	l.worst = max(l.worst, over)
	if err == nil {
		l.ok++
		return nil
	}
	l.fail++
	if !errors.Is(err, ErrUnavailable) && !errors.Is(err, bgtask.ErrDurabilityUnknown) {
		l.t.Errorf("a launch failed with an error that is not retryable: %v", err)
	}
	return err
}

// end stops the launcher and checks its calls kept to their deadlines.
func (l *launcher) end() {
	close(l.stop)
	l.done.Wait()
	l.t.Logf("launches during the fault: %d ok, %d refused; worst overrun %s", l.ok, l.fail, l.worst)
	assert.LessOrEqual(l.t, l.worst, overrun, "a launch overran its deadline")
}

// launchesAgain launches on n until one succeeds — after each refusal,
// once a heartbeat answered again — and returns how long that took.
func (o *outage) launchesAgain(n *Node) time.Duration {
	o.t.Helper()
	up := time.Now()
	for {
		c, cancel := context.WithTimeout(ctx(o.t), 2*time.Second)
		_, err := n.Launch(c, spec)
		cancel()
		if err == nil {
			took := time.Since(up)
			o.t.Logf("launches work again %s after the database answers", took.Round(time.Millisecond))
			return took
		}
		require.Less(o.t, time.Since(up), 10*time.Second, "launches do not work again: %v", err)
		recv(o.t, o.beats, "a heartbeat once the database answers")
	}
}

// endAll ends every task of n's Managers through its session, and checks
// that each ended once: completed, with one attempt_finalized record in
// the database for its one attempt.
func (o *outage) endAll(svc *service, ns ...*Node) {
	o.t.Helper()
	count := 0
	for _, n := range ns {
		for _, m := range n.Managers() {
			for _, task := range m.Snapshot().Tasks {
				running, err := bgtasktest.WaitFor(ctx(o.t), m, task.ID, func(t bgtask.Task) bool {
					return t.Status == bgtask.StatusRunning || t.Status.Terminal()
				})
				require.NoError(o.t, err)
				count++
				if running.Status.Terminal() {
					// A launch whose start the outage cut short ends as its
					// evidence says; nothing else ends before it is answered.
					o.t.Logf("task %s ended before it was answered: %s %q", task.ID, running.Status, running.Error)
					continue
				}
				a := running.Attempts[len(running.Attempts)-1]
				require.NoError(o.t, n.Observe(context.Background(), bgtask.Event{AttemptID: a.ID, SessionID: a.SessionID, Kind: bgtask.SessionIdle, Text: "done"}))
				got, err := m.Wait(ctx(o.t), task.ID)
				require.NoError(o.t, err)
				assert.Equal(o.t, bgtask.StatusCompleted, got.Status, task.ID)
			}
		}
	}
	require.Positive(o.t, count)
	assert.Equal(o.t, count, o.count("bgtask_tasks", "ended"), "every task ended in the database")
	assert.Equal(o.t, count, o.count("bgtask_records", "kind = 'attempt_finalized'"), "and once")
}

// A fast restart mid-run (every connection ended, the server back in a
// second or two): the journal rides it out under the same fence. (The
// lease is long: however slowly a starved machine restarts the server, the
// restart is shorter than the lease.)
func TestANodeRidesOutAServerRestart(t *testing.T) {
	o := newOutage(t)
	svc := newService()
	n := o.node(svc, longLease)
	fence := n.live("w0").j.Fence()
	l := o.launching(n)
	for range 5 {
		_, err := n.Launch(ctx(t), spec)
		require.NoError(t, err)
	}
	require.NoError(t, o.srv.Restart())
	assert.Less(t, o.launchesAgain(n), 5*time.Second)
	l.end()
	assert.Equal(t, fence, n.live("w0").j.Fence(), "the journal rode the restart out: no new life")
	o.endAll(svc, n)
}

// The server stopped for less than a lease, then for more: the first is
// ridden out under the same fence; after the second the member's lease
// may have run out, so the node gives that life up and opens its member
// again (a new fence), reconciling its runs — each task still ends once.
//
// The lease is long, so that the first stop is shorter than it however
// slowly a starved machine stops and starts the server; the second lasts
// longer than the lease by the node's lease clock (advanced while the
// server is stopped) and by the database's (the member's lease expired
// once it is back, as the time would have made it).
func TestANodeRidesOutAStopAndReopensAfterOneLongerThanItsLease(t *testing.T) {
	o := newOutage(t)
	svc := newService()
	lease := longLease
	n := o.node(svc, lease)
	fence := n.live("w0").j.Fence()
	for range 3 {
		_, err := n.Launch(ctx(t), spec)
		require.NoError(t, err)
	}
	l := o.launching(n)
	require.NoError(t, o.srv.Halt())
	err := recv(t, o.aways, "the journal to find the database away")
	assert.True(t, transient(err), "%v", err)
	c, cancel := context.WithTimeout(ctx(t), time.Second)
	_, err = n.Launch(c, spec)
	cancel()
	require.ErrorIs(t, err, ErrUnavailable, "refused at once while the database is away")
	c, cancel = context.WithTimeout(ctx(t), time.Second)
	_, err = Join(c, o.pool, NodeOptions{Ledger: o.ledger, Member: "w9", Host: svc})
	cancel()
	require.ErrorIs(t, err, ErrUnavailable, "a node cannot join while the database is away, and says why")
	select { // the outage goes on: the journal keeps asking, and finds the database away again
	case <-o.aways:
	default:
	}
	recv(t, o.aways, "the journal to find the database still away")
	require.NoError(t, o.srv.Resume())
	assert.Less(t, o.launchesAgain(n), 5*time.Second)
	l.end()
	assert.Equal(t, fence, n.live("w0").j.Fence(), "a stop shorter than the lease is ridden out")

	life := n.live("w0")
	require.NoError(t, o.srv.Halt())
	o.clk.advance(lease + lease/5) // longer than the lease
	recv(t, life.j.Lost(), "the journal to give its life up")
	require.NoError(t, o.srv.Resume())
	o.expire("w0")
	recv(t, o.took, "the node to open its own member again")
	assert.Less(t, o.launchesAgain(n), 5*time.Second)
	assert.Greater(t, n.live("w0").j.Fence(), fence, "a new life of the member")
	o.endAll(svc, n)
}

// A lock held on the members table for longer than a call's deadline
// stalls every write: the calls keep to their deadlines, and once the lock
// is gone the journal goes on under the same fence and what was in flight
// lands.
func TestCallsKeepToTheirDeadlinesWhileTheDatabaseStalls(t *testing.T) {
	o := newOutage(t)
	svc := newService()
	n := o.node(svc, longLease) // the stall is shorter than the lease however starved the machine
	fence := n.live("w0").j.Fence()
	task, err := n.Launch(ctx(t), spec)
	require.NoError(t, err)
	first, err := bgtasktest.WaitStatus(ctx(t), n.Manager(), task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	lock := o.admin("BEGIN", "LOCK TABLE bgtask_members IN ACCESS EXCLUSIVE MODE")
	l := o.launching(n)
	for _, s := range []bgtask.Spec{spec, {Prompt: "no parent", Models: spec.Models}} {
		c, cancel := context.WithTimeout(ctx(t), time.Second)
		asked := time.Now()
		_, err := n.Launch(c, s)
		cancel()
		assert.Less(t, time.Since(asked), time.Second+overrun, "a launch kept to its deadline")
		assert.True(t, errors.Is(err, ErrUnavailable) || errors.Is(err, bgtask.ErrDurabilityUnknown), "%v", err)
	}
	// An event of a task here waits for its records to be durable, which
	// the stall holds up: Observe keeps to its context all the same.
	c, cancel := context.WithTimeout(ctx(t), time.Second)
	asked := time.Now()
	err = n.Observe(c, bgtask.Event{AttemptID: first.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "done"})
	cancel()
	assert.Less(t, time.Since(asked), time.Second+overrun, "Observe kept to its deadline")
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	recv(t, o.aways, "a statement to run out of its time")
	_, err = lock.Exec(ctx(t), "ROLLBACK")
	require.NoError(t, err)
	require.NoError(t, lock.Close(ctx(t)))
	o.launchesAgain(n)
	l.end()
	assert.Equal(t, fence, n.live("w0").j.Fence())
	o.endAll(svc, n)
}

// A stall of the fence checks (a lock on bgtask_launching, which every
// admission writes): the launches sent together behind it keep to their
// deadlines, the statement none of them waits for any more is cancelled
// with nothing of theirs left in flight, and launches work again once the
// lock is gone.
func TestLaunchesBatchedBehindAStallKeepToTheirDeadlines(t *testing.T) {
	o := newOutage(t)
	svc := newService()
	n := o.node(svc, longLease)
	lock := o.admin("BEGIN", "LOCK TABLE bgtask_launching IN ACCESS EXCLUSIVE MODE")
	errs := make([]error, 4)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, cancel := context.WithTimeout(ctx(t), time.Second)
			defer cancel()
			asked := time.Now()
			_, errs[i] = n.Launch(c, spec)
			assert.Less(t, time.Since(asked), time.Second+overrun, "a launch kept to its deadline")
		}()
	}
	wg.Wait()
	for _, err := range errs {
		assert.ErrorIs(t, err, ErrUnavailable)
	}
	// The statement, cancelled by its callers' leaving, may still wait in
	// the server (the cancel request not there yet): the lock goes once
	// the server's clock is past the time its callers waited (a second
	// from when it began, at most), by which it must give up what it did.
	_, err := lock.Exec(ctx(t), `SELECT pg_sleep(greatest(0, extract(epoch FROM a.query_start + interval '1 second' - clock_timestamp())))
  FROM pg_stat_activity a WHERE a.query LIKE 'SELECT bgtask_admit_all%' AND a.state = 'active'`)
	require.NoError(t, err)
	_, err = lock.Exec(ctx(t), "ROLLBACK")
	require.NoError(t, err)
	require.NoError(t, lock.Close(ctx(t)))
	o.launchesAgain(n)
	assert.Equal(t, 0, o.count("bgtask_launching", ""), "nothing left in flight")
	assert.Len(t, n.Manager().Snapshot().Tasks, 1, "only the launch after the stall")
	o.endAll(svc, n)
}

// A failover whose new writer answers at the same address, while the
// pool's connections are still to a server that refuses writes (SQLSTATE
// 25006 — here the database is made read-only, its connections ended, and
// made writable again, so the connections the pool made meanwhile stay
// read-only): the node drops those connections and goes on once a writer
// answers.
func TestANodeDropsConnectionsToAStandby(t *testing.T) {
	o := newOutage(t)
	svc := newService()
	n := o.node(svc, longLease)
	_, err := n.Launch(ctx(t), spec)
	require.NoError(t, err)
	db := "outage"
	admin := o.admin(fmt.Sprintf("ALTER DATABASE %s SET default_transaction_read_only = on", db),
		fmt.Sprintf("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '%s' AND pid <> pg_backend_pid()", db))
	defer func() { _ = admin.Close(context.Background()) }()
	for {
		err := recv(t, o.aways, "a write refused by a read-only server")
		if readOnly(err) {
			break
		}
	}
	// Fill the pool with connections to the read-only server: made while it
	// was so, they stay read-only once it is writable again.
	conns := make([]*pgxpool.Conn, o.pool.Config().MaxConns)
	for i := range conns {
		conns[i], err = o.pool.Acquire(ctx(t))
		require.NoError(t, err)
		var ro string
		require.NoError(t, conns[i].QueryRow(ctx(t), "SHOW transaction_read_only").Scan(&ro))
		require.Equal(t, "on", ro)
	}
	for _, c := range conns {
		c.Release()
	}
	_, err = admin.Exec(ctx(t), fmt.Sprintf("ALTER DATABASE %s RESET default_transaction_read_only", db))
	require.NoError(t, err)
	assert.Less(t, o.launchesAgain(n), 5*time.Second)
	o.endAll(svc, n)
}

// A commit whose connection dropped around its end is tried again, and
// lands once: bgtask_write finds its first record already there.
func TestACommitTriedAgainLandsOnce(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{})
	batch := []bgtask.Record{rec(1, "note", "", "", "", ""), rec(2, "note", "", "", "", "")}
	require.NoError(t, j.Append(batch).Wait())
	require.NoError(t, j.appendGroup(ctx(t), []*commit{{recs: batch}}, &outboxNotes{}), "the same commit again")
	assert.Equal(t, 2, f.count("bgtask_records", "member = 'w1'"))
	require.NoError(t, j.Append([]bgtask.Record{rec(3, "note", "", "", "", "")}).Wait())
	assert.Equal(t, 3, f.count("bgtask_records", "member = 'w1'"))
}

// An append whose connection is cut while it waits in the database (its
// backend terminated, as a restart or a failover does) is tried again, and
// lands once: the launch that waited on it succeeds, the journal goes on
// under the same fence.
func TestAnAppendCutOffMidwayIsTriedAgain(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	j := f.open("w1", Options{Lease: 10 * time.Second})
	m := f.manager(svc, j)
	conn, err := pgx.Connect(ctx(t), dbURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	tx, err := conn.Begin(ctx(t))
	require.NoError(t, err)
	_, err = tx.Exec(ctx(t), "LOCK TABLE bgtask_members IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	launched := make(chan error, 1)
	go func() {
		_, err := m.Launch(ctx(t), spec)
		launched <- err
	}()
	// The append's backend, waiting on the lock: cut it off.
	var pid int
	for looking := ctx(t); pid == 0; { // fails once looking ends (30 s)
		err := conn.QueryRow(looking, `SELECT coalesce((SELECT pid FROM pg_stat_activity
 WHERE query LIKE 'SELECT bgtask_write(%' AND wait_event_type = 'Lock' LIMIT 1), 0)`).Scan(&pid)
		require.NoError(t, err, "no append waits on the lock")
	}
	var cut bool
	require.NoError(t, conn.QueryRow(ctx(t), "SELECT pg_terminate_backend($1)", pid).Scan(&cut))
	require.True(t, cut)
	require.NoError(t, tx.Rollback(ctx(t)))
	require.NoError(t, recv(t, launched, "the launch"), "the append was tried again")
	require.NoError(t, j.Available())
	assert.Equal(t, 1, f.count("bgtask_records", "kind = 'task_launched'"))
	_, err = m.Launch(ctx(t), spec)
	require.NoError(t, err, "the journal goes on")
}

// A stall longer than the lease (the members table locked past it) ends
// with every member owned once: each journal gave its life up once the
// lease could have run out, and each member was opened again — by its own
// process or by the other — under a new fence, never by both.
//
// The lease is long, and the stall outlasts it by the nodes' lease clock
// (advanced while the table is locked) and by the database's (each
// member's expiry put in the past by the locking transaction, which
// commits to end the stall): a short lease would also lapse, under a
// starved CPU, before the stall or after it, which is not this test.
func TestAStallLongerThanTheLeaseNeverMakesTwoOwners(t *testing.T) {
	o := newOutage(t)
	svc := newService()
	clk := &leaseClock{}
	var ns []*Node
	for _, name := range []string{"w0", "w1"} {
		n, err := Join(context.Background(), o.pool, NodeOptions{Ledger: o.ledger, Member: name, Lease: longLease, Heartbeat: time.Second, Host: svc,
			Poll: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(tlog{o.t}, nil)),
			took: func(m string) { tell(o.took)(took{0, m}) }, now: clk.now})
		require.NoError(t, err)
		closeAtEnd(t, n)
		ns = append(ns, n)
	}
	lives := map[string]*member{}
	for _, n := range ns {
		_, err := n.Launch(ctx(t), spec)
		require.NoError(t, err)
		lives[n.o.Member] = n.live(n.o.Member)
	}
	lock := o.admin("BEGIN", "LOCK TABLE bgtask_members IN ACCESS EXCLUSIVE MODE")
	clk.advance(longLease) // the stall itself
	for name, mb := range lives {
		recv(t, mb.j.Lost(), name+"'s journal to give its life up")
	}
	_, err := lock.Exec(ctx(t), `UPDATE bgtask_members SET expires_at = now() - interval '1 hour' WHERE ledger = $1`, o.ledger)
	require.NoError(t, err)
	_, err = lock.Exec(ctx(t), "COMMIT")
	require.NoError(t, err)
	require.NoError(t, lock.Close(ctx(t)))
	for opened := map[string]bool{}; len(opened) < len(lives); { // each member opened again, by one node or the other
		opened[recv(t, o.took, "a member to be opened again").member] = true
	}
	for name, old := range lives {
		var owners []*member
		for _, n := range ns {
			if mb := n.live(name); mb != nil {
				owners = append(owners, mb)
			}
		}
		require.Len(t, owners, 1, "member %s has one owner", name)
		assert.Greater(t, owners[0].j.Fence(), old.j.Fence(), "member %s: a new life", name)
	}
	o.endAll(svc, ns...)
}

// A write that the database never takes (here the records table is
// locked, so every try waits and runs out of its time) is not tried for
// ever: the journal gives its life up, as if its lease had run out. (Here
// the blocked append holds the member's row, so the heartbeat cannot renew
// either; the cap on a write's tries while heartbeats do renew the lease is
// not shown by this test.)
func TestAWriteNeverTakenIsNotTriedForEver(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{Lease: 500 * time.Millisecond})
	conn, err := pgx.Connect(ctx(t), dbURL)
	require.NoError(t, err)
	defer conn.Close(context.Background())
	tx, err := conn.Begin(ctx(t))
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx(t), "LOCK TABLE bgtask_records IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- j.Append([]bgtask.Record{rec(1, "note", "", "", "", "")}).Wait() }()
	err = recv(t, done, "the write to be given up")
	require.ErrorIs(t, err, ErrLeaseLost)
	recv(t, j.Lost(), "the journal to say its life is over")
}

// stallingNotifier counts each notification's deliveries by ID, and
// stalls the server (SIGSTOP) for stall when it is first given a final
// summary: the deliverer's marks of what it delivered then wait for the
// server, longer than the claim lasts.
type stallingNotifier struct {
	srv     *pgtest.Server
	stall   time.Duration
	mu      sync.Mutex
	seen    map[string]int
	stalled bool
	thawed  chan error // the stall's end
	got     chan bgtask.Notification
}

func (s *stallingNotifier) Notify(_ context.Context, n bgtask.Notification) error {
	s.mu.Lock()
	s.seen[n.ID]++
	first := n.Kind == bgtask.NotifyFinalSummary && !s.stalled
	s.stalled = s.stalled || first
	s.mu.Unlock()
	if first {
		stopped, err := s.srv.Freeze()
		if err != nil {
			return err
		}
		go func() { // the fault's length is the fault: a timer, not a wait for a state
			t := time.NewTimer(s.stall)
			<-t.C
			s.thawed <- s.srv.Thaw(stopped)
		}()
	}
	s.got <- n
	return nil
}

// A stall of the server longer than a parent's claim, between a delivery
// and its mark, delivers nothing twice: the marks time out and are kept
// (however long the claim has been held), the claim expires, but nobody
// took it over, so the marks still apply once the server answers (the
// promise: exactly once when nothing crashes). The claim and the marks'
// bound are a second here, the stall three.
func TestAStallLongerThanAClaimDeliversNothingTwice(t *testing.T) {
	o := newOutage(t)
	svc := newService()
	note := &stallingNotifier{srv: o.srv, stall: 3 * time.Second, seen: map[string]int{}, thawed: make(chan error, 1), got: make(chan bgtask.Notification, 64)}
	n, err := Join(ctx(t), o.pool, NodeOptions{Ledger: o.ledger, Member: "w0", Host: svc, Poll: 50 * time.Millisecond, Lease: longLease,
		Notifier: note, claimFor: time.Second, markFor: time.Second, Logger: slog.New(slog.NewTextHandler(tlog{t}, nil))})
	require.NoError(t, err)
	closeAtEnd(t, n)
	finish := func() bgtask.Task {
		task, err := n.Launch(ctx(t), bgtask.Spec{ParentSessionID: "chat", Prompt: "do it", Models: spec.Models})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx(t), n.Manager(), task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		require.NoError(t, n.Observe(ctx(t), bgtask.Event{AttemptID: got.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "ok"}))
		return task
	}
	summaryOf := func(id string) {
		for {
			if got := recv(t, note.got, "a delivery"); got.Kind == bgtask.NotifyFinalSummary && got.TaskID == id {
				return
			}
		}
	}
	first := finish()
	summaryOf(first.ID) // delivered; the server stalls
	require.NoError(t, recv(t, note.thawed, "the stall to end"))
	// The parent's next summary comes after anything of it delivered again.
	second := finish()
	summaryOf(second.ID)
	note.mu.Lock()
	defer note.mu.Unlock()
	for id, times := range note.seen {
		assert.Equal(t, 1, times, "notification %s delivered once", id)
	}
}

// A round whose statement the database does not answer leaves what it
// was to delete for later, and the deliverer waits for a wake-up or Poll
// before it asks again, rather than ask at once, round after round, for
// as long as the database is away.
func TestADelivererWaitsOutADatabaseAway(t *testing.T) {
	o := newOutage(t)
	n := o.node(newService(), longLease) // no Notifier: the test runs the rounds
	d := newDeliverer(n)
	d.done = []sentRow{{part: 3, id: 42, note: "n-42"}}
	require.False(t, d.idle(false), "something to delete: at once")
	require.NoError(t, o.srv.Halt())
	more, runs := d.round(ctx(t), nil)
	require.NoError(t, o.srv.Resume())
	assert.False(t, more)
	assert.Empty(t, runs)
	assert.Len(t, d.done, 1, "kept for the next round")
	assert.True(t, d.idle(more), "the next round waits")
	_, _ = d.round(ctx(t), nil)
	assert.Empty(t, d.done, "deleted once the database answers")
	assert.False(t, d.failed)
}
