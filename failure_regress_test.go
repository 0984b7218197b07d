package bgtask

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Shutdown must return (naming the live child) when an abort fails; with a
// stall timeout the stall watcher of that still-running child keeps the group
// busy until Shutdown's ctx ends.
func TestShutdownWithAFailedAbortDoesNotWaitForTheStallWatcher(t *testing.T) {
	host := &testHost{abort: func(ctx context.Context, sid string) error { return errors.New("cannot abort") }}
	h := newHarness(t, host, WithStallTimeout(time.Hour))
	task := h.launchOn("a/1")
	h.waitTimers(1)
	require.Equal(t, StatusRunning, h.task(task.ID).Status)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err := h.m.Shutdown(ctx)
	require.Error(t, err)
	assert.NotErrorIs(t, err, context.DeadlineExceeded, "Shutdown waited for the stall watcher: %v", err)
	assert.Contains(t, err.Error(), "children did not stop")
}

// A queue timeout never reached a provider; its reason must not be
// provider_error.
func TestQueueTimeoutReasonIsNotProviderError(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1, QueueTimeout: time.Minute}))
	h.launchOn("m/x")
	h.settle()
	made, _ := h.clock.Created()
	b := h.launchOn("m/x")
	h.waitTimers(made + 1)
	h.clock.Advance(time.Minute)
	got := h.wait(b.ID)
	require.NotNil(t, got.Outcome)
	assert.NotEqual(t, ReasonProviderError, got.Outcome.Reason, "queue timeout classified from its own text: %s", got.Outcome.Envelope)
}

// A start failure's typed error is lost: the reason is re-derived from text.
func TestStartFailureKeepsItsTypedReason(t *testing.T) {
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		return "", Permanent(statusErr{503, "upstream said no"})
	}}
	h := newHarness(t, host)
	task := h.launchOn("a/1")
	got := h.wait(task.ID)
	require.NotNil(t, got.Outcome)
	assert.Equal(t, ReasonProviderError, got.Outcome.Reason, got.Outcome.Envelope)
}

type reentrantErr struct{ m *Manager }

func (e reentrantErr) Error() string   { return "boom" }
func (e reentrantErr) StatusCode() int { _ = e.m.Snapshot(); return 500 } // user code calling back

// The outcome classifier calls the error's methods under m.mu.
func TestErrorMethodsAreNeverCalledUnderTheLock(t *testing.T) {
	h := newHarness(t, nil, WithRetryable(func(error, bool) bool { return false }))
	task := h.launchOn("a/1")
	h.settle()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = h.m.Observe(Event{SessionID: h.task(task.ID).SessionID, Kind: SessionError, Err: reentrantErr{h.m}})
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second): // failure detection only
		t.Fatal("deadlock: StatusCode() called with m.mu held")
	}
}

// timerLog is a clock that records, for every timer made, the fake time it
// was made at and its duration: it shows which moment a deadline is
// measured from.
type timerLog struct {
	h    *harness
	mu   sync.Mutex
	made []time.Time // when each timer fires
}

func (l *timerLog) Now() time.Time {
	if l.h == nil { // New reads the clock (a journal's recovery) before h exists
		return t0
	}
	return l.h.clock.Now()
}
func (l *timerLog) NewTimer(d time.Duration) Timer {
	l.mu.Lock()
	l.made = append(l.made, l.h.clock.Now().Add(d))
	l.mu.Unlock()
	return l.h.clock.NewTimer(d)
}

func TestQueueTimeoutIsMeasuredFromWhenTheAttemptQueued(t *testing.T) {
	// The queue timer is made as the attempt queues, not whenever its
	// watcher goroutine gets to run: a late Now read made it a minute long
	// (1 in 40 runs at -cpu 4).
	tl := &timerLog{}
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1, QueueTimeout: time.Minute}), WithClock(tl))
	tl.h = h
	h.launchOn("m/x")
	h.settle()
	queuedAt := h.clock.Now()
	b := h.launchOn("m/x") // queued now
	tl.mu.Lock()
	require.Equal(t, []time.Time{queuedAt.Add(time.Minute)}, tl.made, "the queue timer exists once Launch returns")
	tl.mu.Unlock()
	h.clock.Advance(time.Minute)
	assert.Equal(t, StatusError, h.wait(b.ID).Status, "a full minute had passed since it queued")
}

func TestASessionBoundAfterAFailedArrivalAbortIsWatchedForStalls(t *testing.T) {
	release := make(chan struct{})
	host := &testHost{
		start: func(ctx context.Context, req SessionRequest, sid string) (string, error) { <-release; return sid, nil },
		abort: func(ctx context.Context, sid string) error { return errors.New("cannot abort") },
	}
	h := newHarness(t, host, WithStallTimeout(time.Minute))
	task := h.launchOn("a/1")
	var once sync.Once
	h.m.hooks.waiting = func(string) { once.Do(func() { close(release) }) }
	require.Error(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	require.Equal(t, StatusRunning, h.task(task.ID).Status, "bound: the truth wins")
	h.waitTimers(1) // its stall watcher
}

func TestAStartGateRefusesAStartForGood(t *testing.T) {
	var asked []string
	var mu sync.Mutex
	gate := func(ctx context.Context, req SessionRequest) error {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, req.AttemptID)
		if req.AttemptNumber == 2 {
			return errors.New("inside a closing branch")
		}
		return nil
	}
	h := newHarness(t, nil, WithStartGate(gate))
	task := h.running("chat", func(s *Spec) { s.Models = mustModels(t, "a/one", "b/two", "c/three") })
	require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionError, Err: errRateLimited}))
	got := h.wait(task.ID)
	assert.Equal(t, StatusError, got.Status)
	require.Len(t, got.Attempts, 2, "the refused start is final: no third attempt")
	assert.Contains(t, got.Attempts[1].Error, "the start was refused: inside a closing branch")
	assert.Empty(t, got.Attempts[1].SessionID, "the host was not called")
	mu.Lock()
	assert.Len(t, asked, 2)
	mu.Unlock()
	assert.Len(t, h.host.Starts(), 1)

	panicky := newHarness(t, nil, WithStartGate(func(context.Context, SessionRequest) error { panic("boom") }))
	p, err := panicky.m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one", "b/two")})
	require.NoError(t, err)
	got = panicky.wait(p.ID)
	assert.Equal(t, StatusError, got.Status)
	assert.Contains(t, got.Error, "the start gate panicked: boom")
	assert.Len(t, got.Attempts, 1)
}
