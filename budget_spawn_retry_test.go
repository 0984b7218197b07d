package bgtask

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A task is one spawn however many attempts it makes (README "Spawns":
// a task holds its reservation until a session of it runs, then it is
// spawned): its retry reserves nothing more, so the budget's figures and
// what is left are those of one spawn.
func TestARetriedChildIsOneSpawn(t *testing.T) {
	h := newHarness(t, nil, WithRetryDelay(func(int, error) time.Duration { return 0 }))
	root := h.running("chat", withBudget(Budget{Spawns: 2, SoftPercent: 100}))
	child := h.running(root.SessionID) // a/one, then b/two
	s := budgetOf(t, h.m, root.ID)
	require.Equal(t, int64(1), s.Spawned)
	require.Zero(t, s.Reserved)

	require.NoError(t, h.observe(Event{SessionID: child.SessionID, Kind: SessionError, Err: errors.New("429 Too Many Requests")}))
	retried := waitFor(t, h.m, child.ID, func(t Task) bool { return len(t.Attempts) == 2 && t.Status == StatusRunning })
	assert.Equal(t, "b/two", retried.Model.String())
	s = budgetOf(t, h.m, root.ID)
	assert.Equal(t, int64(1), s.Spawned, "the child is one spawn")
	assert.Zero(t, s.Reserved, "its retry reserves nothing")
	assert.Equal(t, int64(1), s.Left.Spawns)

	second := h.running(root.SessionID)
	require.Equal(t, StatusRunning, second.Status, "the second spawn of two is admitted")
	_, err := h.m.Launch(testCtx(t), Spec{ParentSessionID: root.SessionID, Prompt: "third", Models: oneModel})
	var be *BudgetError
	require.ErrorAs(t, err, &be, "a third is past the limit")
	assert.Equal(t, BudgetError{TaskID: root.ID, Limit: LimitSpawns, Max: 2, Spent: 2}, *be)
}
