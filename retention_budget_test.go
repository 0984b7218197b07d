package bgtask

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Retention keeps the task that holds a budget while a task in memory
// names it (README, "Exact across restarts": "the task that holds the
// budget stays while its tree lives, or a task in memory names it"),
// though its tree has ended. Here the holder ends first (stopped alone),
// so it is the oldest ended task and retention, keeping one, looks at it
// first: it must stay while its child is in memory, and the child goes.
func TestRetentionKeepsABudgetsHolderWhileATaskInMemoryNamesIt(t *testing.T) {
	ctx := testCtx(t)
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: 1}))
	root := h.running("chat", withBudget(Budget{Tokens: 10_000, Spawns: 5}))
	child := h.running(root.SessionID)
	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionUsage, Usage: u(40, 2, 1, 0)}))

	require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: root.ID})))
	assert.Equal(t, StatusCancelled, h.wait(root.ID).Status)
	assert.Equal(t, StatusRunning, h.task(child.ID).Status, "the child was not stopped: only the root was")
	require.NoError(t, h.m.notes.lanes.Wait(ctx)) // the root's notifications are out: nothing but its budget keeps it

	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionIdle, Text: "done"}))
	if _, err := h.m.Wait(ctx, child.ID); !errors.Is(err, ErrForgotten) {
		require.NoError(t, err)
	}
	h.settle()
	require.NoError(t, h.m.notes.lanes.Wait(ctx))

	// Whatever retention forgot, the holder of a budget a task in memory
	// names is still there, and so is what its tree spent.
	_, childErr := h.m.Task(child.ID)
	_, rootErr := h.m.Task(root.ID)
	if childErr == nil {
		require.NoError(t, rootErr, "the child, in memory, names the root's budget: the root must stay")
		s := budgetOf(t, h.m, child.ID)
		assert.Equal(t, root.ID, s.TaskID)
	} else {
		require.ErrorIs(t, childErr, ErrForgotten)
	}
	require.NoError(t, rootErr, "retention keeps one ended task: the root, since the child (newer) may go and the root may not while the child stays")
	s := budgetOf(t, h.m, root.ID)
	assert.Equal(t, int64(42), s.Spent.Tokens(), "the budget keeps what its forgotten child spent")
	assert.Equal(t, int64(1), s.Spawned)
}
