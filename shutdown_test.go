package bgtask

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Shutdown with a context that has already ended still stops an
// in-process run honestly: interrupt, as a Shutdown asks, never error
// with the "context canceled" the run returned as it heard the stop; and,
// with nothing left behind, it returns nil. Many rounds: the trap was a
// race, lost about one time in three.
func TestShutdownWithAnEndedContextInterruptsAndReportsNothingLeft(t *testing.T) {
	for round := range 60 {
		m := mustOpen(nil)
		started := make(chan struct{})
		task, err := m.Launch(context.Background(), Spec{Run: func(ctx context.Context, run Run) (string, error) {
			close(started)
			<-ctx.Done()
			return "", ctx.Err()
		}})
		require.NoError(t, err)
		recv(t, started, "round %d: the function to start", round)
		ended, cancel := context.WithCancel(context.Background())
		cancel()
		require.NoError(t, m.Shutdown(ended), "round %d: nothing is left behind", round)
		done, err := m.Task(task.ID)
		require.NoError(t, err)
		require.Equal(t, StatusInterrupt, done.Status, "round %d: %s", round, done.Error)
		var se *StopError
		require.ErrorAs(t, done.Cause, &se, "round %d", round)
		assert.Equal(t, StopShutdown, se.Stop.Kind)
	}
}

// A Shutdown whose context ended while something is left names it, with
// the context's error.
func TestShutdownWithAnEndedContextNamesWhatIsLeft(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		<-release // a host that ignores its context
		return nil
	}})
	task := h.running("chat")
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	err := h.m.Shutdown(ended)
	require.Error(t, err)
	assert.True(t, errors.Is(err, context.Canceled), "%v", err)
	assert.Contains(t, err.Error(), task.ID, "the child that did not stop is named")
}

// A Manager whose work is done owes Shutdown all the same, and Shutdown
// returns nil at once when nothing is left.
func TestShutdownOfAnIdleManagerIsQuietAndNil(t *testing.T) {
	m := mustOpen(nil)
	_, err := m.Run(testCtx(t), Spec{Run: func(context.Context, Run) (string, error) { return "ok", nil }})
	require.NoError(t, err)
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, m.Shutdown(ended))
	require.NoError(t, m.Shutdown(context.Background()), "again: still nil")
}
