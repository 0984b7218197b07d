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

	// 14 tasks; the early one ended in error, the other 13 were stopped,
	// its grandchildren included.
	assert.Contains(t, out, "13 runs stopped")
	assert.Equal(t, 1, strings.Count(out, " error "), out)
	assert.Equal(t, 13+13, strings.Count(out, " cancelled "), "13 in the report, 13 in the task list")
	assert.Contains(t, out, "task/0/1/1")
	assert.Contains(t, out, "Closure record: root ses_chat, 13 stopped, 0 failed")
	assert.Contains(t, out, "Notification to ses_chat:\n[Branch closure] Session ses_chat: 13 run(s) stopped.")
	assert.NotContains(t, out, " running ")
}
