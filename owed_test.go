package bgtask

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A task that ended in a life without a Notifier was never to be told: a
// restart with a Notifier does not announce it (nothing is owed), while a
// task that ended in a life with one and whose final summary was lost
// (a journal that did not keep the batch whole) is told once.
func TestOnlyWhatWasOwedIsToldAfterARestart(t *testing.T) {
	ctx := context.Background()
	j := &memJournal{}
	w := newCrashWorld()
	m1, err := Open(ctx, w, WithJournal(j), WithIDs(SequentialIDs())) // no Notifier
	require.NoError(t, err)
	quiet, err := m1.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "go", Models: mustModels(t, "a/1")})
	require.NoError(t, err)
	quiet = waitStatus(t, m1, quiet.ID, StatusRunning)
	w.end(quiet.SessionID, Event{Kind: SessionIdle, Text: "done"})
	require.NoError(t, m1.Observe(Event{SessionID: quiet.SessionID, Kind: SessionIdle, Text: "done"}))
	_, err = m1.Wait(ctx, quiet.ID)
	require.NoError(t, err)
	require.NoError(t, m1.Shutdown(ctx))

	// A second life, with a Notifier: a task ends, and the record of its
	// final summary is lost (cut off).
	rec := &crashRecorder{}
	m2, err := Open(ctx, w, WithJournal(j), WithIDs(SequentialIDs()), WithNotifier(rec))
	require.NoError(t, err)
	told, err := m2.Launch(ctx, Spec{ParentSessionID: "q", Prompt: "go", Models: mustModels(t, "a/1")})
	require.NoError(t, err)
	told = waitStatus(t, m2, told.ID, StatusRunning)
	j.await(t, func(recs []Record) bool { // the bind is kept before the crash
		return hasKind(recs, told.ID, "session_bound")
	})
	w.end(told.SessionID, Event{Kind: SessionIdle, Text: "done"})
	j.mu.Lock()
	j.crashed = true // the end is decided, and not kept
	j.mu.Unlock()
	require.NoError(t, m2.Observe(Event{SessionID: told.SessionID, Kind: SessionIdle, Text: "done"}))
	require.NoError(t, m2.Shutdown(ctx))
	j.mu.Lock()
	j.crashed = false
	j.mu.Unlock()

	// Its end is replayed (a non-atomic journal kept it) without the
	// notifications: keep the final record, drop what followed.
	keep := -1
	for i, r := range j.recs {
		if r.TaskID == told.ID && r.Kind == "session_bound" {
			keep = i
		}
	}
	require.GreaterOrEqual(t, keep, 0)
	finalRec, err := m2Final(t, told)
	require.NoError(t, err)
	j.recs = append(j.recs[:keep+1:keep+1], finalRec)

	rec3 := &crashRecorder{w: w}
	m3, err := Open(ctx, w, WithJournal(j), WithIDs(SequentialIDs()), WithNotifier(rec3))
	require.NoError(t, err)
	got, err := m3.Task(told.ID)
	require.NoError(t, err)
	require.Equal(t, StatusCompleted, got.Status)
	require.NoError(t, m3.Shutdown(ctx))
	var finals []string
	for _, n := range rec3.all() {
		if n.Kind == NotifyFinalSummary {
			finals = append(finals, n.TaskID)
		}
	}
	assert.Equal(t, []string{told.ID}, finals, "the end whose summary was lost is told; the one from the quiet life is not")
}

// m2Final is the record that completes task's first attempt, as the live
// Manager made it (encoded by the same code).
func m2Final(t *testing.T, task Task) (Record, error) {
	t.Helper()
	a := task.Attempts[0]
	a.Status, a.CompletedAt = StatusCompleted, a.StartedAt
	return encodeRecord(&record{seq: 1 << 40, kind: recAttemptFinal, task: task.ID, at: a.StartedAt, attempt: a, evidence: evidence{output: "done"}})
}
