package bgtask_test

import (
	"context"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/bgtask/bgtask/mirror"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// restartHost is a scripted Host. A child whose prompt is "answer" reports
// its answer at once (held, and applied at the bind); any other child runs
// until the test observes an event for it or the Manager shuts down.
type restartHost struct {
	m *bgtask.Manager // set before the first Launch
}

func (h *restartHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	if req.Prompt == "answer" {
		_ = h.m.Observe(bgtask.Event{AttemptID: req.AttemptID, Kind: bgtask.SessionIdle, Text: "done"})
	}
	return "ses-" + req.AttemptID, nil
}

func (h *restartHost) AbortSession(ctx context.Context, sessionID string) error { return nil }

// newProcess starts a Manager as one process life with the given epoch; it
// is shut down when the test ends. Every process counts its ids from 1, so
// a restart reuses the task ids of the process before it.
func newProcess(t *testing.T, epoch uint64) *bgtask.Manager {
	t.Helper()
	h := &restartHost{}
	m := testkit.MustOpen(h, bgtask.WithIDs(bgtask.SequentialIDs()))
	h.m = m
	bgtask.SetEpochForTest(m, epoch)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	return m
}

// follow applies the changes from sub to mr until cond holds for its tasks.
func follow(ctx context.Context, t *testing.T, mr *mirror.Mirror, sub *bgtask.Subscription, cond func([]bgtask.Task) bool) {
	t.Helper()
	for !cond(mr.Tasks()) {
		select {
		case c, ok := <-sub.C:
			require.True(t, ok, "the subscription ended: %v", sub.Err())
			mr.ApplyChange(c)
		case <-ctx.Done():
			require.FailNow(t, "the mirror never got there", "tasks: %+v", mr.Tasks())
		}
	}
}

// byID indexes tasks by id.
func byID(ts []bgtask.Task) map[string]bgtask.Task {
	out := make(map[string]bgtask.Task, len(ts))
	for _, t := range ts {
		out[t.ID] = t
	}
	return out
}

func launch(ctx context.Context, t *testing.T, m *bgtask.Manager, desc, prompt string) bgtask.Task {
	t.Helper()
	task, err := m.Launch(ctx, bgtask.Spec{
		ParentSessionID: "ui",
		Description:     desc,
		Prompt:          prompt,
		Models:          []bgtask.Model{{Provider: "p", ID: "m"}},
	})
	require.NoError(t, err)
	return task
}

func TestMirrorFollowsARestartedManagerWhoseClockWentBack(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	var mr mirror.Mirror

	// Process A: one task answered, two running, one of them generating.
	a := newProcess(t, 2_000)
	subA, err := a.Subscribe(ctx, 0)
	require.NoError(t, err)
	a1 := launch(ctx, t, a, "A1", "answer")
	a2 := launch(ctx, t, a, "A2", "work")
	a3 := launch(ctx, t, a, "A3", "work")
	mr.ApplySnapshot(a.Snapshot())
	follow(ctx, t, &mr, subA, func(ts []bgtask.Task) bool {
		got := byID(ts)
		return got[a1.ID].Status == bgtask.StatusCompleted &&
			got[a2.ID].Status == bgtask.StatusRunning && got[a3.ID].Status == bgtask.StatusRunning
	})
	got, _ := mr.Task(a2.ID)
	require.NoError(t, a.Observe(bgtask.Event{SessionID: got.SessionID, Kind: bgtask.SessionBusy}))
	follow(ctx, t, &mr, subA, func(ts []bgtask.Task) bool {
		return byID(ts)[a2.ID].Activity == bgtask.ActivityGenerating
	})
	require.Len(t, mr.Tasks(), 3)

	// The restart. A's last changes (its shutdown interrupting the running
	// tasks) are still on their way to the mirror.
	require.NoError(t, a.Shutdown(ctx))
	late := bgtask.RecvAllForTest(t, subA.C, "A's subscription to end at its Shutdown")
	require.ErrorIs(t, subA.Err(), bgtask.ErrShutdown)
	require.NotEmpty(t, late, "A's shutdown published changes")

	// Process B, whose clock is behind: a smaller epoch, sequences from 1,
	// and the same task ids for different tasks.
	b := newProcess(t, 1_000)
	subB, err := b.Subscribe(ctx, 0)
	require.NoError(t, err)
	b1 := launch(ctx, t, b, "B1", "work")
	b2 := launch(ctx, t, b, "B2", "work")
	require.Equal(t, []string{a1.ID, a2.ID}, []string{b1.ID, b2.ID}, "the restart reuses the ids")

	// B's first change reaches the mirror before B's snapshot: ignored.
	first := bgtask.RecvForTest(t, subB.C, "B's first change")
	require.Equal(t, b1.ID, first.Task.ID)
	before := mr.Tasks()
	assert.False(t, mr.ApplyChange(first), "a change from B before B's snapshot")
	assert.Equal(t, before, mr.Tasks())

	snapB := b.Snapshot()
	require.Less(t, snapB.Epoch, uint64(2_000))
	mr.ApplySnapshot(snapB)
	assert.Equal(t, snapB.Tasks, mr.Tasks(), "the mirror holds exactly B's tasks")

	// A's late changes: each newer, by its own sequence, than anything B
	// has said, and for ids B reuses.
	require.Greater(t, late[len(late)-1].Seq, snapB.Seq)
	for _, c := range late {
		assert.False(t, mr.ApplyChange(c), "late change from A: %s seq %d", c.Task.ID, c.Seq)
	}
	assert.Equal(t, snapB.Tasks, mr.Tasks(), "A's late changes left B's tasks alone")

	// B's later changes apply: both start, B1 answers.
	follow(ctx, t, &mr, subB, func(ts []bgtask.Task) bool {
		got := byID(ts)
		return got[b1.ID].Status == bgtask.StatusRunning && got[b2.ID].Status == bgtask.StatusRunning
	})
	got, _ = mr.Task(b1.ID)
	require.NoError(t, b.Observe(bgtask.Event{SessionID: got.SessionID, Kind: bgtask.SessionIdle, Text: "B's answer"}))
	done, err := b.Wait(ctx, b1.ID)
	require.NoError(t, err)
	follow(ctx, t, &mr, subB, func(ts []bgtask.Task) bool {
		return byID(ts)[b1.ID].Revision == done.Revision
	})
	got, _ = mr.Task(b1.ID)
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
	assert.Equal(t, "B1", got.Description)
	assert.Equal(t, "B's answer", got.Result)
	assert.Equal(t, b.Snapshot().Tasks, mr.Tasks(), "the mirror converged on B")
	for _, c := range late {
		assert.False(t, mr.ApplyChange(c), "still A's: %s seq %d", c.Task.ID, c.Seq)
	}
}
