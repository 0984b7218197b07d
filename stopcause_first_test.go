package bgtask

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The first stop asked is the one kept (StopCause's doc): later stops of
// a task whose stop is under way — another Stop with another cause, a
// closure of its tree, a closure of its parent's session — change
// neither who asked nor anything else, and are no error the Manager logs.
func TestTheFirstStopAskedIsKeptAndLaterOnesAreNoError(t *testing.T) {
	ctx := testCtx(t)
	asked, release := make(chan string, 8), make(chan struct{})
	host := &testHost{abort: func(_ context.Context, sid string) error {
		asked <- sid
		<-release
		return nil
	}}
	h := newHarness(t, host)
	a := h.running("chat")
	first := StopCause{Kind: StopCaller, TaskID: "t-1"}
	require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: a.ID, NoWait: true, Cause: &first})))
	recv(t, asked, "the first stop's abort")
	require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: a.ID, NoWait: true, Cause: &StopCause{Kind: StopClosure, Root: "elsewhere"}})))
	require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: a.ID, NoWait: true})))
	_, err := h.m.Stop(ctx, Target{Task: a.ID, Tree: true, NoWait: true})
	require.NoError(t, err)
	_, err = h.m.Stop(ctx, Target{Session: "chat", NoWait: true})
	require.NoError(t, err)
	now := h.task(a.ID)
	require.NotNil(t, now.Stop)
	assert.Equal(t, first, *now.Stop, "the first stop asked is kept")
	assert.Equal(t, StatusRunning, now.Status, "running until its child stopped")

	close(release)
	done := h.wait(a.ID)
	assert.Equal(t, StatusCancelled, done.Status)
	assert.Equal(t, first, *done.Stop)
	h.settle()
	for _, r := range h.logs.Records() {
		assert.NotEqual(t, "ERROR", r["level"], "no error is logged: %v", r)
	}
}
