//go:build go1.25

package bgtasktest_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

// Inside a synctest bubble the wall clock is virtual: a minute's retry
// delay passes at once, with no Clock.
func TestTheKitWithSynctest(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		host := bgtasktest.NewHost()
		m := testkit.MustOpen(host, bgtask.WithRetryDelay(func(int, error) time.Duration { return time.Minute }))
		host.Attach(m)
		ctx := context.Background()
		start := time.Now()
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: twoModels})
		require.NoError(t, err)
		synctest.Wait() // the start has run
		first, _ := m.Task(task.ID)
		require.Equal(t, bgtask.StatusRunning, first.Status)
		require.NoError(t, host.Fail(first.SessionID, errors.New("429 Too Many Requests")))
		second, err := bgtasktest.WaitFor(ctx, m, task.ID, func(t bgtask.Task) bool {
			return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning
		})
		require.NoError(t, err)
		assert.GreaterOrEqual(t, time.Since(start), time.Minute, "the delay passed in the bubble's time")
		require.NoError(t, host.Idle(second.SessionID, "42"))
		done, err := m.Wait(ctx, task.ID)
		require.NoError(t, err)
		assert.Equal(t, "42", done.Result)
		require.NoError(t, m.Shutdown(ctx))
	})
}
