package bgtask

import (
	"math"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The soft threshold is told when a figure reaches SoftPercent of its
// limit (Budget's doc: "when a figure first reaches that share of its
// limit"), not before: a share that falls between two whole figures is
// reached only by the figure above it. 85% of 10 tokens is 8.5, so 8
// tokens (80%) have not reached it and 9 (90%) have; 50% of 3 requests or
// spawns is 1.5, so 1 has not and 2 has. Each figure is checked alone.
func TestTheSoftThresholdIsNotToldBeforeTheShareIsReached(t *testing.T) {
	type step func(h *harness, root Task)
	usage := func(us Usage) step {
		return func(h *harness, root Task) {
			h.t.Helper()
			require.NoError(h.t, h.observe(Event{SessionID: root.SessionID, Kind: SessionUsage, Usage: us}))
		}
	}
	spawn := func(h *harness, root Task) { h.running(root.SessionID) }
	for _, c := range []struct {
		limit  string
		budget Budget
		below  step // brings the figure just under the share
		reach  step // brings it to the share
	}{
		{LimitTokens, Budget{Tokens: 10, SoftPercent: 85}, usage(u(5, 3, 0, 0)), usage(u(0, 1, 0, 0))},
		{LimitCost, Budget{Cost: 10, SoftPercent: 85}, usage(u(0, 0, 0, 8)), usage(u(0, 0, 0, 1))},
		{LimitRequests, Budget{Requests: 3, SoftPercent: 50}, usage(u(0, 0, 1, 0)), usage(u(0, 0, 1, 0))},
		{LimitSpawns, Budget{Spawns: 3, SoftPercent: 50}, spawn, spawn},
	} {
		t.Run(c.limit, func(t *testing.T) {
			h := newHarness(t, nil)
			root := h.running("chat", withBudget(c.budget))
			c.below(h, root)
			s := budgetOf(t, h.m, root.ID)
			require.False(t, s.SoftReached, "%s: %+v is under %d%% of %+v: the soft threshold is not reached", c.limit, s.Spent, c.budget.SoftPercent, c.budget)
			c.reach(h, root)
			s = budgetOf(t, h.m, root.ID)
			require.True(t, s.SoftReached, "%s: %+v (spawned %d) reached %d%% of %+v", c.limit, s.Spent, s.Spawned, c.budget.SoftPercent, c.budget)
			assert.Empty(t, s.Exceeded, "no hard limit is reached")

			require.NoError(t, h.m.notes.lanes.Wait(testCtx(t)))
			var told []Notification
			for _, n := range h.rec.All() {
				if n.Kind == NotifyBudget {
					told = append(told, n)
				}
			}
			require.Len(t, told, 1, "the parent hears the soft threshold once")
			assert.Equal(t, "chat", told[0].ParentSessionID)
			assert.Equal(t, root.ID, told[0].TaskID)
			assert.Contains(t, told[0].Text, "reached "+strconv.Itoa(c.budget.SoftPercent)+"% of its "+c.limit+" limit")
		})
	}
}

// A share of a limit near the top of int64 is worked out without
// overflow: half of math.MaxInt64 tokens is reached at 2^62, not before.
func TestTheSoftThresholdOfAHugeLimit(t *testing.T) {
	h := newHarness(t, nil)
	root := h.running("chat", withBudget(Budget{Tokens: math.MaxInt64, SoftPercent: 50}))
	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionUsage, Usage: u(1<<62-1, 0, 0, 0)}))
	assert.False(t, budgetOf(t, h.m, root.ID).SoftReached, "2^62-1 tokens are under half of MaxInt64")
	require.NoError(t, h.observe(Event{SessionID: root.SessionID, Kind: SessionUsage, Usage: u(1, 0, 0, 0)}))
	s := budgetOf(t, h.m, root.ID)
	assert.True(t, s.SoftReached, "2^62 tokens are half of MaxInt64, rounded up")
	assert.Empty(t, s.Exceeded)
}
