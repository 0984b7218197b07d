package pgledger

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// runningSpec launches spec at node n and returns the task once it runs
// and its binding is durable (as running does).
func runningSpec(t *testing.T, n *Node, s bgtask.Spec) bgtask.Task {
	t.Helper()
	if s.Models == nil {
		s.Models, s.Prompt = spec.Models, "do it"
	}
	task, err := n.Launch(ctx(t), s)
	require.NoError(t, err)
	got, err := bgtasktest.WaitStatus(ctx(t), n.Manager(), task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	_, err = n.Launch(ctx(t), bgtask.Spec{ParentSessionID: "barrier", Prompt: "barrier", Models: spec.Models})
	require.NoError(t, err)
	return got
}

// usage is an event reporting tokens for session sid.
func usage(sid string, tokens int64) bgtask.Event {
	return bgtask.Event{SessionID: sid, Kind: bgtask.SessionUsage, Usage: bgtask.Usage{InputTokens: tokens, Requests: 1}}
}

// Two processes spend one tree's budget: the root and a child in one, a
// child in the other. The report that reaches the limit, in whichever
// process, refuses the next launch in the tree in every process at once,
// and stops every run of the tree, whichever process owns it, with the
// budget as the stop cause; a report after the stop still counts; the
// figures are the fleet's, read from any process.
func TestAFleetSpendsOneTreesBudget(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	a, b := ns[0], ns[1]
	root := runningSpec(t, a, bgtask.Spec{ParentSessionID: "chat", Budget: &bgtask.Budget{Tokens: 1000, Spawns: 4, SoftPercent: 100}})
	c1 := runningSpec(t, b, bgtask.Spec{ParentSessionID: root.SessionID, Budget: &bgtask.Budget{Tokens: 5000}})
	c2 := runningSpec(t, a, bgtask.Spec{ParentSessionID: root.SessionID})

	s, ok, err := b.Budget(ctx(t), c1.ID)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, int64(1000), s.Limit.Tokens, "the child's grant, clamped by the fleet's root in the other process")
	assert.Equal(t, int64(1000), mustTask(t, b, c1.ID).Budget.Limit.Tokens, "and its Manager launched it with that grant")

	require.NoError(t, b.Observe(context.Background(), usage(c1.SessionID, 600)))
	require.NoError(t, a.Observe(context.Background(), usage(c2.SessionID, 300)))
	s, _, err = a.Budget(ctx(t), root.ID)
	require.NoError(t, err)
	assert.Equal(t, int64(900), s.Spent.Tokens(), "both processes' usage, in one account")
	assert.Equal(t, int64(2), s.Spawned)
	assert.Empty(t, s.Exceeded)

	require.NoError(t, a.Observe(context.Background(), usage(root.SessionID, 150))) // 1050 ≥ 1000
	_, err = b.Launch(ctx(t), bgtask.Spec{ParentSessionID: c1.SessionID, Prompt: "more", Models: spec.Models})
	var be *bgtask.BudgetError
	require.ErrorAs(t, err, &be, "refused in the other process, from the commit that spent it")
	assert.Equal(t, root.ID, be.TaskID)
	assert.Equal(t, bgtask.LimitTokens, be.Limit)
	assert.Equal(t, int64(1050), be.Spent)

	want := bgtask.StopCause{Kind: bgtask.StopBudget, TaskID: root.ID, Limit: bgtask.LimitTokens}
	for _, x := range []struct {
		n    *Node
		task bgtask.Task
	}{{a, root}, {b, c1}, {a, c2}} {
		end, err := bgtasktest.WaitStatus(ctx(t), x.n.Manager(), x.task.ID, bgtask.StatusCancelled)
		require.NoError(t, err, "task %s", x.task.ID)
		require.NotNil(t, end.Stop)
		assert.Equal(t, want, *end.Stop, "task %s: stopped by the budget, in the process that owns it", x.task.ID)
		assert.True(t, svc.aborted(x.task.SessionID), "task %s: its child really stopped", x.task.ID)
	}
	require.NoError(t, b.Observe(context.Background(), usage(c1.SessionID, 25)), "a usage report of a stopped run is no error")
	s, _, err = b.Budget(ctx(t), root.ID)
	require.NoError(t, err)
	assert.Equal(t, int64(1075), s.Spent.Tokens(), "a report after the stop counts")
	assert.Equal(t, bgtask.LimitTokens, s.Exceeded)
	assert.Zero(t, s.Reserved)
	t.Logf("overrun: %d tokens past %d (the report that reached it, and one after the stop)", s.Spent.Tokens()-s.Limit.Tokens, s.Limit.Tokens)
}

// Launches from two processes race the last spawns of one budget: exactly
// as many as it has are admitted; a launch whose start never ran gives its
// spawn back.
func TestTwoProcessesRaceTheLastSpawns(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	root := runningSpec(t, ns[0], bgtask.Spec{ParentSessionID: "chat", Budget: &bgtask.Budget{Spawns: 3}})
	var admitted, refused atomic.Int32
	var wg sync.WaitGroup
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := ns[i%2].Launch(ctx(t), bgtask.Spec{ParentSessionID: root.SessionID, Prompt: "p", Models: spec.Models})
			switch {
			case err == nil:
				admitted.Add(1)
			case errors.Is(err, bgtask.ErrBudget):
				refused.Add(1)
			default:
				t.Errorf("launch %d: %v", i, err)
			}
		}()
	}
	wg.Wait()
	assert.Equal(t, int32(3), admitted.Load())
	assert.Equal(t, int32(9), refused.Load())
	s, _, err := ns[1].Budget(ctx(t), root.ID)
	require.NoError(t, err)
	assert.Equal(t, int64(3), s.Spawned+s.Reserved)
}

// A launch from a branch that spends from no budget makes no budget
// statement: its fence check tells it there is none. A launch from a
// budget's tree is admitted to the budget first, as before — also one
// whose own budget is none (c2) — and refused by it once it is spent.
func TestALaunchOutsideEveryBudgetMakesNoBudgetStatement(t *testing.T) {
	f := newFixture(t)
	n, admits := f.admitsCounted(nil)

	free := runningSpec(t, n, bgtask.Spec{ParentSessionID: "chat"})
	runningSpec(t, n, bgtask.Spec{ParentSessionID: free.SessionID})
	assert.Zero(t, admits.Load(), "no budget anywhere: no budget statement")

	root := runningSpec(t, n, bgtask.Spec{ParentSessionID: "chat-2", Budget: &bgtask.Budget{Spawns: 1}})
	assert.Equal(t, int64(1), admits.Load(), "a launch with a budget of its own is admitted to it")
	runningSpec(t, n, bgtask.Spec{ParentSessionID: root.SessionID})
	assert.Equal(t, int64(2), admits.Load(), "a launch in a budget's tree is admitted to it")
	_, err := n.Launch(ctx(t), bgtask.Spec{ParentSessionID: root.SessionID, Prompt: "one more", Models: spec.Models})
	var be *bgtask.BudgetError
	require.ErrorAs(t, err, &be, "its one spawn is spent")
	assert.Equal(t, "spawns", be.Limit)
	assert.Equal(t, 0, f.count("bgtask_launching", "parent_session = $2", root.SessionID), "a refused launch leaves nothing in flight")
}

// The budget admissions that come together go in one statement: twenty
// launches at once into a tree of ten spawns make a few statements, not
// twenty; exactly ten are admitted and the others refused by the budget,
// each on its own; and one the database refuses (its task admitted
// already) is refused alone.
func TestBudgetAdmissionsAreBatched(t *testing.T) {
	f := newFixture(t)
	started := make(chan struct{}, 64)
	n, admits := f.admitsCounted(started)
	root := runningSpec(t, n, bgtask.Spec{ParentSessionID: "chat", Budget: &bgtask.Budget{Spawns: 10}})
	for len(started) > 0 {
		<-started
	}
	admits.Store(0)
	// The first admission waits for the budget's row, held here, until
	// every other one is queued behind it.
	tx, err := f.pool.Begin(ctx(t))
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx(t), `SELECT 1 FROM bgtask_budgets WHERE ledger = $1 AND holder = $2 FOR UPDATE`, f.ledger, root.ID)
	require.NoError(t, err)
	queued := make(chan struct{}, 20)
	n.budgets.enqueued = func() { queued <- struct{}{} }

	var wg sync.WaitGroup
	var launched, refused atomic.Int64
	launch := func() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := n.Launch(ctx(t), bgtask.Spec{ParentSessionID: root.SessionID, Prompt: "do it", Models: spec.Models})
			var be *bgtask.BudgetError
			switch {
			case err == nil:
				launched.Add(1)
			case errors.As(err, &be):
				refused.Add(1)
			default:
				t.Error(err)
			}
		}()
	}
	// The first is in flight, waiting for the row, before the others
	// come: they queue behind its statement, and go in the next.
	launch()
	recv(t, queued, "the first admission queued")
	recv(t, started, "the first admission's statement sent")
	for range 19 {
		launch()
	}
	for range 19 {
		recv(t, queued, "an admission queued")
	}
	require.NoError(t, tx.Rollback(ctx(t)))
	wg.Wait()
	assert.Equal(t, int64(10), launched.Load(), "the spawns the budget has")
	assert.Equal(t, int64(10), refused.Load())
	assert.Equal(t, int64(2), admits.Load(), "the first, and the nineteen queued behind it in one statement")

	answers, err := n.budgetAll(ctx(t), []budgetAsk{{task: "twice", parent: "chat-2", own: &bgtask.Budget{Tokens: 3}}, {task: "twice", parent: "chat-2", own: &bgtask.Budget{Tokens: 5}},
		{task: "other", parent: "chat-2", own: &bgtask.Budget{Tokens: 7}}})
	require.NoError(t, err)
	assert.Empty(t, answers[0].err)
	assert.Contains(t, answers[1].err, "admitted to a budget already", "refused alone")
	require.NotNil(t, answers[2].grant, "the launch after it is admitted")
	assert.Equal(t, int64(7), answers[2].grant.Tokens)
}

// admitsCounted joins a node of the fixture's ledger on a pool of its
// own, whose budget admission statements (budgetAdmitSQL) it counts.
// Each statement's start is told on started, if it is not nil.
func (f *fixture) admitsCounted(started chan<- struct{}) (*Node, *atomic.Int64) {
	f.t.Helper()
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(f.t, err)
	admits := &atomic.Int64{}
	cfg.ConnConfig.Tracer = statementsLike{sql: budgetAdmitSQL, n: admits, started: started}
	pool, err := pgxpool.NewWithConfig(ctx(f.t), cfg)
	require.NoError(f.t, err)
	f.t.Cleanup(pool.Close)
	n, err := Join(ctx(f.t), pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: newService(), Poll: 100 * time.Millisecond})
	require.NoError(f.t, err)
	closeAtEnd(f.t, n)
	return n, admits
}

// A commit's spending is applied as if record by record: each usage
// report counts against every budget from its task's up, and a budget
// becomes over at the first report (in the commit's order) that takes it
// to a limit, checked tokens, then cost, then requests. A task's first
// binding moves its reservation to a spawn once, however often the commit
// binds it; a reserved task that ends gives its reservation back.
func TestABudgetedCommitIsSpentRecordByRecord(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{})
	require.NoError(t, j.Append([]bgtask.Record{
		rec(1, "task_launched", "t1", "", "", ""),
		rec(2, "attempt_created", "t1", "a1", "r1", ""),
		rec(3, "task_launched", "t2", "", "", ""),
		rec(4, "attempt_created", "t2", "a2", "r2", ""),
		rec(5, "task_launched", "t3", "", "", ""),
		rec(6, "attempt_created", "t3", "a3", "r3", ""),
	}).Wait())
	// R: the tree's budget, 50 tokens and a cost of 100; t1 has a budget
	// of its own under R (30 tokens) and t2 spends from R; both are
	// reserved under R, neither has started. t3 spends from R and has
	// started: its spawn is counted.
	_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_budgets (ledger, holder, up, lim_tokens, lim_cost, reserved, spawned) VALUES
	  ($1, 'R', '', 50, 100, 2, 1), ($1, 't1', 'R', 30, 0, 0, 0)`, f.ledger)
	require.NoError(t, err)
	_, err = f.pool.Exec(ctx(t), `INSERT INTO bgtask_spends (ledger, task_id, holder, reserved, started) VALUES
	  ($1, 't1', 't1', true, false), ($1, 't2', 'R', true, false), ($1, 't3', 'R', false, true)`, f.ledger)
	require.NoError(t, err)

	used := func(seq uint64, task, attempt, token string, u bgtask.Usage) bgtask.Record {
		r := rec(seq, "usage", task, attempt, token, "")
		r.Usage = &u
		return r
	}
	require.NoError(t, j.Append([]bgtask.Record{
		used(7, "t1", "a1", "r1", bgtask.Usage{InputTokens: 10, Requests: 1, Cost: 20}), // R: 10 tokens, cost 20; t1: 10 tokens
		used(8, "t2", "a2", "r2", bgtask.Usage{InputTokens: 5, Requests: 1, Cost: 85}),  // R: 15, cost 105: over by cost, first
		used(9, "t1", "a1", "r1", bgtask.Usage{OutputTokens: 40, Requests: 1}),          // R: 55 tokens (over already); t1: 50 ≥ 30: tokens
		used(10, "nobody", "", "", bgtask.Usage{InputTokens: 1000, Cost: 1000}),         // spends from no budget
		rec(11, "session_bound", "t2", "a2", "r2", "s2"),
		rec(12, "session_bound", "t2", "a2", "r2", "s3"),
		rec(13, "session_bound", "t3", "a3", "r3", "s4"), // started before: no spawn
		rec(14, "attempt_finalized", "t1", "a1", "r1", ""),
	}).Wait())

	type row struct {
		Tokens, Cost, Requests, Spawned, Reserved int64
		Over                                      string
	}
	read := func(holder string) row {
		t.Helper()
		var r row
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT spent_input + spent_output, spent_cost, spent_requests, spawned, reserved, over
		  FROM bgtask_budgets WHERE ledger = $1 AND holder = $2`, f.ledger, holder).Scan(&r.Tokens, &r.Cost, &r.Requests, &r.Spawned, &r.Reserved, &r.Over))
		return r
	}
	assert.Equal(t, row{Tokens: 55, Cost: 105, Requests: 3, Spawned: 2, Reserved: 0, Over: "cost"}, read("R"),
		"every report counted up the chain; over by the limit its reports reached first; t2's spawn counted once, t1's reservation given back")
	assert.Equal(t, row{Tokens: 50, Cost: 20, Requests: 2, Over: "tokens"}, read("t1"), "a task's reports count against its own budget too")
	var started, reserved []bool
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT array_agg(started ORDER BY task_id), array_agg(reserved ORDER BY task_id)
	  FROM bgtask_spends WHERE ledger = $1`, f.ledger).Scan(&started, &reserved))
	assert.Equal(t, []bool{false, true, true}, started, "t2 started, t1 never did")
	assert.Equal(t, []bool{false, false, false}, reserved)
}
