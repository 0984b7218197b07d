package bgtasktest_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var at = time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)

func TestBuildTaskAFallbackThatCompleted(t *testing.T) {
	task, err := bgtasktest.BuildTask(bgtasktest.TaskBuild{
		Prompt: "summarise", LaunchedAt: at, Metadata: map[string]string{"tool": "spawn"},
		Attempts: []bgtasktest.AttemptBuild{
			{Model: bgtask.Model{Provider: "a", ID: "big"}, Status: bgtask.StatusError, Took: 2 * time.Second, Err: errors.New("429 Too Many Requests")},
			{Model: bgtask.Model{Provider: "b", ID: "small"}, Status: bgtask.StatusCompleted, Took: time.Minute, Result: "three points"},
		},
	})
	require.NoError(t, err)
	assert.Equal(t, "task-1", task.ID)
	assert.Equal(t, "chat", task.ParentSessionID)
	assert.Equal(t, "summarise", task.Prompt)
	assert.Equal(t, "spawn", task.Metadata["tool"])
	assert.Equal(t, bgtask.StatusCompleted, task.Status)
	assert.Equal(t, "three points", task.Result)
	require.Len(t, task.Attempts, 2)
	assert.Equal(t, "429 Too Many Requests", task.Attempts[0].Error)
	assert.Equal(t, at, task.LaunchedAt)
	assert.Equal(t, at.Add(2*time.Second), task.Attempts[0].CompletedAt)
	assert.Equal(t, at.Add(2*time.Second+time.Minute), task.CompletedAt)
	require.NotNil(t, task.Outcome)
	assert.Equal(t, "three points", task.Outcome.Answer)
	assert.Equal(t, `Background task attempts:
- Attempt 1 — ERROR — a/big — ses-1
  Error: 429 Too Many Requests
- Attempt 2 — COMPLETED — b/small — ses-2`, bgtask.Timeline(task))
}

func TestBuildTaskEveryLastStatus(t *testing.T) {
	for _, s := range []bgtask.Status{bgtask.StatusPending, bgtask.StatusRunning, bgtask.StatusCompleted, bgtask.StatusError, bgtask.StatusCancelled, bgtask.StatusInterrupt} {
		for _, failedFirst := range []bool{false, true} {
			var attempts []bgtasktest.AttemptBuild
			if failedFirst {
				attempts = append(attempts, bgtasktest.AttemptBuild{Status: bgtask.StatusError})
			}
			attempts = append(attempts, bgtasktest.AttemptBuild{Status: s, Took: time.Second, Result: "ok"})
			task, err := bgtasktest.BuildTask(bgtasktest.TaskBuild{Attempts: attempts})
			require.NoError(t, err, "%s after a failure: %v", s, failedFirst)
			assert.Equal(t, s, task.Status, "%s after a failure: %v", s, failedFirst)
			require.Len(t, task.Attempts, len(attempts))
			assert.Equal(t, "model-"+string(rune('0'+len(attempts))), task.Model.ID)
			assert.Equal(t, s.Terminal(), task.Outcome != nil, "an outcome once terminal")
			if s == bgtask.StatusPending {
				assert.Equal(t, bgtask.PendingAwaitingSession, task.Pending)
				assert.Empty(t, task.SessionID)
			}
			if failedFirst {
				assert.Equal(t, "500 Internal Server Error", task.Attempts[0].Error)
			}
		}
	}
}

func TestBuildTaskRefusesWhatNoTaskGoesThrough(t *testing.T) {
	for _, b := range []bgtasktest.TaskBuild{
		{},
		{Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusCompleted}, {Status: bgtask.StatusCompleted}}},
		{Attempts: []bgtasktest.AttemptBuild{{Status: "paused"}}},
		{Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusRunning, Took: -time.Second}}},
	} {
		_, err := bgtasktest.BuildTask(b)
		require.Error(t, err)
		assert.True(t, strings.HasPrefix(err.Error(), "bgtasktest: BuildTask: "), err.Error())
	}
}
