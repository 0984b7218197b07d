package pgledger

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The tests of retention make rows old by writing their times back (SQL),
// and run a pass (pruneLedger) themselves; TestANodePrunesItsLedger shows
// the nodes run it.

// prune runs one pass of retention r over the fixture's ledger.
func (f *fixture) prune(r bgtask.Retention) pruned {
	f.t.Helper()
	p, err := pruneLedger(ctx(f.t), f.pool, f.ledger, retentionOf(r), f.t.Logf)
	require.NoError(f.t, err)
	return p
}

// exec runs sql with the fixture's ledger as $1.
func (f *fixture) exec(sql string, args ...any) {
	f.t.Helper()
	_, err := f.pool.Exec(ctx(f.t), sql, append([]any{f.ledger}, args...)...)
	require.NoError(f.t, err)
}

// changed returns the ids of the tasks with a row in the fixture's
// ledger's change stream.
func (f *fixture) changed() []string {
	f.t.Helper()
	rows, err := f.pool.Query(ctx(f.t), `SELECT task_id FROM bgtask_changes WHERE ledger = $1 ORDER BY task_id`, f.ledger)
	require.NoError(f.t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(f.t, err)
	return ids
}

func taskIDs(tasks []bgtask.Task) []string {
	out := make([]string, 0, len(tasks))
	for _, t := range tasks {
		out = append(out, t.ID)
	}
	slices.Sort(out)
	return out
}

// untilChange reads changes from sub until want says it has seen enough.
func untilChange(t *testing.T, sub *bgtask.Subscription, want func(bgtask.Change) bool, what string) {
	t.Helper()
	for {
		c, ok := recvOrClosed(t, sub.C, what)
		require.True(t, ok, "the subscription ended before %s: %v", what, sub.Err())
		if want(c) {
			return
		}
	}
}

// recvOrClosed is recv for a channel that may close.
func recvOrClosed[T any](t *testing.T, c <-chan T, what string) (T, bool) {
	t.Helper()
	select {
	case v, ok := <-c:
		return v, ok
	case <-time.After(30 * time.Second):
		t.Fatalf("waited 30s for %s", what)
		panic("not reached")
	}
}

// The change of a task that ended longer ago than MaxAge is pruned, and
// Snapshot leaves it out even before; the change of a live task stays,
// and so does the ledger's newest change (a snapshot's Seq never goes
// back).
func TestRetentionPrunesTheChangesOfEndedTasks(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	node := f.nodes(svc, 1, 0)[0]
	sub, err := node.Subscribe(ctx(t), 1024)
	require.NoError(t, err)
	defer sub.Close()
	live := running(t, node, "chat")
	var ended []bgtask.Task
	for range 3 {
		ended = append(ended, running(t, node, "chat"))
	}
	for _, task := range ended {
		require.NoError(t, node.Observe(context.Background(), bgtask.Event{AttemptID: task.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "done"}))
		untilChange(t, sub, func(c bgtask.Change) bool { return c.Task.ID == task.ID && c.Task.Status == bgtask.StatusCompleted },
			"the change of "+task.ID+" ending")
	}
	newest := ended[2].ID // its end is the ledger's newest change
	var top string
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT task_id FROM bgtask_changes WHERE ledger = $1 ORDER BY id DESC LIMIT 1`, f.ledger).Scan(&top))
	require.Equal(t, newest, top)
	all := f.changed()
	require.Contains(t, all, live.ID)

	// Nothing is old yet: nothing goes.
	assert.Equal(t, pruned{}, f.prune(bgtask.Retention{}))
	assert.Equal(t, all, f.changed())

	f.exec(`UPDATE bgtask_changes SET ended_at = ended_at - interval '2 days' WHERE ledger = $1 AND task_id = ANY($2)`,
		[]string{ended[0].ID, ended[1].ID, ended[2].ID})
	snap, err := node.Snapshot(ctx(t))
	require.NoError(t, err)
	assert.NotContains(t, taskIDs(snap.Tasks), ended[0].ID, "past MaxAge: left out before it is pruned")
	assert.NotContains(t, taskIDs(snap.Tasks), newest)
	assert.Contains(t, taskIDs(snap.Tasks), live.ID)
	seq := snap.Seq

	p := f.prune(bgtask.Retention{})
	assert.Equal(t, 2, p.Changes)
	now := f.changed()
	assert.NotContains(t, now, ended[0].ID)
	assert.NotContains(t, now, ended[1].ID)
	assert.Contains(t, now, newest, "the newest change stays")
	assert.Contains(t, now, live.ID, "a live task's change stays")
	assert.Len(t, now, len(all)-2)
	snap, err = node.Snapshot(ctx(t))
	require.NoError(t, err)
	assert.Equal(t, seq, snap.Seq)
	assert.Contains(t, taskIDs(snap.Tasks), live.ID)
	assert.Len(t, snap.Tasks, len(all)-3)

	// A node with no age bound has the newest in its snapshot.
	other, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w9", Host: svc, Retention: bgtask.Retention{MaxAge: -1}})
	require.NoError(t, err)
	closeAtEnd(t, other)
	snap, err = other.Snapshot(ctx(t))
	require.NoError(t, err)
	assert.Contains(t, taskIDs(snap.Tasks), newest)
}

// publish writes changes of member w0 (whose journal j holds the lease)
// as a node does.
func (f *fixture) publish(j *Journal, tasks ...bgtask.Task) {
	f.t.Helper()
	var id []string
	var body [][]byte
	for _, task := range tasks {
		b, err := json.Marshal(task)
		require.NoError(f.t, err)
		id, body = append(id, task.ID), append(body, b)
	}
	f.exec(`SELECT bgtask_publish($1, $2, $3, $4, $5::jsonb[])`, j.member, j.Fence(), id, body)
}

// A change is ended as its task is (bgtask.Status.Terminal), at its
// CompletedAt; with MaxEnded only the newest that many ended stay.
func TestRetentionKeepsTheNewestEnded(t *testing.T) {
	f := newFixture(t)
	j := f.open("w0", Options{})
	at := time.Date(2020, 1, 2, 3, 4, 5, 123456000, time.FixedZone("", 2*3600))
	var tasks []bgtask.Task
	for i, s := range []bgtask.Status{bgtask.StatusCompleted, bgtask.StatusError, bgtask.StatusCancelled, bgtask.StatusInterrupt,
		bgtask.StatusPending, bgtask.StatusRunning, ""} {
		tasks = append(tasks, bgtask.Task{ID: "t" + string(rune('0'+i)), Status: s, CompletedAt: at.Add(time.Duration(i) * time.Minute)})
	}
	f.publish(j, tasks...)
	for _, task := range tasks {
		var ended *time.Time
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT ended_at FROM bgtask_changes WHERE ledger = $1 AND task_id = $2`, f.ledger, task.ID).Scan(&ended))
		if task.Status.Terminal() {
			require.NotNil(t, ended, "%s is ended", task.Status)
			assert.True(t, ended.Equal(task.CompletedAt), "%s ended at %s, not %s", task.Status, ended, task.CompletedAt)
		} else {
			assert.Nil(t, ended, "%q is not ended", task.Status)
		}
	}
	// A task that ends without a CompletedAt ends now.
	f.publish(j, bgtask.Task{ID: "t9", Status: bgtask.StatusCompleted})
	var fresh bool
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT ended_at > now() - interval '1 minute' FROM bgtask_changes WHERE ledger = $1 AND task_id = 't9'`, f.ledger).Scan(&fresh))
	assert.True(t, fresh)

	// The newest two ended (t9 now, t3 at 03:07) stay, with every live one
	// and the newest change (t9's).
	p := f.prune(bgtask.Retention{MaxEnded: 2, MaxAge: -1})
	assert.Equal(t, 3, p.Changes)
	assert.Equal(t, []string{"t3", "t4", "t5", "t6", "t9"}, f.changed())
}

// A closure that ended longer ago than MaxAge is pruned with its stops; an
// open one stays whatever its age, unless its opener's lease has ended:
// then it holds no fence, and is closed (and pruned in its turn).
func TestRetentionPrunesClosuresAndTheirStops(t *testing.T) {
	f := newFixture(t)
	node := f.nodes(newService(), 1, 0)[0] // member w0, live
	j := f.open("gone", Options{})
	f.expire("gone")
	closure := func(member, root, opened string, closed any) int64 {
		var id int64
		require.NoError(t, f.pool.QueryRow(ctx(t), `INSERT INTO bgtask_closures (ledger, root_session, member, opened_at, closed_at, record)
VALUES ($1, $2, $3, now() - $4::interval, now() - $5::interval, CASE WHEN $5::interval IS NOT NULL THEN '{}'::jsonb END) RETURNING id`,
			f.ledger, root, member, opened, closed).Scan(&id))
		for _, tok := range []string{"r1", "r2"} {
			_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_stops (closure_id, task_id, attempt_id, session_id, token, member, status, err)
VALUES ($1, 't', 'a', 's', $2, $3, 'cancelled', '')`, id, tok, member)
			require.NoError(t, err)
		}
		return id
	}
	old := closure("w0", "s-old", "3 days", "2 days")
	recent := closure("w0", "s-recent", "2 hours", "1 hour")
	open := closure("w0", "s-open", "3 days", nil)
	inert := closure(j.member, "s-inert", "3 days", nil)
	stopsOf := func(id int64) int {
		var n int
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT count(*) FROM bgtask_stops WHERE closure_id = $1`, id).Scan(&n))
		return n
	}
	var fenced *int64
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT bgtask_fenced($1, 's-open')`, f.ledger).Scan(&fenced))
	require.NotNil(t, fenced)

	p := f.prune(bgtask.Retention{})
	assert.Equal(t, pruned{Closures: 1, Stops: 2, Closed: 1, Idled: 1}, p, "and member gone is found idle")
	assert.Equal(t, 0, f.count("bgtask_closures", "id = $2", old))
	assert.Equal(t, 0, stopsOf(old))
	assert.Equal(t, 1, f.count("bgtask_closures", "id = $2 AND closed_at IS NOT NULL", recent), "ended an hour ago: it stays")
	assert.Equal(t, 2, stopsOf(recent))
	assert.Equal(t, 1, f.count("bgtask_closures", "id = $2 AND closed_at IS NULL", open), "open: it stays open")
	assert.Equal(t, 2, stopsOf(open))
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT bgtask_fenced($1, 's-open')`, f.ledger).Scan(&fenced))
	assert.Equal(t, &open, fenced, "its fence holds")
	assert.Equal(t, 1, f.count("bgtask_closures", "id = $2 AND closed_at > now() - interval '1 minute'", inert), "closed now")
	assert.Equal(t, 2, stopsOf(inert))

	// What a stop came to, written after its closure was pruned, stays out.
	require.NoError(t, node.insertStops(ctx(t), []stopResult{{closure: old, row: stopRow{run: bgtask.StoppedRun{TaskID: "t", Token: "r3"}, member: "w0"}}}))
	assert.Equal(t, 0, stopsOf(old))

	f.exec(`UPDATE bgtask_closures SET closed_at = closed_at - interval '2 days' WHERE ledger = $1 AND id = $2`, inert)
	assert.Equal(t, pruned{Closures: 1, Stops: 2}, f.prune(bgtask.Retention{}))
	assert.Equal(t, 0, f.count("bgtask_closures", "id = $2", inert))
	assert.Equal(t, 2, f.count("bgtask_closures", ""))
}

// taskRec is a record of task, launched from parent, for a journal's
// Append: its attempt, run and session are named after it.
func taskRec(seq uint64, kind, task, parent string) bgtask.Record {
	return bgtask.Record{Seq: seq, Kind: kind, TaskID: task, AttemptID: "a-" + task, Token: "r-" + task, SessionID: "s-" + task,
		ParentSessionID: parent, Data: []byte{1}}
}

// lifecycle appends a whole task's life (launched, bound, ended) to j,
// from sequence seq, and returns the next sequence.
func lifecycle(t *testing.T, j *Journal, seq uint64, task string, parent string) uint64 {
	t.Helper()
	require.NoError(t, j.Append([]bgtask.Record{taskRec(seq, "task_launched", task, parent), taskRec(seq+1, "attempt_created", task, parent),
		taskRec(seq+2, "session_bound", task, parent), taskRec(seq+3, "attempt_finalized", task, parent)}).Wait())
	return seq + 4
}

func (f *fixture) allComplete() []string {
	f.t.Helper()
	rows, err := f.pool.Query(ctx(f.t), `SELECT note_id FROM bgtask_notes WHERE ledger = $1 AND kind = 'all_complete' ORDER BY id`, f.ledger)
	require.NoError(f.t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(f.t, err)
	return ids
}

// A parent's row with nothing live and no round open is pruned once it
// is older than MaxAge; one with a round open is not. A parent whose row
// was pruned counts its rounds on from above the ledger's round floor:
// its all_complete ids never repeat (the outbox still holds the old ones
// here: a repeat would be refused, and the commit with it).
func TestRetentionPrunesIdleParentsAndRoundsNeverRepeat(t *testing.T) {
	f := newFixture(t)
	j := f.open("w0", Options{Rounds: true})
	seq := lifecycle(t, j, 1, "t1", "chat")
	seq = lifecycle(t, j, seq, "t2", "chat")
	require.NoError(t, j.Append([]bgtask.Record{taskRec(seq, "task_launched", "t3", "busy"), taskRec(seq+1, "attempt_created", "t3", "busy")}).Wait())
	seq += 2
	assert.Equal(t, []string{"all_complete:chat:1", "all_complete:chat:2"}, f.allComplete())

	assert.Equal(t, pruned{}, f.prune(bgtask.Retention{}), "nothing is old yet")
	f.exec(`UPDATE bgtask_parents SET touched = touched - interval '2 days' WHERE ledger = $1`)
	assert.Equal(t, pruned{Parents: 1}, f.prune(bgtask.Retention{}))
	assert.Equal(t, 0, f.count("bgtask_parents", "parent_session = 'chat'"))
	assert.Equal(t, 1, f.count("bgtask_parents", "parent_session = 'busy' AND live = 1"), "a round open: it stays")
	var floor int64
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT round_floor FROM bgtask_retention WHERE ledger = $1`, f.ledger).Scan(&floor))
	assert.Equal(t, int64(3), floor, "chat's next round")

	seq = lifecycle(t, j, seq, "t4", "chat")
	lifecycle(t, j, seq, "t5", "new")
	got := f.allComplete()
	assert.Equal(t, []string{"all_complete:chat:1", "all_complete:chat:2", "all_complete:chat:4", "all_complete:new:4"}, got)
	assert.Len(t, slices.Compact(slices.Sorted(slices.Values(got))), len(got), "no id twice")
}

// A commit whose statement still sees a parent's row that retention
// deletes meanwhile makes the row again from the round it had, not from
// 1 (a REPEATABLE READ transaction's snapshot stands for the statement's).
func TestARoundGoesOnWhenItsRowIsPrunedUnderACommit(t *testing.T) {
	f := newFixture(t)
	j := f.open("w0", Options{Rounds: true})
	seq := lifecycle(t, j, 1, "t1", "chat")
	lifecycle(t, j, seq, "t2", "chat")
	f.exec(`UPDATE bgtask_parents SET touched = touched - interval '2 days' WHERE ledger = $1`)

	tx, err := f.pool.BeginTx(ctx(t), pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	var n int
	require.NoError(t, tx.QueryRow(ctx(t), `SELECT count(*) FROM bgtask_parents WHERE ledger = $1`, f.ledger).Scan(&n)) // its snapshot
	require.Equal(t, 1, n)
	assert.Equal(t, pruned{Parents: 1}, f.prune(bgtask.Retention{}))

	var round int64
	require.NoError(t, tx.QueryRow(ctx(t), `INSERT INTO bgtask_parents AS x (ledger, parent_session, live, round_tasks) VALUES ($1, 'chat', 1, '{t3}')
ON CONFLICT (ledger, parent_session) DO UPDATE SET live = x.live + 1 RETURNING round`, f.ledger).Scan(&round))
	assert.Equal(t, int64(3), round, "chat's rounds 1 and 2 were told: it goes on from 3")
	require.NoError(t, tx.Commit(ctx(t)))
}

// A member that is dead and idle past MaxAge loses its records, tasks and
// sessions, never its row: its next life has a greater fence, and a write
// of the old one is refused. A member with a live task, or whose session
// launched a live task, keeps its data; a dead member with nothing live
// is found idle; a dead member's launches in flight are cleared.
func TestRetentionPrunesTheDataOfDeadMembers(t *testing.T) {
	f := newFixture(t)
	open := func(member string) *Journal {
		j, err := Open(ctx(t), f.pool, Options{Ledger: f.ledger, Member: member})
		require.NoError(t, err)
		return j
	}
	gone := open("gone")
	lifecycle(t, gone, 1, "t-gone", "chat")
	require.NoError(t, gone.Close()) // idle: nothing live
	crashed := open("crashed")
	lifecycle(t, crashed, 1, "t-crashed", "chat")
	crashed.abandon() // not idle: it died
	busy := open("busy")
	require.NoError(t, busy.Append([]bgtask.Record{taskRec(1, "task_launched", "t-busy", "s-t-parent"), taskRec(2, "attempt_created", "t-busy", "s-t-parent")}).Wait())
	busy.abandon()
	parent := open("parent") // its session s-t-parent launched t-busy, live
	lifecycle(t, parent, 1, "t-parent", "chat")
	require.NoError(t, parent.Close())
	f.open("alive", Options{})
	f.exec(`INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) VALUES ($1, 'l-crashed', 'chat', 'crashed'), ($1, 'l-alive', 'chat', 'alive')`)
	f.exec(`UPDATE bgtask_members SET expires_at = now() - interval '2 days' WHERE ledger = $1 AND member <> 'alive'`)
	dataOf := func(member string) int {
		return f.count("bgtask_records", "member = $2", member) + f.count("bgtask_tasks", "member = $2", member) +
			f.count("bgtask_sessions", "member = $2", member)
	}
	require.Equal(t, 6, dataOf("gone"))
	require.Equal(t, 6, dataOf("crashed"))
	require.Equal(t, 6, dataOf("parent"))

	p := f.prune(bgtask.Retention{})
	assert.Equal(t, pruned{Members: 2, Idled: 1, Launching: 1}, p)
	assert.Equal(t, 0, dataOf("gone"))
	assert.Equal(t, 0, dataOf("crashed"), "found idle, then pruned")
	assert.Equal(t, 3, dataOf("busy"), "a live task")
	assert.Equal(t, 6, dataOf("parent"), "its session launched a live task")
	assert.Equal(t, 1, f.count("bgtask_members", "member = 'busy' AND NOT idle"))
	assert.Equal(t, 5, f.count("bgtask_members", ""), "every member's row stays")
	assert.Equal(t, 1, f.count("bgtask_launching", "task_id = 'l-alive'"))
	assert.Equal(t, 0, f.count("bgtask_launching", "task_id = 'l-crashed'"))
	assert.Equal(t, pruned{}, f.prune(bgtask.Retention{}), "nothing more")

	// Its next life: a greater fence, nothing to replay; the old fence is
	// refused.
	again := f.open("gone", Options{})
	assert.Equal(t, gone.Fence()+1, again.Fence())
	var n int
	require.NoError(t, again.Replay(func(bgtask.Record) error { n++; return nil }))
	assert.Zero(t, n)
	_, err := f.pool.Exec(ctx(t), `SELECT bgtask_write($1, 'gone', $2, '15 seconds', '{1}', '{task_launched}', '{t-x}', '{a}', '{r}', '{s}', '{chat}', '{"\\x01"}', false,
 '{0}', '{0}', '{0}', '{0}', '{0}', '{}', '{}', '{}', '{}', '{}')`,
		f.ledger, gone.Fence())
	assert.ErrorIs(t, classify(err), ErrLeaseLost)
}

// A node prunes its ledger on its own, and one node per ledger takes each
// pass.
func TestANodePrunesItsLedger(t *testing.T) {
	f := newFixture(t)
	done := make(chan pruned, 16)
	f.exec(`INSERT INTO bgtask_closures (ledger, root_session, member, closed_at) VALUES ($1, 'old', 'w0', now() - interval '2 hours')`)
	node, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: newService(), Poll: 50 * time.Millisecond,
		Retention: bgtask.Retention{MaxAge: time.Hour}, prune: &pruneHook{every: 20 * time.Millisecond, done: done}})
	require.NoError(t, err)
	closeAtEnd(t, node)
	p := recv(t, done, "a pass")
	assert.Equal(t, 1, p.Closures)
	assert.Equal(t, 0, f.count("bgtask_closures", ""))
	c, cancel := ending()
	defer cancel()
	require.NoError(t, node.Close(c))

	mine, err := claimPrune(ctx(t), f.pool, f.ledger, time.Hour)
	require.NoError(t, err)
	assert.False(t, mine, "a node took a pass within the hour")
	f.exec(`UPDATE bgtask_retention SET pruned_at = now() - interval '2 hours' WHERE ledger = $1`)
	mine, err = claimPrune(ctx(t), f.pool, f.ledger, time.Hour)
	require.NoError(t, err)
	assert.True(t, mine)
}

func TestRetentionOf(t *testing.T) {
	assert.Equal(t, retention{age: DefaultRetainFor}, retentionOf(bgtask.Retention{}))
	assert.Equal(t, retention{age: 0, maxEnded: 5}, retentionOf(bgtask.Retention{MaxAge: -1, MaxEnded: 5}))
	assert.Equal(t, retention{age: minRetainFor}, retentionOf(bgtask.Retention{MaxAge: time.Second, MaxEnded: -1}))
	assert.Equal(t, retention{age: 2 * time.Hour}, retentionOf(bgtask.Retention{MaxAge: 2 * time.Hour}))
}
