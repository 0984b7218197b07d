package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// inbox is a Notifier shared by a test's nodes: what was delivered, in
// order, and a channel that hears each delivery. fail makes the first
// deliveries to a parent fail.
type inbox struct {
	mu    sync.Mutex
	got   []bgtask.Notification
	fails map[string]int
	heard chan bgtask.Notification
}

func newInbox() *inbox {
	return &inbox{fails: map[string]int{}, heard: make(chan bgtask.Notification, 1024)}
}

func (b *inbox) Notify(ctx context.Context, n bgtask.Notification) error {
	b.mu.Lock()
	if b.fails[n.ParentSessionID] > 0 {
		b.fails[n.ParentSessionID]--
		b.mu.Unlock()
		return errors.New("the parent chat is away")
	}
	b.got = append(b.got, n)
	b.mu.Unlock()
	b.heard <- n
	return nil
}

// await returns once want says the deliveries heard so far are enough.
func (b *inbox) await(t *testing.T, want func([]bgtask.Notification) bool) []bgtask.Notification {
	t.Helper()
	timeout := time.After(60 * time.Second) // failure detection only
	for {
		b.mu.Lock()
		got := append([]bgtask.Notification(nil), b.got...)
		b.mu.Unlock()
		if want(got) {
			return got
		}
		select {
		case <-b.heard:
		case <-timeout:
			t.Fatalf("deliveries never came: %d so far", len(got))
		}
	}
}

func (f *fixture) deliveringNodes(svc *service, box *inbox, n int) []*Node {
	f.t.Helper()
	out := make([]*Node, n)
	for i := range out {
		node, err := Join(context.Background(), f.pool, NodeOptions{Ledger: f.ledger, Member: fmt.Sprintf("w%d", i),
			Host: svc, Poll: 100 * time.Millisecond, Notifier: box, Logger: slog.New(slog.NewTextHandler(tlog{f.t}, nil)),
			marked: tell(f.marked)})
		require.NoError(f.t, err)
		closeAtEnd(f.t, node)
		out[i] = node
	}
	return out
}

func ofKind(ns []bgtask.Notification, parent string, k bgtask.NotificationKind) []bgtask.Notification {
	var out []bgtask.Notification
	for _, n := range ns {
		if n.ParentSessionID == parent && n.Kind == k {
			out = append(out, n)
		}
	}
	return out
}

// Siblings of one parent run in three processes and end at the same
// moment, round after round: each round's all_complete is delivered
// exactly once, after the final summary of each of its tasks, and every
// final summary exactly once.
func TestAllCompleteOncePerRoundAcrossProcesses(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	box := newInbox()
	ns := f.deliveringNodes(svc, box, 3)
	const rounds = 8
	for r := range rounds {
		parent := fmt.Sprintf("chat-%d", r)
		var tasks []bgtask.Task
		for i, n := range ns {
			task, err := n.Launch(ctx(t), bgtask.Spec{ParentSessionID: parent, Prompt: "do it", Models: spec.Models})
			require.NoError(t, err)
			got, err := bgtasktest.WaitStatus(ctx(t), n.Manager(), task.ID, bgtask.StatusRunning)
			require.NoError(t, err, "w%d", i)
			tasks = append(tasks, got)
		}
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i, task := range tasks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				assert.NoError(t, ns[i].Observe(context.Background(), bgtask.Event{AttemptID: task.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "answer " + task.ID}))
			}()
		}
		close(start)
		wg.Wait()
		got := box.await(t, func(got []bgtask.Notification) bool { return len(ofKind(got, parent, bgtask.NotifyAllComplete)) > 0 })
		all := ofKind(got, parent, bgtask.NotifyAllComplete)
		require.Len(t, all, 1, "round %d", r)
		var ids []string
		for _, task := range all[0].Tasks {
			ids = append(ids, task.ID)
			assert.Equal(t, bgtask.StatusCompleted, task.Status)
			assert.Equal(t, "answer "+task.ID, task.Result)
		}
		assert.ElementsMatch(t, []string{tasks[0].ID, tasks[1].ID, tasks[2].ID}, ids)
		assert.Contains(t, all[0].Text, "3 tasks under "+parent)
		assert.NotEmpty(t, all[0].ID)
		sums := ofKind(got, parent, bgtask.NotifyFinalSummary)
		require.Len(t, sums, 3, "every final summary, once, before the all_complete")
		last := 0
		for i, n := range got {
			if n.ParentSessionID == parent {
				last = i
			}
		}
		assert.Equal(t, bgtask.NotifyAllComplete, got[last].Kind, "the round's last word")
		// Delivered, and then marked: only then does its round leave the
		// outbox (a Close in between would leave it to deliver again).
		for recv(t, f.marked, "the all_complete to be marked delivered") != all[0].ID {
		}
	}
	// Nothing more comes: one all_complete per round, none from a Manager.
	for _, n := range ns {
		require.NoError(t, n.Close(ctx(t)))
	}
	box.mu.Lock()
	defer box.mu.Unlock()
	seen := map[string]bool{}
	for _, n := range box.got {
		assert.False(t, seen[n.ID], "delivered twice: %s %s", n.Kind, n.ID)
		seen[n.ID] = true
	}
	assert.Len(t, box.got, rounds*4)
	assert.Equal(t, 0, f.count("bgtask_outbox", ""), "a told round leaves nothing in the outbox")
}

// A delivery that fails is tried again, in order: nothing is lost and
// nothing overtakes it. (The tasks are one process's: across processes
// the order is the order the outbox rows were written, which the test
// could not know.)
func TestAFailedDeliveryIsTriedAgainInOrder(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	box := newInbox()
	box.fails["chat"] = 3
	ns := f.deliveringNodes(svc, box, 2)
	var order []string
	for range 4 {
		n := ns[0]
		task, err := n.Launch(ctx(t), bgtask.Spec{ParentSessionID: "chat", Prompt: "do it", Models: spec.Models})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx(t), n.Manager(), task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		require.NoError(t, n.Observe(context.Background(), bgtask.Event{AttemptID: got.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "ok"}))
		_, err = n.Manager().Wait(ctx(t), task.ID)
		require.NoError(t, err)
		order = append(order, task.ID)
	}
	got := box.await(t, func(got []bgtask.Notification) bool { return len(ofKind(got, "chat", bgtask.NotifyFinalSummary)) == 4 })
	var ids []string
	for _, n := range ofKind(got, "chat", bgtask.NotifyFinalSummary) {
		ids = append(ids, n.TaskID)
	}
	assert.Equal(t, order, ids, "in the order they were written")
	box.mu.Lock()
	assert.Zero(t, box.fails["chat"], "the failures happened")
	box.mu.Unlock()
}

// hanging is a Notifier that ignores its context until released.
type hanging struct {
	asked, release chan struct{}
}

func (h hanging) Notify(ctx context.Context, n bgtask.Notification) error {
	select {
	case h.asked <- struct{}{}:
	default:
	}
	<-h.release
	return nil
}

// Close is bounded by its context even when a delivery hangs in a
// Notifier that ignores its own: it says so, and the leases are released.
func TestCloseIsBoundedWhenTheNotifierHangs(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	h := hanging{asked: make(chan struct{}, 1), release: make(chan struct{})}
	node, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: svc, Poll: 50 * time.Millisecond, Notifier: h})
	require.NoError(t, err)
	task, err := node.Launch(ctx(t), spec)
	require.NoError(t, err)
	got, err := bgtasktest.WaitStatus(ctx(t), node.Manager(), task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, node.Observe(context.Background(), bgtask.Event{AttemptID: got.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "ok"}))
	recv(t, h.asked, "the deliverer to call Notify") // inside it, it will not come out
	short, cancel := context.WithTimeout(ctx(t), 300*time.Millisecond)
	defer cancel()
	err = node.Close(short)
	require.Error(t, err)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Equal(t, 1, f.count("bgtask_members", "expires_at <= now()"), "the lease was released")
	close(h.release) // the left-behind delivery ends, before the leak check
	node.stray.Wait()
}

// A process whose claim on a parent expired mid-delivery (a slow
// Notifier) and was taken by another marks nothing: the row is the new
// holder's to deliver, once. Marks of several parents go in one
// statement, each parent's only under its claim.
func TestADeliveryIsMarkedOnlyUnderItsClaim(t *testing.T) {
	f := newFixture(t)
	ns := f.nodes(newService(), 2, 0) // no Notifier: no deliverer of their own runs
	run := func(parent string) *parentRun {
		_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, body)
VALUES ($1, 'w0', $2, $3, 'progress', '{"kind":"progress"}')`, f.ledger, "n-"+parent, parent)
		require.NoError(t, err)
		row := outboxRow{kind: "progress", noteID: "n-" + parent, sent: true}
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT id FROM bgtask_outbox WHERE ledger = $1 AND parent_session = $2`, f.ledger, parent).Scan(&row.id))
		return &parentRun{parent: parent, rows: []outboxRow{row}, sent: []int{0}}
	}
	claim := func(parent, member string) {
		_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_claims (ledger, parent_session, member, until) VALUES ($1, $2, $3, now() + interval '1 hour')
ON CONFLICT (ledger, parent_session) DO UPDATE SET member = EXCLUDED.member, until = EXCLUDED.until`, f.ledger, parent, member)
		require.NoError(t, err)
	}
	chat, other := run("chat"), run("other")
	claim("chat", "w1") // taken from w0
	claim("other", "w0")
	held, err := ns[0].markRuns(ctx(t), []*parentRun{chat, other}, true)
	require.NoError(t, err)
	assert.Equal(t, map[string]bool{"other": true}, held, "w0 holds only other's claim")
	assert.Equal(t, 1, f.count("bgtask_outbox", "parent_session = 'chat' AND delivered_at IS NULL"), "chat's row is still to deliver")
	assert.Equal(t, 0, f.count("bgtask_outbox", "parent_session = 'other'"), "other's row is marked")
	assert.Equal(t, 0, f.count("bgtask_claims", "parent_session = 'other'"), "and its claim released in the same statement")
	assert.Empty(t, other.sent)
	assert.Len(t, chat.sent, 1, "still unmarked")
	held, err = ns[1].markRuns(ctx(t), []*parentRun{chat}, false)
	require.NoError(t, err)
	assert.True(t, held["chat"], "the holder marks it")
	assert.Equal(t, 0, f.count("bgtask_outbox", ""))
	assert.Equal(t, 1, f.count("bgtask_claims", "parent_session = 'chat' AND member = 'w1'"), "a renewal keeps the claim")
}

// A task launched and ended in one group commit (a cancel racing its
// launch) is counted in its round: the round's all_complete has it.
func TestATaskLaunchedAndEndedInOneCommitIsInItsRound(t *testing.T) {
	f := newFixture(t)
	j := f.open("w0", Options{Rounds: true})
	rec := func(seq uint64, kind, task string) bgtask.Record {
		return bgtask.Record{Seq: seq, Kind: kind, TaskID: task, AttemptID: "a-" + task, Token: "r-" + task, ParentSessionID: "chat", Data: []byte{1}}
	}
	require.NoError(t, j.Append([]bgtask.Record{rec(1, "task_launched", "t1"), rec(2, "attempt_created", "t1"), rec(3, "attempt_finalized", "t1")}).Wait())
	var tasks []string
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT round_tasks FROM bgtask_outbox WHERE ledger = $1 AND kind = 'all_complete'`, f.ledger).Scan(&tasks))
	assert.Equal(t, []string{"t1"}, tasks)
	assert.Equal(t, 0, f.count("bgtask_parents", "live <> 0"))
}

// A closure that spans processes tells the root task's parent, once,
// through the outbox, as a Manager's own closure does.
func TestAFleetClosureTellsTheParent(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	box := newInbox()
	ns := f.deliveringNodes(svc, box, 2)
	a := running(t, ns[0], "chat")
	running(t, ns[1], a.SessionID)
	_, err := ns[1].Stop(ctx(t), bgtask.Target{Session: a.SessionID})
	require.NoError(t, err)
	got := box.await(t, func(got []bgtask.Notification) bool { return len(ofKind(got, "chat", bgtask.NotifyBranchClosed)) > 0 })
	closed := ofKind(got, "chat", bgtask.NotifyBranchClosed)
	require.Len(t, closed, 1)
	assert.Equal(t, a.ID, closed[0].TaskID)
	assert.Contains(t, closed[0].Text, "[Branch closure]")
	assert.Contains(t, closed[0].Text, "2 run(s) stopped.", "both runs, each in its process")
}

// A round's final summary may be written after the next rounds' rows (the
// round's all_complete is made by the commit that ended its last task, the
// summary after it). It overtakes its own all_complete, wherever it is
// behind it; nothing else does: the parent hears each round's summaries
// and then its all_complete, round after round.
func TestASummaryWrittenLateOvertakesOnlyItsOwnAllComplete(t *testing.T) {
	f := newFixture(t)
	require.NoError(t, Migrate(ctx(t), f.pool))
	final := func(task string) []any {
		body := fmt.Sprintf(`{"id":"final:%s","kind":"final_summary","parentSessionID":"chat","taskID":%q,"task":{"id":%q}}`, task, task, task)
		return []any{"final:" + task, "final_summary", task, body, nil}
	}
	round := func(n int, task string) []any {
		return []any{fmt.Sprintf("all_complete:chat:%d", n), "all_complete", "", nil, []string{task}}
	}
	for _, row := range [][]any{round(1, "t1"), final("t1"), round(2, "t2"), round(3, "t3"), final("t3"), final("t2")} {
		_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, task_id, body, round_tasks)
VALUES ($1, 'w0', $2, 'chat', $3, $4, $5, $6)`, append([]any{f.ledger}, row...)...)
		require.NoError(t, err)
	}
	box := newInbox()
	f.deliveringNodes(newService(), box, 1)
	got := box.await(t, func(got []bgtask.Notification) bool { return len(got) >= 6 })
	var ids []string
	for _, n := range got {
		ids = append(ids, n.ID)
	}
	assert.Equal(t, []string{"final:t1", "all_complete:chat:1", "final:t2", "all_complete:chat:2", "final:t3", "all_complete:chat:3"}, ids)
	for i, n := range got[1:] {
		if n.Kind == bgtask.NotifyAllComplete {
			require.Len(t, n.Tasks, 1, "%s", n.ID)
			assert.Equal(t, got[i].TaskID, n.Tasks[0].ID, "%s has its round's task", n.ID)
		}
	}
}

// outboxRows inserts a pending row of kind for each parent, in order.
func (f *fixture) outboxRows(kind string, parents ...string) {
	f.t.Helper()
	for _, p := range parents {
		_, err := f.pool.Exec(ctx(f.t), `INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, body)
VALUES ($1, 'w0', $2, $3, $4, $5)`, f.ledger, fmt.Sprintf("%s:%s:%d", kind, p, ledgers.Add(1)), p, kind,
			fmt.Sprintf(`{"kind":%q,"parentSessionID":%q}`, kind, p))
		require.NoError(f.t, err)
	}
}

// wrote reports whether tx has written anything so far (it was given a
// transaction id).
func wrote(t *testing.T, tx pgx.Tx) bool {
	t.Helper()
	var xid *string
	require.NoError(t, tx.QueryRow(ctx(t), `SELECT pg_current_xact_id_if_assigned()::text`).Scan(&xid))
	return xid != nil
}

func parentsOf(runs []*parentRun) []string {
	var out []string
	for _, r := range runs {
		out = append(out, r.parent)
	}
	return out
}

// Processes that look for parents to deliver to at the same moment share
// them out: one skips the parents another is claiming (its transaction
// still open) instead of waiting for it, and a look that finds nothing it
// can claim writes nothing.
func TestClaimersLookingAtOnceShareTheParents(t *testing.T) {
	f := newFixture(t)
	ns := f.nodes(newService(), 2, 0) // no Notifier: no deliverer runs; the test claims by hand
	f.outboxRows("progress", "chat-0", "chat-1", "chat-2", "chat-3", "chat-4", "chat-5")
	tx0, err := f.pool.Begin(ctx(t))
	require.NoError(t, err)
	defer func() { _ = tx0.Rollback(context.Background()) }()
	_, first, err := ns[0].exchange(ctx(t), tx0, nil, true, nil, 3)
	require.NoError(t, err)
	assert.Equal(t, []string{"chat-0", "chat-1", "chat-2"}, parentsOf(first), "the oldest first")

	// Bounded for failure detection only: a claimer that waited for w0's
	// open transaction would wait until it ends.
	c, cancel := context.WithTimeout(ctx(t), 10*time.Second)
	defer cancel()
	tx1, err := f.pool.Begin(c)
	require.NoError(t, err)
	defer func() { _ = tx1.Rollback(context.Background()) }()
	_, second, err := ns[1].exchange(c, tx1, nil, true, nil, 6)
	require.NoError(t, err, "w1 did not wait for w0's claim")
	assert.Equal(t, []string{"chat-3", "chat-4", "chat-5"}, parentsOf(second))
	for _, r := range second {
		assert.Len(t, r.rows, 1, "with its row")
	}
	require.NoError(t, tx1.Commit(c))

	tx2, err := f.pool.Begin(c)
	require.NoError(t, err)
	defer func() { _ = tx2.Rollback(context.Background()) }()
	_, third, err := ns[1].exchange(c, tx2, nil, true, []string{"chat-3", "chat-4", "chat-5"}, 6)
	require.NoError(t, err)
	assert.Empty(t, third, "nothing left that w1 may claim")
	assert.False(t, wrote(t, tx2), "and a look that claims nothing writes nothing")
	require.NoError(t, tx2.Rollback(c))

	require.NoError(t, tx0.Commit(ctx(t)))
	assert.Equal(t, 3, f.count("bgtask_claims", "member = 'w0'"))
	assert.Equal(t, 3, f.count("bgtask_claims", "member = 'w1'"))
}

// An all_complete whose round's summary is not written yet is not
// claimed (nothing could be delivered: it would be a write for nothing);
// once the summary is in the outbox, the parent is claimed with both.
func TestAWaitingAllCompleteIsNotClaimed(t *testing.T) {
	f := newFixture(t)
	ns := f.nodes(newService(), 1, 0)
	_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, round_tasks)
VALUES ($1, '', 'all_complete:chat:1', 'chat', 'all_complete', '{t1}')`, f.ledger)
	require.NoError(t, err)
	tx, err := f.pool.Begin(ctx(t))
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, claimed, err := ns[0].exchange(ctx(t), tx, nil, true, nil, 5)
	require.NoError(t, err)
	assert.Empty(t, claimed)
	assert.False(t, wrote(t, tx))
	require.NoError(t, tx.Rollback(ctx(t)))

	_, err = f.pool.Exec(ctx(t), `INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, task_id, body)
VALUES ($1, 'w0', 'final:t1', 'chat', 'final_summary', 't1', '{"kind":"final_summary","parentSessionID":"chat","taskID":"t1"}')`, f.ledger)
	require.NoError(t, err)
	_, claimed, err = ns[0].exchange(ctx(t), f.pool, nil, true, nil, 5)
	require.NoError(t, err)
	require.Len(t, claimed, 1)
	var kinds []string
	for _, r := range claimed[0].rows {
		kinds = append(kinds, r.kind)
	}
	assert.Equal(t, []string{"all_complete", "final_summary"}, kinds)
}

// slowFor is a Notifier whose deliveries to parent slow wait until
// released (the first hands its context to asked); the rest go to box.
type slowFor struct {
	slow    string
	asked   chan context.Context
	release chan struct{}
	box     *inbox
}

func (s slowFor) Notify(ctx context.Context, n bgtask.Notification) error {
	if n.ParentSessionID == s.slow {
		select {
		case s.asked <- ctx:
		default:
		}
		<-s.release
	}
	return s.box.Notify(ctx, n)
}

// A node delivers to several parents side by side: a parent whose
// Notifier call is slow holds up its own deliveries only. Another
// parent's are delivered while the slow call is still within its bound
// (one deliverer at a time would get to them only once it gave the slow
// call up).
func TestParentsAreDeliveredSideBySide(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	n := slowFor{slow: "slow", asked: make(chan context.Context, 1), release: make(chan struct{}), box: newInbox()}
	node, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: svc, Poll: 100 * time.Millisecond, Notifier: n,
		Logger: slog.New(slog.NewTextHandler(tlog{t}, nil))})
	require.NoError(t, err)
	closeAtEnd(t, node)
	var released bool
	defer func() {
		if !released {
			close(n.release)
		}
	}()
	end := func(parent string) {
		task, err := node.Launch(ctx(t), bgtask.Spec{ParentSessionID: parent, Prompt: "do it", Models: spec.Models})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx(t), node.Manager(), task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		require.NoError(t, node.Observe(context.Background(), bgtask.Event{AttemptID: got.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "ok"}))
	}
	end("slow")
	slowCtx := recv(t, n.asked, "the slow parent's delivery")
	end("fast")
	n.box.await(t, func(got []bgtask.Notification) bool { return len(ofKind(got, "fast", bgtask.NotifyAllComplete)) == 1 })
	assert.NoError(t, slowCtx.Err(), "the slow call is still within its bound")
	close(n.release)
	released = true
	got := n.box.await(t, func(got []bgtask.Notification) bool { return len(ofKind(got, "slow", bgtask.NotifyAllComplete)) == 1 })
	assert.Len(t, ofKind(got, "slow", bgtask.NotifyFinalSummary), 1)
	assert.Len(t, ofKind(got, "fast", bgtask.NotifyFinalSummary), 1)
}

// exchanges counts the statements of exchange that marked something, and
// the parents they marked.
type exchanges struct {
	mu             sync.Mutex
	marks, parents int
}

func (e *exchanges) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if d.SQL == exchangeSQL && len(d.Args) > 2 {
		if ps, ok := d.Args[2].([]string); ok && len(ps) > 0 {
			e.mu.Lock()
			e.marks++
			e.parents += len(ps)
			e.mu.Unlock()
		}
	}
	return ctx
}

func (*exchanges) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// What a round delivered to several parents is marked in one statement,
// not one per row nor one per parent.
func TestARoundIsMarkedInOneStatement(t *testing.T) {
	f := newFixture(t)
	var parents []string
	for i := range 20 {
		parents = append(parents, fmt.Sprintf("chat-%d", i))
	}
	require.NoError(t, Migrate(ctx(t), f.pool))
	f.outboxRows("progress", parents...)
	f.outboxRows("answer", parents...)
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	count := &exchanges{}
	cfg.ConnConfig.Tracer = count
	pool, err := pgxpool.NewWithConfig(ctx(t), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	box := newInbox()
	node, err := Join(ctx(t), pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: newService(), Poll: 100 * time.Millisecond,
		Notifier: box, marked: tell(f.marked)})
	require.NoError(t, err)
	closeAtEnd(t, node)
	for range 40 {
		recv(t, f.marked, "each row to be marked delivered")
	}
	got := box.await(t, func(got []bgtask.Notification) bool { return len(got) == 40 })
	for _, p := range parents { // in order, per parent
		var kinds []bgtask.NotificationKind
		for _, n := range got {
			if n.ParentSessionID == p {
				kinds = append(kinds, n.Kind)
			}
		}
		assert.Equal(t, []bgtask.NotificationKind{"progress", "answer"}, kinds, p)
	}
	count.mu.Lock()
	defer count.mu.Unlock()
	assert.Equal(t, 20, count.parents, "each parent marked once")
	assert.Less(t, count.marks, 5, "in a few statements: %d", count.marks)
	assert.Equal(t, 0, f.count("bgtask_outbox", ""), "nothing left")
	assert.Equal(t, 0, f.count("bgtask_claims", ""), "and every claim released with its marks")
}

// The notifications that come together are written to the outbox in one
// statement; one the database refuses fails alone.
func TestNotificationsAreWrittenTogether(t *testing.T) {
	f := newFixture(t)
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	var writes atomic.Int64
	cfg.ConnConfig.Tracer = statementsLike{sql: writeNotesSQL, n: &writes}
	pool, err := pgxpool.NewWithConfig(ctx(t), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	node, err := Join(ctx(t), pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: newService(), Poll: time.Hour})
	require.NoError(t, err) // no Notifier: the test runs a writer of its own
	closeAtEnd(t, node)
	q := &noteWriter{n: node, wake: make(chan struct{}, 1)}
	note := func(parent, text string) *noteWrite {
		n := bgtask.Notification{Kind: bgtask.NotifyAnswer, ID: "answer:" + parent, ParentSessionID: parent, Text: text}
		body, err := json.Marshal(n)
		require.NoError(t, err)
		return &noteWrite{member: "w0", note: n, body: body, done: make(chan struct{})}
	}
	ws := []*noteWrite{note("a", "1"), note("b", "2"), note("c", "3")}
	for _, w := range ws {
		require.True(t, q.add(w))
	}
	stop, ended := make(chan struct{}), make(chan struct{})
	go func() { defer close(ended); q.run(stop) }()
	for _, w := range ws {
		recv(t, w.done, "the write")
		assert.NoError(t, w.err)
	}
	assert.Equal(t, int64(1), writes.Load(), "one statement")
	assert.Equal(t, 3, f.count("bgtask_outbox", ""))

	// jsonb refuses a NUL character: that one fails, on its own.
	bad := note("d", "\x00")
	ws = []*noteWrite{note("e", "4"), bad, note("f", "5")}
	q.mu.Lock() // queued together
	q.queue = append(q.queue, ws...)
	q.mu.Unlock()
	require.True(t, q.add(note("g", "6")))
	for _, w := range ws {
		recv(t, w.done, "the write")
	}
	assert.Error(t, bad.err)
	assert.NoError(t, ws[0].err)
	assert.NoError(t, ws[2].err)
	close(stop)
	recv(t, ended, "the writer to stop")
	assert.False(t, q.add(note("h", "7")), "a stopped writer takes nothing more")
	assert.Equal(t, 6, f.count("bgtask_outbox", ""), "all but the refused one")
}

// statementsLike counts the statements that are sql.
type statementsLike struct {
	sql string
	n   *atomic.Int64
}

func (s statementsLike) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if d.SQL == s.sql {
		s.n.Add(1)
	}
	return ctx
}

func (statementsLike) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A row written while this node delivers its parent's earlier rows — its
// parent claimed, so that no deliverer could take it then — is delivered
// once those are, without waiting for a poll or a wake-up.
func TestARowWrittenDuringADeliveryFollowsIt(t *testing.T) {
	f := newFixture(t)
	require.NoError(t, Migrate(ctx(t), f.pool))
	f.outboxRows("answer", "chat")
	n := slowFor{slow: "chat", asked: make(chan context.Context, 1), release: make(chan struct{}), box: newInbox()}
	node, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: newService(), Poll: time.Hour, Notifier: n,
		marked: tell(f.marked)})
	require.NoError(t, err)
	closeAtEnd(t, node)
	released := false
	defer func() {
		if !released {
			close(n.release)
		}
	}()
	recv(t, n.asked, "the first row's delivery")
	// Written with no wake-up at all: any that came now would find the
	// parent claimed, and claim nothing.
	f.outboxRows("retry_scheduled", "chat")
	close(n.release)
	released = true
	got := n.box.await(t, func(got []bgtask.Notification) bool { return len(got) == 2 })
	assert.Equal(t, bgtask.NotifyAnswer, got[0].Kind)
	assert.Equal(t, bgtask.NotifyRetryScheduled, got[1].Kind)
}

// A task may be in its round twice (it lived again after a crash: a retry
// owed was written in a later commit): the round's all_complete is ready
// once each of its tasks' summaries is there, not held back for
// claimGrace as if one were missing.
func TestExchangeTakesARoundWithATaskTwice(t *testing.T) {
	f := newFixture(t)
	require.NoError(t, Migrate(ctx(t), f.pool))
	for _, q := range []string{
		`INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, task_id, body, delivered_at)
VALUES ($1, 'w', 'final:t1', 'P', 'final_summary', 't1', '{}', now()), ($1, 'w', 'final:t2', 'P', 'final_summary', 't2', '{}', now())`,
		`INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, round_tasks)
VALUES ($1, '', 'all_complete:P:1', 'P', 'all_complete', ARRAY['t1', 't2', 't1'])`,
	} {
		_, err := f.pool.Exec(ctx(t), q, f.ledger)
		require.NoError(t, err)
	}
	rows, err := f.pool.Query(ctx(t), exchangeSQL, f.ledger, "w", []string{}, claimFor, []int64{}, []string{}, []int64{}, []string{},
		[]string{}, []string{}, false, []string{"x"}, claimBatch, 4*claimBatch, claimGrace, rowsPerParent)
	require.NoError(t, err)
	var kinds []string
	for rows.Next() {
		var which int
		var parent string
		var kind *string
		require.NoError(t, rows.Scan(&which, &parent, nil, nil, &kind, nil, nil, nil, nil))
		if which == 1 && kind != nil {
			kinds = append(kinds, parent+" "+*kind)
		}
	}
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"P all_complete"}, kinds, "claimed at once, with its all_complete")
}
