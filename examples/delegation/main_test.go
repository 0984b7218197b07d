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

	assert.Contains(t, out, "Lead task-1: completed; the supplemental prompt was invocation 2")
	assert.Contains(t, out, "held (awaiting_children)")
	// Each invocation answered once, in order, after both subtasks'
	// results reached the lead; the turn it ended early is never an answer.
	assert.Contains(t, out, `1. "Analyse: the quick brown fox jumps over the lazy dog" → "Both subtasks reported: 9 words; the longest word is quick."`)
	assert.Contains(t, out, `2. "how many subtasks did you use?" → "To \"how many subtasks did you use?\": I used 2 subtasks."`)
	assert.NotContains(t, out, "I have started two subtasks.")
	told := out[strings.Index(out, "What the chat was told"):]
	assert.Equal(t, 1, strings.Count(told, "--- answer\n"), told)
	assert.Equal(t, 1, strings.Count(told, "--- final_summary\n"), told)
	assert.Less(t, strings.Index(told, `invocation="1"`), strings.Index(told, "--- final_summary"), "answer 1 before the final summary")
	assert.Contains(t, told, "I used 2 subtasks.")
	assert.NotContains(t, told, "degraded")
}
