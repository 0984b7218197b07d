package bgtask

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestATaskTimeoutEndsItErrorWithReasonDeadline(t *testing.T) {
	h := newHarness(t, nil)
	task := h.running("chat", func(s *Spec) { s.Timeout = time.Minute })
	for range 4 { // a chatty child: never silent, never done
		h.clock.Advance(14 * time.Second)
		require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionBusy, Text: "still looping"}))
	}
	assert.Equal(t, StatusRunning, h.task(task.ID).Status)
	h.clock.Advance(4 * time.Second)
	done := h.wait(task.ID)
	assert.Equal(t, StatusError, done.Status)
	assert.Len(t, done.Attempts, 1, "a task's deadline never falls back")
	assert.Equal(t, []string{task.SessionID}, h.host.Aborts(), "the child was stopped")
	require.NotNil(t, done.Outcome)
	assert.Equal(t, ReasonDeadline, done.Outcome.Reason)
	assert.ErrorIs(t, done.Cause, ReasonDeadline)
	assert.Contains(t, done.Error, "deadline: the task ran longer than its timeout of 1m0s")
	assert.Equal(t, "still looping", done.Outcome.Evidence)
}

func TestATaskTimeoutEndsAQueuedTaskWithoutAChild(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Default: 1}))
	h.running("chat")
	queued := h.running("chat", func(s *Spec) { s.Timeout = time.Minute })
	require.Equal(t, PendingQueued, queued.Pending)
	h.clock.Advance(time.Minute)
	done := h.wait(queued.ID)
	assert.Equal(t, StatusError, done.Status)
	assert.Equal(t, ReasonDeadline, done.Outcome.Reason)
	assert.Empty(t, h.host.Aborts())
}

func TestAnAttemptTimeoutFallsBackOnlyWhenAsked(t *testing.T) {
	for _, retry := range []bool{false, true} {
		t.Run(fmt.Sprint("retry=", retry), func(t *testing.T) {
			h := newHarness(t, nil)
			task := h.running("chat", func(s *Spec) { s.AttemptTimeout = time.Minute; s.RetryOnTimeout = retry })
			h.clock.Advance(time.Minute)
			if !retry {
				done := h.wait(task.ID)
				assert.Equal(t, StatusError, done.Status)
				assert.Len(t, done.Attempts, 1)
				assert.Equal(t, ReasonDeadline, done.Outcome.Reason)
				assert.Contains(t, done.Error, "the attempt ran longer than its timeout of 1m0s")
				return
			}
			now := waitFor(t, h.m, task.ID, func(t Task) bool { return len(t.Attempts) == 2 && t.Status == StatusRunning })
			assert.Equal(t, StatusError, now.Attempts[0].Status)
			assert.Contains(t, now.Attempts[0].Error, "deadline")
			assert.Equal(t, StatusRunning, now.Status)
			h.clock.Advance(time.Minute) // the second attempt has its own deadline, from its start
			done := h.wait(task.ID)
			assert.Equal(t, StatusError, done.Status)
			assert.Len(t, done.Attempts, 2)
		})
	}
}

func TestDeadlinesAreArmedAgainAfterARestart(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	clk := clock.NewFake(t0)
	j := openJournal(t, dir)
	m := mustOpen(&svcHost{svc: svc}, WithJournal(j), WithIDs(SequentialIDs()), WithClock(clk))
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), Timeout: time.Hour})
	require.NoError(t, err)
	waitStatus(t, m, task.ID, StatusRunning)
	crash(t, m, j)

	later := clock.NewFake(t0.Add(2 * time.Hour)) // the deadline passed while nobody ran
	m2, err := Open(context.Background(), &svcHost{svc: svc, abortOK: true}, WithJournal(openJournal(t, dir)), WithClock(later))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	done := waitStatus(t, m2, task.ID, StatusError)
	assert.Equal(t, ReasonDeadline, done.Outcome.Reason)
	assert.Contains(t, done.Error, "deadline")
}

func TestATaskDeadlineAsksAgainWhenTheAbortFails(t *testing.T) {
	aborts := make(chan string, 4)
	var mu sync.Mutex
	refuse := true
	host := &testHost{abort: func(_ context.Context, sid string) error {
		mu.Lock()
		defer mu.Unlock()
		aborts <- sid
		if refuse {
			refuse = false
			return errors.New("the session service is busy")
		}
		return nil
	}}
	h := newHarness(t, host)
	task := h.running("chat", func(s *Spec) { s.Timeout = time.Minute })
	made, _ := h.clock.Created()
	h.clock.Advance(time.Minute)
	recv(t, aborts, "the deadline's abort")
	for n, next := h.clock.Created(); n == made; n, next = h.clock.Created() {
		recv(t, next, "the abort's retry timer") // the retry's timer: the refused abort was answered
	}
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "alive: never reported stopped")
	h.clock.Advance(deadlineRetry)
	recv(t, aborts, "the deadline's second abort")
	done := h.wait(task.ID)
	assert.Equal(t, StatusError, done.Status)
	assert.Equal(t, ReasonDeadline, done.Outcome.Reason)
}

func TestATaskDeadlineDuringASessionStartAbortsTheSessionOnArrival(t *testing.T) {
	release := make(chan struct{})
	asked := make(chan struct{}, 1)
	host := &testHost{start: func(ctx context.Context, _ SessionRequest, sid string) (string, error) {
		asked <- struct{}{}
		<-release
		return sid, nil
	}}
	h := newHarness(t, host)
	decided := make(chan string, 4)
	h.m.hooks.deadline = func(id string) { decided <- id }
	task := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one", "b/two"), Timeout: time.Minute})
	recv(t, asked, "the start")
	h.clock.Advance(time.Minute)
	recv(t, decided, "the deadline's decision")
	h.m.mu.Lock()
	stop := h.m.led.tasks[task.ID].stop
	h.m.mu.Unlock()
	require.Equal(t, StatusError, stop, "the deadline's stop is recorded while the start is in flight")
	close(release)
	done := h.wait(task.ID)
	assert.Equal(t, StatusError, done.Status)
	assert.Equal(t, ReasonDeadline, done.Outcome.Reason)
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts(), "the session that arrived late was stopped")
	assert.Len(t, done.Attempts, 1)
}

// lateAnswerHost answers a restart's question about a run only once the
// run's abort has removed its session (or after a while): the answer is
// then "gone".
type lateAnswerHost struct {
	svcHost
	removed chan struct{}
	once    sync.Once
}

func (h *lateAnswerHost) AbortSession(ctx context.Context, sid string) error {
	err := h.svcHost.AbortSession(ctx, sid)
	h.once.Do(func() { close(h.removed) })
	return err
}

func (h *lateAnswerHost) SessionStatus(ctx context.Context, sid string) (SessionReport, error) {
	select {
	case <-h.removed:
	case <-time.After(2 * time.Second): // the question may come first: then it is answered as is
	case <-ctx.Done():
	}
	return h.svcHost.SessionStatus(ctx, sid)
}

// A deadline that passed while nobody ran is stopped after the restart;
// if its abort removes the session before the host is asked about the
// run, the answer "gone" is what this life's stop did: the task fails,
// reason deadline, and is not interrupt as "lost across restart".
func TestADeadlineStopAfterARestartIsNotLostToAGoneAnswer(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	j := openJournal(t, dir)
	m := mustOpen(&svcHost{svc: svc}, WithJournal(j), WithIDs(SequentialIDs()), WithClock(clock.NewFake(t0)))
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), Timeout: time.Hour})
	require.NoError(t, err)
	waitStatus(t, m, task.ID, StatusRunning)
	crash(t, m, j)

	host := &lateAnswerHost{svcHost: svcHost{svc: svc, abortOK: true}, removed: make(chan struct{})}
	m2, err := Open(context.Background(), host, WithJournal(openJournal(t, dir)), WithClock(clock.NewFake(t0.Add(2*time.Hour))))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	done, err := m2.Wait(context.Background(), task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusError, done.Status, "%s: %s", done.Status, done.Error)
	assert.Equal(t, ReasonDeadline, done.Outcome.Reason)
}
