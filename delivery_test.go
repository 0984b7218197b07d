package bgtask

import (
	"context"
	"encoding/json"
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

func TestNotificationsForOneParentKeepProductionOrderAcrossTasks(t *testing.T) {
	h := newHarness(t, nil)
	a := h.launch("a/1", "b/2")
	b := h.launch("a/1", "b/2")
	h.settle()
	// Interleave the two tasks' lifecycles.
	require.NoError(t, h.observe(Event{SessionID: h.task(a.ID).SessionID, Kind: SessionError, Err: errRateLimited}))
	require.NoError(t, h.observe(Event{SessionID: h.task(b.ID).SessionID, Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(b.ID).SessionID, Kind: SessionIdle}))
	require.NoError(t, h.observe(Event{SessionID: h.task(a.ID).SessionID, Kind: SessionIdle}))
	h.settle()
	var got []string
	for _, n := range h.rec.All() {
		got = append(got, n.TaskID+":"+string(n.Kind))
	}
	for _, id := range []string{a.ID, b.ID} {
		assert.Equal(t, []NotificationKind{NotifyRetryScheduled, NotifyRetrySessionReady, NotifyFinalSummary}, h.rec.Kinds(id))
	}
	assert.Equal(t, a.ID+":retry_scheduled", got[0], "a failed first")
	// b completed before a, and the round's end comes last.
	assert.Equal(t, []string{b.ID + ":final_summary", a.ID + ":final_summary", ":all_complete"}, got[len(got)-3:])
}

func TestASlowParentDoesNotHoldUpAnother(t *testing.T) {
	block := make(chan struct{})
	defer close(block)
	fastDone := make(chan struct{})
	h := newHarness(t, nil)
	h.rec.hook = func(ctx context.Context, n Notification) error {
		switch {
		case n.ParentSessionID == "slow":
			<-block
		case n.Kind == NotifyAllComplete:
			close(fastDone)
		}
		return nil
	}
	slow := h.launchSpec(Spec{ParentSessionID: "slow", Models: mustModels(t, "a/1")})
	fast := h.launchSpec(Spec{ParentSessionID: "fast", Models: mustModels(t, "a/1")})
	h.until(func() bool { return h.task(slow.ID).Status == StatusRunning && h.task(fast.ID).Status == StatusRunning })
	require.NoError(t, h.observe(Event{SessionID: h.task(slow.ID).SessionID, Kind: SessionIdle}))
	require.NoError(t, h.observe(Event{SessionID: h.task(fast.ID).SessionID, Kind: SessionIdle}))
	select {
	case <-fastDone: // delivered while the slow parent's lane is stuck
	case <-time.After(10 * time.Second): // failure detection only
		t.Fatal("the fast parent was held up by the slow one")
	}
}

func TestRefusedNotificationIsRetriedWithBackoff(t *testing.T) {
	var calls atomic.Int32
	var mu sync.Mutex
	var causes []string
	h := newHarness(t, nil, WithNotifyRetry(3, func(n int, cause error) time.Duration {
		mu.Lock()
		causes = append(causes, fmt.Sprint(n, " ", cause))
		mu.Unlock()
		return time.Duration(n) * time.Second
	}))
	h.rec.hook = func(ctx context.Context, n Notification) error {
		if n.Kind == NotifyFinalSummary && calls.Add(1) < 3 {
			return errors.New("parent session busy")
		}
		return nil
	}
	task := h.launch("a/1")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle}))
	h.waitTimers(1)
	h.clock.Advance(2 * time.Second) // before try 2
	h.waitTimers(2)
	h.clock.Advance(3 * time.Second) // before try 3
	h.settle()
	assert.Equal(t, int32(3), calls.Load())
	assert.Zero(t, h.m.Dropped().NotifyFailures)
	assert.Empty(t, h.m.Dropped().Undelivered)
	mu.Lock()
	assert.Equal(t, []string{"2 parent session busy", "3 parent session busy"}, causes, "the backoff sees each try's number and the Notifier's error")
	mu.Unlock()
	_ = task
}

func TestNotificationRefusedEveryTimeIsKeptAndLaterOnesGoOn(t *testing.T) {
	h := newHarness(t, nil, WithNotifyRetry(2, nil))
	h.rec.hook = func(ctx context.Context, n Notification) error {
		if n.Kind == NotifyRetryScheduled {
			return errors.New("rejected")
		}
		return nil
	}
	task := h.launch("a/1", "b/2")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-2", Kind: SessionIdle}))
	h.wait(task.ID)
	h.settle()
	assert.Equal(t, uint64(1), h.m.Dropped().NotifyFailures)
	lost := h.m.Dropped().Undelivered
	require.Len(t, lost, 1)
	assert.Equal(t, NotifyRetryScheduled, lost[0].Kind)
	kinds := h.rec.Kinds(task.ID)
	assert.Equal(t, NotifyFinalSummary, kinds[len(kinds)-1], "later deliveries went on")
	var logged bool
	for _, r := range h.logs.Records() {
		if r["level"] == "ERROR" && r["msg"] == "notification not delivered" {
			logged = true
		}
	}
	assert.True(t, logged)
	err := h.m.Shutdown(context.Background())
	require.Error(t, err)
	assert.Contains(t, err.Error(), "1 notifications not delivered")
}

func TestSiblingsEndingTogetherYieldExactlyOneAllComplete(t *testing.T) {
	for i := range 50 {
		h := newHarness(t, nil)
		a := h.launch("a/1")
		b := h.launch("a/1")
		h.settle()
		var wg sync.WaitGroup
		for _, id := range []string{a.ID, b.ID} {
			sid := h.task(id).SessionID
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = h.m.Observe(Event{SessionID: sid, Kind: SessionIdle})
			}()
		}
		wg.Wait()
		h.settle()
		n := 0
		for _, x := range h.rec.All() {
			if x.Kind == NotifyAllComplete {
				n++
			}
		}
		require.Equal(t, 1, n, "iteration %d", i)
		require.NoError(t, h.m.Shutdown(context.Background()))
	}
}

func TestAllCompleteListsFailuresFirstWithTimelinesAndStartsNewRounds(t *testing.T) {
	h := newHarness(t, nil)
	ok := h.launchSpec(Spec{ParentSessionID: "p", Description: "fine", Models: mustModels(t, "a/1")})
	bad := h.launchSpec(Spec{ParentSessionID: "p", Description: "doomed", Models: mustModels(t, "a/1", "b/2")})
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(ok.ID).SessionID, Kind: SessionIdle, Text: "yes"}))
	require.NoError(t, h.observe(Event{SessionID: h.task(bad.ID).SessionID, Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(bad.ID).SessionID, Kind: SessionError, Err: errors.New("context_length_exceeded")}))
	h.wait(bad.ID)
	h.settle()
	var all []Notification
	for _, n := range h.rec.All() {
		if n.Kind == NotifyAllComplete {
			all = append(all, n)
		}
	}
	require.Len(t, all, 1)
	n := all[0]
	require.Len(t, n.Tasks, 2)
	assert.Equal(t, bad.ID, n.Tasks[0].ID, "failures first")
	assert.Equal(t, ok.ID, n.Tasks[1].ID)
	assert.NotNil(t, n.Tasks[0].Outcome)
	assert.Contains(t, n.Text, "1 failed, 1 completed")
	assert.Contains(t, n.Text, bad.ID+" — ERROR (context_overflow) — doomed")
	assert.Contains(t, n.Text, "  Background task attempts:", "the multi-attempt task's timeline")
	assert.Equal(t, 1, strings.Count(n.Text, "Background task attempts:"), "only for multi-attempt tasks")

	// A task launched later under the same parent starts a new round.
	later := h.launchSpec(Spec{ParentSessionID: "p", Models: mustModels(t, "a/1")})
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(later.ID).SessionID, Kind: SessionIdle}))
	h.wait(later.ID)
	h.settle()
	var rounds []Notification
	for _, n := range h.rec.All() {
		if n.Kind == NotifyAllComplete {
			rounds = append(rounds, n)
		}
	}
	require.Len(t, rounds, 2)
	require.Len(t, rounds[1].Tasks, 1)
	assert.Equal(t, later.ID, rounds[1].Tasks[0].ID)
}

func TestSubscribeDeliversEveryChangeInSequence(t *testing.T) {
	h := newHarness(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	sub, err := h.m.Subscribe(ctx, 0)
	require.NoError(t, err)
	task := h.launch("a/1", "b/2")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionBusy}))
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-2", Kind: SessionIdle}))
	h.wait(task.ID)
	snap := h.m.Snapshot()
	cancel()
	changes := recvAll(t, sub.C, "the subscription to end with its context")
	assert.ErrorIs(t, sub.Err(), context.Canceled)
	require.NotEmpty(t, changes)
	for i := 1; i < len(changes); i++ {
		assert.Equal(t, changes[i-1].Seq+1, changes[i].Seq, "every mutation, in order")
		assert.GreaterOrEqual(t, changes[i].Task.Revision, changes[i-1].Task.Revision)
	}
	last := changes[len(changes)-1]
	assert.Equal(t, snap.Seq, last.Seq)
	assert.Equal(t, snap.Tasks[0], last.Task, "the last change is the snapshot's state")
	var sawGenerating bool
	for _, c := range changes {
		if c.Task.Activity == ActivityGenerating {
			sawGenerating = true
		}
	}
	assert.True(t, sawGenerating)
}

func TestSlowSubscriberIsToldItLaggedAndNeverBlocks(t *testing.T) {
	h := newHarness(t, nil)
	sub, err := h.m.Subscribe(context.Background(), 2)
	require.NoError(t, err)
	for range 10 { // far more changes than the buffer; nobody reads
		h.launch("a/1")
	}
	h.settle()
	n := len(recvAll(t, sub.C, "the lagging subscription to end"))
	assert.Equal(t, 2, n, "the buffered changes, then the close")
	assert.ErrorIs(t, sub.Err(), ErrLagged)
	snap := h.m.Snapshot()
	assert.Len(t, snap.Tasks, 10, "resync from a snapshot")
}

func TestSubscriptionEndsAtShutdownAndCloseIsIdempotent(t *testing.T) {
	h := newHarness(t, nil)
	sub, err := h.m.Subscribe(context.Background(), 0)
	require.NoError(t, err)
	other, err := h.m.Subscribe(context.Background(), 0)
	require.NoError(t, err)
	other.Close()
	other.Close()
	require.NoError(t, h.m.Shutdown(context.Background()))
	recvAll(t, sub.C, "the subscription to end at Shutdown")
	assert.ErrorIs(t, sub.Err(), ErrShutdown)
	_, err = h.m.Subscribe(context.Background(), 0)
	assert.ErrorIs(t, err, ErrShutdown)
}

func TestActivityIsDerivedFromEventsAndNotInTheLedger(t *testing.T) {
	needRecords(t)
	h := newHarness(t, nil)
	task := h.launch("a/1")
	h.settle()
	rev := h.task(task.ID).Revision
	assert.Equal(t, activityNone, h.task(task.ID).Activity)
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionBusy}))
	assert.Equal(t, ActivityGenerating, h.task(task.ID).Activity)
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionWaiting}))
	assert.Equal(t, ActivityWaiting, h.task(task.ID).Activity)
	assert.Equal(t, rev, h.task(task.ID).Revision, "process-local: no ledger record")
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle}))
	assert.Equal(t, activityNone, h.wait(task.ID).Activity)
	h.m.mu.Lock()
	for _, r := range recordsOf(h.m.led, task.ID) {
		b, _ := json.Marshal(r.attempt)
		assert.NotContains(t, string(b), "generating")
	}
	h.m.unlock()
}
