package mirror

import (
	"context"
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func task(id string, status bgtask.Status, act bgtask.Activity) bgtask.Task {
	return bgtask.Task{ID: id, Status: status, Activity: act}
}

func TestOlderChangeIsIgnored(t *testing.T) {
	var m Mirror
	assert.True(t, m.ApplyChange(bgtask.Change{Seq: 5, Task: task("a", bgtask.StatusCompleted, "")}))
	assert.False(t, m.ApplyChange(bgtask.Change{Seq: 4, Task: task("a", bgtask.StatusRunning, bgtask.ActivityGenerating)}))
	assert.False(t, m.ApplyChange(bgtask.Change{Seq: 5, Task: task("a", bgtask.StatusRunning, "")}), "a duplicate")
	got, _ := m.Task("a")
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
}

func TestSnapshotOvertakenByANewerChangeDoesNotErase(t *testing.T) {
	var m Mirror
	// The snapshot was taken at seq 10, but change 12 arrived first.
	m.ApplyChange(bgtask.Change{Seq: 12, Task: task("a", bgtask.StatusRunning, bgtask.ActivityGenerating)})
	m.ApplyChange(bgtask.Change{Seq: 11, Task: task("new", bgtask.StatusPending, "")})
	m.ApplySnapshot(bgtask.Snapshot{Seq: 10, Tasks: []bgtask.Task{task("a", bgtask.StatusPending, "")}})
	got, _ := m.Task("a")
	assert.Equal(t, bgtask.StatusRunning, got.Status, "the newer event wins")
	assert.Equal(t, bgtask.ActivityGenerating, got.Activity)
	_, ok := m.Task("new")
	assert.True(t, ok, "absent from an older snapshot, but changed after it: kept")
}

func TestCompleteSnapshotRemovesAbsentTasksAndClearsActivity(t *testing.T) {
	var m Mirror
	m.ApplyChange(bgtask.Change{Seq: 3, Task: task("gone", bgtask.StatusRunning, "")})
	m.ApplyChange(bgtask.Change{Seq: 4, Task: task("a", bgtask.StatusRunning, bgtask.ActivityGenerating)})
	// After a restart the server's snapshot omits activity and the gone task.
	m.ApplySnapshot(bgtask.Snapshot{Seq: 20, Tasks: []bgtask.Task{task("a", bgtask.StatusRunning, "")}})
	_, ok := m.Task("gone")
	assert.False(t, ok)
	got, _ := m.Task("a")
	assert.Equal(t, bgtask.ActivityNone, got.Activity, "an omitted activity in a complete snapshot clears it")
	require.Len(t, m.Tasks(), 1)
	// A change older than the snapshot is ignored afterwards.
	assert.False(t, m.ApplyChange(bgtask.Change{Seq: 19, Task: task("a", bgtask.StatusError, "")}))
}

func TestWaitWakesOnApply(t *testing.T) {
	var m Mirror
	done := make(chan error, 1)
	go func() {
		done <- m.Wait(context.Background(), func(ts []bgtask.Task) bool { return len(ts) == 1 })
	}()
	m.ApplyChange(bgtask.Change{Seq: 1, Task: task("a", bgtask.StatusRunning, "")})
	require.NoError(t, <-done)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, m.Wait(ctx, func([]bgtask.Task) bool { return false }), context.Canceled)
}

func TestNothingOlderThanACompleteSnapshotBringsATaskBack(t *testing.T) {
	var m Mirror
	m.ApplySnapshot(bgtask.Snapshot{Seq: 10}) // complete: no task x as of 10
	assert.False(t, m.ApplyChange(bgtask.Change{Seq: 5, Task: task("x", bgtask.StatusRunning, "")}))
	m.ApplySnapshot(bgtask.Snapshot{Seq: 7, Tasks: []bgtask.Task{task("x", bgtask.StatusRunning, "")}})
	_, ok := m.Task("x")
	assert.False(t, ok)
	assert.True(t, m.ApplyChange(bgtask.Change{Seq: 11, Task: task("x", bgtask.StatusPending, "")}), "a newer change is news")
}

func TestALaterProcessReplacesWhatAnEarlierOneSaid(t *testing.T) {
	var m Mirror
	m.ApplyChange(bgtask.Change{Epoch: 1, Seq: 500, Task: task("x", bgtask.StatusRunning, bgtask.ActivityWaiting)})
	m.ApplyChange(bgtask.Change{Epoch: 1, Seq: 501, Task: task("gone", bgtask.StatusRunning, "")})
	// The Manager restarted: its sequence starts again.
	m.ApplySnapshot(bgtask.Snapshot{Epoch: 2, Seq: 3, Tasks: []bgtask.Task{task("x", bgtask.StatusRunning, "")}})
	got, ok := m.Task("x")
	require.True(t, ok)
	assert.Equal(t, bgtask.ActivityNone, got.Activity, "restart clears what was never persisted")
	_, ok = m.Task("gone")
	assert.False(t, ok)
	assert.False(t, m.ApplyChange(bgtask.Change{Epoch: 1, Seq: 502, Task: task("x", bgtask.StatusError, "")}), "the old process is over")
}
