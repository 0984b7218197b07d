package bgtask

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// resumingHost is a session service that can resume a session.
type resumingHost struct{ *testHost }

func (resumingHost) ResumeSession(context.Context, string, SessionRequest) error { return nil }

// The envelope of a task that ended without an answer offers the parent
// only what the host can do with the task's session: inspect or resume it
// (a Resumer), inspect it (a session service), or nothing (a FuncHost,
// whose runs leave no session behind) — and ContinueFrom works exactly
// where resuming is offered.
func TestTheEnvelopeOffersOnlyWhatTheHostCanDo(t *testing.T) {
	resumed := "can be inspected or resumed by task id"
	inspected := "can be inspected by task id"
	for _, tt := range []struct {
		name    string
		host    func() Host
		offers  string // "" : no session notice
		resumes bool
	}{
		{"a Resumer", func() Host { return resumingHost{&testHost{}} }, resumed, true},
		{"a session service", func() Host { return &testHost{} }, inspected, false},
		{"a FuncHost", func() Host {
			return NewFuncHost(func(ctx context.Context, run Run) (string, error) {
				<-ctx.Done()
				return "", ctx.Err()
			})
		}, "", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			m := mustOpen(tt.host(), WithIDs(SequentialIDs()))
			shutdownAtCleanup(t, m)
			task, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: []Model{{ID: "m"}}})
			require.NoError(t, err)
			running := waitFor(t, m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
			require.NoError(t, stopErr(m.Stop(context.Background(), Target{Task: task.ID})))
			done, err := m.Wait(context.Background(), task.ID)
			require.NoError(t, err)
			require.Equal(t, StatusCancelled, done.Status)
			env := Envelope(done)
			if tt.offers == "" {
				assert.NotContains(t, env, running.SessionID, "no session is offered")
				assert.NotContains(t, env, "inspected")
			} else {
				assert.Contains(t, env, "the task's session "+running.SessionID+" "+tt.offers+" "+task.ID)
				if tt.offers == inspected {
					assert.NotContains(t, env, "resumed")
				}
			}
			_, err = m.Launch(context.Background(), Spec{ParentSessionID: "chat", ContinueFrom: task.ID, Prompt: "go on", Models: []Model{{ID: "m"}}})
			if tt.resumes {
				assert.NoError(t, err, "offered, so it can be done")
			} else {
				assert.ErrorIs(t, err, errors.ErrUnsupported, "not offered, and not possible")
			}
		})
	}
}

// After a restart the notice says what the new process's host can do.
func TestAfterARestartTheNoticeFollowsTheNewHost(t *testing.T) {
	dir := t.TempDir()
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m, err := Open(context.Background(), resumingHost{&testHost{}}, WithJournal(j))
	require.NoError(t, err)
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: []Model{{ID: "m"}}})
	require.NoError(t, err)
	waitFor(t, m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
	require.NoError(t, stopErr(m.Stop(context.Background(), Target{Task: task.ID})))
	done, err := m.Wait(context.Background(), task.ID)
	require.NoError(t, err)
	assert.Contains(t, Envelope(done), "can be inspected or resumed by task id")
	require.NoError(t, m.Shutdown(context.Background()))

	j, err = OpenFileJournal(dir)
	require.NoError(t, err)
	m, err = Open(context.Background(), &testHost{}, WithJournal(j)) // no Resumer now
	require.NoError(t, err)
	shutdownAtCleanup(t, m)
	again, err := m.Task(task.ID)
	require.NoError(t, err)
	assert.Contains(t, Envelope(again), "can be inspected by task id "+task.ID)
	assert.NotContains(t, Envelope(again), "resumed")
}
