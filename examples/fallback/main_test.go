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
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var buf bytes.Buffer
	require.NoError(t, run(ctx, &buf))
	out := buf.String()

	// The parent hears, in order: two retries, each with its session ready,
	// then one final summary.
	var kinds []string
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "→ parent ses_parent gets ") {
			kinds = append(kinds, strings.TrimSuffix(strings.TrimPrefix(line, "→ parent ses_parent gets "), ":"))
		}
	}
	assert.Equal(t, []string{"retry_scheduled", "retry_session_ready", "retry_scheduled", "retry_session_ready", "final_summary", "all_complete"}, kinds)

	// The seed's balanced timeline, with this run's sessions.
	assert.Contains(t, out, `Background task attempts:
- Attempt 1 — ERROR — openai/gpt-5.4-mini — ses_1
  Error: Forbidden: Selected provider is forbidden
- Attempt 2 — ERROR — anthropic/claude-haiku-4.5 — ses_2
  Error: Too Many Requests
- Attempt 3 — COMPLETED — google/gemini-2.5-flash-lite — ses_3`)
	assert.Contains(t, out, `Task task-1 ended completed with: "The flaky test races on a shared temp dir."`)
}
