package bgtask

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// ownFnStatusHost is a session service that can say what became of a
// session (StatusHost: every one it is asked about is gone), and keeps
// who asked it.
type ownFnStatusHost struct {
	testHost
	amu   sync.Mutex
	asked []string
}

func (h *ownFnStatusHost) SessionStatus(_ context.Context, sid string) (SessionReport, error) {
	h.amu.Lock()
	defer h.amu.Unlock()
	h.asked = append(h.asked, sid)
	return SessionReport{State: SessionStateGone}, nil
}

func (h *ownFnStatusHost) FindSession(_ context.Context, req SessionRequest) (string, error) {
	h.amu.Lock()
	defer h.amu.Unlock()
	h.asked = append(h.asked, "find "+req.AttemptID)
	return "", nil
}

// A task that runs its own function (Spec.Run) is interrupt after a
// restart, "lost across restart", and the session service is never asked
// about it (Spec.Run's doc) — also when its launch record carries more
// than the function's mark: a budget (record format 6), an attached value
// (format 7).
func TestATasksOwnFunctionIsLostAcrossARestartWhateverItsLaunchCarries(t *testing.T) {
	ctx := testCtx(t)
	j := &memJournal{}
	blocked := func(ctx context.Context, _ Run) (string, error) { <-ctx.Done(); return "", ctx.Err() }
	m1, err := Open(ctx, &ownFnStatusHost{}, WithJournal(j), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	specs := map[string]Spec{
		"plain":    {ParentSessionID: "chat", Prompt: "p", Models: oneModel, Run: blocked},
		"budget":   {ParentSessionID: "chat", Prompt: "p", Models: oneModel, Run: blocked, Budget: &Budget{Tokens: 1000}},
		"attached": {ParentSessionID: "chat", Prompt: "p", Models: oneModel, Run: blocked, Attach: map[string]string{"chat": "42"}},
	}
	ids := map[string]string{}
	for name, spec := range specs {
		task, err := m1.Launch(ctx, spec)
		require.NoError(t, err)
		waitStatus(t, m1, task.ID, StatusRunning)
		ids[name] = task.ID
	}
	crashed := j.copyWhen(t, func(recs []Record) bool { // the process dies with its functions, each run's binding kept
		for _, id := range ids {
			if !hasKind(recs, id, "session_bound") {
				return false
			}
		}
		return true
	})
	require.NoError(t, m1.Shutdown(ctx))

	host := &ownFnStatusHost{}
	m2, err := Open(ctx, host, WithJournal(&memJournal{recs: crashed}), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	for name, id := range ids {
		end, err := m2.Wait(ctx, id)
		require.NoError(t, err, name)
		assert.Equal(t, StatusInterrupt, end.Status, name)
		assert.Equal(t, lostAcrossRestart, end.Error, name)
		_, err = m2.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "again", Models: oneModel, ContinueFrom: id})
		assert.ErrorIs(t, err, errors.ErrUnsupported, "%s: a run of its own function cannot be resumed", name)
	}
	host.amu.Lock()
	defer host.amu.Unlock()
	assert.Empty(t, host.asked, "never asked about a function's session")
	assert.Empty(t, host.Starts(), "never asked to run a function's task")
}
