package bgtask

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// m44AlwaysRetry is a classifier that retries every failure it is asked about.
func m44AlwaysRetry(error, bool) bool { return true }

// m44RunOnce launches a task on two models over host fn (with opts) and
// returns its end.
func m44RunOnce(t *testing.T, fn RunFunc, opts ...Option) Task {
	t.Helper()
	ctx := testCtx(t)
	m, err := Open(ctx, NewFuncHost(fn), append([]Option{WithIDs(SequentialIDs())}, opts...)...)
	require.NoError(t, err)
	shutdownAtCleanup(t, m)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/two")})
	require.NoError(t, err)
	end, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	return end
}

// A panic in a subagent function is a non-retryable *PanicError (FuncHost's
// doc), whatever it carries — a provider's 429 the default classifier
// would retry — and whatever the classifier says (WithRetryable: "A
// Permanent error is never retried, whatever f says").
func TestAPanicInAFunctionIsNeverRetried(t *testing.T) {
	for _, c := range []struct {
		name  string
		value any
		opts  []Option
	}{
		{"a panic carrying a 429", errors.New("429 Too Many Requests"), nil},
		{"a panic, a classifier that retries everything", "nil map write", []Option{WithRetryable(m44AlwaysRetry)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			end := m44RunOnce(t, func(context.Context, Run) (string, error) { panic(c.value) }, c.opts...)
			assert.Equal(t, StatusError, end.Status)
			assert.Len(t, end.Attempts, 1, "a panic is not retried")
			var pe *PanicError
			require.ErrorAs(t, end.Cause, &pe)
			assert.Equal(t, c.value, pe.Value)
		})
	}
}

// A Returning function's nil result with a nil error ends the attempt in
// error with ErrNilResult, never retried (Returning's doc), also under a
// classifier that retries everything.
func TestANilResultIsNeverRetried(t *testing.T) {
	type answer struct{ Text string }
	calls := 0
	fn := Returning(func(context.Context, Run) (*answer, error) { calls++; return nil, nil }, func(a *answer) string { return a.Text })
	end := m44RunOnce(t, fn, WithRetryable(m44AlwaysRetry))
	assert.Equal(t, StatusError, end.Status)
	assert.Len(t, end.Attempts, 1, "a nil result is not retried")
	assert.ErrorIs(t, end.Cause, ErrNilResult)
	assert.Equal(t, 1, calls)
}
