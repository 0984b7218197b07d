package fleet_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Importing the root fills the hooks in, with the root's own texts.
func TestTheRootFillsTheHooksIn(t *testing.T) {
	n := fleet.AllComplete("chat", []bgtask.Task{{ID: "t1", Status: bgtask.StatusCompleted}}).(bgtask.Notification)
	assert.Equal(t, bgtask.NotifyAllComplete, n.Kind)
	assert.Equal(t, "chat", n.ParentSessionID)
	assert.NotEmpty(t, n.Text)
	b := fleet.BranchClosed("chat", "t1", bgtask.Task{ID: "t1"}, bgtask.ClosureReport{}).(bgtask.Notification)
	assert.Equal(t, bgtask.NotifyBranchClosed, b.Kind)
	assert.Equal(t, "t1", b.TaskID)
}

// atCommit is an AtCommit notifier: the Manager must never call it.
type atCommit struct{ calls chan bgtask.Notification }

func (atCommit) NotesAtCommit() {}
func (a atCommit) Notify(_ context.Context, n bgtask.Notification) error {
	a.calls <- n
	return nil
}

// notesJournal is a file journal that keeps the notifications its
// appends carry (fleet.NoteOf), by kind, in the order appended.
type notesJournal struct {
	bgtask.Journal
	mu    sync.Mutex
	notes []bgtask.Notification
	kinds []string // of every record appended
}

func (j *notesJournal) Append(b []bgtask.Record) bgtask.Commit {
	j.mu.Lock()
	for i := range b {
		j.kinds = append(j.kinds, b[i].Kind)
		if n, ok := fleet.NoteOf(&b[i]).(*bgtask.Notification); ok {
			j.notes = append(j.notes, *n)
		} else if b[i].Kind == "notification_produced" {
			j.notes = append(j.notes, bgtask.Notification{Kind: "missing"})
		}
	}
	j.mu.Unlock()
	return j.Journal.Append(b)
}

func (j *notesJournal) seen() ([]bgtask.Notification, []string) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.notes), slices.Clone(j.kinds)
}

// With an AtCommit notifier and a journal, each notification rides its
// commit: the journal gets it with its notification_produced record, the
// Notifier is never called, no notification_delivered is written, and a
// restart owes nothing again.
func TestANotifierAtCommitGetsEachNotificationWithItsCommit(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	calls := make(chan bgtask.Notification, 16)
	open := func() (*bgtask.Manager, *notesJournal) {
		fj, err := bgtask.OpenFileJournal(dir)
		require.NoError(t, err)
		j := &notesJournal{Journal: fj}
		m, err := bgtask.Open(ctx, nil, bgtask.WithJournal(j), bgtask.WithNotifier(atCommit{calls: calls}))
		require.NoError(t, err)
		return m, j
	}
	m, j := open()
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Run: func(context.Context, bgtask.Run) (string, error) { return "done", nil }})
	require.NoError(t, err)
	_, err = m.Wait(ctx, task.ID)
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(ctx))

	notes, kinds := j.seen()
	var got []bgtask.NotificationKind
	for _, n := range notes {
		got = append(got, n.Kind)
		assert.NotEmpty(t, n.ID)
		assert.Equal(t, "chat", n.ParentSessionID)
	}
	assert.Contains(t, got, bgtask.NotifyFinalSummary)
	assert.Contains(t, got, bgtask.NotifyAllComplete)
	assert.NotContains(t, got, bgtask.NotificationKind("missing"), "every notification_produced record carries its notification")
	for _, n := range notes {
		if n.Kind == bgtask.NotifyFinalSummary {
			assert.Equal(t, task.ID, n.TaskID)
			assert.Equal(t, bgtask.StatusCompleted, n.Task.Status, "the summary holds the task as it ended")
		}
	}
	assert.NotContains(t, kinds, "notification_delivered")

	// A restart owes nothing: what was produced was delivered with it.
	m2, j2 := open()
	require.NoError(t, m2.Shutdown(ctx))
	notes2, _ := j2.seen()
	assert.Empty(t, notes2, "nothing produced again")
	select {
	case n := <-calls:
		t.Fatalf("the Notifier was called: %+v", n)
	default:
	}
}
