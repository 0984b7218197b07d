package bgtask

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// dlAliveHost is a session service whose sessions are all alive
// (StatusHost), and whose aborts are refused until accept is set; each
// abort refused is sent on aborts, each accepted on accepted.
type dlAliveHost struct {
	testHost
	accept   atomic.Bool
	aborts   chan string
	accepted chan string
}

func newDLAliveHost() *dlAliveHost {
	h := &dlAliveHost{aborts: make(chan string, 16), accepted: make(chan string, 16)}
	h.testHost.abort = func(_ context.Context, sid string) error {
		if h.accept.Load() {
			h.accepted <- sid
			return nil
		}
		h.aborts <- sid
		return errors.New("the session service is busy")
	}
	return h
}

func (h *dlAliveHost) SessionStatus(context.Context, string) (SessionReport, error) {
	return SessionReport{State: SessionStateAlive}, nil
}

func (h *dlAliveHost) FindSession(context.Context, SessionRequest) (string, error) { return "", nil }

// A task's deadline that passed, whose abort the host refused, is asked
// again every 30 seconds (Spec.Timeout's doc) — also after a restart
// ("Both are journaled and armed again after a restart"): the stop was
// asked before the crash, the child is alive, the new life's abort is
// refused too, and the deadline asks again 30 seconds later, until the
// host stops it; the task ends error, reason deadline.
func TestADeadlineWhoseStopWasAskedAsksAgainAfterARestart(t *testing.T) {
	ctx := testCtx(t)
	j := &memJournal{}
	host1 := newDLAliveHost()
	clk1 := clock.NewFake(t0)
	m1, err := Open(ctx, host1, WithJournal(j), WithClock(clk1), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	task, err := m1.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "p", Models: oneModel, Timeout: time.Minute})
	require.NoError(t, err)
	waitStatus(t, m1, task.ID, StatusRunning)
	clk1.Advance(time.Minute)
	recv(t, host1.aborts, "the deadline's abort")                                                          // refused: the child is alive, its stop recorded
	crashed := j.copyWhen(t, func(recs []Record) bool { return hasKind(recs, task.ID, "stop_requested") }) // the stop asked is kept
	host1.accept.Store(true)
	_ = m1.Shutdown(ctx) // the first life's end is no part of the test (its child "did not stop")

	host2 := newDLAliveHost()
	clk2 := clock.NewFake(t0.Add(time.Minute))
	m2, err := Open(ctx, host2, WithJournal(&memJournal{recs: crashed}), WithClock(clk2), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	recv(t, host2.aborts, "the new life's abort of the stopped run") // refused, as every abort until accept
	for {
		_, next := clk2.Created()
		if clk2.Pending() > 0 {
			break
		}
		recv(t, next, "the deadline's next ask (a timer of 30 s)")
	}
	now, err := m2.Task(task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusRunning, now.Status, "alive: never reported stopped")
	host2.accept.Store(true)
	for retries := 0; ; retries++ {
		require.Less(t, retries, 3, "the deadline asks again every 30 s: an abort within 3 of them")
		_, next := clk2.Created()
		clk2.Advance(deadlineRetry)
		timer := time.NewTimer(hangBound) // a bound on a failure, not a wait for a state
		select {
		case <-host2.accepted: // asked again: stopped
			timer.Stop()
		case <-next: // a retry's next timer: 30 s more
			timer.Stop()
			continue
		case <-timer.C:
			t.Fatalf("waited %v after a retry's 30 s for the deadline to ask again or set its next retry", hangBound)
		}
		break
	}
	done, err := m2.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusError, done.Status)
	assert.Equal(t, ReasonDeadline, done.Outcome.Reason)
}
