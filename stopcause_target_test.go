package bgtask

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Target.Cause is recorded as who asked a stop of a task or a run
// (Target's doc), however the stop is asked: of the task or of its run,
// waiting for the child or not. The task still ends cancelled, its Cause
// a *StopError saying who asked.
func TestTargetCauseIsRecordedForEveryStopOfATaskOrARun(t *testing.T) {
	for _, c := range []struct {
		name   string
		target func(a Task, cause *StopCause) Target
	}{
		{"task, waiting", func(a Task, cause *StopCause) Target { return Target{Task: a.ID, Cause: cause} }},
		{"task, no wait", func(a Task, cause *StopCause) Target { return Target{Task: a.ID, NoWait: true, Cause: cause} }},
		{"run, waiting", func(a Task, cause *StopCause) Target {
			return Target{Run: RunRef{TaskID: a.ID, AttemptID: a.CurrentAttemptID, Token: a.Current().Token}, Cause: cause}
		}},
		{"run, no wait", func(a Task, cause *StopCause) Target {
			return Target{Run: RunRef{TaskID: a.ID, AttemptID: a.CurrentAttemptID, Token: a.Current().Token}, NoWait: true, Cause: cause}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, nil)
			cause := StopCause{Kind: StopClosure, Root: "elsewhere"}
			a := h.running("chat")
			require.NoError(t, stopErr(h.m.Stop(context.Background(), c.target(a, &cause))))
			done := h.wait(a.ID)
			assert.Equal(t, StatusCancelled, done.Status)
			require.NotNil(t, done.Stop)
			assert.Equal(t, cause, *done.Stop, "who asked, as the Target said")
			var se *StopError
			require.ErrorAs(t, done.Cause, &se)
			assert.Equal(t, cause, se.Stop)
			assert.ErrorIs(t, done.Cause, ErrCancelled)
		})
	}
}

// Target.Validate refuses a Cause with a closure, of a task's tree or of
// a session: a closure records its own cause.
func TestTargetCauseIsRefusedWithAClosure(t *testing.T) {
	cause := &StopCause{Kind: StopCancel}
	for _, tg := range []Target{{Task: "t", Tree: true, Cause: cause}, {Session: "s", Cause: cause}, {Task: "t", Tree: true, NoWait: true, Cause: cause}} {
		assert.ErrorIs(t, tg.Validate(), ErrInvalidArgument, "%+v", tg)
	}
	for _, tg := range []Target{{Task: "t", Cause: cause}, {Task: "t", NoWait: true, Cause: cause}, {Run: RunRef{TaskID: "t", Token: "r"}, Cause: cause}} {
		assert.NoError(t, tg.Validate(), "%+v", tg)
	}
}
