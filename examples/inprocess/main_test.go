package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRunEndToEnd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var buf bytes.Buffer
	require.NoError(t, run(ctx, &buf))
	out := buf.String()

	// Two tasks answer on the third model after a 403 and a 429.
	for _, id := range []string{"task-1", "task-2"} {
		assert.Contains(t, out, id+" COMPLETED")
	}
	assert.Contains(t, out, `task-1 COMPLETED: "The prompt has 7 words."`)
	assert.Contains(t, out, `task-2 COMPLETED: "The prompt has 5 words."`)
	assert.Contains(t, out, "  Error: 403 Forbidden: Selected provider is forbidden")
	assert.Contains(t, out, "  Error: 429 Too Many Requests (retry after 2s)")
	// The slow one was cancelled mid-flight, on the model that was running.
	assert.Contains(t, out, `task-3 CANCELLED: ""`)
	assert.Contains(t, out, "- Attempt 3 — CANCELLED — google/gemini-2.5-flash-lite — fn_attempt-")

	// Per task, the parent hears retries in order and one final summary last.
	for _, id := range []string{"task-1", "task-2", "task-3"} {
		var kinds []string
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "→ ses_parent ["+id+"] ") {
				kinds = append(kinds, strings.TrimPrefix(line, "→ ses_parent ["+id+"] "))
			}
		}
		require.Len(t, kinds, 5, id)
		assert.True(t, strings.HasPrefix(kinds[0], "[Background task retry] Attempt 1 failed"), kinds[0])
		assert.True(t, strings.HasPrefix(kinds[1], "[Background task retry] Attempt 2 is running"), kinds[1])
		assert.True(t, strings.HasPrefix(kinds[2], "[Background task retry] Attempt 2 failed"), kinds[2])
		assert.True(t, strings.HasPrefix(kinds[3], "[Background task retry] Attempt 3 is running"), kinds[3])
		assert.True(t, strings.HasPrefix(kinds[4], "[Background task "), kinds[4])
	}
}
