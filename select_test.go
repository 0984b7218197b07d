package bgtask_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Query.Select over a Snapshot's tasks pages exactly as Manager.Tasks
// does over the Manager's: the same tasks, cursors and errors, for every
// kind of query.
func TestSelectPagesAsTasksDoes(t *testing.T) {
	h := bgtasktest.NewHost()
	m := testkit.MustOpen(h, bgtask.WithIDs(bgtask.SequentialIDs()))
	h.Attach(m)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	defer func() { _ = m.Shutdown(context.Background()) }()
	var sessions []string
	for i := range 30 {
		parent := fmt.Sprintf("chat-%d", i%3)
		if i >= 10 && i%4 == 0 {
			parent = sessions[i%len(sessions)] // deeper in a tree
		}
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Prompt: "p", Models: []bgtask.Model{{ID: "m"}},
			Metadata: map[string]string{"kind": []string{"a", "b"}[i%2]}})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		sessions = append(sessions, got.SessionID)
		if i%5 == 0 {
			require.NoError(t, h.Idle(got.SessionID, "done"))
			_, err = m.Wait(ctx, task.ID)
			require.NoError(t, err)
		}
	}
	snap := m.Snapshot()
	queries := []bgtask.Query{
		{}, {Limit: 7}, {Parent: "chat-1"}, {Root: "chat-0", Limit: 3},
		{Statuses: []bgtask.Status{bgtask.StatusCompleted}}, {Metadata: map[string]string{"kind": "b"}, Limit: 4},
		{Parent: "chat-2", Statuses: []bgtask.Status{bgtask.StatusRunning}, Limit: 2}, {Parent: "nobody"},
	}
	for _, q := range queries {
		var got []string
		for cur := q; ; {
			p, err := m.Tasks(cur)
			require.NoError(t, err)
			sel, err := cur.Select(snap.Tasks)
			require.NoError(t, err)
			assert.Equal(t, p, sel, "%+v", cur)
			for _, task := range sel.Tasks {
				got = append(got, task.ID)
			}
			if sel.Next == "" {
				break
			}
			cur.After = sel.Next
		}
		var want []string // by hand, from the query's own words
		for _, task := range snap.Tasks {
			if (q.Parent == "" || task.ParentSessionID == q.Parent) && (q.Root == "" || task.Root == q.Root) &&
				(len(q.Statuses) == 0 || task.Status == q.Statuses[0]) && (q.Metadata == nil || task.Metadata["kind"] == q.Metadata["kind"]) {
				want = append(want, task.ID)
			}
		}
		assert.Equal(t, want, got, "%+v: every task it selects, once, in launch order", q)
	}
	for _, bad := range []bgtask.Query{{Limit: -1}, {Limit: 1001}, {After: "no-such-task"}, {Statuses: []bgtask.Status{bgtask.StatusRunning, "bogus"}}, {Statuses: []bgtask.Status{""}}} {
		_, err := bad.Select(snap.Tasks)
		assert.ErrorIs(t, err, bgtask.ErrInvalidArgument, "%+v", bad)
		_, err2 := m.Tasks(bad)
		assert.ErrorIs(t, err2, bgtask.ErrInvalidArgument)
	}
	_, err := bgtask.Query{After: "no-such-task"}.Select(snap.Tasks)
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
}

// prompted is a test host that takes prompts.
type prompted struct{ *bgtasktest.Host }

func (prompted) PromptSession(context.Context, bgtask.PromptRequest) error { return nil }

// Extendable is true exactly where an Extend would be admitted: a task
// that runs, on a session, with no stop asked, whose host (or own
// function) takes prompts.
func TestExtendableIsWhereExtendIsAdmitted(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, takes := range []bool{false, true} {
		h := bgtasktest.NewHost()
		var host bgtask.Host = h
		if takes {
			host = prompted{h}
		}
		m := testkit.MustOpen(host)
		h.Attach(m)
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err)
		run, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		assert.Equal(t, takes, m.Extendable(task.ID), "a host that takes prompts: %v", takes)
		_, err = m.Extend(ctx, task.ID, "more")
		assert.Equal(t, takes, err == nil, "%v", err)

		own, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Run: func(ctx context.Context, r bgtask.Run) (string, error) {
			<-ctx.Done()
			return "", ctx.Err()
		}})
		require.NoError(t, err)
		_, err = bgtasktest.WaitStatus(ctx, m, own.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		assert.True(t, m.Extendable(own.ID), "its own function takes prompts, whatever the host")

		require.NoError(t, h.Idle(run.SessionID, "done"))
		_, err = m.Wait(ctx, task.ID)
		require.NoError(t, err)
		assert.False(t, m.Extendable(task.ID), "ended")
		assert.False(t, m.Extendable("no-such-task"))
		require.NoError(t, m.Shutdown(context.Background()))
	}
}
