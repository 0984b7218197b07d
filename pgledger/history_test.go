package pgledger

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A task's history is read from any process of the fleet: the one that
// runs it tells it (its lines of progress too); another reads its records
// from the ledger — a fallback across models, in order — and no record of
// the other tasks the same member ran meanwhile.
func TestHistoryFromAnyProcessOfTheFleet(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	task := running(t, ns[0], "chat")
	other := running(t, ns[0], "chat-2")
	require.NoError(t, ns[0].Observe(context.Background(), bgtask.Event{AttemptID: task.Attempts[0].ID, Kind: bgtask.SessionError,
		Err: errors.New("429 Too Many Requests")}))
	retried, err := bgtasktest.WaitFor(ctx(t), ns[0].Manager(), task.ID, func(t bgtask.Task) bool {
		return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning
	})
	require.NoError(t, err)
	require.NoError(t, ns[0].Observe(context.Background(), bgtask.Event{AttemptID: retried.CurrentAttemptID, Kind: bgtask.SessionBusy, Progress: "reading"}))
	require.NoError(t, ns[0].Observe(context.Background(), bgtask.Event{AttemptID: retried.CurrentAttemptID, Kind: bgtask.SessionIdle, Text: "done"}))
	_, err = bgtasktest.WaitStatus(ctx(t), ns[0].Manager(), task.ID, bgtask.StatusCompleted)
	require.NoError(t, err)

	own, err := ns[0].History(ctx(t), task.ID)
	require.NoError(t, err)
	assert.Contains(t, kinds(own), "progress", "the process that runs it has its lines of progress")

	far, err := ns[1].History(ctx(t), task.ID)
	require.NoError(t, err)
	got := kinds(far)
	assert.NotContains(t, got, "progress", "no other process has them")
	var created []string
	for _, v := range far {
		assert.True(t, v.TaskID == task.ID || v.TaskID == "", "a record of another task: %+v", v)
		assert.NotEqual(t, other.ID, v.TaskID)
		if v.Kind == "attempt_created" {
			created = append(created, v.Change)
		}
	}
	assert.Equal(t, []string{"attempt 1 created on a/1", "attempt 2 created on b/2"}, created)
	for _, k := range []string{"task_launched", "session_bound", "retry_scheduled", "attempt_finalized"} {
		assert.Contains(t, got, k)
	}
	assert.Less(t, slices.Index(got, "attempt_finalized"), slices.Index(got, "retry_scheduled"), "the first attempt ended, then its retry: %v", got)
	ownRecords := slices.DeleteFunc(slices.Clone(own), func(v bgtask.RecordView) bool { return v.Kind == "progress" })
	assert.Equal(t, ownRecords, far, "both read the same records")

	// A live task's records run to the end of its member's.
	live, err := ns[1].History(ctx(t), other.ID)
	require.NoError(t, err)
	assert.Contains(t, kinds(live), "session_bound")

	_, err = ns[1].History(ctx(t), "nope")
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	_, err = ns[1].History(ctx(t), " ")
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
}

// kinds are the kinds of views, in order.
func kinds(views []bgtask.RecordView) []string {
	out := make([]string, len(views))
	for i, v := range views {
		out[i] = v.Kind
	}
	return out
}
