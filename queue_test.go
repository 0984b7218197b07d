package bgtask

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func (h *harness) launchOn(models ...string) Task {
	h.t.Helper()
	return h.launchSpec(Spec{ParentSessionID: "p", Models: mustModels(h.t, models...)})
}

func (h *harness) finish(id string) {
	h.t.Helper()
	task := h.task(id)
	require.Equal(h.t, StatusRunning, task.Status, "task %s", id)
	require.NoError(h.t, h.observe(Event{SessionID: task.SessionID, Kind: SessionIdle}))
	h.settle()
}

// until waits, on the Manager's change signal, until cond holds.
func (h *harness) until(cond func() bool) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		h.m.mu.Lock()
		wait := h.m.waitAny()
		h.m.unlock()
		if cond() {
			return
		}
		select {
		case <-wait:
		case <-ctx.Done():
			h.t.Fatal("condition not reached")
		}
	}
}

// waitTimers waits until the fake clock has made at least n timers.
func (h *harness) waitTimers(n int) {
	h.t.Helper()
	for {
		made, next := h.clock.Created()
		if made >= n {
			return
		}
		recv(h.t, next, "the fake clock's timer %d", n)
	}
}

func TestQueueIsFIFOPerKey(t *testing.T) {
	needRecords(t)
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1}))
	a, b, c := h.launchOn("m/x"), h.launchOn("m/x"), h.launchOn("m/x")
	other := h.launchOn("m/y") // another key is not held up
	h.settle()
	assert.Equal(t, StatusRunning, h.task(a.ID).Status)
	assert.Equal(t, StatusRunning, h.task(other.ID).Status)
	for _, id := range []string{b.ID, c.ID} {
		got := h.task(id)
		assert.Equal(t, StatusPending, got.Status)
		assert.Equal(t, PendingQueued, got.Pending)
	}
	assert.Equal(t, []QueueStat{
		{Key: "model:m/x", Running: 1, Queued: 2, Limit: 1},
		{Key: "model:m/y", Running: 1, Queued: 0, Limit: 1},
	}, h.m.Snapshot().Queues)

	h.finish(a.ID)
	assert.Equal(t, StatusRunning, h.task(b.ID).Status, "first queued, first served")
	assert.Equal(t, PendingQueued, h.task(c.ID).Pending)
	h.finish(b.ID)
	assert.Equal(t, StatusRunning, h.task(c.ID).Status)
	h.finish(c.ID)
	h.finish(other.ID)
	assert.Empty(t, h.m.Snapshot().Queues)

	// A queued attempt went queued → awaiting session → running.
	h.m.mu.Lock()
	var reasons []PendingReason
	for _, r := range recordsOf(h.m.led, c.ID) {
		if r.kind == recAttemptCreated || r.kind == recAttemptPending {
			reasons = append(reasons, r.attempt.Pending)
		}
	}
	h.m.unlock()
	assert.Equal(t, []PendingReason{PendingAwaitingSession, PendingQueued, PendingAwaitingSession}, reasons)
}

func TestLimitPrecedenceModelThenProviderThenDefault(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{
		Models:    map[string]int{"a/x": 1},
		Providers: map[string]int{"a": 2},
		Default:   3,
	}))
	for range 2 {
		h.launchOn("a/x") // its own limit of 1
	}
	for range 2 {
		h.launchOn("a/y") // the provider's shared limit of 2 …
		h.launchOn("a/z") // … with a/z
	}
	for range 4 {
		h.launchOn("b/w") // the default, per model
	}
	h.settle()
	assert.Equal(t, []QueueStat{
		{Key: "model:a/x", Running: 1, Queued: 1, Limit: 1},
		{Key: "model:b/w", Running: 3, Queued: 1, Limit: 3},
		{Key: "provider:a", Running: 2, Queued: 2, Limit: 2},
	}, h.m.Snapshot().Queues)
}

func TestZeroLimitMeansUnlimitedAndNegativeIsAnError(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Models: map[string]int{"a/x": 0}, Default: 1}))
	for range 5 {
		h.launchOn("a/x")
	}
	h.settle()
	assert.Equal(t, []QueueStat{{Key: "model:a/x", Running: 5, Limit: 0}}, h.m.Snapshot().Queues)

	bad, err := Open(context.Background(), &testHost{}, WithModelLimits(ModelLimits{Providers: map[string]int{"a": -1}}))
	require.ErrorIs(t, err, ErrInvalidArgument, "Open refuses it at once")
	require.Nil(t, bad)
	assert.Contains(t, err.Error(), `Providers["a"]`)
}

func TestRetryReleasesItsSlotAndQueuesUnderTheNewKey(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1}))
	t1 := h.launchOn("a/1", "b/2")
	t2 := h.launchOn("b/2") // holds b/2
	t3 := h.launchOn("a/1") // waits for t1's slot on a/1
	h.settle()
	require.Equal(t, PendingQueued, h.task(t3.ID).Pending)

	require.NoError(t, h.observe(Event{SessionID: h.task(t1.ID).SessionID, Kind: SessionError, Err: errRateLimited}))
	h.settle()
	assert.Equal(t, StatusRunning, h.task(t3.ID).Status, "t1's slot on a/1 went to the next in line")
	got := h.task(t1.ID)
	require.Len(t, got.Attempts, 2)
	assert.Equal(t, PendingQueued, got.Pending, "the retry waits behind t2 on b/2")
	assert.Equal(t, []QueueStat{
		{Key: "model:a/1", Running: 1, Queued: 0, Limit: 1},
		{Key: "model:b/2", Running: 1, Queued: 1, Limit: 1},
	}, h.m.Snapshot().Queues)

	h.finish(t2.ID)
	assert.Equal(t, StatusRunning, h.task(t1.ID).Status)
	assert.Equal(t, "b/2", h.task(t1.ID).Model.String())
}

func TestCancelOfQueuedWorkLeavesTheQueueAtOnce(t *testing.T) {
	for _, victim := range []int{0, 1, 2} {
		t.Run([]string{"head", "middle", "tail"}[victim], func(t *testing.T) {
			h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1}))
			running := h.launchOn("m/x")
			var queuedIDs []string
			for range 3 {
				queuedIDs = append(queuedIDs, h.launchOn("m/x").ID)
			}
			h.settle()
			require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: queuedIDs[victim]})))
			assert.Equal(t, StatusCancelled, h.task(queuedIDs[victim]).Status)
			assert.Equal(t, []QueueStat{{Key: "model:m/x", Running: 1, Queued: 2, Limit: 1}}, h.m.Snapshot().Queues)

			h.finish(running.ID)
			for i, id := range queuedIDs {
				if i == victim {
					continue
				}
				assert.Equal(t, StatusRunning, h.task(id).Status, "tasks behind it still start")
				h.finish(id)
			}
			assert.Empty(t, h.m.Snapshot().Queues)
			assert.Len(t, h.host.Starts(), 3, "the cancelled task never started")
		})
	}
}

func TestClosureTakesQueuedWorkOutOfTheQueue(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1}))
	outside := h.launchSpec(Spec{ParentSessionID: "elsewhere", Models: mustModels(t, "m/x")})
	inside := h.launchSpec(Spec{ParentSessionID: "root", Models: mustModels(t, "m/x")})
	after := h.launchSpec(Spec{ParentSessionID: "elsewhere", Models: mustModels(t, "m/x")})
	h.settle()
	_, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.NoError(t, err)
	assert.Equal(t, StatusCancelled, h.task(inside.ID).Status)
	h.finish(outside.ID)
	assert.Equal(t, StatusRunning, h.task(after.ID).Status)
}

func TestQueueTimeoutFreesTheWaiterAndTheNextTaskStarts(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1, QueueTimeout: time.Minute}))
	a := h.launchOn("m/x")
	h.settle()
	made, _ := h.clock.Created()
	b := h.launchOn("m/x")
	h.waitTimers(made + 1) // b's queue timer
	h.clock.Advance(30 * time.Second)
	c := h.launchOn("m/x") // queued later: its own minute is not up
	h.waitTimers(made + 2)
	h.clock.Advance(30 * time.Second)

	got := h.wait(b.ID)
	assert.Equal(t, StatusError, got.Status)
	assert.Contains(t, got.Error, "timed out while queued")
	assert.Contains(t, got.Error, "position 1")
	assert.Contains(t, got.Error, "model:m/x")
	assert.Len(t, got.Attempts, 1, "not retried")
	assert.Equal(t, PendingQueued, h.task(c.ID).Pending)
	assert.Equal(t, []QueueStat{{Key: "model:m/x", Running: 1, Queued: 1, Limit: 1}}, h.m.Snapshot().Queues)

	h.finish(a.ID)
	assert.Equal(t, StatusRunning, h.task(c.ID).Status)
	h.settle()
	assert.Zero(t, h.clock.Pending(), "c's queue timer was stopped when it left the queue")
}

func TestStallTimeoutAbortsAndFallsBack(t *testing.T) {
	h := newHarness(t, nil, WithStallTimeout(30*time.Second))
	task := h.launchOn("a/1", "b/2")
	h.waitTimers(1)
	h.clock.Advance(20 * time.Second)
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionBusy})) // activity resets the clock
	h.clock.Advance(20 * time.Second)
	h.waitTimers(2) // the watcher re-armed for the rest of the window
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "busy 20s ago: not stalled")
	h.clock.Advance(10 * time.Second)
	h.until(func() bool { got := h.task(task.ID); return got.Status == StatusRunning && len(got.Attempts) == 2 })

	got := h.task(task.ID)
	require.Len(t, got.Attempts, 2)
	assert.Equal(t, StatusError, got.Attempts[0].Status)
	assert.Equal(t, "stalled: no activity for 30s", got.Attempts[0].Error)
	assert.Equal(t, StatusRunning, got.Status)
	assert.Equal(t, "ses-2", got.SessionID)
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts(), "aborted through the host, once")
}

func TestStalledRunsTimerCannotTouchItsSuccessor(t *testing.T) {
	h := newHarness(t, nil, WithStallTimeout(30*time.Second))
	task := h.launchOn("a/1", "b/2")
	h.waitTimers(1)
	h.clock.Advance(29 * time.Second)
	// The first run fails on its own just before its stall deadline.
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	h.until(func() bool { return h.task(task.ID).SessionID == "ses-2" })
	h.waitTimers(2)                  // the successor's own watcher
	h.clock.Advance(2 * time.Second) // past the first run's deadline
	got := h.task(task.ID)
	assert.Equal(t, StatusRunning, got.Status, "the old timer did nothing to the new run")
	assert.Len(t, got.Attempts, 2)
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts(), "only the retry's abort of the failed session")
	h.clock.Advance(28 * time.Second) // the successor's own 30s
	assert.Equal(t, StatusError, h.wait(task.ID).Status)
	assert.Equal(t, "stalled: no activity for 30s", h.task(task.ID).Error)
}

func TestStallAbortThatFailsKeepsTheRunAndRetriesLater(t *testing.T) {
	var mu sync.Mutex
	fail := true
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		mu.Lock()
		defer mu.Unlock()
		if fail {
			return fmt.Errorf("cannot abort %s", sid)
		}
		return nil
	}}, WithStallTimeout(10*time.Second))
	task := h.launchOn("a/1")
	h.waitTimers(1)
	h.clock.Advance(10 * time.Second)
	h.waitTimers(2) // the abort failed; the watcher waits another window
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "a failed abort is no evidence")
	assert.Len(t, h.host.Aborts(), 1)
	mu.Lock()
	fail = false
	mu.Unlock()
	h.clock.Advance(10 * time.Second)
	got := h.wait(task.ID)
	assert.Equal(t, StatusError, got.Status)
	assert.True(t, strings.HasPrefix(got.Error, "stalled"), got.Error)
	assert.Len(t, h.host.Aborts(), 2)
}

func TestThousandTasksThroughALimitOfThree(t *testing.T) {
	var m *Manager
	var mu sync.Mutex
	live := map[string]int{}
	peak := map[string]int{}
	var children sync.WaitGroup
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		key := req.Model.String()
		mu.Lock()
		live[key]++
		peak[key] = max(peak[key], live[key])
		mu.Unlock()
		children.Add(1)
		go func() {
			defer children.Done()
			_ = m.Observe(Event{AttemptID: req.AttemptID, Kind: SessionBusy})
			mu.Lock()
			live[key]-- // the child is done before it says so
			mu.Unlock()
			if req.AttemptNumber == 1 && strings.HasSuffix(req.TaskID, "7") {
				_ = m.Observe(Event{AttemptID: req.AttemptID, Kind: SessionError, Err: errRateLimited})
				return
			}
			_ = m.Observe(Event{AttemptID: req.AttemptID, Kind: SessionIdle, Text: "ok"})
		}()
		return sid, nil
	}}
	h := newHarness(t, host, WithModelLimits(ModelLimits{Default: 3}), WithNotifier(nil))
	m = h.m
	var ids []string
	for i := range 1000 {
		models := []string{"a/1", "b/2"}
		if i%2 == 1 {
			models = []string{"b/2", "a/1"}
		}
		ids = append(ids, h.launchOn(models...).ID)
	}
	for _, id := range ids {
		assert.Equal(t, StatusCompleted, h.wait(id).Status)
	}
	children.Wait()
	mu.Lock()
	defer mu.Unlock()
	assert.LessOrEqual(t, peak["a/1"], 3)
	assert.LessOrEqual(t, peak["b/2"], 3)
	if os.Getenv("BGTASK_TEST_JOURNAL") == "" {
		// On a database, each Launch waits for its commit: the loop is
		// slower than a lifecycle, and the limit need not be reached.
		assert.Equal(t, 3, peak["a/1"], "the limit was reached, not avoided")
	}
	assert.Empty(t, h.m.Snapshot().Queues)
}
