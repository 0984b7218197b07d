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
				assert.NoError(t, ns[i].Observe(bgtask.Event{AttemptID: task.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "answer " + task.ID}))
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
		require.NoError(t, n.Observe(bgtask.Event{AttemptID: got.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "ok"}))
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
	require.NoError(t, node.Observe(bgtask.Event{AttemptID: got.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "ok"}))
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
// holder's to deliver, once.
func TestADeliveryIsMarkedOnlyUnderItsClaim(t *testing.T) {
	f := newFixture(t)
	ns := f.nodes(newService(), 2, 0) // no Notifier: no deliverer of their own runs
	_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, body)
VALUES ($1, 'w0', 'n-1', 'chat', 'progress', '{"kind":"progress","parentSessionID":"chat"}')`, f.ledger)
	require.NoError(t, err)
	row := outboxRow{kind: "progress", noteID: "n-1"}
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT id FROM bgtask_outbox WHERE ledger = $1`, f.ledger).Scan(&row.id))
	_, err = f.pool.Exec(ctx(t), `INSERT INTO bgtask_claims (ledger, parent_session, member, until) VALUES ($1, 'chat', 'w1', now() + interval '1 hour')
ON CONFLICT (ledger, parent_session) DO UPDATE SET member = 'w1', until = now() + interval '1 hour'`, f.ledger)
	require.NoError(t, err)
	assert.False(t, ns[0].delivered("chat", row), "w0 no longer holds the claim")
	assert.Equal(t, 1, f.count("bgtask_outbox", "delivered_at IS NULL"), "the row is still to deliver")
	assert.True(t, ns[1].delivered("chat", row), "the holder marks it")
	assert.Equal(t, 0, f.count("bgtask_outbox", ""))
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
	_, err := ns[1].CloseBranch(ctx(t), a.SessionID)
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
