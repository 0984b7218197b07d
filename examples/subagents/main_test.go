package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newHarness(t *testing.T) *Harness {
	t.Helper()
	h := New()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		assert.NoError(t, h.M.Shutdown(ctx))
	})
	return h
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestATreeOfSubagentsThreeLevelsDeep(t *testing.T) {
	h := newHarness(t)
	tree, err := h.Tree(testCtx(t), "chat-1")
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, tree.Root.Status)
	require.Len(t, tree.Tasks, 5, "1 + 2 + 2 subagents")
	depths := map[int]int{}
	for _, task := range tree.Tasks {
		assert.Equal(t, bgtask.StatusCompleted, task.Status, task.ID)
		assert.Equal(t, "chat-1", task.Root)
		depths[task.Depth]++
	}
	assert.Equal(t, map[int]int{1: 1, 2: 2, 3: 2}, depths)

	// The structured result came up the tree; its text form is ForModel.
	assert.Equal(t, "4 subagents answered, 2 spawns refused", tree.Root.Result)
	assert.Len(t, tree.Result.ForUser, 5)
	assert.Contains(t, tree.Result.ForUser[0], "chat chat-1", "the launch context's values reached the function")
	require.Len(t, tree.Result.Refused, 2, "each depth-3 leaf was refused a fourth level")
	for _, r := range tree.Result.Refused {
		assert.Contains(t, r, "depth 3: spawn depth limit reached (3)")
	}
	calls := h.OnDoneCalls()
	assert.Len(t, calls, 5)
	for id, n := range calls {
		assert.Equal(t, 1, n, "OnDone of %s exactly once", id)
	}
	assert.Equal(t, "gpt-primary", tree.Root.Model.String(), "a router alias, no provider")
}

func TestAFanOutPastTheCapWaitsItsTurn(t *testing.T) {
	h := newHarness(t)
	fan, err := h.Fan(testCtx(t), "chat-2", 7)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, fan.Fan.Status)
	assert.Equal(t, []int{1, 2, 3, 4, 5}, fan.Launched, "five launched at once")
	assert.True(t, fan.WaitedForSlot, "the sixth and seventh waited for a slot")
	assert.Equal(t, MaxPerParent, fan.MaxLive, "never more than five live under one parent")
	require.Len(t, fan.Tasks, 7)
	for _, task := range fan.Tasks {
		assert.Equal(t, bgtask.StatusCompleted, task.Status)
		assert.Equal(t, 2, task.Depth)
	}
	assert.Equal(t, "7 subagents answered, 0 spawns refused", fan.Result.ForModel)
}

func TestANestedStopADeadlineAndACallerWhoLeft(t *testing.T) {
	h := newHarness(t)
	stops, err := h.Stops(testCtx(t), "chat-3")
	require.NoError(t, err)

	require.Len(t, stops.Branch, 3, "the branch: its subagent and the two it spawned")
	for _, task := range stops.Branch {
		assert.Equal(t, bgtask.StatusCancelled, task.Status, "%s %s", task.ID, task.Description)
	}
	assert.Len(t, stops.Stopped.Stopped, 3, "every run in the branch stopped, by token")
	assert.Equal(t, bgtask.StatusCompleted, stops.Sibling.Status, "the sibling branch ran on")

	assert.Equal(t, bgtask.StatusError, stops.Deadline.Status)
	require.NotNil(t, stops.Deadline.Outcome)
	assert.Equal(t, bgtask.ReasonDeadline, stops.Deadline.Outcome.Reason)
	assert.ErrorIs(t, stops.Deadline.Cause, bgtask.ReasonDeadline)
	assert.Len(t, stops.Deadline.Attempts, 1, "a task's deadline does not fall back")

	require.Len(t, stops.Caller, 2)
	for _, task := range stops.Caller {
		assert.Equal(t, bgtask.StatusCancelled, task.Status, task.Description)
	}
}

func TestTheProgramRuns(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run(testCtx(t), &out))
	got := out.String()
	for _, want := range []string{
		"tree: completed — 4 subagents answered, 2 spawns refused",
		"fan: completed — 7 subagents answered",
		"at most 5 live under one parent (cap 5); a launch waited for a slot: true",
		"nested stop: 3 runs stopped;",
		"sibling completed",
		"deadline: error, reason deadline",
		"caller's context ended: fan 1 cancelled, hold cancelled",
	} {
		assert.True(t, strings.Contains(got, want), "missing %q in:\n%s", want, got)
	}
}
