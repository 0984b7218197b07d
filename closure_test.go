package bgtask

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCancelStopsRunningChild(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one", "b/two")
	h.settle()
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	got := h.task(task.ID)
	assert.Equal(t, StatusCancelled, got.Status, "Stop returns only after the abort was confirmed")
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts())
	assert.Len(t, got.Attempts, 1)
}

func TestFailedAbortKeepsTaskRunning(t *testing.T) {
	abortErr := errors.New("host: session busy, cannot abort")
	var fail atomic.Bool
	fail.Store(true)
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		if fail.Load() {
			return abortErr
		}
		return nil
	}})
	task := h.launch("a/one", "b/two")
	h.settle()

	_, err := h.m.Stop(context.Background(), Target{Task: task.ID})
	require.ErrorIs(t, err, abortErr)
	got := h.task(task.ID)
	assert.Equal(t, StatusRunning, got.Status, "a failed abort is no evidence the child stopped")
	h.settle()
	assert.Empty(t, h.rec.Kinds(task.ID), "no final summary for a live task")

	// Compaction and busy afterwards change nothing; a later error does not
	// retry because a stop was asked for.
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionCompacted}))
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionBusy}))
	assert.Equal(t, StatusRunning, h.task(task.ID).Status)

	fail.Store(false)
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	assert.Equal(t, StatusCancelled, h.task(task.ID).Status)
}

func TestCompletionBeatsInFlightAbort(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		close(entered)
		<-release
		return nil
	}})
	task := h.launch("a/one")
	h.settle()
	cancelled := make(chan error, 1)
	go func() { cancelled <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	recv(t, entered, "the abort")
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle, Text: "finished first"}))
	close(release)
	require.NoError(t, recv(t, cancelled, "Stop to return"))
	got := h.task(task.ID)
	assert.Equal(t, StatusCompleted, got.Status, "the child's own evidence wins")
	assert.Equal(t, "finished first", got.Result)
	h.settle()
	assert.Equal(t, []NotificationKind{NotifyFinalSummary}, h.rec.Kinds(task.ID))
}

func TestCancelDuringSessionCreation(t *testing.T) {
	tests := []struct {
		name        string
		startErr    error
		wantSession string
		wantAborts  []string
	}{
		{name: "session arrives, is bound, and is aborted", wantSession: "ses-1", wantAborts: []string{"ses-1"}},
		{name: "start fails", startErr: errRateLimited, wantSession: "", wantAborts: nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			entered := make(chan struct{})
			release := make(chan struct{})
			h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
				close(entered)
				<-release
				if tt.startErr != nil {
					return "", tt.startErr
				}
				return sid, nil
			}})
			waiting := make(chan string, 1)
			h.m.hooks.waiting = func(id string) { waiting <- id }
			task := h.launch("a/one", "b/two")
			recv(t, entered, "the start")
			cancelled := make(chan error, 1)
			go func() { cancelled <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
			recv(t, waiting, "Stop to wait for the start") // Stop recorded the stop and waits for the start
			close(release)
			require.NoError(t, recv(t, cancelled, "Stop to return"))
			got := h.wait(task.ID)
			assert.Equal(t, StatusCancelled, got.Status)
			assert.Equal(t, tt.wantSession, got.SessionID)
			assert.Len(t, got.Attempts, 1, "no retry after a cancel")
			h.settle()
			assert.Equal(t, tt.wantAborts, h.host.Aborts())
		})
	}
}

func TestCancelDuringSessionCreationWhoseAbortFailsBindsTheLiveSession(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{})
	h := newHarness(t, &testHost{
		start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
			close(entered)
			<-release
			return sid, nil
		},
		abort: func(ctx context.Context, sid string) error { return errors.New("cannot") },
	})
	waiting := make(chan string, 1)
	h.m.hooks.waiting = func(id string) { waiting <- id }
	task := h.launch("a/one")
	recv(t, entered, "the start")
	cancelled := make(chan error, 1)
	go func() { cancelled <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	recv(t, waiting, "Stop to wait for the start")
	close(release)
	err := recv(t, cancelled, "Stop to return")
	require.Error(t, err)
	got := h.task(task.ID)
	assert.Equal(t, StatusRunning, got.Status, "alive, and the truth wins")
	assert.Equal(t, "ses-1", got.SessionID)
}

func TestCancelEdgeCases(t *testing.T) {
	h := newHarness(t, nil)
	assert.ErrorIs(t, stopErr(h.m.Stop(context.Background(), Target{Task: "missing"})), ErrUnknownTask)
	task := h.launch("a/one")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle}))
	done := h.wait(task.ID)
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})), "terminal: nil, nothing changes")
	assert.Equal(t, done, h.task(task.ID))
	assert.Empty(t, h.host.Aborts())
}

func TestCancelContextEndsBeforeAbortLands(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{})
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		close(entered)
		<-release
		return nil
	}})
	task := h.launch("a/one")
	h.settle()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- stopErr(h.m.Stop(ctx, Target{Task: task.ID})) }()
	recv(t, entered, "the abort")
	cancel()
	assert.ErrorIs(t, recv(t, errc, "Stop to return at its context's end"), context.Canceled)
	assert.Equal(t, StatusRunning, h.task(task.ID).Status)
	close(release)
	assert.Equal(t, StatusCancelled, h.wait(task.ID).Status, "the abort's outcome is recorded when it lands")
}

func TestConcurrentCancelsShareOneAbort(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{})
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		close(entered) // a second abort call would panic here
		<-release
		return nil
	}})
	task := h.launch("a/one")
	h.settle()
	waiting := make(chan string, 2)
	h.m.hooks.waiting = func(id string) { waiting <- id }
	errc := make(chan error, 2)
	go func() { errc <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	recv(t, entered, "the abort")
	recv(t, waiting, "the first Stop to wait for its abort")
	go func() { errc <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	recv(t, waiting, "the second Stop to wait for the abort") // the second Stop joined the abort in flight
	close(release)
	require.NoError(t, recv(t, errc, "the first Stop to return"))
	require.NoError(t, recv(t, errc, "the second Stop to return"))
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts())
}

func TestCancelFromInsideStartSessionDoesNotWaitOnItself(t *testing.T) {
	var m *Manager
	cancelErr := make(chan error, 1)
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		ref, ok := RunFromContext(ctx)
		if !ok || ref.AttemptID != req.AttemptID {
			return "", errors.New("start context does not carry its run")
		}
		cancelErr <- stopErr(m.Stop(ctx, Target{Task: req.TaskID}))
		return sid, nil
	}})
	m = h.m
	task := h.launch("a/one")
	assert.ErrorIs(t, recv(t, cancelErr, "the Stop made inside the start callback"), ErrStopPending)
	got := h.wait(task.ID)
	assert.Equal(t, StatusCancelled, got.Status, "the session was aborted on arrival")
	h.settle()
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts())
}

func TestCancelFromInsideAbortSessionDoesNotWaitOnItself(t *testing.T) {
	var m *Manager
	inner := make(chan error, 1)
	var taskID string
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		inner <- stopErr(m.Stop(ctx, Target{Task: taskID}))
		return nil
	}})
	m = h.m
	task := h.launch("a/one")
	taskID = task.ID
	h.settle()
	require.NoError(t, stopErr(m.Stop(context.Background(), Target{Task: task.ID})))
	assert.ErrorIs(t, recv(t, inner, "the Stop made inside the abort callback"), ErrStopPending)
	assert.Equal(t, StatusCancelled, h.task(task.ID).Status)
}

func TestReentrantNotifierAndHostCallbacks(t *testing.T) {
	var m *Manager
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		// A host reading and launching from inside its callback.
		if _, err := m.Task(req.TaskID); err != nil {
			return "", errors.New("task not visible from the host")
		}
		_ = m.Snapshot().Tasks
		return sid, nil
	}})
	m = h.m
	var child Task
	var childErr error
	h.rec.hook = func(ctx context.Context, n Notification) error {
		_ = m.Snapshot().Tasks
		if n.Kind == NotifyRetryScheduled {
			// A notifier launching follow-up work and cancelling from inside
			// its callback.
			child, childErr = m.Launch(ctx, Spec{ParentSessionID: n.Task.SessionID + "-child-parent", Models: mustModels(t, "c/three")})
			if childErr == nil {
				_, childErr = m.Stop(ctx, Target{Task: child.ID})
			}
		}
		return nil
	}
	task := h.launch("a/one", "b/two")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(task.ID).SessionID, Kind: SessionIdle}))
	assert.Equal(t, StatusCompleted, h.wait(task.ID).Status)
	h.settle()
	require.NoError(t, childErr)
	assert.Equal(t, StatusCancelled, h.task(child.ID).Status)
}

func TestSessionForAttemptNoLongerCurrentIsAbortedNotAdopted(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		close(entered)
		<-release
		return sid, nil
	}})
	task := h.launch("a/one")
	recv(t, entered, "the start")
	// The attempt ends while its start is in flight (as a closure or a
	// restart would end it).
	h.m.mu.Lock()
	e := h.m.led.tasks[task.ID]
	h.m.finalize(e, e.cur().ID, StatusCancelled, "", "", t0)
	h.m.unlock()
	close(release)
	h.settle()
	got := h.task(task.ID)
	assert.Equal(t, StatusCancelled, got.Status)
	assert.Empty(t, got.SessionID, "never adopted")
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts(), "aborted on arrival")
	assert.ErrorIs(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle}), ErrStaleEvent, "its events resolve, as stale")
}
