package bgtask

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// reenters reports whether a call back into m from here returns: it cannot
// if this goroutine holds m's lock. (A TryLock probe would also catch other
// goroutines that hold the lock for a moment.)
func reenters(m *Manager) bool {
	done := make(chan struct{})
	go func() {
		_ = m.Snapshot().Tasks
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(10 * time.Second): // failure detection only
		return false
	}
}

// lockProbe is a slog handler that counts calls made while the Manager's
// lock is held by the caller.
type lockProbe struct {
	m         atomic.Pointer[Manager]
	heldCalls atomic.Int32
}

func (p *lockProbe) Enabled(context.Context, slog.Level) bool { return true }
func (p *lockProbe) Handle(context.Context, slog.Record) error {
	if m := p.m.Load(); m != nil && !reenters(m) {
		p.heldCalls.Add(1)
	}
	return nil
}
func (p *lockProbe) WithAttrs([]slog.Attr) slog.Handler { return p }
func (p *lockProbe) WithGroup(string) slog.Handler      { return p }

func TestLoggerIsNeverCalledUnderTheLock(t *testing.T) {
	probe := &lockProbe{}
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error { return errors.New("cannot") }},
		WithLogger(slog.New(probe)))
	probe.m.Store(h.m)
	task := h.launch("a/one")
	h.settle()
	require.Error(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID}))) // logs "abort failed" at warn
	require.ErrorIs(t, h.m.Observe(Event{SessionID: "nobody", Kind: SessionBusy}), ErrUnknownSession)
	assert.Zero(t, probe.heldCalls.Load(), "the logger was called with the lock held")
}

func TestRetryClassifierAndDelayRunWithoutTheLock(t *testing.T) {
	var m *Manager
	var held atomic.Int32
	probe := func() {
		if !reenters(m) {
			held.Add(1)
		}
	}
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.AttemptNumber == 2 {
			return "", errors.New("503") // a failed start is classified too
		}
		return sid, nil
	}},
		WithRetryable(func(err error, _ bool) bool { probe(); return true }),
		WithRetryDelay(func(int, error) time.Duration { probe(); return 0 }))
	m = h.m
	task := h.launch("a/one", "b/two", "c/three")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	h.settle()
	assert.Len(t, h.task(task.ID).Attempts, 3)
	assert.Zero(t, held.Load(), "a user callback ran with the lock held")
}

func TestShutdownWakesWhenAStartForANonCurrentAttemptReturns(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		close(entered)
		<-release
		return "", errRateLimited
	}})
	task := h.launch("a/one")
	recv(t, entered, "the start")
	h.m.mu.Lock() // the attempt ends while its start is in flight
	e := h.m.led.tasks[task.ID]
	h.m.finalize(e, e.cur().ID, StatusCancelled, "", "", t0)
	h.m.unlock()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- h.m.Shutdown(ctx) }()
	close(release)
	assert.NoError(t, recv(t, errc, "Shutdown to return"), "Shutdown returns once the last start returned")
	h.m.mu.Lock()
	assert.False(t, e.rt.starting())
	h.m.unlock()
}

func TestStaleHeldEventsDoNotStarveLaterEarlyEvents(t *testing.T) {
	blockA := make(chan struct{})
	earlyErr := make(chan error, 1)
	var m *Manager
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.Model.Provider == "slow" {
			<-blockA
			return sid, nil
		}
		earlyErr <- m.Observe(Event{SessionID: sid, AttemptID: req.AttemptID, Kind: SessionIdle, Text: "fast"})
		return sid, nil
	}}, WithHoldLimit(2))
	m = h.m
	defer close(blockA)
	h.launch("slow/one") // its start stays in flight
	// Events for sessions no start will return: held while the slow start
	// might still claim them, filling the session bound.
	require.NoError(t, h.m.Observe(Event{SessionID: "gone-1", Kind: SessionBusy}))
	require.NoError(t, h.m.Observe(Event{SessionID: "gone-2", Kind: SessionBusy}))
	require.ErrorIs(t, h.m.Observe(Event{SessionID: "gone-3", Kind: SessionBusy}), ErrUnknownSession)
	b := h.launch("fast/two")
	// B's early event by attempt id is outside the session bound.
	assert.NoError(t, recv(t, earlyErr, "the fast start's early event"))
	got := h.wait(b.ID)
	assert.Equal(t, StatusCompleted, got.Status)
}

func TestHeldSessionEventsExpireWhenTheirStartsReturn(t *testing.T) {
	blockA := make(chan struct{})
	blockB := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.Model.Provider == "a" {
			<-blockA
		} else {
			<-blockB
		}
		return sid, nil
	}})
	h.launch("a/one")
	require.NoError(t, h.m.Observe(Event{SessionID: "orphan", Kind: SessionBusy})) // only start A can claim it
	h.launch("b/two")
	close(blockA) // A returns another session: "orphan" can no longer be claimed
	for {         // (waiting for a change before the first look hung when A had returned already)
		h.m.mu.Lock()
		n, inflight := h.m.calls.held.BySession(), len(h.m.calls.inflight)
		wait := h.m.waitAny()
		h.m.unlock()
		if inflight == 1 {
			assert.Zero(t, n, "the held event expired although start B is still in flight")
			break
		}
		recv(t, wait, "a change (start A's return)")
	}
	close(blockB)
	h.settle()
}

func TestShutdownFromACallbackContextDoesNotWaitOnItself(t *testing.T) {
	h := newHarness(t, nil)
	returned := make(chan error, 1)
	h.rec.hook = func(ctx context.Context, n Notification) error {
		if n.Kind == NotifyFinalSummary {
			returned <- h.m.Shutdown(ctx)
		}
		return nil
	}
	task := h.launch("a/one")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle}))
	h.wait(task.ID)
	assert.ErrorIs(t, recv(t, returned, "the Shutdown made inside the notifier"), ErrStopPending)
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/b")})
	assert.ErrorIs(t, err, ErrShutdown, "the shutdown began")
	require.NoError(t, h.m.Shutdown(context.Background()))
}

func TestStartReturningASessionWithAnErrorAbortsThatSession(t *testing.T) {
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.AttemptNumber == 1 {
			return sid, errors.New("503 after the session was created")
		}
		return sid, nil
	}})
	task := h.launch("a/one", "b/two")
	h.settle()
	got := h.task(task.ID)
	first := got.Attempts[0]
	assert.Equal(t, "ses-1", first.SessionID, "the session existed: bound, then aborted")
	assert.Equal(t, StatusError, first.Status, "ended only once its abort was confirmed")
	assert.Contains(t, first.Error, "503")
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts(), "aborted once, not left running")
	assert.Equal(t, "ses-2", got.SessionID)
	assert.ErrorIs(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle}), ErrStaleEvent)
}

func TestStartReturningASessionWithAnErrorWhoseAbortFailsRuns(t *testing.T) {
	h := newHarness(t, &testHost{
		start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
			return sid, errors.New("503 after the session was created")
		},
		abort: func(ctx context.Context, sid string) error { return errors.New("cannot") },
	})
	task := h.launch("a/one", "b/two")
	h.settle()
	got := h.task(task.ID)
	assert.Equal(t, StatusRunning, got.Status, "a child may be alive: the truth wins")
	assert.Equal(t, "ses-1", got.SessionID)
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionIdle, Text: "it was alive"}))
	assert.Equal(t, StatusCompleted, h.wait(task.ID).Status)
}

func TestEarlyEventStampedBeforeTheBindDoesNotEndBeforeItStarted(t *testing.T) {
	var m *Manager
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		_ = m.Observe(Event{SessionID: sid, Kind: SessionIdle, At: t0.Add(-time.Minute)})
		return sid, nil
	}})
	m = h.m
	got := h.wait(h.launch("a/one").ID)
	assert.False(t, got.CompletedAt.Before(got.StartedAt))
}
