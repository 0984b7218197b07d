package bgtask

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Every stop says who asked: in the snapshot (Task.Stop), in Cause (a
// *StopError matching ErrCancelled for a cancelled task), in the Timeline
// (and so the final summary), in the envelope and in the task-ended log.
func TestEveryStopSaysWhoAsked(t *testing.T) {
	for _, tt := range []struct {
		name   string
		stop   func(h *harness, task Task)
		want   StopCause
		status Status
	}{
		{"Cancel", func(h *harness, task Task) {
			require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
		},
			StopCause{Kind: StopCancel}, StatusCancelled},
		{"Stop", func(h *harness, task Task) {
			require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID, NoWait: true})))
		},
			StopCause{Kind: StopCancel}, StatusCancelled},
		{"CloseBranch", func(h *harness, task Task) {
			_, err := h.m.Stop(context.Background(), Target{Session: "chat"})
			require.NoError(t, err)
		}, StopCause{Kind: StopClosure, Root: "chat"}, StatusCancelled},
		{"CloseTask", func(h *harness, task Task) {
			_, err := h.m.Stop(context.Background(), Target{Task: task.ID, Tree: true})
			require.NoError(t, err)
		}, StopCause{Kind: StopClosure, TaskID: "task-1"}, StatusCancelled}, // the task closed as a unit, not its session
		{"a deleted session", func(h *harness, task Task) {
			require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionDeleted}))
		}, StopCause{Kind: StopSessionDeleted}, StatusCancelled},
		{"Shutdown", func(h *harness, task Task) { require.NoError(t, h.m.Shutdown(context.Background())) },
			StopCause{Kind: StopShutdown}, StatusInterrupt},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, nil)
			task := h.running("chat")
			tt.stop(h, task)
			done := h.wait(task.ID)
			require.Equal(t, tt.status, done.Status)
			require.NotNil(t, done.Stop)
			assert.Equal(t, tt.want, *done.Stop)
			var se *StopError
			require.ErrorAs(t, done.Cause, &se, "a stopped task's Cause is never nil")
			assert.Equal(t, tt.want, se.Stop)
			assert.Equal(t, tt.status == StatusCancelled, errors.Is(done.Cause, ErrCancelled))
			assert.Equal(t, tt.want.Kind == StopShutdown, errors.Is(done.Cause, ErrShutdown))
			said := tt.want.String()
			assert.Contains(t, Timeline(done), "\nStopped: "+said)
			assert.Contains(t, done.Outcome.Envelope, "stopped: "+said)
			h.settle() // the line is written as the lock is let go, maybe after Wait returned
			logged := false
			for _, r := range h.logs.Records() {
				if r["msg"] == "task ended" && r["task"] == task.ID {
					logged = r["stop"] == said
				}
			}
			assert.True(t, logged, "the task-ended line says who asked: %v", h.logs.Records())
		})
	}
}

// A deadline's stop ends the task in error: its Cause stays the deadline,
// and Stop says who asked.
func TestADeadlineSaysSo(t *testing.T) {
	h := newHarness(t, nil)
	task := h.running("chat", func(s *Spec) { s.Timeout = time.Minute })
	h.clock.Advance(time.Minute)
	done := h.wait(task.ID)
	require.Equal(t, StatusError, done.Status)
	require.NotNil(t, done.Stop)
	assert.Equal(t, StopCause{Kind: StopDeadline}, *done.Stop)
	assert.ErrorIs(t, done.Cause, ReasonDeadline)
	assert.Contains(t, Timeline(done), "Stopped: its deadline passed")
}

// A stop asked of a run whose child ended on its own first leaves the
// child's outcome; Stop still says a stop was asked. A task never stopped
// has none.
func TestAStopTheChildOutranKeepsTheChildsOutcome(t *testing.T) {
	release := make(chan struct{})
	host := &testHost{abort: func(ctx context.Context, sid string) error {
		<-release
		return nil
	}}
	h := newHarness(t, host)
	task := h.running("chat")
	other := h.running("chat")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID, NoWait: true})))
	require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "finished first"}))
	close(release)
	done := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	require.NotNil(t, done.Stop)
	assert.Nil(t, done.Cause, "it completed: nothing failed")
	assert.NotContains(t, done.Outcome.Envelope, "stopped:", "the answer stands")

	require.NoError(t, h.observe(Event{SessionID: other.SessionID, Kind: SessionIdle, Text: "done"}))
	plain := h.wait(other.ID)
	assert.Nil(t, plain.Stop)
	assert.NotContains(t, Timeline(plain), "Stop asked")
}

// Who asked survives a restart: it is in the ledger.
func TestAStopCauseSurvivesARestart(t *testing.T) {
	dir := t.TempDir()
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m, err := Open(context.Background(), &testHost{}, WithJournal(j))
	require.NoError(t, err)
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: []Model{{ID: "m"}}})
	require.NoError(t, err)
	waitFor(t, m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
	_, err = m.Stop(context.Background(), Target{Session: "chat"})
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(context.Background()))

	j, err = OpenFileJournal(dir)
	require.NoError(t, err)
	m, err = Open(context.Background(), &testHost{}, WithJournal(j))
	require.NoError(t, err)
	shutdownAtCleanup(t, m)
	again, err := m.Task(task.ID)
	require.NoError(t, err)
	require.NotNil(t, again.Stop)
	assert.Equal(t, StopCause{Kind: StopClosure, Root: "chat"}, *again.Stop)
	assert.ErrorIs(t, again.Cause, ErrCancelled, "rebuilt from the ledger: never nil")
	assert.True(t, strings.HasSuffix(Timeline(again), "Stopped: everything session chat started was stopped"))
}

func TestStopCauseOfAnUnknownNote(t *testing.T) {
	c := stopCauseOf("a future release's stop")
	assert.Equal(t, StopCause{Kind: StopOther, Note: "a future release's stop"}, c)
	assert.Equal(t, "a stop was asked (a future release's stop)", c.String())
}

// A compaction rewrites the stop as it was asked: who asked survives it.
func TestACompactionKeepsWhoAsked(t *testing.T) {
	h := newHarness(t, nil)
	task := h.running("chat")
	_, err := h.m.Stop(context.Background(), Target{Session: "chat"})
	require.NoError(t, err)
	h.wait(task.ID)
	h.settle()
	h.m.mu.Lock()
	recs := h.m.snapshotRecords()
	h.m.mu.Unlock()
	l, _, err := replayLedger(recs)
	require.NoError(t, err)
	got := l.tasks[task.ID].project()
	require.NotNil(t, got.Stop)
	assert.Equal(t, StopCause{Kind: StopClosure, Root: "chat"}, *got.Stop)
}

// A stop that did not end the task (a crash came first: it ended
// interrupt, lost across restart) is not blamed for its end.
func TestAStopIsNotBlamedForAnEndItDidNotBring(t *testing.T) {
	dir := t.TempDir()
	release := make(chan struct{})
	cj := openJournal(t, dir)
	m, err := Open(context.Background(), &testHost{abort: func(ctx context.Context, sid string) error {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return ctx.Err()
	}}, WithJournal(cj))
	require.NoError(t, err)
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: []Model{{ID: "m"}}})
	require.NoError(t, err)
	waitFor(t, m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
	require.NoError(t, stopErr(m.Stop(context.Background(), Target{Task: task.ID, NoWait: true})))
	crash(t, m, cj)
	close(release)

	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m2, err := Open(context.Background(), &testHost{}, WithJournal(j))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	done, err := m2.Task(task.ID)
	require.NoError(t, err)
	require.Equal(t, StatusInterrupt, done.Status)
	require.NotNil(t, done.Stop, "a stop was asked")
	assert.Equal(t, StopCancel, done.Stop.Kind)
	var se *StopError
	assert.False(t, errors.As(done.Cause, &se), "it did not end the task: %v", done.Cause)
}

// A stop with Target.Cause records that cause, not a cancel; every kind
// reads back as it was given.
func TestTargetCauseSaysWhoAsked(t *testing.T) {
	h := newHarness(t, nil)
	closure := StopCause{Kind: StopClosure, Root: "chat"}
	a := h.running("chat")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Run: RunRef{TaskID: a.ID, AttemptID: a.CurrentAttemptID, Token: a.Current().Token}, Cause: &closure})))
	done := h.wait(a.ID)
	require.NotNil(t, done.Stop)
	assert.Equal(t, closure, *done.Stop)
	assert.Equal(t, StatusCancelled, done.Status)

	b := h.running("chat")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: b.ID, NoWait: true, Cause: &StopCause{Kind: StopCaller, TaskID: "t-9"}})))
	assert.Equal(t, StopCause{Kind: StopCaller, TaskID: "t-9"}, *h.wait(b.ID).Stop)
	_, err := h.m.Stop(context.Background(), Target{Session: "chat", Cause: &closure})
	assert.ErrorIs(t, err, ErrInvalidArgument, "a closure records its own cause")

	for _, c := range []StopCause{{Kind: StopCancel}, {Kind: StopShutdown}, {Kind: StopDeadline}, {Kind: StopSessionDeleted},
		{Kind: StopCaller, TaskID: "t"}, {Kind: StopClosure, Root: "s"}, {Kind: StopClosure, TaskID: "t"}, {Kind: StopOther, Note: "x"}} {
		assert.Equal(t, c, stopCauseOf(c.note()), "%+v", c)
	}
}
