package bgtask

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func u(in, out, req int64, cost Cost) Usage {
	return Usage{InputTokens: in, OutputTokens: out, Requests: req, Cost: cost}
}

// Usage rides any event as a delta: counted for the attempt that did the
// work, summed per task and per tree, shown in the Timeline in one line,
// and replayed exactly.
func TestUsageIsCountedPerAttemptTaskAndTree(t *testing.T) {
	h := newHarness(t, nil, WithRetryDelay(func(int, error) time.Duration { return 0 }))
	root := h.running("chat")
	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionBusy, Usage: u(100, 10, 1, 1500)}))
	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionError, Err: errors.New("429 rate limited"), Usage: u(50, 0, 1, 500)}))
	second := waitFor(t, h.m, root.ID, func(t Task) bool { return len(t.Attempts) == 2 && t.Status == StatusRunning })
	child := h.running(second.SessionID)
	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionUsage, Usage: Usage{InputTokens: 1000, CachedTokens: 800, OutputTokens: 20, Requests: 2, Cost: 2 * CostUnit}}))
	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionIdle, Text: "child done"}))
	h.wait(child.ID)
	require.NoError(t, h.m.notes.lanes.Wait(testCtx(t))) // its summary reached the root: the root's next turn is its answer
	require.NoError(t, h.observe(Event{SessionID: second.SessionID, Kind: SessionIdle, Text: "done", Usage: u(7, 3, 1, 0)}))

	got := h.task(root.ID)
	require.NotNil(t, got.Usage)
	assert.Equal(t, []Usage{u(150, 10, 2, 2000), u(7, 3, 1, 0)}, got.Usage.ByAttempt, "each attempt's own")
	assert.Equal(t, u(157, 13, 3, 2000), got.Usage.Total)
	assert.Equal(t, int64(170), got.Usage.Total.Tokens())
	tree, err := h.m.TreeUsage(root.ID)
	require.NoError(t, err)
	assert.Equal(t, Usage{InputTokens: 1157, OutputTokens: 33, CachedTokens: 800, Requests: 5, Cost: 2*CostUnit + 2000}, tree, "the tree: the root and its child")
	assert.Nil(t, h.task(child.ID).Budget, "no budget: none shown")

	h.wait(root.ID)
	timeline := Timeline(h.task(root.ID))
	assert.True(t, strings.HasSuffix(timeline, "\nUsage: 170 tokens (157 in, 13 out), 3 requests, cost 0.002"), timeline)
	assert.Equal(t, 1, strings.Count(timeline, "Usage:"), "one line")
	plain := h.running("chat2")
	require.NoError(t, h.observe(Event{SessionID: plain.SessionID, Kind: SessionIdle, Text: "x"}))
	assert.NotContains(t, Timeline(h.wait(plain.ID)), "Usage", "a task that reported none: the seed's timeline, unchanged")
	assert.Nil(t, h.task(plain.ID).Usage)

	replaysAlike(t, h.m)
}

// A stale event's usage counts for the attempt that did the work and
// moves nothing else; one that contradicts its attempt counts nowhere.
func TestAStaleEventsUsageCountsForTheAttemptThatDidTheWork(t *testing.T) {
	h := newHarness(t, nil, WithRetryDelay(func(int, error) time.Duration { return 0 }))
	task := h.running("chat")
	first := task.Current()
	require.NoError(t, h.observe(Event{SessionID: first.SessionID, Kind: SessionError, Err: errors.New("529 overloaded")}))
	now := waitFor(t, h.m, task.ID, func(t Task) bool { return len(t.Attempts) == 2 && t.Status == StatusRunning })
	rev := now.Revision

	// The old session's late idle carries usage: stale, but counted for attempt 1.
	err := h.observe(Event{SessionID: first.SessionID, Kind: SessionIdle, Text: "late answer", Usage: u(40, 4, 1, 100)})
	require.ErrorIs(t, err, ErrStaleEvent)
	after := h.task(task.ID)
	assert.Equal(t, StatusRunning, after.Status, "the task did not move")
	assert.Equal(t, now.CurrentAttemptID, after.CurrentAttemptID)
	assert.Empty(t, after.Result)
	assert.Equal(t, []Usage{u(40, 4, 1, 100), {}}, after.Usage.ByAttempt, "counted for attempt 1, which did the work")
	assert.Equal(t, rev+1, after.Revision, "the usage is the one change")

	// A usage report by attempt id for the old attempt is no error.
	require.NoError(t, h.observe(Event{AttemptID: first.ID, Kind: SessionUsage, Usage: u(1, 0, 0, 0)}))
	// One whose token contradicts its attempt counts nowhere.
	err = h.observe(Event{AttemptID: first.ID, Token: now.Current().Token, Kind: SessionUsage, Usage: u(1000, 0, 0, 0)})
	require.ErrorIs(t, err, ErrStaleEvent)
	assert.Equal(t, u(41, 4, 1, 100), h.task(task.ID).Usage.ByAttempt[0])
	assert.Equal(t, u(41, 4, 1, 100), h.task(task.ID).Usage.Total)

	// A stale event with no usage changes nothing at all.
	rev = h.task(task.ID).Revision
	require.ErrorIs(t, h.observe(Event{SessionID: first.SessionID, Kind: SessionBusy}), ErrStaleEvent)
	assert.Equal(t, rev, h.task(task.ID).Revision)
}

func TestUsageWithANegativeFigureIsRefused(t *testing.T) {
	h := newHarness(t, nil)
	task := h.running("chat")
	for _, bad := range []Usage{{InputTokens: -1}, {OutputTokens: -1}, {CachedTokens: -1}, {Requests: -1}, {Cost: -1}} {
		err := h.observe(Event{SessionID: task.SessionID, Kind: SessionUsage, Usage: bad})
		require.ErrorIs(t, err, ErrInvalidArgument, "%+v", bad)
	}
	assert.Nil(t, h.task(task.ID).Usage, "nothing counted")
}

// Sums saturate instead of wrapping: a hostile host cannot make spent
// negative and so refund a budget.
func TestUsageSumsSaturate(t *testing.T) {
	big := Usage{InputTokens: math.MaxInt64, OutputTokens: math.MaxInt64, Requests: math.MaxInt64, Cost: Cost(math.MaxInt64)}
	sum := big.Add(big)
	assert.Equal(t, int64(math.MaxInt64), sum.InputTokens)
	assert.Equal(t, int64(math.MaxInt64), sum.Tokens())
	assert.Equal(t, Cost(math.MaxInt64), sum.Cost)
}

func TestCostString(t *testing.T) {
	for c, want := range map[Cost]string{0: "0.00", CostUnit: "1.00", 1_500_000: "1.50", 125: "0.000125", 12_345_678: "12.345678", -CostUnit / 2: "-0.50"} {
		assert.Equal(t, want, c.String(), "%d", int64(c))
	}
}

// An in-process function reports usage with Run.Usage; what it reports
// after it was asked to stop still counts.
func TestRunUsageCountsAlsoAfterTheStop(t *testing.T) {
	ctx := testCtx(t)
	stopped := make(chan error, 1)
	m := mustOpen(NewFuncHost(func(ctx context.Context, run Run) (string, error) {
		if err := run.Usage(u(10, 5, 1, 0)); err != nil {
			return "", err
		}
		<-ctx.Done()
		stopped <- run.Usage(u(3, 0, 1, 0)) // the call in flight when it was stopped
		return "", ctx.Err()
	}), WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	waitFor(t, m, task.ID, func(t Task) bool { return t.Usage != nil })
	require.NoError(t, stopErr(m.Stop(ctx, Target{Task: task.ID})))
	require.NoError(t, recv(t, stopped, "the function's usage report after its stop"))
	end, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusCancelled, end.Status)
	got := waitFor(t, m, task.ID, func(t Task) bool { return t.Usage.Total.Requests == 2 })
	assert.Equal(t, u(13, 5, 2, 0), got.Usage.Total)
	assert.Error(t, Run{}.Usage(Usage{}), "a Run no FuncHost made")
}
