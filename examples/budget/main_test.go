package main

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The tree spends past its budget: the fourth spawn is refused naming the
// spawns; the chat hears the soft threshold, then the hard stop, then the
// closure; every task ends cancelled by the budget once its function
// returned; the overrun is at most one call per live run; the page's
// JSON holds the usage and the spent budget.
func TestTheTreeHitsItsBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var out bytes.Buffer
	o, err := run(ctx, &out)
	require.NoError(t, err, out.String())

	var be *bgtask.BudgetError
	require.ErrorAs(t, o.Refused, &be)
	assert.Equal(t, bgtask.LimitSpawns, be.Limit)
	assert.Equal(t, int64(3), be.Max)
	require.Len(t, o.Kids, 3)

	want := bgtask.StopCause{Kind: bgtask.StopBudget, TaskID: o.Root.ID, Limit: bgtask.LimitTokens}
	for _, task := range append([]bgtask.Task{o.Root}, o.Kids...) {
		assert.Equal(t, bgtask.StatusCancelled, task.Status, "task %s", task.ID)
		require.NotNil(t, task.Stop, "task %s", task.ID)
		assert.Equal(t, want, *task.Stop)
		assert.True(t, errors.Is(task.Cause, bgtask.ErrCancelled))
	}
	var kinds []bgtask.NotificationKind
	for _, n := range o.Told {
		if n.ParentSessionID == "chat" {
			kinds = append(kinds, n.Kind)
		}
	}
	assert.Equal(t, []bgtask.NotificationKind{bgtask.NotifyBudget, bgtask.NotifyBudget, bgtask.NotifyFinalSummary,
		bgtask.NotifyAllComplete, bgtask.NotifyBranchClosed}, kinds)
	assert.Contains(t, out.String(), "its tree reached 50% of its ")
	assert.Contains(t, out.String(), "its budget is spent (tokens)")
	assert.Contains(t, out.String(), "\nUsage: ")
	assert.GreaterOrEqual(t, o.Overrun, int64(0))
	assert.LessOrEqual(t, o.Overrun, int64(4*800), "at most one call in flight per live run")
	require.NotNil(t, o.PageBudget)
	assert.Equal(t, bgtask.LimitTokens, o.PageBudget.Exceeded)
	assert.Equal(t, int64(3), o.PageBudget.Spawned)
	assert.Equal(t, int64(0), o.PageBudget.Left.Tokens)
}
