package mirror

import (
	"context"
	"fmt"
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
	_, err := m.Task("new")
	assert.NoError(t, err, "absent from an older snapshot, but changed after it: kept")
}

func TestCompleteSnapshotRemovesAbsentTasksAndClearsActivity(t *testing.T) {
	var m Mirror
	m.ApplyChange(bgtask.Change{Seq: 3, Task: task("gone", bgtask.StatusRunning, "")})
	m.ApplyChange(bgtask.Change{Seq: 4, Task: task("a", bgtask.StatusRunning, bgtask.ActivityGenerating)})
	// After a restart the server's snapshot omits activity and the gone task.
	m.ApplySnapshot(bgtask.Snapshot{Seq: 20, Tasks: []bgtask.Task{task("a", bgtask.StatusRunning, "")}})
	_, err := m.Task("gone")
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	got, _ := m.Task("a")
	assert.Equal(t, bgtask.Activity(""), got.Activity, "an omitted activity in a complete snapshot clears it")
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
	_, err := m.Task("x")
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	assert.True(t, m.ApplyChange(bgtask.Change{Seq: 11, Task: task("x", bgtask.StatusPending, "")}), "a newer change is news")
}

// ids lists the mirrored tasks' ids, in the order Tasks returns them.
func ids(m *Mirror) []string {
	var out []string
	for _, t := range m.Tasks() {
		out = append(out, t.ID)
	}
	return out
}

func TestASnapshotFromAnotherEpochReplacesEverything(t *testing.T) {
	tests := []struct {
		name string
		give uint64 // the new process's epoch; the mirror holds epoch 2_000
	}{
		{name: "a larger epoch", give: 3_000},
		{name: "a smaller epoch: the restarted process's clock is behind", give: 1_000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Mirror
			m.ApplySnapshot(bgtask.Snapshot{Epoch: 2_000, Seq: 499})
			require.True(t, m.ApplyChange(bgtask.Change{Epoch: 2_000, Seq: 500, Task: task("x", bgtask.StatusRunning, bgtask.ActivityWaiting)}))
			require.True(t, m.ApplyChange(bgtask.Change{Epoch: 2_000, Seq: 501, Task: task("gone", bgtask.StatusRunning, "")}))

			// The Manager restarted: its sequence starts again, far below
			// what the mirror holds for x.
			m.ApplySnapshot(bgtask.Snapshot{Epoch: tt.give, Seq: 3, Tasks: []bgtask.Task{
				task("x", bgtask.StatusPending, ""),
				task("new", bgtask.StatusPending, ""),
			}})
			assert.Equal(t, []string{"new", "x"}, ids(&m), "exactly the new process's tasks")
			got, err := m.Task("x")
			require.NoError(t, err)
			assert.Equal(t, bgtask.StatusPending, got.Status, "the new process's version, though its sequence is smaller")
			assert.Equal(t, bgtask.Activity(""), got.Activity, "restart clears what was never persisted")

			assert.False(t, m.ApplyChange(bgtask.Change{Epoch: 2_000, Seq: 502, Task: task("x", bgtask.StatusError, "")}), "the old process is over")
			assert.True(t, m.ApplyChange(bgtask.Change{Epoch: tt.give, Seq: 4, Task: task("x", bgtask.StatusRunning, bgtask.ActivityGenerating)}))
			got, _ = m.Task("x")
			assert.Equal(t, bgtask.StatusRunning, got.Status)
		})
	}
}

func TestAChangeFromAnotherEpochIsHeldUntilThatEpochsSnapshot(t *testing.T) {
	var m Mirror
	m.ApplySnapshot(bgtask.Snapshot{Epoch: 2_000, Seq: 10, Tasks: []bgtask.Task{task("a", bgtask.StatusRunning, "")}})

	// The restarted process (clock behind) reports before its snapshot
	// reached the mirror.
	early := bgtask.Change{Epoch: 1_000, Seq: 5, Task: task("b", bgtask.StatusRunning, "")}
	assert.False(t, m.ApplyChange(early))
	assert.Equal(t, []string{"a"}, ids(&m), "the foreign change left the mirror alone")

	m.ApplySnapshot(bgtask.Snapshot{Epoch: 1_000, Seq: 4, Tasks: []bgtask.Task{task("b", bgtask.StatusPending, "")}})
	got, err := m.Task("b")
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, got.Status, "the held change, newer than its epoch's snapshot, applied after it")
	assert.Equal(t, []string{"b"}, ids(&m))
	assert.False(t, m.ApplyChange(early), "the same change again: a duplicate now")
}

func TestTheOldEpochsChangesAreIgnoredAfterTheSwitch(t *testing.T) {
	tests := []struct {
		name string
		give bgtask.Change
	}{
		{name: "newer than the new process's version", give: bgtask.Change{Epoch: 2_000, Seq: 900, Task: task("a", bgtask.StatusError, "")}},
		{name: "older than the new process's version", give: bgtask.Change{Epoch: 2_000, Seq: 1, Task: task("a", bgtask.StatusError, "")}},
		{name: "a task the new process does not have", give: bgtask.Change{Epoch: 2_000, Seq: 901, Task: task("old", bgtask.StatusRunning, "")}},
		{name: "a third epoch", give: bgtask.Change{Epoch: 3_000, Seq: 902, Task: task("a", bgtask.StatusError, "")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Mirror
			m.ApplySnapshot(bgtask.Snapshot{Epoch: 2_000, Seq: 800, Tasks: []bgtask.Task{task("old", bgtask.StatusRunning, "")}})
			m.ApplySnapshot(bgtask.Snapshot{Epoch: 1_000, Seq: 2, Tasks: []bgtask.Task{task("a", bgtask.StatusRunning, "")}})
			require.Equal(t, []string{"a"}, ids(&m))

			assert.False(t, m.ApplyChange(tt.give))
			assert.Equal(t, []string{"a"}, ids(&m))
			got, _ := m.Task("a")
			assert.Equal(t, bgtask.StatusRunning, got.Status)
		})
	}
}

func TestAZeroMirrorTakesTheFirstEpochItIsGiven(t *testing.T) {
	var m Mirror
	// A change newer than the snapshot the client is still fetching.
	require.True(t, m.ApplyChange(bgtask.Change{Epoch: 7, Seq: 12, Task: task("a", bgtask.StatusCompleted, "")}))
	m.ApplySnapshot(bgtask.Snapshot{Epoch: 7, Seq: 10, Tasks: []bgtask.Task{task("a", bgtask.StatusRunning, "")}})
	got, _ := m.Task("a")
	assert.Equal(t, bgtask.StatusCompleted, got.Status, "same epoch: the newer change wins")
	assert.False(t, m.ApplyChange(bgtask.Change{Epoch: 8, Seq: 13, Task: task("a", bgtask.StatusError, "")}), "the epoch is set")
}

// change is a change from epoch at seq setting task id to status.
func change(epoch, seq uint64, id string, status bgtask.Status) bgtask.Change {
	return bgtask.Change{Epoch: epoch, Seq: seq, Task: task(id, status, "")}
}

// statuses maps the mirrored tasks' ids to their statuses.
func statuses(m *Mirror) map[string]bgtask.Status {
	out := map[string]bgtask.Status{}
	for _, t := range m.Tasks() {
		out[t.ID] = t.Status
	}
	return out
}

func TestChangesThatArriveBeforeTheirEpochsSnapshotAreReplayed(t *testing.T) {
	// The mirror follows process 2_000; process 1_000 (its restart, clock
	// behind) sends changes, then its snapshot at seq 10 arrives with a
	// Pending and b Running.
	snap := bgtask.Snapshot{Epoch: 1_000, Seq: 10, Tasks: []bgtask.Task{
		task("a", bgtask.StatusPending, ""),
		task("b", bgtask.StatusRunning, ""),
	}}
	tests := []struct {
		name  string
		early []bgtask.Change // from 1_000, before its snapshot, in arrival order
		want  map[string]bgtask.Status
	}{
		{
			name:  "a change newer than the snapshot survives",
			early: []bgtask.Change{change(1_000, 11, "b", bgtask.StatusCompleted)},
			want:  map[string]bgtask.Status{"a": bgtask.StatusPending, "b": bgtask.StatusCompleted},
		},
		{
			name:  "a change older than the snapshot does not override it",
			early: []bgtask.Change{change(1_000, 9, "a", bgtask.StatusRunning)},
			want:  map[string]bgtask.Status{"a": bgtask.StatusPending, "b": bgtask.StatusRunning},
		},
		{
			name:  "a change the snapshot includes does not override it",
			early: []bgtask.Change{change(1_000, 10, "a", bgtask.StatusRunning)},
			want:  map[string]bgtask.Status{"a": bgtask.StatusPending, "b": bgtask.StatusRunning},
		},
		{
			name: "older and newer together: only the newer applies",
			early: []bgtask.Change{
				change(1_000, 8, "b", bgtask.StatusPending),
				change(1_000, 9, "a", bgtask.StatusRunning),
				change(1_000, 12, "a", bgtask.StatusCompleted),
			},
			want: map[string]bgtask.Status{"a": bgtask.StatusCompleted, "b": bgtask.StatusRunning},
		},
		{
			name: "out of order arrival replays in sequence order",
			early: []bgtask.Change{
				change(1_000, 13, "b", bgtask.StatusCompleted),
				change(1_000, 12, "b", bgtask.StatusError),
			},
			want: map[string]bgtask.Status{"a": bgtask.StatusPending, "b": bgtask.StatusCompleted},
		},
		{
			name:  "a task launched after the snapshot comes in",
			early: []bgtask.Change{change(1_000, 11, "c", bgtask.StatusPending)},
			want:  map[string]bgtask.Status{"a": bgtask.StatusPending, "b": bgtask.StatusRunning, "c": bgtask.StatusPending},
		},
		{
			name:  "a task the snapshot omits, changed before it, stays gone",
			early: []bgtask.Change{change(1_000, 7, "c", bgtask.StatusRunning)},
			want:  map[string]bgtask.Status{"a": bgtask.StatusPending, "b": bgtask.StatusRunning},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Mirror
			m.ApplySnapshot(bgtask.Snapshot{Epoch: 2_000, Seq: 50, Tasks: []bgtask.Task{task("old", bgtask.StatusRunning, "")}})
			for _, c := range tt.early {
				assert.False(t, m.ApplyChange(c), "held, not applied: %s seq %d", c.Task.ID, c.Seq)
			}
			assert.Equal(t, []string{"old"}, ids(&m), "held changes left the mirror alone")

			m.ApplySnapshot(snap)
			assert.Equal(t, tt.want, statuses(&m))
			for _, c := range tt.early {
				assert.False(t, m.ApplyChange(c), "replayed or covered already: %s seq %d", c.Task.ID, c.Seq)
			}
			assert.Equal(t, tt.want, statuses(&m))
		})
	}
}

func TestHeldChangesOfASupersededEpochAreDiscarded(t *testing.T) {
	tests := []struct {
		name string
		// then runs after b1 (epoch 2_000, seq 5, newer than any 2_000
		// snapshot below) was held by a mirror following 1_000.
		then func(t *testing.T, m *Mirror)
	}{
		{
			name: "a change from a third epoch replaces the held ones",
			then: func(t *testing.T, m *Mirror) {
				assert.False(t, m.ApplyChange(change(3_000, 2, "c", bgtask.StatusRunning)))
				m.ApplySnapshot(bgtask.Snapshot{Epoch: 3_000, Seq: 1})
				assert.Equal(t, map[string]bgtask.Status{"c": bgtask.StatusRunning}, statuses(m), "the third epoch's held change replayed")
			},
		},
		{
			name: "a snapshot of a third epoch discards them",
			then: func(t *testing.T, m *Mirror) {
				m.ApplySnapshot(bgtask.Snapshot{Epoch: 3_000, Seq: 1, Tasks: []bgtask.Task{task("c", bgtask.StatusPending, "")}})
				assert.Equal(t, map[string]bgtask.Status{"c": bgtask.StatusPending}, statuses(m))
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Mirror
			m.ApplySnapshot(bgtask.Snapshot{Epoch: 1_000, Seq: 100, Tasks: []bgtask.Task{task("a", bgtask.StatusRunning, "")}})
			b1 := change(2_000, 5, "b", bgtask.StatusCompleted)
			require.False(t, m.ApplyChange(b1))

			tt.then(t, &m)

			// Epoch 2_000's snapshot, should it still come, has nothing
			// held to replay.
			m.ApplySnapshot(bgtask.Snapshot{Epoch: 2_000, Seq: 4, Tasks: []bgtask.Task{task("b", bgtask.StatusRunning, "")}})
			assert.Equal(t, map[string]bgtask.Status{"b": bgtask.StatusRunning}, statuses(&m), "b1 was discarded")
		})
	}
}

func TestTheNextEpochsHeldChangesSurviveTheLeftEpochsLateOnes(t *testing.T) {
	var m Mirror
	m.ApplySnapshot(bgtask.Snapshot{Epoch: 1_000, Seq: 100, Tasks: []bgtask.Task{task("a", bgtask.StatusRunning, "")}})
	m.ApplySnapshot(bgtask.Snapshot{Epoch: 2_000, Seq: 3, Tasks: []bgtask.Task{task("a", bgtask.StatusPending, "")}})

	// 2_000 restarts as 3_000, whose change arrives before its snapshot;
	// then 1_000's late changes, then 2_000's last one.
	require.False(t, m.ApplyChange(change(3_000, 2, "a", bgtask.StatusCompleted)))
	assert.False(t, m.ApplyChange(change(1_000, 101, "a", bgtask.StatusError)), "the epoch left")
	assert.True(t, m.ApplyChange(change(2_000, 4, "a", bgtask.StatusRunning)), "the mirror's epoch still applies")

	m.ApplySnapshot(bgtask.Snapshot{Epoch: 3_000, Seq: 1, Tasks: []bgtask.Task{task("a", bgtask.StatusRunning, "")}})
	assert.Equal(t, map[string]bgtask.Status{"a": bgtask.StatusCompleted}, statuses(&m), "3_000's held change replayed")
}

func TestHeldChangesAreBounded(t *testing.T) {
	tests := []struct {
		name  string
		order func(seqs []uint64) // arranges the arrival order
	}{
		{name: "in order", order: func([]uint64) {}},
		{name: "the oldest arrives last", order: func(seqs []uint64) {
			copy(seqs, append(seqs[1:], seqs[0]))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Mirror
			m.ApplySnapshot(bgtask.Snapshot{Epoch: 1_000, Seq: 1})
			// One more change than is kept, each for its own task, all
			// newer than the snapshot below.
			seqs := make([]uint64, MaxPending+1)
			for i := range seqs {
				seqs[i] = uint64(i + 1)
			}
			tt.order(seqs)
			for _, seq := range seqs {
				require.False(t, m.ApplyChange(change(2_000, seq, fmt.Sprint("t", seq), bgtask.StatusRunning)))
			}
			m.ApplySnapshot(bgtask.Snapshot{Epoch: 2_000})

			got := statuses(&m)
			assert.Len(t, got, MaxPending)
			assert.NotContains(t, got, "t1", "the oldest held change was dropped")
			assert.Contains(t, got, "t2")
			assert.Contains(t, got, fmt.Sprint("t", MaxPending+1), "the newest held change kept")
		})
	}
}
