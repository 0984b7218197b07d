package pgledger

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/jackc/pgx/v5"
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
	assert.Equal(t, 0, f.count("bgtask_notes", ""), "a told round leaves nothing in the outbox")
	assert.Equal(t, 0, f.count("bgtask_finals", ""), "nor any summary kept for its round")
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

// A task launched and ended in one group commit (a cancel racing its
// launch) is counted in its round: the round's all_complete has it.
func TestATaskLaunchedAndEndedInOneCommitIsInItsRound(t *testing.T) {
	f := newFixture(t)
	j := f.open("w0", Options{Rounds: true})
	rec := func(seq uint64, kind, task string) bgtask.Record {
		return bgtask.Record{Seq: seq, Kind: kind, TaskID: task, AttemptID: "a-" + task, Token: "r-" + task, ParentSessionID: "chat", Data: []byte{1}}
	}
	require.NoError(t, j.Append([]bgtask.Record{rec(1, "task_launched", "t1"), rec(2, "attempt_created", "t1"), rec(3, "attempt_finalized", "t1")}).Wait())
	var id string
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT note_id FROM bgtask_notes WHERE ledger = $1 AND kind = 'all_complete'`, f.ledger).Scan(&id))
	assert.Equal(t, "all_complete:chat:1", id)
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

// outboxRows inserts a row of kind for each parent, in order.
func (f *fixture) outboxRows(kind string, parents ...string) {
	f.t.Helper()
	for _, p := range parents {
		_, err := f.pool.Exec(ctx(f.t), `INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body)
VALUES ($1, bgtask_part($2), $2, $3, $4, $5)`, f.ledger, p, fmt.Sprintf("%s:%s:%d", kind, p, ledgers.Add(1)), kind,
			fmt.Sprintf(`{"kind":%q,"parentSessionID":%q}`, kind, p))
		require.NoError(f.t, err)
	}
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

// statementsLike counts the statements that are sql.
type statementsLike struct {
	sql     string
	n       *atomic.Int64
	started chan<- struct{} // nil, or told of each one as it starts
}

func (s statementsLike) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if d.SQL == s.sql {
		s.n.Add(1)
		if s.started != nil {
			s.started <- struct{}{}
		}
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

// A Manager's notification is written in the commit that produced it:
// the final summary's row and the round's all_complete land in the
// transaction of the attempt_finalized that ended the task, and no
// notification_delivered record is written for either.
func TestANotificationIsWrittenWithItsCommit(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	n := slowFor{slow: "chat", asked: make(chan context.Context, 1), release: make(chan struct{}), box: newInbox()}
	node, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: svc, Poll: 100 * time.Millisecond, Notifier: n})
	require.NoError(t, err)
	closeAtEnd(t, node)
	defer close(n.release) // the deliveries wait while the test looks
	task := running(t, node, "chat")
	require.NoError(t, node.Observe(context.Background(), bgtask.Event{AttemptID: task.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "ok"}))
	recv(t, n.asked, "the first delivery")
	var ended string
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT xmin::text FROM bgtask_records WHERE ledger = $1 AND kind = 'attempt_finalized' AND task_id = $2`,
		f.ledger, task.ID).Scan(&ended))
	rows, err := f.pool.Query(ctx(t), `SELECT kind, xmin::text FROM bgtask_notes WHERE ledger = $1 AND kind IN ('final_summary', 'all_complete') ORDER BY id`, f.ledger)
	require.NoError(t, err)
	type row struct{ Kind, Xmin string }
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	assert.Equal(t, []row{{"final_summary", ended}, {"all_complete", ended}}, got, "in the commit that ended the task, in that order")
	assert.Equal(t, 0, f.count("bgtask_records", "kind = 'notification_delivered'"))
}

// partOf is the part of the outbox a parent's notifications go to, as
// bgtask_part makes it: the first byte of the SHA-256 of its name, mod
// noteParts. The tests place rows by it.
func partOf(parent string) int {
	h := sha256.Sum256([]byte(parent))
	return int(h[0]) % noteParts
}

// The outbox's parts are the same in Go (partOf) and in SQL
// (bgtask_part), for any text.
func TestPartOfIsTheDatabasesPart(t *testing.T) {
	f := newFixture(t)
	require.NoError(t, Migrate(ctx(t), f.pool))
	for _, p := range []string{"", "chat", "chat-7", "ünïcödé 会话", "a\tb", strings.Repeat("x", 500)} {
		var part int
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT bgtask_part($1)`, p).Scan(&part))
		assert.Equal(t, part, partOf(p), "%q", p)
		assert.Less(t, part, noteParts)
	}
}

// rowsOf is the rows of runs, as "parent/kind".
func rowsOf(runs []*parentRun) []string {
	var out []string
	for _, r := range runs {
		for _, row := range r.rows {
			out = append(out, r.parent+"/"+row.kind)
		}
	}
	return out
}

// A node deletes what it delivered whoever holds its part now. Its claim
// expired (a stall) and another took the part over: the first node's
// late delete still takes the row, so the new holder, if it reads after
// the delete, does not deliver it again — and if it read before, it
// delivers it with its ID (at least once), and its own delete finds
// nothing. Either way the first node no longer counts the part its own.
func TestADeliveryIsDeletedWhoeverHoldsItsPartNow(t *testing.T) {
	f := newFixture(t)
	ns := f.nodes(newService(), 2, 0) // no Notifier: the test runs the rounds
	_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_parts (ledger, part) SELECT $1, g FROM generate_series(0, 15) g`, f.ledger)
	require.NoError(t, err)
	expire := func(parent string) {
		_, err := f.pool.Exec(ctx(t), `UPDATE bgtask_parts SET until = now() - interval '1 second' WHERE ledger = $1 AND part = $2`, f.ledger, partOf(parent))
		require.NoError(t, err)
	}
	deliver := func(d *deliverer, runs []*parentRun) {
		for _, r := range runs {
			for _, row := range r.rows {
				r.sent = append(r.sent, row.id)
			}
			d.finished(r)
		}
	}
	d0, d1 := newDeliverer(ns[0]), newDeliverer(ns[1])

	// The delete comes before the new holder reads: delivered once.
	f.outboxRows("answer", "chat")
	_, runs := d0.round(ctx(t), nil)
	require.Equal(t, []string{"chat/answer"}, rowsOf(runs))
	deliver(d0, runs)
	expire("chat")
	_, again := d0.round(ctx(t), nil) // its claim expired, and nobody took it: still its own
	assert.Empty(t, again)
	assert.Equal(t, 0, f.count("bgtask_notes", ""))
	assert.Contains(t, d0.parts, partOf("chat"))
	expire("chat")
	_, taken := d1.round(ctx(t), nil)
	assert.Empty(t, taken, "nothing to deliver again")

	// The new holder reads first: delivered again, with its ID.
	f.outboxRows("progress", "chat")
	expire("chat")
	_, runs = d0.round(ctx(t), nil)
	require.Equal(t, []string{"chat/progress"}, rowsOf(runs))
	deliver(d0, runs)
	expire("chat")
	_, taken = d1.round(ctx(t), nil)
	require.Equal(t, []string{"chat/progress"}, rowsOf(taken), "the row was not deleted yet")
	assert.Equal(t, runs[0].rows[0].noteID, taken[0].rows[0].noteID)
	_, _ = d0.round(ctx(t), nil)
	assert.Equal(t, 0, f.count("bgtask_notes", ""), "the late delete applies")
	assert.NotContains(t, d0.parts, partOf("chat"), "and the part is no longer the first node's")
	deliver(d1, taken)
	_, _ = d1.round(ctx(t), nil)
	assert.Contains(t, d1.parts, partOf("chat"))
}

// Nodes that look for parts at the same moment share them out: one skips
// a part another is claiming (its row locked) instead of waiting for it.
func TestClaimersLookingAtOnceShareTheParts(t *testing.T) {
	f := newFixture(t)
	ns := f.nodes(newService(), 1, 0)
	_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_parts (ledger, part) SELECT $1, g FROM generate_series(0, 15) g`, f.ledger)
	require.NoError(t, err)
	var parents []string
	for i := 0; len(parents) < 2; i++ { // two parents in two parts
		p := fmt.Sprintf("chat-%d", i)
		if len(parents) == 0 || partOf(p) != partOf(parents[0]) {
			parents = append(parents, p)
		}
	}
	f.outboxRows("answer", parents...)
	tx, err := f.pool.Begin(ctx(t))
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx(t), `SELECT 1 FROM bgtask_parts WHERE ledger = $1 AND part = $2 FOR UPDATE`, f.ledger, partOf(parents[0]))
	require.NoError(t, err)
	c, cancel := context.WithTimeout(ctx(t), 10*time.Second) // failure detection only
	defer cancel()
	_, runs := newDeliverer(ns[0]).round(c, nil)
	require.NoError(t, c.Err(), "not held up by the locked part")
	assert.Equal(t, []string{parents[1] + "/answer"}, rowsOf(runs), "the part another is claiming is skipped")
}
