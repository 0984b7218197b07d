package pgledger

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// longLease is the lease of the tests' members that are taken over: long,
// so that a starved CPU never lets a live member's lapse under the test
// (nor its heartbeat's statement, which may take up to a heartbeat, make
// the node refuse launches as if the database were away). A test ends a
// lease itself (expire), as time passing would.
const longLease = time.Minute

// nodes joins n nodes (members w0, w1, …) of the fixture's ledger on one
// session service, closed at the test's end.
func (f *fixture) nodes(svc *service, n int, lease time.Duration, opts ...bgtask.Option) []*Node {
	f.t.Helper()
	out := make([]*Node, n)
	for i := range out {
		node, err := Join(context.Background(), f.pool, NodeOptions{Ledger: f.ledger, Member: fmt.Sprintf("w%d", i),
			Lease: lease, Host: svc, Poll: 50 * time.Millisecond, Options: opts, Logger: slog.New(slog.NewTextHandler(tlog{f.t}, nil)), took: func(m string) { tell(f.took)(took{i, m}) }, drained: tell(f.drained), stopped: tell(f.stopped)})
		require.NoError(f.t, err)
		closeAtEnd(f.t, node)
		out[i] = node
	}
	return out
}

// An event may reach any process: it is applied by the process that owns
// its session, checked in the database first — a stale event is refused
// wherever it arrives, and one no member knows is unknown.
func TestEventsReachTheOwner(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 3, 0)
	task, err := ns[0].Launch(ctx(t), spec)
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(ctx(t), ns[0].Manager(), task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	a := running.Attempts[0]
	// The binding must be in the database before another process can
	// route by it: a durable barrier is any later commit of w0.
	_, err = ns[0].Launch(ctx(t), bgtask.Spec{ParentSessionID: "other", Models: spec.Models})
	require.NoError(t, err)

	// By session only, sent to w1: routed to w0, applied there.
	require.NoError(t, ns[1].Observe(context.Background(), bgtask.Event{SessionID: a.SessionID, Kind: bgtask.SessionIdle, Text: "from afar"}))
	got, err := ns[0].Manager().Wait(ctx(t), task.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
	assert.Equal(t, "from afar", got.Attempts[0].Result)
	_, err = ns[1].Task(task.ID)
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask, "w1 does not own it")

	// The same event again, at w2: stale, in the database.
	err = ns[2].Observe(context.Background(), bgtask.Event{SessionID: a.SessionID, AttemptID: a.ID, Kind: bgtask.SessionIdle, Text: "again"})
	assert.ErrorIs(t, err, bgtask.ErrStaleEvent)
	err = ns[2].Observe(context.Background(), bgtask.Event{SessionID: a.SessionID, Kind: bgtask.SessionIdle, Text: "again"})
	assert.ErrorIs(t, err, bgtask.ErrStaleEvent)
	assert.Equal(t, "from afar", mustTask(t, ns[0], task.ID).Attempts[0].Result)
	err = ns[1].Observe(context.Background(), bgtask.Event{SessionID: "nobody's", Kind: bgtask.SessionIdle})
	assert.ErrorIs(t, err, bgtask.ErrUnknownSession)
	err = ns[1].Observe(context.Background(), bgtask.Event{AttemptID: "nobody's", Kind: bgtask.SessionIdle})
	assert.ErrorIs(t, err, bgtask.ErrUnknownSession)
	// The one event routed was applied (Wait saw it) and then removed
	// from w0's inbox; the refused ones were never put in one.
	assert.Equal(t, "w0", recv(t, f.drained, "w0's inbox to be drained"))
	assert.Equal(t, 0, f.count("bgtask_inbox", ""), "every routed event was applied and removed")
}

func mustTask(t *testing.T, n *Node, id string) bgtask.Task {
	t.Helper()
	task, err := n.Task(id)
	require.NoError(t, err, "task %s", id)
	return task
}

// Launches with the same Spec.Key in two processes start one run; the key
// is free again once its task ended.
func TestKeyAcrossProcesses(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	keyed := spec
	keyed.Key = "review-pr-7"
	first, err := ns[0].Launch(ctx(t), keyed)
	require.NoError(t, err)
	_, err = ns[1].Launch(ctx(t), keyed)
	var held *bgtask.KeyHeldError
	require.ErrorAs(t, err, &held)
	assert.Equal(t, first.ID, held.TaskID)
	assert.Empty(t, ns[1].Manager().Snapshot().Tasks, "nothing was launched")

	running, err := bgtasktest.WaitStatus(ctx(t), ns[0].Manager(), first.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, ns[0].Observe(context.Background(), bgtask.Event{AttemptID: running.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "ok"}))
	_, err = ns[0].Manager().Wait(ctx(t), first.ID)
	require.NoError(t, err)
	second, err := ns[1].Launch(ctx(t), keyed)
	require.NoError(t, err, "the key was given up when its task ended")
	assert.NotEqual(t, first.ID, second.ID)
}

// A process dies mid-run: once its lease expires a live process takes its
// member over, reconciles its runs through the session service, and
// events for them, sent anywhere, reach the new owner.
func TestLiveProcessTakesOverADeadOne(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 3, longLease)
	var tasks []bgtask.Task
	for range 2 {
		task, err := ns[2].Launch(ctx(t), spec)
		require.NoError(t, err)
		running, err := bgtasktest.WaitStatus(ctx(t), ns[2].Manager(), task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		tasks = append(tasks, running)
	}
	ns[2].kill()
	svc.end(svc.sessionOf(tasks[1].Attempts[0].ID), bgtask.Event{Kind: bgtask.SessionIdle, Text: "ended while its owner was dead"})
	f.expire("w2")

	// Wait for the takeover: some live node comes to own w2.
	heir := awaitOwner(t, f, ns, "w2")
	ended, err := heir.Managers()[1].Wait(ctx(t), tasks[1].ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, ended.Status)
	assert.Equal(t, "ended while its owner was dead", ended.Attempts[0].Result)
	alive := mustTask(t, heir, tasks[0].ID)
	require.Equal(t, bgtask.StatusRunning, alive.Status, "its session runs on: re-adopted")

	// Its event, sent to the node that is not the heir.
	other := ns[0]
	if other == heir {
		other = ns[1]
	}
	a := alive.Attempts[0]
	require.NoError(t, other.Observe(context.Background(), bgtask.Event{SessionID: a.SessionID, AttemptID: a.ID, Kind: bgtask.SessionIdle, Text: "done"}))
	got, err := heir.Managers()[1].Wait(ctx(t), tasks[0].ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
	assert.Equal(t, "done", got.Attempts[0].Result)
}

// A member taken over stays the node's while the node asks whether
// nothing of it is live (to give it back): its tasks are found, and it is
// among the members, until it is found idle. (It was taken out of the
// node's members for the question: Node.Task said a live task it owned
// was unknown meanwhile.)
func TestAMemberAskedAboutIsStillOwned(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	asked, answer := make(chan struct{}, 1), make(chan struct{})
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = stallOn{sql: "SELECT NOT EXISTS (SELECT 1 FROM bgtask_tasks", asked: asked, answer: answer}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	heir := f.hostileNode(pool, svc, "heir", longLease, nil)
	t.Cleanup(func() { close(answer) }) // before the heir is closed
	victim := f.hostileNode(f.pool, svc, "victim", longLease, nil)
	task := running(t, victim, "chat")
	victim.kill()
	f.expire("victim")
	recv(t, asked, "the heir to ask whether the member it took over is idle")
	assert.Contains(t, heir.Members(), "victim")
	got, err := heir.Task(task.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, got.Status)
}

// stallOn is a tracer that holds every statement containing sql, once it
// said so on asked, until answer is closed.
type stallOn struct {
	sql           string
	asked, answer chan struct{}
}

func (s stallOn) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, s.sql) {
		tell(s.asked)(struct{}{})
		<-s.answer
	}
	return ctx
}

func (stallOn) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// took is a takeover: node i took member over.
type took struct {
	node   int
	member string
}

// awaitOwner waits until one of nodes took member over, and returns it.
func awaitOwner(t *testing.T, f *fixture, nodes []*Node, member string) *Node {
	t.Helper()
	for {
		select {
		case tk := <-f.took:
			if tk.member == member {
				return nodes[tk.node]
			}
		case <-ctx(t).Done():
			t.Fatalf("nobody took %s over", member)
			return nil
		}
	}
}

// A process that lost its member's lease (paused past it) stops acting
// for that member at once: the Manager of that life writes nothing more,
// and an event for the member's session goes to the member's next life —
// in another process that took it over, or in this one, which opens its
// own member again (a new fence) once it finds the lease lost.
func TestAStaleOwnerStopsActingForItsMember(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, longLease)
	task, err := ns[0].Launch(ctx(t), spec)
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(ctx(t), ns[0].Manager(), task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	_, err = ns[0].Launch(ctx(t), bgtask.Spec{ParentSessionID: "barrier", Models: spec.Models}) // the binding is durable
	require.NoError(t, err)
	stale := ns[0].live("w0")
	f.expire("w0") // as if w0's process had been paused past its lease
	// Its next write (here; or its next heartbeat, TestHeartbeatKeepsLease)
	// finds the lease lost.
	_, err = stale.m.Launch(ctx(t), spec)
	require.ErrorIs(t, err, bgtask.ErrJournal, "the stale life acts no more")
	recv(t, stale.j.Lost(), "w0's lease to be found lost")
	heir := awaitOwner(t, f, ns, "w0")
	next := heir.live("w0")
	require.NotNil(t, next)
	assert.Greater(t, next.j.Fence(), stale.j.Fence(), "a new life of w0")
	a := running.Attempts[0]
	require.NoError(t, ns[0].Observe(context.Background(), bgtask.Event{SessionID: a.SessionID, Kind: bgtask.SessionIdle, Text: "to the heir"}))
	got, err := next.m.Wait(ctx(t), task.ID)
	require.NoError(t, err)
	assert.Equal(t, "to the heir", got.Attempts[0].Result)
}

type tlog struct{ t *testing.T }

func (w tlog) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }

// startGate is a service whose StartSession creates the session, says
// its id on started, and returns it only once release is closed: the
// start is in flight, and its session exists, but no member has bound
// it yet.
type startGate struct {
	*service
	started chan string
	release chan struct{}
}

func (g startGate) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	id, err := g.service.StartSession(ctx, req)
	tell(g.started)(id)
	select {
	case <-g.release:
		return id, err
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// sawQuery is a tracer that says on seen when a statement containing sql
// starts.
type sawQuery struct {
	sql  string
	seen chan struct{}
}

func (s sawQuery) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, s.sql) {
		tell(s.seen)(struct{}{})
	}
	return ctx
}

func (sawQuery) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// An event for a session whose binding is still on its way reaches its
// owner even when it arrives first at another process with a start of
// its own in flight. That process's Manager would hold it for its own
// start and drop it once that start bound another session, after
// Observe said nil: the task then ran for ever (TestChaosOfAFleet saw
// it). It waits for the binding instead, and is applied by the owner.
func TestAnEventArrivingBeforeItsBindingReachesItsOwner(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	g0 := startGate{svc, make(chan string, 1), make(chan struct{})}
	g1 := startGate{svc, make(chan string, 1), make(chan struct{})}
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	lookup := sawQuery{sql: "FROM bgtask_sessions s JOIN bgtask_tasks t", seen: make(chan struct{}, 1)}
	cfg.ConnConfig.Tracer = lookup
	pool1, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool1.Close)
	join := func(pool *pgxpool.Pool, member string, host bgtask.Host) *Node {
		node, err := Join(context.Background(), pool, NodeOptions{Ledger: f.ledger, Member: member, Lease: longLease, Host: host,
			Poll: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(tlog{t}, nil))})
		require.NoError(t, err)
		closeAtEnd(t, node)
		return node
	}
	w0, w1 := join(f.pool, "w0", g0), join(pool1, "w1", g1)

	// w1 has a start in flight; so has w0, whose session exists but is
	// bound nowhere yet.
	other, err := w1.Launch(ctx(t), bgtask.Spec{ParentSessionID: "other", Models: spec.Models})
	require.NoError(t, err)
	recv(t, g1.started, "w1's start")
	task, err := w0.Launch(ctx(t), spec)
	require.NoError(t, err)
	session := recv(t, g0.started, "w0's start")

	// The session's answer comes at w1 first.
	observed := make(chan error, 1)
	go func() {
		observed <- w1.Observe(context.Background(), bgtask.Event{SessionID: session, Kind: bgtask.SessionIdle, Text: "the answer"})
	}()
	recv(t, lookup.seen, "w1 to look the session's owner up")
	// w1's own start binds its session; then w0's binds the answered one.
	close(g1.release)
	_, err = bgtasktest.WaitStatus(ctx(t), w1.Manager(), other.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	close(g0.release)

	require.NoError(t, recv(t, observed, "Observe to return"))
	got, err := w0.Manager().Wait(ctx(t), task.ID)
	require.NoError(t, err, "the answer reached w0")
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
	assert.Equal(t, "the answer", got.Result)

	// A session that no start is binding is unknown at once.
	err = w1.Observe(ctx(t), bgtask.Event{SessionID: "nobody's", Kind: bgtask.SessionIdle})
	assert.ErrorIs(t, err, bgtask.ErrUnknownSession)
	assert.NotContains(t, err.Error(), "in flight", "nothing waited: no start was binding it")
	// An event that names neither is refused as such, at once.
	err = w1.Observe(ctx(t), bgtask.Event{Kind: bgtask.SessionIdle})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
}
