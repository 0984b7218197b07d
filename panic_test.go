package bgtask

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A subagent function that panics ends its attempt in error, never
// retried, with a *PanicError that keeps the value and the stack, and the
// panic is logged at error level with the stack.
func TestAPanicKeepsItsValueAndStack(t *testing.T) {
	boom := errors.New("boom")
	sink := &logSink{}
	m := mustOpen(NewFuncHost(func(ctx context.Context, run Run) (string, error) {
		panicsDeepInside(boom)
		return "unreachable", nil
	}), WithLogger(slog.New(sink)))
	task, done := runOnce(t, m, Model{ID: "a"}, Model{ID: "b"})

	assert.Equal(t, StatusError, done.Status)
	assert.Len(t, done.Attempts, 1, "a panic is never retried")
	assert.Equal(t, "subagent function panicked: boom", done.Error)
	p, ok := done.Cause.(*PanicError)
	require.True(t, ok, "Cause is the *PanicError itself, as its doc says: %T", done.Cause)
	assert.Equal(t, boom, p.Value)
	assert.ErrorIs(t, done.Cause, boom, "a panic with an error unwraps to it")
	assert.Contains(t, string(p.Stack), "panicsDeepInside", "the stack of the panic, not of the recovery's caller")
	logged := false
	for _, r := range sink.Records() {
		if r["msg"] == "subagent function panicked" {
			logged = true
			assert.Equal(t, "ERROR", r["level"])
			assert.Equal(t, task.ID, r["task"])
			assert.Contains(t, r["stack"], "panicsDeepInside")
		}
	}
	assert.True(t, logged, "the panic is logged: %v", sink.Records())
}

func panicsDeepInside(v any) { panic(v) }

type report2 struct{ findings []string }

// A Returning function that returns a nil result and no error ends its
// attempt in error with ErrNilResult: text is never called with nil, and
// it is not reported as a panic.
func TestANilResultIsReportedAsOne(t *testing.T) {
	texts := 0
	sink := &logSink{}
	m := mustOpen(NewFuncHost(Returning(func(ctx context.Context, run Run) (*report2, error) {
		return nil, nil
	}, func(r *report2) string {
		texts++
		return strings.Join(r.findings, ", ")
	})), WithLogger(slog.New(sink)))
	_, done := runOnce(t, m, Model{ID: "a"}, Model{ID: "b"})
	assert.Equal(t, StatusError, done.Status)
	assert.Len(t, done.Attempts, 1, "never retried")
	assert.Equal(t, ErrNilResult, done.Cause, "Cause is ErrNilResult itself, as its doc says")
	var p *PanicError
	assert.False(t, errors.As(done.Cause, &p), "not a panic")
	assert.Contains(t, done.Error, "nil result")
	typed := false
	for _, r := range sink.Records() {
		typed = typed || r["type"] == "*bgtask.report2"
	}
	assert.True(t, typed, "the result's type is logged: %v", sink.Records())
	assert.Zero(t, texts)
}

// A value that is not nil, even an empty one, is a result.
func TestAZeroValueResultIsAResult(t *testing.T) {
	m := mustOpen(NewFuncHost(Returning(func(ctx context.Context, run Run) (report2, error) {
		return report2{}, nil
	}, func(r report2) string { return "no findings" })))
	_, done := runOnce(t, m, Model{ID: "a"})
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "no findings", done.Result)
}

// runOnce launches a task on models and waits for its end; m is shut down
// when the test ends.
func runOnce(t *testing.T, m *Manager, models ...Model) (launched, done Task) {
	t.Helper()
	t.Cleanup(func() { require.NoError(t, m.Shutdown(context.Background())) })
	launched, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: models})
	require.NoError(t, err)
	done, err = m.Wait(context.Background(), launched.ID)
	require.NoError(t, err)
	return launched, done
}
