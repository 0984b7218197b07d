package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var dbURL string

// dbURL is the test database's; TestMain (main_test.go) sets it.

// ledgers makes each test's ledger name distinct: tests share a database.
var ledgers atomic.Int64

// fixture is one test's pool and ledger name.
type fixture struct {
	t      *testing.T
	pool   *pgxpool.Pool
	ledger string
	took   chan took // the fixture's nodes' takeovers
	// drained hears the member whenever a node of the fixture's removed
	// applied events from its inbox.
	drained chan string
	// stopped hears the task whenever a node of the fixture wrote what a
	// stop of its run came to.
	stopped chan string
	// marked hears the id of each notification a delivering node of the
	// fixture marked delivered.
	marked chan string
}

func newFixture(t *testing.T) *fixture { t.Helper(); return newFixtureOn(t, dbURL) }

// newFixtureOn is a fixture on the database at url, migrated: a test
// may write the tables before it opens a journal, whichever tests ran
// before it (-run picks any).
func newFixtureOn(t *testing.T, url string) *fixture {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	require.NoError(t, Migrate(context.Background(), pool))
	return &fixture{t: t, pool: pool, ledger: fmt.Sprintf("%s-%d", t.Name(), ledgers.Add(1)), took: make(chan took, 16), drained: make(chan string, 64), stopped: make(chan string, 64), marked: make(chan string, 256)}
}

// open opens member's journal, closed at the test's end.
func (f *fixture) open(member string, o Options) *Journal {
	f.t.Helper()
	o.Ledger, o.Member = f.ledger, member
	j, err := Open(context.Background(), f.pool, o)
	require.NoError(f.t, err)
	f.t.Cleanup(func() { _ = j.Close() })
	return j
}

// manager opens a Manager on j, shut down at the test's end.
func (f *fixture) manager(host bgtask.Host, j bgtask.Journal, opts ...bgtask.Option) *bgtask.Manager {
	f.t.Helper()
	m, err := bgtask.Open(context.Background(), host, append(opts, bgtask.WithJournal(j))...)
	require.NoError(f.t, err)
	f.t.Cleanup(func() {
		c, cancel := ending()
		defer cancel()
		_ = m.Shutdown(c)
	})
	return m
}

// expire ends member's lease, as time passing would. It is set an hour
// back, not to now(): a heartbeat whose statement began just before this
// one and waited for its row lock would find expires_at (this statement's
// now()) later than its own now(), and renew the lease.
func (f *fixture) expire(member string) {
	f.t.Helper()
	_, err := f.pool.Exec(context.Background(), `UPDATE bgtask_members SET expires_at = now() - interval '1 hour' WHERE ledger = $1 AND member = $2`, f.ledger, member)
	require.NoError(f.t, err)
}

// leaseClock is the clock journals keep their leases by (Options.now,
// NodeOptions.now): the wall clock, plus what a test advanced it by — as
// if the process had waited that long, without the test waiting.
type leaseClock struct{ ahead atomic.Int64 }

func (c *leaseClock) now() time.Time { return time.Now().Add(time.Duration(c.ahead.Load())) }

func (c *leaseClock) advance(d time.Duration) { c.ahead.Add(int64(d)) }

// count reads how many rows of table belong to the fixture's ledger.
func (f *fixture) count(table, where string, args ...any) int {
	f.t.Helper()
	var n int
	q := "SELECT count(*) FROM " + table + " WHERE ledger = $1"
	if where != "" {
		q += " AND " + where
	}
	require.NoError(f.t, f.pool.QueryRow(context.Background(), q, append([]any{f.ledger}, args...)...).Scan(&n))
	return n
}

var spec = bgtask.Spec{ParentSessionID: "parent", Prompt: "do it", Models: []bgtask.Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}}}

// recv waits for a value from c for at most 30 seconds (failure
// detection only: the tests never wait on time for a state), and fails the
// test, naming what it waited for, if none came.
func recv[T any](t *testing.T, c <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("waited 30s for %s", what)
		panic("not reached")
	}
}

// tell returns a hook that sends its value on c if c has room, and
// otherwise drops it (nobody in this test waits for it).
func tell[T any](c chan<- T) func(T) {
	return func(v T) {
		select {
		case c <- v:
		default:
		}
	}
}

// ending is the bound of a Node's Close or a Manager's Shutdown at a
// test's end: a test that failed with a host call held (a gate never
// released) then still ends, and its failure is printed, where an
// unbounded Close would wait for the call forever.
func ending() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 30*time.Second)
}

// closeAtEnd closes node when the test ends, bounded by ending.
func closeAtEnd(t testing.TB, node *Node) {
	t.Cleanup(func() {
		c, cancel := ending()
		defer cancel()
		_ = node.Close(c)
	})
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

// Migrate is idempotent, and refuses a schema newer than the package.
func TestMigrate(t *testing.T) {
	f := newFixture(t)
	for range 2 {
		require.NoError(t, Migrate(ctx(t), f.pool))
	}
	var v int
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT max(version) FROM bgtask_schema`).Scan(&v))
	assert.Equal(t, SchemaVersion(), v)

	// A database from a newer package (in a schema of its own, so that the
	// shared database stays at this package's version): refused.
	_, err := f.pool.Exec(ctx(t), `DROP SCHEMA IF EXISTS newer CASCADE; CREATE SCHEMA newer`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = f.pool.Exec(context.Background(), `DROP SCHEMA newer CASCADE`) })
	cfg := f.pool.Config().Copy()
	cfg.ConnConfig.RuntimeParams["search_path"] = "newer"
	p2, err := pgxpool.NewWithConfig(ctx(t), cfg)
	require.NoError(t, err)
	defer p2.Close()
	require.NoError(t, Migrate(ctx(t), p2))
	_, err = p2.Exec(ctx(t), `INSERT INTO bgtask_schema (version) VALUES ($1)`, SchemaVersion()+1)
	require.NoError(t, err)
	err = Migrate(ctx(t), p2)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "newer than this package")
}

func TestOpenRefusesBadOptions(t *testing.T) {
	f := newFixture(t)
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{}, "Member is required"},
		{Options{Member: "  "}, "Member is required"},
		{Options{Member: "m", Lease: -1}, "negative"},
		{Options{Member: "m", Lease: time.Millisecond}, "too short"},
		{Options{Member: "m", Lease: time.Second, Heartbeat: 2 * time.Second}, "does not renew"},
	} {
		_, err := Open(ctx(t), f.pool, tc.o)
		require.Error(t, err, "%+v", tc.o)
		assert.Contains(t, err.Error(), tc.want)
	}
	_, err := Open(ctx(t), nil, Options{Member: "m"})
	assert.ErrorContains(t, err, "nil pool")
	//lint:ignore SA1012 a nil context is what a hostile caller passes
	j, err := Open(nil, f.pool, Options{Ledger: f.ledger, Member: "m"})
	require.NoError(t, err)
	require.NoError(t, j.Close())
	require.NoError(t, j.Close(), "Close twice")
	assert.ErrorIs(t, j.Append(nil).Wait(), ErrClosed)
}

// A Manager on the journal: what it did is in the database, and a new
// process on the same member sees the same tasks, byte for byte.
func TestDurableAcrossRestart(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	j := f.open("w1", Options{})
	m := f.manager(svc, j)
	done, err := m.Launch(ctx(t), spec)
	require.NoError(t, err)
	require.NoError(t, m.Observe(bgtask.Event{AttemptID: done.Attempts[0].ID, SessionID: svc.sessionOf(done.Attempts[0].ID), Kind: bgtask.SessionIdle, Text: "answer"}))
	got, err := m.Wait(ctx(t), done.ID)
	require.NoError(t, err)
	require.Equal(t, bgtask.StatusCompleted, got.Status)
	failed, err := m.Launch(ctx(t), spec)
	require.NoError(t, err)
	a1 := failed.Attempts[0]
	require.NoError(t, m.Observe(bgtask.Event{AttemptID: a1.ID, Kind: bgtask.SessionError, Err: errors.New("429 rate limited")}))
	retried, err := bgtasktest.WaitFor(ctx(t), m, failed.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Attempts[1].SessionID != "" })
	require.NoError(t, err)
	before := m.Snapshot().Tasks
	// The process dies: nothing it does from now on lands, and its lease
	// runs out.
	j.abandon()
	require.ErrorIs(t, m.Shutdown(ctx(t)), bgtask.ErrJournal)
	f.expire("w1")

	// The next process on w1: the service still runs the retry's session,
	// so it is re-adopted (found by its attempt if its binding was not yet
	// durable at the crash); its answer, sent now, ends it.
	j2 := f.open("w1", Options{})
	assert.Greater(t, j2.Fence(), j.Fence(), "a new fence at every open")
	m2 := f.manager(svc, j2)
	assert.Positive(t, f.count("bgtask_records", "member = 'w1'"))
	assert.Equal(t, 2, f.count("bgtask_tasks", "member = 'w1'"))
	assert.Equal(t, 3, f.count("bgtask_sessions", "member = 'w1'"), "every session bound, once recovery is done")
	after := m2.Snapshot().Tasks
	require.Len(t, after, 2)
	assert.Equal(t, jsonOf(t, before[0]), jsonOf(t, after[0]), "an ended task is replayed exactly")
	assert.Equal(t, jsonOf(t, before[1].Attempts[:1]), jsonOf(t, after[1].Attempts[:1]))
	a2 := retried.Attempts[1]
	require.NoError(t, m2.Observe(bgtask.Event{AttemptID: a2.ID, SessionID: a2.SessionID, Kind: bgtask.SessionIdle, Text: "second try"}))
	end, err := m2.Wait(ctx(t), failed.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, end.Status)
	assert.Equal(t, "second try", end.Attempts[1].Result)
}

func jsonOf(t *testing.T, v any) string {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}

// One owner per member: a second opener is refused while the lease is
// live and names who holds it; Close releases it at once.
func TestSecondOpenerRefused(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{Holder: "first"})
	_, err := Open(ctx(t), f.pool, Options{Ledger: f.ledger, Member: "w1", Holder: "second"})
	var held *LeaseHeldError
	require.ErrorAs(t, err, &held)
	assert.Equal(t, "first", held.Holder)
	assert.Contains(t, err.Error(), `member "w1"`)
	require.NoError(t, j.Close())
	j2 := f.open("w1", Options{Holder: "second"})
	assert.Greater(t, j2.Fence(), j.Fence())
}

// A process dies mid-run: once its lease expires, another process takes
// the member over and reconciles its runs as a restart does — a run whose
// session still runs is re-adopted, one whose session ended ends with its
// evidence, one whose session is gone is interrupt — and the dead owner's
// late writes never land.
//
// The leases are long, and the dead owner's expires when the test says
// (expire), as time passing would: a short one could lapse under a starved
// CPU while its owner still lives, which is not what this test is about.
func TestTakeoverAfterExpiry(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	lease := time.Minute
	j := f.open("w1", Options{Lease: lease})
	m := f.manager(svc, j)
	var ids [3]string
	for i := range ids {
		task, err := m.Launch(ctx(t), spec)
		require.NoError(t, err)
		_, err = bgtasktest.WaitFor(ctx(t), m, task.ID, func(t bgtask.Task) bool { return t.Status == bgtask.StatusRunning })
		require.NoError(t, err)
		ids[i] = task.ID
	}
	tasks := map[string]bgtask.Task{}
	for _, id := range ids {
		tasks[id], _ = m.Task(id)
	}
	records := f.count("bgtask_records", "")

	// The process stops dead: no more heartbeats, no release.
	j.abandon()
	svc.end(svc.sessionOf(tasks[ids[1]].Attempts[0].ID), bgtask.Event{Kind: bgtask.SessionIdle, Text: "finished while nobody listened"})
	svc.forget(svc.sessionOf(tasks[ids[2]].Attempts[0].ID))

	// Another process waits for the lease in vain while the dead owner's
	// lease lasts, and takes over once it expired.
	_, err := Open(ctx(t), f.pool, Options{Ledger: f.ledger, Member: "w1", Lease: lease, Wait: 300 * time.Millisecond, Holder: "heir"})
	var held *LeaseHeldError
	require.ErrorAs(t, err, &held, "the dead owner's lease still lasts")
	f.expire("w1")
	j2 := f.open("w1", Options{Lease: lease, Holder: "heir"})
	assert.Greater(t, j2.Fence(), j.Fence(), "the heir holds a newer fence")
	heir := f.manager(svc, j2)
	alive, err := heir.Task(ids[0])
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, alive.Status, "its session runs on: re-adopted")
	ended, err := heir.Wait(ctx(t), ids[1])
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, ended.Status)
	assert.Equal(t, "finished while nobody listened", ended.Attempts[0].Result)
	gone, err := heir.Wait(ctx(t), ids[2])
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusInterrupt, gone.Status)
	assert.Equal(t, "lost across restart", gone.Attempts[0].Error)

	// The re-adopted run's events resolve again, at the heir.
	a := alive.Attempts[0]
	require.NoError(t, heir.Observe(bgtask.Event{AttemptID: a.ID, SessionID: a.SessionID, Kind: bgtask.SessionIdle, Text: "done"}))
	got, err := heir.Wait(ctx(t), ids[0])
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, got.Status)

	// The dead owner's old Manager acts once more: its write is refused,
	// and nothing of it lands.
	assert.ErrorIs(t, testkit.StopErr(m.Stop(ctx(t), bgtask.Target{Task: ids[0]})), bgtask.ErrJournal)
	assert.Positive(t, f.count("bgtask_records", "")-records)
	heirRecords := f.count("bgtask_records", "")
	// A writer that still believes it holds the old fence, and that its
	// lease was renewed a moment ago: the database refuses its write.
	stale := newJournal(f.pool, Options{Ledger: f.ledger, Member: "w1", Holder: "ghost", Lease: lease})
	stale.fence = j.Fence()
	stale.renewed(time.Now())
	stale.done.Add(1)
	go stale.writer()
	err = stale.Append([]bgtask.Record{{Seq: 1 << 40, Kind: "stop_requested", TaskID: ids[0], AttemptID: a.ID, Token: a.Token, Data: []byte{1}}}).Wait()
	assert.ErrorIs(t, err, ErrLeaseLost)
	select {
	case <-stale.Lost():
	default:
		t.Error("Lost is not closed after a refused write")
	}
	require.NoError(t, stale.Close())
	assert.Equal(t, heirRecords, f.count("bgtask_records", ""), "a stale owner's write landed")
}

// A heartbeat keeps the lease: an owner that writes nothing for several
// lease lengths is not taken over; and once the lease expired all the same
// (the process was paused past it), the next heartbeat finds it lost and
// the journal writes nothing more. Time passes in the database, as expire
// makes it: each round spends half of the lease (its expiry set half a
// lease from now) and waits for a heartbeat to renew a whole lease from
// then — so the test needs no wall-clock time, and a starved CPU cannot
// let the lease lapse under it.
func TestHeartbeatKeepsLease(t *testing.T) {
	f := newFixture(t)
	lease := time.Hour
	beats := make(chan struct{}, 1)
	j := f.open("w1", Options{Lease: lease, Heartbeat: 20 * time.Millisecond, beat: func() { tell(beats)(struct{}{}) }})
	left := func() (d time.Duration) {
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT expires_at - now() FROM bgtask_members WHERE ledger = $1 AND member = 'w1'`, f.ledger).Scan(&d))
		return d
	}
	for range 7 { // seven half leases: three and a half leases with no write
		_, err := f.pool.Exec(ctx(t), `UPDATE bgtask_members SET expires_at = now() + $2::interval WHERE ledger = $1 AND member = 'w1'`, f.ledger, lease/2)
		require.NoError(t, err)
		for left() <= lease*3/4 { // not renewed since: a beat may have come before the update
			recv(t, beats, "a heartbeat")
		}
	}
	_, err := Open(ctx(t), f.pool, Options{Ledger: f.ledger, Member: "w1", Lease: lease})
	var held *LeaseHeldError
	require.ErrorAs(t, err, &held)
	require.NoError(t, j.Append(nil).Wait())

	f.expire("w1")
	recv(t, j.Lost(), "the heartbeat to find the lease lost")
	assert.ErrorIs(t, j.Append(nil).Wait(), ErrLeaseLost)
}

// Exact identity in the database: a record for an attempt that is not
// its task's current one, or for another member's task, changes nothing;
// a session bound by one member cannot be bound by another.
func TestIdentityInTheDatabase(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{})
	require.NoError(t, j.Append([]bgtask.Record{
		rec(1, "task_launched", "t1", "", "", ""),
		rec(2, "attempt_created", "t1", "a1", "r1", ""),
		rec(3, "session_bound", "t1", "a1", "r1", "s1"),
		rec(4, "attempt_created", "t1", "a2", "r2", ""),
	}).Wait())
	before := f.count("bgtask_records", "")

	// The journal fails on the stale record (its Manager would stop).
	err := j.Append([]bgtask.Record{rec(5, "attempt_finalized", "t1", "a1", "r1", "s1")}).Wait()
	assert.ErrorIs(t, err, ErrStale)
	assert.ErrorIs(t, j.Append(nil).Wait(), ErrStale, "a failed journal stays failed")
	assert.Equal(t, before, f.count("bgtask_records", ""))

	j2 := f.open("w2", Options{})
	i := 0
	for _, tc := range []struct {
		recs []bgtask.Record
		want error
	}{
		{[]bgtask.Record{rec(1, "task_launched", "t1", "", "", "")}, ErrStale},
		{[]bgtask.Record{rec(1, "task_launched", "u1", "", "", ""), rec(2, "attempt_created", "u1", "b1", "q1", ""),
			rec(3, "session_bound", "u1", "b1", "q1", "s1")}, ErrSessionTaken},
		{[]bgtask.Record{rec(1, "attempt_created", "t1", "b1", "q1", "")}, ErrStale},
		// Another member's task, named with its current attempt and run.
		{[]bgtask.Record{rec(1, "session_bound", "t1", "a2", "r2", "s9")}, ErrStale},
		{[]bgtask.Record{rec(1, "attempt_finalized", "t1", "a2", "r2", "")}, ErrStale},
		// Its own task, with the current attempt under another run.
		{[]bgtask.Record{rec(1, "task_launched", "u2", "", "", ""), rec(2, "attempt_created", "u2", "b2", "q2", ""),
			rec(3, "start_requested", "u2", "b2", "q-other", "")}, ErrStale},
	} {
		i++
		jj := j2
		err := jj.Append(tc.recs).Wait()
		assert.ErrorIs(t, err, tc.want)
		assert.Equal(t, 0, f.count("bgtask_records", "member LIKE 'w2%'"), "a refused commit left records")
		assert.Equal(t, 0, f.count("bgtask_tasks", "member LIKE 'w2%'"), "a refused commit left a task")
		require.NoError(t, jj.Close())
		j2 = f.open(fmt.Sprintf("w2-%d", i), Options{})
	}
}

// A commit is written with a statement per kind of work (bgtask_write),
// yet each record is checked as if the records were applied one by one:
// against the attempt the last attempt_created before it in the commit
// made current, else against the task's row.
func TestACommitIsCheckedRecordByRecord(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{})
	// A whole life in one commit: a retry, with checks on each attempt in
	// turn.
	require.NoError(t, j.Append([]bgtask.Record{
		rec(1, "task_launched", "t1", "", "", ""),
		rec(2, "attempt_created", "t1", "a1", "r1", ""),
		rec(3, "start_requested", "t1", "a1", "r1", ""),
		rec(4, "session_bound", "t1", "a1", "r1", "s1"),
		rec(5, "attempt_finalized", "t1", "a1", "r1", ""),
		rec(6, "retry_scheduled", "t1", "a1", "r1", ""),
		rec(7, "attempt_created", "t1", "a2", "r2", ""),
		rec(8, "session_bound", "t1", "a2", "r2", "s2"),
	}).Wait())
	var attempt, token string
	var ended bool
	read := func() {
		t.Helper()
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT attempt_id, token, ended FROM bgtask_tasks WHERE ledger = $1 AND task_id = 't1'`,
			f.ledger).Scan(&attempt, &token, &ended))
	}
	read()
	assert.Equal(t, []any{"a2", "r2", false}, []any{attempt, token, ended}, "the last attempt created is current, and live")
	assert.Equal(t, 2, f.count("bgtask_sessions", "task_id = 't1'"))
	assert.Equal(t, 8, f.count("bgtask_records", ""))

	// The retry ends in the same commit as a check of it: ended.
	require.NoError(t, j.Append([]bgtask.Record{
		rec(9, "start_requested", "t1", "a2", "r2", ""),
		rec(10, "attempt_finalized", "t1", "a2", "r2", ""),
	}).Wait())
	read()
	assert.Equal(t, []any{"a2", "r2", true}, []any{attempt, token, ended})

	// A check of the attempt a record before it in the same commit
	// replaced is stale, and nothing of the commit lands.
	j2 := f.open("w2", Options{})
	err := j2.Append([]bgtask.Record{
		rec(1, "task_launched", "u1", "", "", ""),
		rec(2, "attempt_created", "u1", "b1", "q1", ""),
		rec(3, "attempt_created", "u1", "b2", "q2", ""),
		rec(4, "session_bound", "u1", "b1", "q1", "s9"),
	}).Wait()
	assert.ErrorIs(t, err, ErrStale)
	assert.Equal(t, 0, f.count("bgtask_tasks", "task_id = 'u1'"), "a refused commit left a task")
	assert.Equal(t, 0, f.count("bgtask_sessions", "session_id = 's9'"), "a refused commit left a session")

	// A check made before the commit's attempt_created is checked against
	// the task's row, not against the attempt created after it.
	j3 := f.open("w3", Options{})
	require.NoError(t, j3.Append([]bgtask.Record{
		rec(1, "task_launched", "v1", "", "", ""),
		rec(2, "attempt_created", "v1", "c1", "p1", ""),
	}).Wait())
	assert.ErrorIs(t, j3.Append([]bgtask.Record{
		rec(3, "start_requested", "v1", "c2", "p2", ""),
		rec(4, "attempt_created", "v1", "c2", "p2", ""),
	}).Wait(), ErrStale)
}

// A task gives its key up in the commit that ends it, not in one that
// ends an attempt and starts its retry.
func TestKeyGivenUpWhenItsTaskEnds(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{})
	require.NoError(t, j.Append([]bgtask.Record{
		rec(1, "task_launched", "t1", "", "", ""),
		rec(2, "attempt_created", "t1", "a1", "r1", ""),
	}).Wait())
	_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_keys (ledger, key, member, task_id) VALUES ($1, 'k', 'w1', 't1')`, f.ledger)
	require.NoError(t, err)
	require.NoError(t, j.Append([]bgtask.Record{
		rec(3, "attempt_finalized", "t1", "a1", "r1", ""),
		rec(4, "retry_scheduled", "t1", "a1", "r1", ""),
		rec(5, "attempt_created", "t1", "a2", "r2", ""),
	}).Wait())
	assert.Equal(t, 1, f.count("bgtask_keys", "key = 'k'"), "a retry in the same commit keeps the key")
	require.NoError(t, j.Append([]bgtask.Record{rec(6, "attempt_finalized", "t1", "a2", "r2", "")}).Wait())
	assert.Equal(t, 0, f.count("bgtask_keys", "key = 'k'"), "the task ended: its key is free")
}

// Two Managers binding the same session (a host bug, or two processes
// told the same child): the second cannot win; its Manager stops rather
// than act on a session another owns.
func TestSessionBoundOnce(t *testing.T) {
	f := newFixture(t)
	same := &fixedHost{id: "shared-session"}
	m1 := f.manager(same, f.open("w1", Options{}))
	m2 := f.manager(same, f.open("w2", Options{}))
	t1, err := m1.Launch(ctx(t), spec)
	require.NoError(t, err)
	bound, err := bgtasktest.WaitFor(ctx(t), m1, t1.ID, func(t bgtask.Task) bool { return t.Attempts[0].SessionID != "" })
	require.NoError(t, err)
	// Observe returns once its records are durable, and they come after
	// the binding's: from here on w1's binding is in the database.
	require.NoError(t, m1.Observe(bgtask.Event{AttemptID: bound.Attempts[0].ID, SessionID: "shared-session", Kind: bgtask.SessionIdle, Text: "ok"}))
	t2, err := m2.Launch(ctx(t), spec)
	require.NoError(t, err)
	_, err = m2.Wait(ctx(t), t2.ID)
	require.Error(t, err)
	assert.ErrorIs(t, err, bgtask.ErrJournal)
	assert.Equal(t, 1, f.count("bgtask_sessions", "session_id = 'shared-session'"))
	var owner string
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT member FROM bgtask_sessions WHERE ledger = $1 AND session_id = 'shared-session'`, f.ledger).Scan(&owner))
	assert.Equal(t, "w1", owner)
	_, err = m2.Launch(ctx(t), spec)
	assert.ErrorIs(t, err, bgtask.ErrJournal, "a stopped Manager refuses new work")
}

type fixedHost struct{ id string }

func (h *fixedHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	return h.id, nil
}
func (h *fixedHost) AbortSession(ctx context.Context, id string) error { return nil }

// Compaction replaces the member's records in one transaction, drops the
// identity rows of the tasks it no longer has, and leaves other members'
// rows alone; a compaction without the lease changes nothing.
func TestCompaction(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{})
	other := f.open("w2", Options{})
	batch := func(task string, seq uint64) []bgtask.Record {
		return []bgtask.Record{
			rec(seq, "task_launched", task, "", "", ""),
			rec(seq+1, "attempt_created", task, task+"-a", task+"-r", ""),
			rec(seq+2, "session_bound", task, task+"-a", task+"-r", task+"-s"),
		}
	}
	require.NoError(t, j.Append(batch("t1", 1)).Wait())
	require.NoError(t, j.Append(batch("t2", 4)).Wait())
	require.NoError(t, other.Append(batch("u1", 1)).Wait())
	require.NoError(t, j.Compact(batch("t2", 4)))
	assert.Equal(t, 3, f.count("bgtask_records", "member = 'w1'"))
	assert.Equal(t, 0, f.count("bgtask_records", "member = 'w1' AND task_id = 't1'"))
	assert.Equal(t, 0, f.count("bgtask_tasks", "task_id = 't1'"))
	assert.Equal(t, 0, f.count("bgtask_sessions", "session_id = 't1-s'"))
	assert.Equal(t, 1, f.count("bgtask_sessions", "session_id = 't2-s'"))
	assert.Equal(t, 3, f.count("bgtask_records", "member = 'w2'"), "another member's records are its own")
	var seqs []uint64
	require.NoError(t, j.Replay(func(r bgtask.Record) error { seqs = append(seqs, r.Seq); return nil }))
	assert.Equal(t, []uint64{4, 5, 6}, seqs)
	// Appends go on after the compacted records.
	require.NoError(t, j.Append(batch("t3", 7)).Wait())
	assert.Equal(t, 6, f.count("bgtask_records", "member = 'w1'"))

	// The lease is lost: the compaction is refused and nothing changes.
	f.expire("w1")
	f.open("w1", Options{Holder: "heir"})
	err := j.Compact(nil)
	assert.ErrorIs(t, err, ErrLeaseLost)
	assert.Equal(t, 6, f.count("bgtask_records", "member = 'w1'"))
}

func rec(seq uint64, kind, task, attempt, token, session string) bgtask.Record {
	return bgtask.Record{Seq: seq, Kind: kind, TaskID: task, AttemptID: attempt, Token: token, SessionID: session, Data: []byte{byte(seq)}}
}

// The database goes away under a running Manager (here: its pool is
// closed): the next write fails and Observe says so, the Manager stops
// acting on the world and refuses new work, Shutdown returns with the
// journal's error, and the run is recovered from the session service.
func TestDatabaseGoneMidRun(t *testing.T) {
	f := newFixture(t)
	pool, err := pgxpool.New(ctx(t), dbURL)
	require.NoError(t, err)
	svc := newService()
	j, err := Open(ctx(t), pool, Options{Ledger: f.ledger, Member: "w1"})
	require.NoError(t, err)
	m, err := bgtask.Open(ctx(t), svc, bgtask.WithJournal(j))
	require.NoError(t, err)
	task, err := m.Launch(ctx(t), spec)
	require.NoError(t, err)
	running, err := bgtasktest.WaitFor(ctx(t), m, task.ID, func(t bgtask.Task) bool { return t.Status == bgtask.StatusRunning })
	require.NoError(t, err)

	pool.Close()
	a := running.Attempts[0]
	err = m.Observe(bgtask.Event{AttemptID: a.ID, SessionID: a.SessionID, Kind: bgtask.SessionIdle, Text: "ok"})
	assert.ErrorIs(t, err, bgtask.ErrJournal, "the event's records are not durable: Observe says so")
	_, err = m.Launch(ctx(t), spec)
	assert.ErrorIs(t, err, bgtask.ErrJournal)
	assert.ErrorIs(t, m.Shutdown(context.Background()), bgtask.ErrJournal)
	require.NoError(t, j.Close())
	// The lease was never released: another process takes the member over
	// once it expires, and finds the run's evidence in the service.
	svc.end(a.SessionID, bgtask.Event{Kind: bgtask.SessionIdle, Text: "ok"})
	f.expire("w1")
	heir := f.manager(svc, f.open("w1", Options{}))
	got, err := heir.Wait(ctx(t), task.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
	assert.Equal(t, "ok", got.Attempts[0].Result)
}
