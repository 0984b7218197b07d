package bgtask

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestTreeLimitsRefuseASpawnPastTheDepth(t *testing.T) {
	h := newHarness(t, nil, WithTreeLimits(TreeLimits{MaxDepth: 3}))
	one := h.running("chat")
	two := h.running(one.SessionID)
	three := h.running(two.SessionID)
	assert.Equal(t, []int{1, 2, 3}, []int{one.Depth, two.Depth, three.Depth})
	assert.Equal(t, "chat", three.Root)
	before := len(h.m.Snapshot().Tasks)
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: three.SessionID, Models: mustModels(t, "a/one")})
	require.ErrorIs(t, err, ErrDepthLimit)
	var le *LimitError
	require.ErrorAs(t, err, &le)
	assert.Equal(t, 3, le.Max)
	assert.Equal(t, three.SessionID, le.Session)
	assert.Len(t, h.m.Snapshot().Tasks, before, "a refused launch records nothing")
	h.running(two.SessionID) // a sibling at depth 3 is fine
}

func TestTreeLimitsRefuseAFanOutPastThePerParentCap(t *testing.T) {
	h := newHarness(t, nil, WithTreeLimits(TreeLimits{MaxPerParent: 2}))
	a := h.running("chat")
	h.running("chat")
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	require.ErrorIs(t, err, ErrFanOutLimit)
	h.running("other") // another parent has its own cap
	require.NoError(t, h.observe(Event{SessionID: a.SessionID, Kind: SessionIdle, Text: "ok"}))
	h.running("chat") // one ended: room again
}

// queuedLaunch launches spec on a goroutine of the test and returns its
// result channel, once the launch waits in its parent's queue.
func queuedLaunch(t *testing.T, h *harness, queued <-chan string, spec Spec) <-chan error {
	t.Helper()
	out := make(chan error, 1)
	go func() {
		_, err := h.m.Launch(context.Background(), spec)
		out <- err
	}()
	recv(t, queued, "the launch to wait in its parent's queue")
	return out
}

func TestTreeLimitsLetLaunchesWaitForAParentSlotInOrder(t *testing.T) {
	h := newHarness(t, nil, WithTreeLimits(TreeLimits{MaxPerParent: 2, ParentWait: time.Minute}))
	queued := make(chan string, 8)
	h.m.hooks.queued = func(parent string) { queued <- parent }
	a, b := h.running("chat"), h.running("chat")
	third := queuedLaunch(t, h, queued, Spec{ParentSessionID: "chat", Description: "third", Models: mustModels(t, "a/one")})
	fourth := queuedLaunch(t, h, queued, Spec{ParentSessionID: "chat", Description: "fourth", Models: mustModels(t, "a/one")})

	require.NoError(t, h.observe(Event{SessionID: a.SessionID, Kind: SessionIdle, Text: "ok"}))
	require.NoError(t, recv(t, third, "the third Launch to return"), "the first in line gets the slot")
	select {
	case err := <-fourth:
		t.Fatalf("the fourth jumped the queue: %v", err)
	default:
	}
	require.NoError(t, h.observe(Event{SessionID: b.SessionID, Kind: SessionIdle, Text: "ok"}))
	require.NoError(t, recv(t, fourth, "the fourth Launch to return"))
	var order []string
	for _, task := range h.m.Snapshot().Tasks {
		order = append(order, task.Description)
	}
	assert.Equal(t, []string{"", "", "third", "fourth"}, order)

	h.m.mu.Lock()
	assert.Empty(t, h.m.calls.fanout, "no queue left behind")
	h.m.mu.Unlock()
}

func TestTreeLimitsBoundTheWaitForAParentSlot(t *testing.T) {
	h := newHarness(t, nil, WithTreeLimits(TreeLimits{MaxPerParent: 1, ParentWait: time.Minute}))
	queued := make(chan string, 8)
	h.m.hooks.queued = func(parent string) { queued <- parent }
	h.running("chat")
	late := queuedLaunch(t, h, queued, Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	h.clock.Advance(time.Minute)
	err := recv(t, late, "the queued Launch to give up at ParentWait")
	require.ErrorIs(t, err, ErrFanOutLimit)
	var le *LimitError
	require.ErrorAs(t, err, &le)
	assert.Equal(t, time.Minute, le.Waited)

	ctx, cancel := context.WithCancel(context.Background())
	gaveUp := make(chan error, 1)
	go func() {
		_, err := h.m.Launch(ctx, Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
		gaveUp <- err
	}()
	recv(t, queued, "the launch to wait in its parent's queue")
	cancel()
	assert.ErrorIs(t, recv(t, gaveUp, "the queued Launch to return at its context's end"), context.Canceled)

	atShutdown := queuedLaunch(t, h, queued, Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	require.NoError(t, h.m.Shutdown(context.Background()))
	assert.ErrorIs(t, recv(t, atShutdown, "the queued Launch to return at Shutdown"), ErrShutdown)
	h.m.mu.Lock()
	assert.Empty(t, h.m.calls.fanout)
	h.m.mu.Unlock()
	assert.Len(t, h.m.Snapshot().Tasks, 1, "no waiting launch left a task")
}

func TestTreeLimitsCapTheLiveTasksOfATree(t *testing.T) {
	h := newHarness(t, nil, WithTreeLimits(TreeLimits{MaxPerRoot: 2}))
	top := h.running("chat")
	kid := h.running(top.SessionID)
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: kid.SessionID, Models: mustModels(t, "a/one")})
	require.ErrorIs(t, err, ErrTreeLimit)
	var le *LimitError
	require.ErrorAs(t, err, &le)
	assert.Equal(t, "chat", le.Session, "counted under the root")
	_, err = h.m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	require.ErrorIs(t, err, ErrTreeLimit)
	h.running("another chat")
	require.NoError(t, h.observe(Event{SessionID: kid.SessionID, Kind: SessionIdle, Text: "ok"}))
	h.running(top.SessionID)
}

func TestInvalidTreeLimitsAreReported(t *testing.T) {
	m, err := Open(context.Background(), &testHost{}, WithTreeLimits(TreeLimits{MaxDepth: -1}))
	assert.ErrorContains(t, err, "TreeLimits")
	assert.ErrorIs(t, err, ErrInvalidArgument)
	assert.Nil(t, m, "Open refuses it at once, not at each Launch")
}

func TestAnEndedTaskWhoseSessionLaunchedLiveTasksIsKeptWhole(t *testing.T) {
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: 1}), WithTreeLimits(TreeLimits{MaxDepth: 2}))
	p := h.running("chat", func(s *Spec) { s.Models = mustModels(t, "a/one") })
	kid := h.running(p.SessionID)
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: p.ID}))) // p alone
	for range 3 {                                                                   // others end: retention would forget p
		o := h.running("other")
		require.NoError(t, h.observe(Event{SessionID: o.SessionID, Kind: SessionIdle, Text: "ok"}))
	}
	_, err := h.m.Task(p.ID)
	require.NoError(t, err, "kept while a task its session launched is live")
	sibling, err := h.m.Launch(context.Background(), Spec{ParentSessionID: p.SessionID, Models: mustModels(t, "a/one")})
	require.NoError(t, err)
	assert.Equal(t, "chat", sibling.Root)
	assert.Equal(t, 2, sibling.Depth)
	_, err = h.m.Launch(context.Background(), Spec{ParentSessionID: kid.SessionID, Models: mustModels(t, "a/one")})
	assert.ErrorIs(t, err, ErrDepthLimit, "the tree's depth is still known")
	rep, err := h.m.Stop(context.Background(), Target{Session: "chat"})
	require.NoError(t, err)
	sib, _ := h.m.Task(sibling.ID)
	assert.Len(t, rep.Stopped, 2, "a closure of the root still reaches them: %+v, sibling %+v", rep, sib)
}

func TestALaunchRecordKeepsItsPlaceInTheTree(t *testing.T) {
	info := &taskInfo{id: "t", parent: "ses-9", models: []Model{{ID: "m"}}, maxAttempts: 1, root: "chat", depth: 3,
		x: &taskExtra{timeout: time.Minute, attemptTimeout: time.Second, retryOnTimeout: true}, launchedAt: t0}
	enc, err := encodeRecord(&record{seq: 1, kind: recTaskLaunched, task: "t", at: t0, recordExt: &recordExt{spec: info}})
	require.NoError(t, err)
	dec, err := decodeRecord(enc)
	require.NoError(t, err)
	got := dec.spec
	assert.Equal(t, "chat", got.root)
	assert.Equal(t, 3, got.depth)
	assert.Equal(t, time.Minute, got.opt().timeout)
	assert.Equal(t, time.Second, got.opt().attemptTimeout)
	assert.True(t, got.opt().retryOnTimeout)
	bare, err := encodeRecord(&record{seq: 2, kind: recTaskLaunched, task: "u", at: t0, recordExt: &recordExt{spec: &taskInfo{id: "u", parent: "p", models: []Model{{ID: "m"}}, maxAttempts: 1, launchedAt: t0}}})
	require.NoError(t, err)
	dec, err = decodeRecord(bare)
	require.NoError(t, err)
	assert.Nil(t, dec.spec.x, "a spec that set none of the optional part keeps none")
}

func TestWaitParentWaitsForEveryTaskOfAParent(t *testing.T) {
	h := newHarness(t, nil)
	a, b := h.running("chat"), h.running("chat")
	other := h.running("elsewhere")
	got := make(chan []Task, 1)
	go func() {
		tasks, err := h.m.WaitParent(context.Background(), "chat")
		assert.NoError(t, err)
		got <- tasks
	}()
	require.NoError(t, h.observe(Event{SessionID: a.SessionID, Kind: SessionIdle, Text: "a"}))
	c := h.running("chat") // launched while it waits: waited for too
	require.NoError(t, h.observe(Event{SessionID: b.SessionID, Kind: SessionIdle, Text: "b"}))
	select {
	case <-got:
		t.Fatal("returned while c runs")
	default:
	}
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: c.ID})))
	tasks := recv(t, got, "WaitParent to return")
	var ids []string
	for _, task := range tasks {
		assert.True(t, task.Status.Terminal())
		ids = append(ids, task.ID)
	}
	assert.Equal(t, []string{a.ID, b.ID, c.ID}, ids)
	assert.Equal(t, StatusRunning, h.task(other.ID).Status)

	none, err := h.m.WaitParent(context.Background(), "nobody")
	require.NoError(t, err)
	assert.Empty(t, none)
	_, err = h.m.WaitParent(context.Background(), " ")
	assert.ErrorIs(t, err, ErrInvalidArgument)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = h.m.WaitParent(ctx, "elsewhere")
	assert.ErrorIs(t, err, context.Canceled)
}
