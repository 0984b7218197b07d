package bgtask

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// checkBudgets checks every budget a restarted Manager holds against the
// records it was restarted on, counted here on their own: its spent is
// the sum of the usage records of the tasks in its scope (the task that
// holds it, and every task launched from a session of one in it), no
// more (no double count) and no less (no refund); its spawns are the
// tasks beneath it whose sessions ran; once every task ended nothing is
// reserved; and a budget spent refuses a launch beneath it.
func checkBudgets(t *testing.T, m *Manager, recs []record) {
	t.Helper()
	parent := map[string]string{}  // task → parent session
	owner := map[string]string{}   // session → task
	used := map[string]Usage{}     // task → its usage records, summed
	granted := map[string]Budget{} // holder → its grant
	var order []string
	for _, r := range recs {
		switch r.kind {
		case recTaskLaunched:
			parent[r.task] = r.spec.parent
			order = append(order, r.task)
			if b := r.spec.opt().budget; b != nil {
				granted[r.task] = *b
			}
		case recSessionBound:
			owner[r.attempt.SessionID] = r.task
		case recSessionOrphan:
			owner[r.session] = r.task
		case recUsage:
			used[r.task] = used[r.task].Add(r.usage.u)
		}
	}
	under := func(task, holder string) bool {
		for range len(order) + 1 {
			if task == holder {
				return true
			}
			up, ok := owner[parent[task]]
			if !ok {
				return false
			}
			task = up
		}
		return false
	}
	for _, h := range order {
		g, ok := granted[h]
		if !ok {
			continue
		}
		s, has, err := m.Budget(h)
		if errors.Is(err, ErrForgotten) {
			continue // retention forgot the tree, ended whole
		}
		if errors.Is(err, ErrUnknownTask) && !slices.ContainsFunc(recs, func(r record) bool { return r.kind == recAttemptCreated && r.task == h }) {
			continue // launched without its first attempt: it never happened
		}
		require.NoError(t, err)
		require.True(t, has, "task %s holds a budget", h)
		require.Equal(t, h, s.TaskID)
		require.Equal(t, g, s.Limit, "task %s keeps its grant", h)
		var want Usage
		spawned := int64(0)
		for _, id := range order {
			if !under(id, h) {
				continue
			}
			want = want.Add(used[id])
			if id != h && slices.ContainsFunc(recs, func(r record) bool { return r.kind == recSessionBound && r.task == id }) {
				spawned++
			}
		}
		require.Equal(t, want, s.Spent, "budget of %s: spent is what its tree's records say", h)
		require.GreaterOrEqual(t, s.Spawned, spawned, "budget of %s: every task beneath it that ran is spawned", h)
		require.Zero(t, s.Reserved, "budget of %s: every task ended, nothing is reserved", h)
		if s.Exceeded != "" {
			task, err := m.Task(h)
			require.NoError(t, err)
			_, err = m.Launch(context.Background(), Spec{ParentSessionID: sessionOrFirst(task), Prompt: "more", Models: mustModels(t, "a/1")})
			require.ErrorIs(t, err, ErrBudget, "budget of %s spent: a launch beneath it is refused", h)
		}
	}
}

// sessionOrFirst is task's session, or its first attempt's.
func sessionOrFirst(task Task) string {
	if task.SessionID != "" {
		return task.SessionID
	}
	for _, a := range task.Attempts {
		if a.SessionID != "" {
			return a.SessionID
		}
	}
	return "no-session"
}
