package bgtask

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// slowAborts is a host whose aborts wait until released: a child that takes
// its time to stop.
func slowAborts() (*testHost, chan string, chan struct{}) {
	asked, release := make(chan string, 16), make(chan struct{})
	return &testHost{abort: func(ctx context.Context, sid string) error {
		asked <- sid
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}}, asked, release
}

// Stop returns once the stop is recorded: the task reads running until its
// child really stopped, then cancelled, with no retry.
func TestStopReturnsBeforeTheChildStopped(t *testing.T) {
	host, asked, release := slowAborts()
	h := newHarness(t, host)
	task := h.running("chat")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID, NoWait: true})))
	assert.Equal(t, task.SessionID, recv(t, asked, "the abort"), "the abort was set off")
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "running until the child stopped")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID, NoWait: true})), "asked again: the stop stands")
	close(release)
	done := h.wait(task.ID)
	assert.Equal(t, StatusCancelled, done.Status)
	assert.Len(t, done.Attempts, 1, "no retry follows a stop")

	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID, NoWait: true})), "a terminal task: nothing to do")
	assert.ErrorIs(t, stopErr(h.m.Stop(context.Background(), Target{Task: "task-404", NoWait: true})), ErrUnknownTask)
	//lint:ignore SA1012 a nil context is taken as Background
	assert.ErrorIs(t, stopErr(h.m.Stop(nil, Target{Task: "task-404", NoWait: true})), ErrUnknownTask)
}

// A Stop of a task whose start is still in flight ends it without a child
// or aborts the child on arrival: the caller never waits for either.
func TestStopOfAPendingTaskEndsIt(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1}))
	first := h.running("chat")
	queued := h.running("chat") // waits for first's slot
	require.Equal(t, PendingQueued, queued.Pending)
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: queued.ID, NoWait: true})))
	done := h.wait(queued.ID)
	assert.Equal(t, StatusCancelled, done.Status)
	assert.Empty(t, done.SessionID, "it never had a child")
	assert.Equal(t, StatusRunning, h.task(first.ID).Status, "the other task is untouched")
}

// A Stop of a session with NoWait raises the fence and asks every run to
// stop, then returns: no new work starts in the branch, each task ends
// cancelled once its child stopped, and the closure is recorded and
// announced at the end.
func TestStopBranchReturnsBeforeTheBranchStopped(t *testing.T) {
	host, asked, release := slowAborts()
	h := newHarness(t, host)
	lead := h.running("chat")
	child := h.running(lead.SessionID)
	other := h.running("another chat")

	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Session: "chat", NoWait: true})))
	got := []string{recv(t, asked, "the first abort of the branch"), recv(t, asked, "the second abort of the branch")}
	assert.ElementsMatch(t, []string{lead.SessionID, child.SessionID}, got)
	assert.Equal(t, StatusRunning, h.task(lead.ID).Status, "running until its child stopped")
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: child.SessionID, Models: mustModels(t, "a/one")})
	assert.ErrorIs(t, err, ErrBranchClosing, "the fence is up while the branch stops")
	assert.Empty(t, h.m.Snapshot().Closures, "not recorded before it ended")

	close(release)
	assert.Equal(t, StatusCancelled, h.wait(lead.ID).Status)
	assert.Equal(t, StatusCancelled, h.wait(child.ID).Status)
	h.settle()
	recs := h.m.Snapshot().Closures
	require.Len(t, recs, 1, "the closure finished in the background")
	assert.Equal(t, "chat", recs[0].SessionID)
	assert.Len(t, recs[0].Stopped, 2)
	assert.Equal(t, StatusRunning, h.task(other.ID).Status, "outside the branch: untouched")
	assert.Contains(t, h.rec.Kinds(""), NotifyBranchClosed)
}

func TestStopBranchRefusesWhatCloseBranchRefuses(t *testing.T) {
	h := newHarness(t, nil)
	assert.ErrorIs(t, stopErr(h.m.Stop(context.Background(), Target{Session: " ", NoWait: true})), ErrInvalidArgument)
	assert.ErrorIs(t, stopErr(h.m.Stop(context.Background(), Target{Session: "nobody", NoWait: true})), ErrUnknownSession)
	h.running("chat")
	//lint:ignore SA1012 a nil context is taken as Background
	require.NoError(t, stopErr(h.m.Stop(nil, Target{Session: "chat", NoWait: true})))
}
