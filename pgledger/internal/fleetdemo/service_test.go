package fleetdemo

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The loopback service is the workers' StatusHost: a session it started
// is alive until aborted or ended, and is found by its attempt.
func TestTheServiceIsAStatusHost(t *testing.T) {
	svc, err := newService()
	require.NoError(t, err)
	defer svc.close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	h := host{client{base: svc.addr, member: "w0", http: &http.Client{Transport: tr, Timeout: 10 * time.Second}}}
	ctx := context.Background()
	req := bgtask.SessionRequest{TaskID: "t1", AttemptID: "a1"}
	ses, err := h.StartSession(ctx, req)
	require.NoError(t, err)
	found, err := h.FindSession(ctx, req)
	require.NoError(t, err)
	assert.Equal(t, ses, found)
	rep, err := h.SessionStatus(ctx, ses)
	require.NoError(t, err)
	assert.Equal(t, bgtask.SessionStateAlive, rep.State)
	svc.mu.Lock()
	id, owner, ok := svc.sessionOf("t1")
	svc.mu.Unlock()
	assert.True(t, ok)
	assert.Equal(t, ses, id)
	assert.Equal(t, "w0", owner, "the member that started it")

	require.NoError(t, h.AbortSession(ctx, ses))
	rep, err = h.SessionStatus(ctx, ses)
	require.NoError(t, err)
	assert.Equal(t, bgtask.SessionStateEnded, rep.State)
	assert.Equal(t, bgtask.SessionInterrupted, rep.End.Kind)
	rep, err = h.SessionStatus(ctx, "nobody's")
	require.NoError(t, err)
	assert.Equal(t, bgtask.SessionStateGone, rep.State)

	other, err := h.StartSession(ctx, bgtask.SessionRequest{TaskID: "t2", AttemptID: "a2"})
	require.NoError(t, err)
	svc.endWhileDown(other, bgtask.Event{Kind: bgtask.SessionIdle, Text: "while down"})
	rep, err = h.SessionStatus(ctx, other)
	require.NoError(t, err)
	assert.Equal(t, bgtask.SessionStateEnded, rep.State)
	assert.Equal(t, "while down", rep.End.Text)
	require.NoError(t, svc.await(ctx, "two status calls", func() bool { return svc.sessions[other].asked == 1 }))

	n := notifier(h)
	require.NoError(t, n.Notify(ctx, bgtask.Notification{Kind: bgtask.NotifyFinalSummary, TaskID: "t2", ParentSessionID: "p"}))
	svc.mu.Lock()
	assert.Len(t, svc.summaries("t2"), 1)
	svc.mu.Unlock()
	short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	assert.Error(t, svc.await(short, "never", func() bool { return false }), "await ends with its context")
}
