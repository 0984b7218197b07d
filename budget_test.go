package bgtask

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// withBudget sets a Spec's Budget (harness.running's option).
func withBudget(b Budget) func(*Spec) { return func(s *Spec) { s.Budget = &b } }

// budgetOf is the state of the budget task id spends from.
func budgetOf(t *testing.T, m *Manager, id string) BudgetState {
	t.Helper()
	s, ok, err := m.Budget(id)
	require.NoError(t, err)
	require.True(t, ok, "task %s spends from a budget", id)
	return s
}

// A hard limit reached: a launch in the tree is refused at once, naming
// the limit and the figures; the live runs are stopped by a closure whose
// stop cause is the budget, and read running until their children really
// stopped; usage reported after the stop, and after the end, still counts.
func TestAHardLimitStopsTheTreeHonestlyAndRefusesLaunches(t *testing.T) {
	ctx := testCtx(t)
	asked, release := make(chan string, 4), make(chan struct{})
	host := &testHost{abort: func(ctx context.Context, sid string) error {
		asked <- sid
		<-release
		return nil
	}}
	h := newHarness(t, host)
	root := h.running("chat", withBudget(Budget{Tokens: 1000, SoftPercent: 100}))
	child := h.running(root.SessionID)
	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionUsage, Usage: u(600, 0, 1, 0)}))
	_, err := h.m.Launch(ctx, Spec{ParentSessionID: child.SessionID, Prompt: "more", Models: oneModel})
	require.NoError(t, err, "999 tokens left: a launch is still admitted")

	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionBusy, Usage: u(300, 150, 1, 0)}))
	_, err = h.m.Launch(ctx, Spec{ParentSessionID: child.SessionID, Prompt: "more", Models: oneModel})
	var be *BudgetError
	require.ErrorAs(t, err, &be, "refused at once: the report that reached the limit has returned")
	require.ErrorIs(t, err, ErrBudget)
	assert.Equal(t, BudgetError{TaskID: root.ID, Limit: LimitTokens, Max: 1000, Spent: 1050}, *be)
	assert.Contains(t, err.Error(), "tokens 1050 of 1000")

	// Honest: the aborts are asked and not yet answered; the runs go on.
	recv(t, asked, "the budget closure's first abort")
	recv(t, asked, "the budget closure's second abort")
	for _, id := range []string{root.ID, child.ID} {
		task := h.task(id)
		assert.Equal(t, StatusRunning, task.Status, "task %s reads running until its child stopped", id)
		require.NotNil(t, task.Stop)
		assert.Equal(t, StopCause{Kind: StopBudget, TaskID: root.ID, Limit: LimitTokens}, *task.Stop)
	}
	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionBusy, Usage: u(25, 0, 0, 0)}), "usage while stopping counts")
	close(release)
	for _, id := range []string{root.ID, child.ID} {
		end := h.wait(id)
		assert.Equal(t, StatusCancelled, end.Status)
		var se *StopError
		require.ErrorAs(t, end.Cause, &se)
		assert.Equal(t, StopBudget, se.Stop.Kind)
		assert.Contains(t, end.Outcome.Envelope, "stopped: the budget of task "+root.ID+" ran out of tokens")
		assert.Contains(t, end.Outcome.Envelope, "<task_notice>budget: Spent: ")
	}
	require.ErrorIs(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionIdle, Text: "late", Usage: u(5, 0, 0, 0)}), ErrStaleEvent)
	s := budgetOf(t, h.m, root.ID)
	assert.Equal(t, int64(1080), s.Spent.Tokens(), "600 + 450 + 25 while stopping + 5 after the end")
	assert.Equal(t, LimitTokens, s.Exceeded)
	assert.Equal(t, int64(0), s.Left.Tokens)

	// The parent chat heard: the budget once (no soft notice: SoftPercent 100), the closure, the ends.
	h.settle()
	require.NoError(t, h.m.notes.lanes.Wait(ctx))
	var kinds []NotificationKind
	for _, n := range h.rec.All() {
		if n.ParentSessionID == "chat" {
			kinds = append(kinds, n.Kind)
		}
	}
	assert.Equal(t, []NotificationKind{NotifyBudget, NotifyFinalSummary, NotifyAllComplete, NotifyBranchClosed}, kinds)
	for _, n := range h.rec.All() {
		if n.Kind == NotifyBudget {
			assert.Equal(t, root.ID, n.TaskID)
			assert.Contains(t, n.Text, "its budget is spent (tokens)")
			assert.Contains(t, n.Text, "Spent: 1050 of 1000 tokens")
		}
	}
	replaysAlike(t, h.m)
}

// replaysAlike checks that the records m's ledger committed replay to the
// same tasks, notifications and closures (when it keeps them: not under
// BGTASK_TEST_NOTAP, the production path).
func replaysAlike(t *testing.T, m *Manager) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.led.keepLog {
		require.NoError(t, checkReplay(m.led), "the records replay to the same ledger")
	}
}

// The soft threshold is told to the parent of the budget's task once,
// however many reports pass it.
func TestTheSoftThresholdIsToldOnce(t *testing.T) {
	h := newHarness(t, nil)
	root := h.running("chat", withBudget(Budget{Tokens: 1000}))
	for _, n := range []int64{700, 99, 1, 100} {
		require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionUsage, Usage: u(n, 0, 0, 0)}))
	}
	require.NoError(t, h.m.notes.lanes.Wait(testCtx(t)))
	var told []Notification
	for _, n := range h.rec.All() {
		if n.Kind == NotifyBudget {
			told = append(told, n)
		}
	}
	require.Len(t, told, 1)
	assert.Equal(t, "chat", told[0].ParentSessionID)
	assert.Equal(t, "[Budget] Task "+root.ID+": its tree reached 80% of its tokens limit. Spent: 800 of 1000 tokens. Left: 200 tokens.", told[0].Text)
	s := budgetOf(t, h.m, root.ID)
	assert.True(t, s.SoftReached)
	assert.Empty(t, s.Exceeded)
	assert.Equal(t, StatusRunning, h.task(root.ID).Status)
}

// Spawns reserve at launch: the reservation holds until a session of the
// task runs (then it is spent) or the task ends without one (then it is
// given back); a launch past the limit is refused and stops nothing.
func TestSpawnsReserveAtLaunchAndGiveBackOnAFailedStart(t *testing.T) {
	ctx := testCtx(t)
	fail := make(chan struct{})
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.Prompt == "fail" {
			<-fail
			return "", errors.New("403 Forbidden")
		}
		return sid, nil
	}}
	h := newHarness(t, host)
	root := h.running("chat", withBudget(Budget{Spawns: 2}))
	failing := h.launchSpec(Spec{ParentSessionID: root.SessionID, Prompt: "fail", Models: oneModel})
	ok := h.running(root.SessionID)
	s := budgetOf(t, h.m, root.ID)
	assert.Equal(t, int64(1), s.Spawned)
	assert.Equal(t, int64(1), s.Reserved)
	assert.Equal(t, int64(0), s.Left.Spawns)
	_, err := h.m.Launch(ctx, Spec{ParentSessionID: ok.SessionID, Prompt: "p", Models: oneModel})
	var be *BudgetError
	require.ErrorAs(t, err, &be, "deeper too: every task beneath the budget's counts")
	assert.Equal(t, BudgetError{TaskID: root.ID, Limit: LimitSpawns, Max: 2, Spent: 1, Reserved: 1}, *be)
	assert.Equal(t, StatusRunning, h.task(ok.ID).Status, "a spawn limit stops nothing")

	close(fail)
	assert.Equal(t, StatusError, h.wait(failing.ID).Status)
	s = budgetOf(t, h.m, root.ID)
	assert.Equal(t, int64(0), s.Reserved, "a task whose sessions never ran gives its spawn back")
	assert.Equal(t, int64(1), s.Spawned)
	third := h.running(ok.SessionID)
	assert.Equal(t, int64(2), budgetOf(t, h.m, third.ID).Spawned)
	_, err = h.m.Launch(ctx, Spec{ParentSessionID: root.SessionID, Prompt: "p", Models: oneModel})
	require.ErrorIs(t, err, ErrBudget)
}

// Many launches race the last spawns of a budget: exactly as many as it
// has are admitted.
func TestConcurrentSpawnsRaceTheLastOfABudget(t *testing.T) {
	h := newHarness(t, nil)
	root := h.running("chat", withBudget(Budget{Spawns: 5}))
	var admitted, refused atomic.Int32
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: root.SessionID, Prompt: fmt.Sprint(i), Models: oneModel})
			switch {
			case err == nil:
				admitted.Add(1)
			case errors.Is(err, ErrBudget):
				refused.Add(1)
			default:
				t.Errorf("launch %d: %v", i, err)
			}
		}()
	}
	wg.Wait()
	h.settle()
	assert.Equal(t, int32(5), admitted.Load())
	assert.Equal(t, int32(35), refused.Load())
	s := budgetOf(t, h.m, root.ID)
	assert.Equal(t, int64(5), s.Spawned+s.Reserved)
}

// Runs that report usage concurrently race the last tokens of a budget:
// what is spent past the limit is at most what was in flight when it was
// reached — one report per live run.
func TestConcurrentUsageOverrunsByAtMostWhatWasInFlight(t *testing.T) {
	h := newHarness(t, nil)
	const limit, report, children = 10_000, 70, 12
	root := h.running("chat", withBudget(Budget{Tokens: limit, SoftPercent: 100}))
	var kids []Task
	for range children {
		kids = append(kids, h.running(root.SessionID))
	}
	var wg sync.WaitGroup
	for _, k := range append(kids, root) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				// A child spends while its run is live: one report in flight
				// at most when it is stopped.
				err := h.m.Observe(Event{SessionID: k.SessionID, Kind: SessionBusy, Usage: u(report, 0, 1, 0)})
				if errors.Is(err, ErrStaleEvent) {
					return
				}
				require.NoError(t, err)
				task, err := h.m.Task(k.ID)
				require.NoError(t, err)
				if task.Stop != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	for _, k := range append(kids, root) {
		assert.Equal(t, StatusCancelled, h.wait(k.ID).Status)
	}
	s := budgetOf(t, h.m, root.ID)
	over := s.Spent.Tokens() - limit
	t.Logf("spent %d of %d: overrun %d tokens (bound: %d runs × %d)", s.Spent.Tokens(), limit, over, children+1, report)
	assert.GreaterOrEqual(t, over, int64(0))
	assert.LessOrEqual(t, over, int64((children+1)*report), "spent ≤ limit + what was in flight at the crossing")
}

// A child's budget is a grant clamped by what every budget above it has
// left at its launch; usage counts against all of them.
func TestAChildsGrantIsClampedByWhatItsParentHasLeft(t *testing.T) {
	h := newHarness(t, nil)
	root := h.running("chat", withBudget(Budget{Tokens: 1000, Cost: CostUnit, Spawns: 5}))
	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionUsage, Usage: u(700, 0, 0, 0)}))
	child := h.running(root.SessionID, withBudget(Budget{Tokens: 500, Requests: 7}))
	s := budgetOf(t, h.m, child.ID)
	assert.Equal(t, child.ID, s.TaskID)
	assert.Equal(t, Budget{Tokens: 300, Cost: CostUnit, Requests: 7, Spawns: 4}, s.Limit,
		"tokens clamped to the 300 left; cost and spawns, unasked, granted what was left; requests, unlimited above, as asked")
	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionUsage, Usage: u(200, 50, 1, 0)}))
	s = budgetOf(t, h.m, child.ID)
	assert.Equal(t, int64(50), s.Left.Tokens, "min(300-250, 1000-950)")
	assert.Equal(t, int64(950), budgetOf(t, h.m, root.ID).Spent.Tokens(), "the root's counts the child's")
	grand := h.running(child.SessionID, withBudget(Budget{Tokens: 1000}))
	assert.Equal(t, int64(50), budgetOf(t, h.m, grand.ID).Limit.Tokens)
}

// A child's grant spent stops that child's branch only; its parent and
// siblings go on, and a launch beneath the child is refused naming it.
func TestASpentGrantStopsOnlyItsBranch(t *testing.T) {
	ctx := testCtx(t)
	h := newHarness(t, nil)
	root := h.running("chat", withBudget(Budget{Tokens: 10_000}))
	child := h.running(root.SessionID, withBudget(Budget{Tokens: 300}))
	grand := h.running(child.SessionID)
	sibling := h.running(root.SessionID)
	require.NoError(t, h.observe(Event{SessionID: grand.SessionID, Kind: SessionUsage, Usage: u(300, 0, 0, 0)}))
	assert.Equal(t, StatusCancelled, h.wait(child.ID).Status)
	assert.Equal(t, StatusCancelled, h.wait(grand.ID).Status)
	assert.Equal(t, StopCause{Kind: StopBudget, TaskID: child.ID, Limit: LimitTokens}, *h.task(grand.ID).Stop)
	assert.Equal(t, StatusRunning, h.task(root.ID).Status)
	assert.Equal(t, StatusRunning, h.task(sibling.ID).Status)
	_, err := h.m.Launch(ctx, Spec{ParentSessionID: grand.SessionID, Prompt: "p", Models: oneModel})
	var be *BudgetError
	require.ErrorAs(t, err, &be)
	assert.Equal(t, child.ID, be.TaskID)
	h.running(root.SessionID) // the root's budget has room
}

// A task that continues an ended task's session (ContinueFrom) spends
// from that task's budget: its grant, kept whole with what was spent of
// it, never what was left elsewhere nor a fresh one; reaching it stops
// the continuation too.
func TestAResumedChildKeepsItsGrant(t *testing.T) {
	ctx := testCtx(t)
	host := &resumeHost{testHost: &testHost{}}
	h := harnessOn(t, host, host.testHost)
	root := h.running("chat", withBudget(Budget{Tokens: 1000, SoftPercent: 100}))
	child := h.running(root.SessionID, withBudget(Budget{Tokens: 400, SoftPercent: 100}))
	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionIdle, Text: "draft", Usage: u(300, 0, 0, 0)}))
	h.wait(child.ID)
	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionUsage, Usage: u(500, 0, 0, 0)}))

	next, err := h.m.Launch(ctx, Spec{ParentSessionID: root.SessionID, Prompt: "polish", ContinueFrom: child.ID, Models: oneModel})
	require.NoError(t, err)
	next = waitStatus(t, h.m, next.ID, StatusRunning)
	assert.Equal(t, child.SessionID, next.SessionID, "the same session")
	s := budgetOf(t, h.m, next.ID)
	assert.Equal(t, child.ID, s.TaskID, "the continued task's budget")
	assert.Equal(t, int64(400), s.Limit.Tokens, "its grant, whole")
	assert.Equal(t, int64(300), s.Spent.Tokens(), "with what was spent of it")
	assert.Equal(t, int64(100), s.Left.Tokens)

	require.NoError(t, h.observe(Event{SessionID: next.SessionID, Kind: SessionBusy, Usage: u(100, 0, 0, 0)}))
	end := h.wait(next.ID)
	assert.Equal(t, StatusCancelled, end.Status)
	assert.Equal(t, StopCause{Kind: StopBudget, TaskID: child.ID, Limit: LimitTokens}, *end.Stop)
	assert.Equal(t, int64(900), budgetOf(t, h.m, root.ID).Spent.Tokens())
	assert.Equal(t, StatusRunning, h.task(root.ID).Status)
}

// A restart between a reservation and its start, and a restart after
// every record of a budgeted tree's life: replay gives back exactly the
// spent, reserved and granted figures the records say.
func TestARestartRestoresSpentReservedAndGranted(t *testing.T) {
	ctx := testCtx(t)
	hold := make(chan struct{})
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.Prompt == "held" {
			select {
			case <-hold:
			case <-ctx.Done():
			}
			return "", ctx.Err()
		}
		return sid, nil
	}}
	j := &memJournal{}
	m, err := Open(ctx, host, WithJournal(j), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	root, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "r", Models: oneModel, Budget: &Budget{Tokens: 5000, Spawns: 3}})
	require.NoError(t, err)
	rs := waitStatus(t, m, root.ID, StatusRunning).SessionID
	child, err := m.Launch(ctx, Spec{ParentSessionID: rs, Prompt: "c", Models: oneModel, Budget: &Budget{Tokens: 2000}})
	require.NoError(t, err)
	cs := waitStatus(t, m, child.ID, StatusRunning).SessionID
	require.NoError(t, m.Observe(Event{SessionID: cs, Kind: SessionUsage, Usage: u(1200, 300, 4, 700)}))
	require.NoError(t, m.Observe(Event{SessionID: rs, Kind: SessionUsage, Usage: u(100, 0, 1, 0)}))
	held, err := m.Launch(ctx, Spec{ParentSessionID: cs, Prompt: "held", Models: oneModel})
	require.NoError(t, err)
	waitFor(t, m, held.ID, func(t Task) bool { return t.Pending == PendingAwaitingSession })
	want := map[string]BudgetState{}
	for _, id := range []string{root.ID, child.ID, held.ID} {
		want[id] = budgetOf(t, m, id)
	}
	assert.Equal(t, int64(1), want[root.ID].Reserved, "the held start's reservation")
	assert.Equal(t, int64(1), want[root.ID].Spawned)
	j.mu.Lock()
	j.crashed = true // the process dies between the reservation and its start
	recs := cloneRecords(j.recs)
	j.mu.Unlock()
	close(hold)
	require.NoError(t, m.Shutdown(ctx))

	// Replayed alone, after every record: the figures are the records'.
	for k := 1; k <= len(recs); k++ {
		l, _, err := replayLedger(decodeAll(t, recs[:k]))
		require.NoError(t, err, "after record %d", k)
		for _, e := range l.tasks {
			if e.acct != nil && e.acct.bud != nil && e.acct.bud.owner == e {
				s := e.acct.bud.state()
				assert.GreaterOrEqual(t, s.Spawned+s.Reserved, int64(0))
				assert.LessOrEqual(t, s.Spawned+s.Reserved, s.Limit.Spawns+boolInt(s.Limit.Spawns == 0)*100, "after record %d", k)
			}
		}
	}
	// Restarted on all of it, with a host that answers no start: the
	// figures come back as they were; the held launch is still reserved
	// until its start is settled.
	m2, err := Open(ctx, &testHost{start: func(context.Context, SessionRequest, string) (string, error) {
		return "", errors.New("503 unavailable")
	}}, WithJournal(&memJournal{recs: recs}), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	for _, id := range []string{root.ID, child.ID} {
		got := budgetOf(t, m2, id)
		assert.Equal(t, want[id].Limit, got.Limit, "task %s keeps its grant", id)
		assert.Equal(t, want[id].Spent, got.Spent, "task %s: spent, no refund, no double count", id)
		assert.Equal(t, want[id].Spawned, got.Spawned, "task %s", id)
	}
	end, err := m2.Wait(ctx, held.ID)
	require.NoError(t, err)
	assert.Empty(t, end.SessionID, "its session never ran (%s)", end.Status)
	got := budgetOf(t, m2, root.ID)
	assert.Equal(t, int64(0), got.Reserved, "and its reservation went back")
	assert.Equal(t, want[root.ID].Spawned, got.Spawned)
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// decodeAll decodes what a journal keeps.
func decodeAll(t *testing.T, recs []Record) []record {
	t.Helper()
	out := make([]record, len(recs))
	for i, r := range recs {
		var err error
		out[i], err = decodeRecord(r)
		require.NoError(t, err)
	}
	return out
}

// WithBudget gives every root launch its budget; a child of a budgeted
// task gets no second one.
func TestWithBudgetGivesEveryRootItsBudget(t *testing.T) {
	h := newHarness(t, nil, WithBudget(Budget{Requests: 3}))
	a := h.running("chat")
	b := h.running("chat")
	kid := h.running(a.SessionID)
	assert.Equal(t, a.ID, budgetOf(t, h.m, a.ID).TaskID)
	assert.Equal(t, b.ID, budgetOf(t, h.m, b.ID).TaskID, "each root its own")
	assert.Equal(t, a.ID, budgetOf(t, h.m, kid.ID).TaskID, "a child spends from its root's")
	m, err := Open(context.Background(), &testHost{}, WithBudget(Budget{Tokens: -1}))
	require.ErrorIs(t, err, ErrInvalidArgument, "Open refuses a bad option at once")
	require.Nil(t, m)
}

func TestABudgetWithANegativeLimitIsRefused(t *testing.T) {
	h := newHarness(t, nil)
	for _, b := range []Budget{{Tokens: -1}, {Cost: -1}, {Requests: -1}, {Spawns: -1}, {SoftPercent: -5}} {
		_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: oneModel, Budget: &b})
		var se *SpecError
		require.ErrorAs(t, err, &se, "%+v", b)
		assert.True(t, strings.HasPrefix(se.Field, "Budget"))
	}
}

// The parent model reads what the tree spent and has left: in a running
// task's receipt, in the ended task's envelope, and TaskProtocol says
// what the notice means.
func TestTheEnvelopeCarriesTheBudgetNotice(t *testing.T) {
	h := newHarness(t, nil)
	root := h.running("chat", withBudget(Budget{Tokens: 1000, Cost: 2 * CostUnit, Spawns: 4}))
	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionUsage, Usage: u(100, 20, 2, CostUnit/2)}))
	receipt := Envelope(h.task(root.ID))
	assert.Contains(t, receipt, "<task_notice>budget: Spent: 120 of 1000 tokens, 0.50 of 2.00 cost, 2 requests, 0 of 4 spawns. Left: 880 tokens, 1.50 cost, 4 spawns.</task_notice>")
	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionIdle, Text: "done"}))
	end := h.wait(root.ID)
	assert.Contains(t, end.Outcome.Envelope, "<task_notice>budget: Spent: 120 of 1000 tokens")
	assert.Contains(t, TaskProtocol, `"budget:"`)
	for _, n := range end.Outcome.Notices {
		assert.LessOrEqual(t, len([]rune(n)), maxNoticeRunes+40, "one bounded line")
	}
	plain := h.running("chat2")
	assert.NotContains(t, Envelope(h.task(plain.ID)), "budget", "no budget: the seed's receipt")
}

// The stop cause survives the ledger's note.
func TestStopCauseBudgetRoundTrips(t *testing.T) {
	c := StopCause{Kind: StopBudget, TaskID: "task of 7", Limit: LimitCost}
	assert.Equal(t, c, stopCauseOf(c.note()))
	assert.Equal(t, "the budget of task task of 7 ran out of cost", c.String())
}

// A compaction keeps what every attempt used and every grant: a restart
// on the compacted journal has the same figures.
func TestUsageAndBudgetsSurviveACompaction(t *testing.T) {
	ctx := testCtx(t)
	j := &memJournal{}
	m, err := Open(ctx, &testHost{}, WithJournal(j), WithIDs(SequentialIDs()), WithRetryDelay(func(int, error) time.Duration { return 0 }))
	require.NoError(t, err)
	root, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "r", Models: mustModels(t, "a/1", "b/2"), Budget: &Budget{Tokens: 50_000, Spawns: 5}})
	require.NoError(t, err)
	rs := waitStatus(t, m, root.ID, StatusRunning).SessionID
	require.NoError(t, m.Observe(Event{SessionID: rs, Kind: SessionError, Err: errors.New("429 rate limited"), Usage: u(300, 20, 1, 100)}))
	rs = waitFor(t, m, root.ID, func(t Task) bool { return len(t.Attempts) == 2 && t.Status == StatusRunning }).SessionID
	child, err := m.Launch(ctx, Spec{ParentSessionID: rs, Prompt: "c", Models: oneModel, Budget: &Budget{Tokens: 9000}})
	require.NoError(t, err)
	cs := waitStatus(t, m, child.ID, StatusRunning).SessionID
	require.NoError(t, m.Observe(Event{SessionID: cs, Kind: SessionIdle, Text: "done", Usage: u(4000, 500, 3, 7000)}))
	_, err = m.Wait(ctx, child.ID)
	require.NoError(t, err)
	require.NoError(t, m.Observe(Event{SessionID: cs, Kind: SessionUsage, Usage: u(10, 0, 0, 0)}), "late, after the end")
	require.NoError(t, m.Observe(Event{SessionID: rs, Kind: SessionUsage, Usage: u(70, 7, 1, 0)}))
	wantTasks := map[string]Task{}
	wantBudgets := map[string]BudgetState{}
	for _, id := range []string{root.ID, child.ID} {
		wantTasks[id], err = m.Task(id)
		require.NoError(t, err)
		wantBudgets[id] = budgetOf(t, m, id)
	}
	m.mu.Lock()
	m.led.forgotten += compactEvery
	m.mu.Unlock()
	m.maybeCompact()
	j.mu.Lock()
	compacted := len(j.recs) > 0 && j.recs[0].Kind == recTaskLaunched.String() // a snapshot, not the life's first epoch
	recs := cloneRecords(j.recs)
	j.crashed = true
	j.mu.Unlock()
	require.True(t, compacted)
	require.NoError(t, m.Shutdown(ctx))

	m2, err := Open(ctx, &testHost{}, WithJournal(&memJournal{recs: recs}), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	for _, id := range []string{root.ID, child.ID} {
		got, err := m2.Task(id)
		require.NoError(t, err)
		assert.Equal(t, wantTasks[id].Usage, got.Usage, "task %s: each attempt's usage", id)
		gb := budgetOf(t, m2, id)
		assert.Equal(t, wantBudgets[id].Limit, gb.Limit, "task %s: its grant", id)
		assert.Equal(t, wantBudgets[id].Spent, gb.Spent, "task %s: spent", id)
		assert.Equal(t, wantBudgets[id].Spawned, gb.Spawned, "task %s: spawned", id)
	}
}

// Retention forgets the ended tasks of a budgeted tree as it forgets any
// (the task holding the budget stays while its tree lives, or a task in
// memory names it); what they spent stays in the budget, and a
// compaction carries it, so a restart refunds nothing.
func TestRetentionForgetsABudgetedTreesTasksAndTheBudgetKeepsTheirSpend(t *testing.T) {
	ctx := testCtx(t)
	j := &memJournal{}
	m, err := Open(ctx, &testHost{}, WithJournal(j), WithIDs(SequentialIDs()), WithRetention(Retention{MaxEnded: 1}))
	require.NoError(t, err)
	run := func(parent string, b *Budget) Task {
		t.Helper()
		task, err := m.Launch(ctx, Spec{ParentSessionID: parent, Prompt: "p", Models: oneModel, Budget: b})
		require.NoError(t, err)
		return waitStatus(t, m, task.ID, StatusRunning)
	}
	end := func(task Task, tokens int64) {
		t.Helper()
		require.NoError(t, m.Observe(Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "done", Usage: u(tokens, 0, 1, 0)}))
		if _, err := m.Wait(ctx, task.ID); !errors.Is(err, ErrForgotten) {
			require.NoError(t, err)
		}
		require.NoError(t, m.notes.lanes.Wait(ctx))
	}
	root := run("chat", &Budget{Tokens: 100_000, Spawns: 10})
	for range 3 {
		kid := run(root.SessionID, nil)
		end(kid, 300)
	}
	for i := range 3 {
		end(run(fmt.Sprintf("other-%d", i), nil), 1)
	}
	page, err := m.Tasks(Query{Parent: root.SessionID})
	require.NoError(t, err)
	require.Less(t, len(page.Tasks), 3, "retention forgot some of the root's children")
	_, err = m.Task(root.ID)
	require.NoError(t, err, "the task holding the budget stays while its tree lives")
	s := budgetOf(t, m, root.ID)
	assert.Equal(t, int64(900), s.Spent.Tokens())
	assert.Equal(t, int64(3), s.Spawned)
	m.mu.Lock()
	m.led.forgotten += compactEvery
	m.mu.Unlock()
	m.maybeCompact()
	j.mu.Lock()
	recs := cloneRecords(j.recs)
	j.crashed = true
	j.mu.Unlock()
	require.NoError(t, m.Shutdown(ctx))
	m2, err := Open(ctx, &testHost{}, WithJournal(&memJournal{recs: recs}), WithIDs(SequentialIDs()), WithRetention(Retention{MaxEnded: 1}))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	s2 := budgetOf(t, m2, root.ID)
	assert.Equal(t, s.Spent, s2.Spent, "no refund: the compaction carried what the forgotten spent")
	assert.Equal(t, s.Spawned, s2.Spawned)
}

// A child launched from its parent's session before the parent's start
// returned (the session is not bound yet) is in no budget of the
// parent's: the launch could not know the tree. What the launch resolved
// is recorded, so a replay — after a compaction too, whose records come
// in another order — links it as it ran: nothing moves.
func TestALaunchFromASessionNotYetBoundReplaysAsItRan(t *testing.T) {
	ctx := testCtx(t)
	var m *Manager
	var child atomic.Value
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.Prompt == "root" { // the session launches a child before StartSession returns
			c, err := m.Launch(ctx, Spec{ParentSessionID: sid, Prompt: "early", Models: oneModel})
			if err != nil {
				return "", err
			}
			child.Store(c)
		}
		return sid, nil
	}}
	j := &memJournal{}
	var err error
	m, err = Open(ctx, host, WithJournal(j), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	root, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "root", Models: oneModel, Budget: &Budget{Tokens: 100}})
	require.NoError(t, err)
	waitStatus(t, m, root.ID, StatusRunning)
	c := child.Load().(Task)
	cs := waitStatus(t, m, c.ID, StatusRunning).SessionID
	require.NoError(t, m.Observe(Event{SessionID: cs, Kind: SessionUsage, Usage: u(500, 0, 1, 0)}))
	before := budgetOf(t, m, root.ID)
	assert.Zero(t, before.Spent.Tokens(), "the early child is not in the root's budget")
	_, inBudget, err := m.Budget(c.ID)
	require.NoError(t, err)
	assert.False(t, inBudget)
	m.mu.Lock()
	m.led.forgotten += compactEvery
	m.mu.Unlock()
	m.maybeCompact()
	j.mu.Lock()
	recs := cloneRecords(j.recs)
	j.crashed = true
	j.mu.Unlock()
	require.NoError(t, m.Shutdown(ctx))
	m2, err := Open(ctx, &testHost{}, WithJournal(&memJournal{recs: recs}), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	after := budgetOf(t, m2, root.ID)
	assert.Equal(t, before.Spent, after.Spent, "no budget moved by the replay's order")
	assert.Empty(t, after.Exceeded)
	_, inBudget, err = m2.Budget(c.ID)
	require.NoError(t, err)
	assert.False(t, inBudget)
}

// A task that continues a session spends from the continued task's
// budget, but its spawn counts where it was launched: resuming a child
// whose grant has no spawn left is no spawn of that grant. A session
// carries its grant into no other tree.
func TestAContinuationSpawnsUnderItsParentAndStaysInItsTree(t *testing.T) {
	ctx := testCtx(t)
	host := &resumeHost{testHost: &testHost{}}
	h := harnessOn(t, host, host.testHost)
	root := h.running("chat", withBudget(Budget{Tokens: 10_000, SoftPercent: 100}))
	child := h.running(root.SessionID, withBudget(Budget{Tokens: 2000, Spawns: 1, SoftPercent: 100}))
	grand := h.running(child.SessionID)
	require.NoError(t, h.observe(Event{SessionID: grand.SessionID, Kind: SessionIdle, Text: "g"}))
	h.wait(grand.ID)
	require.NoError(t, h.m.notes.lanes.Wait(ctx))
	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionIdle, Text: "c"}))
	h.wait(child.ID)
	assert.Equal(t, int64(0), budgetOf(t, h.m, child.ID).Left.Spawns, "the child's grant has no spawn left")

	next, err := h.m.Launch(ctx, Spec{ParentSessionID: root.SessionID, Prompt: "again", ContinueFrom: child.ID, Models: oneModel})
	require.NoError(t, err, "a resume is no spawn of the grant it resumes")
	assert.Equal(t, child.ID, budgetOf(t, h.m, next.ID).TaskID)
	rs := budgetOf(t, h.m, root.ID)
	assert.Equal(t, int64(3), rs.Spawned+rs.Reserved, "the root counts the child, the grandchild and the continuation")

	other := h.running("chat-2", withBudget(Budget{Tokens: 500}))
	_, err = h.m.Launch(ctx, Spec{ParentSessionID: other.SessionID, Prompt: "steal", ContinueFrom: grand.ID, Models: oneModel})
	var se *SpecError
	require.ErrorAs(t, err, &se, "another tree's session is not resumed under this one's budget")
	assert.Equal(t, "ContinueFrom", se.Field)
}
