package bgtask

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// kindsOf are the kinds of views, in order, with a progress line as
// "progress:<text>".
func kindsOf(views []RecordView) []string {
	out := make([]string, 0, len(views))
	for _, v := range views {
		if v.Kind == kindProgress {
			out = append(out, kindProgress+":"+v.Change)
			continue
		}
		out = append(out, v.Kind)
	}
	return out
}

// fallbackRun fails the first attempt (rate limited) after a line of
// progress, and answers on the second after another.
func fallbackRun(ctx context.Context, run Run) (string, error) {
	run.Progress(fmt.Sprintf("attempt %d at work", run.Attempt))
	if run.Attempt == 1 {
		return "", errRateLimited
	}
	return "done", nil
}

// With a journal that reads a task's records back (the file journal), a
// task's history is its records — a fallback across models, the epoch of
// the process life, its notifications — with its lines of progress, in
// the order they happened; another task's records are not in it.
func TestHistoryOfAFileJournalIsTheTasksRecords(t *testing.T) {
	j, err := OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	h := newFuncHarness(t, fallbackRun, WithJournal(j))
	task := h.launchSpec(Spec{ParentSessionID: "p", Prompt: "q", Models: mustModels(t, "a/1", "b/2")})
	other := h.launchSpec(Spec{ParentSessionID: "p2", Prompt: "q", Models: mustModels(t, "b/2")})
	done := h.wait(task.ID)
	require.Equal(t, StatusCompleted, done.Status)
	h.wait(other.ID)

	views, err := h.m.History(context.Background(), task.ID)
	require.NoError(t, err)
	kinds := kindsOf(views)
	for _, want := range []string{"task_launched", "attempt_created", "session_bound", "attempt_finalized", "retry_scheduled",
		"notification_produced", "progress:attempt 1 at work", "progress:attempt 2 at work"} {
		assert.Contains(t, kinds, want)
	}
	assert.Less(t, slices.Index(kinds, "progress:attempt 1 at work"), slices.Index(kinds, "retry_scheduled"), "in the order they happened: %v", kinds)
	assert.Less(t, slices.Index(kinds, "retry_scheduled"), slices.Index(kinds, "progress:attempt 2 at work"), "%v", kinds)
	var attempts []string
	for _, v := range views {
		assert.True(t, v.TaskID == task.ID || v.TaskID == "", "another task's record: %+v", v)
		assert.False(t, v.At.IsZero(), "each step has its time: %+v", v)
		if v.Kind == "attempt_created" {
			attempts = append(attempts, v.Change)
		}
	}
	assert.Equal(t, []string{"attempt 1 created on a/1", "attempt 2 created on b/2"}, attempts, "the fallback, as the records tell it")
	for i := 1; i < len(views); i++ {
		assert.False(t, views[i].At.Before(views[i-1].At), "oldest first: %v then %v", views[i-1], views[i])
	}
}

// Without a journal, a task's history is what the Manager holds of it:
// its launch, each attempt's creation, binding and end, its stop, and its
// lines of progress.
func TestHistoryWithoutAJournalIsWhatTheManagerHolds(t *testing.T) {
	release, reported := make(chan struct{}), make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		if run.Attempt == 1 {
			return fallbackRun(ctx, run)
		}
		run.Progress("waiting to be stopped")
		close(reported)
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-release:
			return "", nil
		}
	})
	defer close(release)
	task := h.launchSpec(Spec{ParentSessionID: "p", Prompt: "q", Models: mustModels(t, "a/1", "b/2")})
	<-reported
	_, err := h.m.Stop(context.Background(), Target{Task: task.ID})
	require.NoError(t, err)

	//lint:ignore SA1012 a nil context is taken as Background, and this says so
	views, err := h.m.History(nil, task.ID)
	require.NoError(t, err)
	assert.Equal(t, []string{"task_launched", "attempt_created", "session_bound", "progress:attempt 1 at work", "attempt_finalized",
		"attempt_created", "session_bound", "progress:waiting to be stopped", "attempt_finalized", "stop_requested"}, kindsOf(views))
	assert.Contains(t, views[len(views)-1].Change, "stopped", "the stop, with who asked for it")
}

// A task keeps its latest 16 lines of progress for its history, not
// every line it ever reported.
func TestHistoryKeepsTheLatestLinesOfProgress(t *testing.T) {
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		for i := range 40 {
			run.Progress(fmt.Sprintf("line %d", i))
		}
		return "done", nil
	})
	task := h.launchSpec(Spec{ParentSessionID: "p", Prompt: "q", Models: mustModels(t, "a/1")})
	h.wait(task.ID)
	views, err := h.m.History(context.Background(), task.ID)
	require.NoError(t, err)
	var lines []string
	for _, v := range views {
		if v.Kind == kindProgress {
			lines = append(lines, v.Change)
		}
	}
	require.Len(t, lines, progressKept)
	assert.Equal(t, "line 24", lines[0])
	assert.Equal(t, "line 39", lines[len(lines)-1])
}

// A blank id is a bad argument; an id no task has is unknown.
func TestHistoryOfNoTask(t *testing.T) {
	h := newFuncHarness(t, fallbackRun)
	_, err := h.m.History(context.Background(), " ")
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = h.m.History(context.Background(), "nope")
	assert.ErrorIs(t, err, ErrUnknownTask)
}

// panickyReader is a journal whose TaskRecords panics.
type panickyReader struct{ Journal }

func (panickyReader) TaskRecords(context.Context, string) ([]Record, error) { panic("boom") }

// A journal whose read-back panics gives History an error that says so;
// the process goes on.
func TestHistoryOfAJournalThatPanics(t *testing.T) {
	j, err := OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	h := newFuncHarness(t, fallbackRun, WithJournal(panickyReader{j}))
	task := h.launchSpec(Spec{ParentSessionID: "p", Prompt: "q", Models: mustModels(t, "a/1", "b/2")})
	h.wait(task.ID)
	_, err = h.m.History(context.Background(), task.ID)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "panicked: boom")
}

// A task that lived across a restart has the process lives in its
// history, between its steps; and a restarted Manager reads the history
// its journal holds.
func TestHistoryTellsARestart(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	host := &svcHost{svc: svc}
	j1 := openJournal(t, dir)
	m1, err := Open(context.Background(), host, WithJournal(j1))
	require.NoError(t, err)
	task, err := m1.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	waitStatus(t, m1, task.ID, StatusRunning)
	// Its binding is durable before the crash: a later launch returns once
	// its own record is, and records land in order.
	barrier, err := m1.Launch(context.Background(), Spec{ParentSessionID: "barrier", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	crash(t, m1, j1)

	j2, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m2, err := Open(context.Background(), host, WithJournal(j2))
	require.NoError(t, err)
	defer func() { require.NoError(t, m2.Shutdown(context.Background())) }()
	waitStatus(t, m2, task.ID, StatusRunning)
	require.NoError(t, m2.Observe(Event{SessionID: "s-" + task.CurrentAttemptID, Kind: SessionIdle, Text: "after"}))
	waitStatus(t, m2, task.ID, StatusCompleted)
	for _, id := range []string{barrier.ID} { // ended too, so that Shutdown has nothing to stop
		b := waitStatus(t, m2, id, StatusRunning)
		require.NoError(t, m2.Observe(Event{SessionID: "s-" + b.CurrentAttemptID, Kind: SessionIdle}))
		waitStatus(t, m2, id, StatusCompleted)
	}

	views, err := m2.History(context.Background(), task.ID)
	require.NoError(t, err)
	kinds := kindsOf(views)
	assert.Less(t, slices.Index(kinds, "session_bound"), slices.Index(kinds, "epoch"), "%v", kinds)
	assert.Less(t, slices.Index(kinds, "epoch"), slices.Index(kinds, "attempt_finalized"), "the restart, between its binding and its end: %v", kinds)
}
