package main

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/bgtask/bgtask/bgtaskmcp"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The example serves its subagents: a client launches one, extends it
// while it works, and waits for its answer, which took the extension in.
func TestTheExampleServesSubagents(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, ct := mcp.NewInMemoryTransports()
	served := make(chan error, 1)
	sctx, stop := context.WithCancel(ctx)
	go func() { served <- serve(sctx, t.TempDir(), 200*time.Millisecond, st) }()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(ctx, ct, nil)
	require.NoError(t, err)
	defer func() {
		_ = cs.Close()
		stop()
		<-served
	}()

	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "launch_task", Arguments: map[string]any{"prompt": "summarise the design", "description": "summary"}})
	require.NoError(t, err)
	require.False(t, res.IsError)
	var task bgtaskmcp.TaskView
	b, _ := json.Marshal(res.StructuredContent)
	require.NoError(t, json.Unmarshal(b, &task))

	res, err = cs.CallTool(ctx, &mcp.CallToolParams{Name: "extend_task", Arguments: map[string]any{"id": task.ID, "prompt": "and list the risks"}})
	require.NoError(t, err)
	require.False(t, res.IsError, "%v", res.Content)

	res, err = cs.CallTool(ctx, &mcp.CallToolParams{Name: "wait_task", Arguments: map[string]any{"id": task.ID, "seconds": 20}})
	require.NoError(t, err)
	require.False(t, res.IsError)
	b, _ = json.Marshal(res.StructuredContent)
	require.NoError(t, json.Unmarshal(b, &task))
	assert.Equal(t, "completed", task.Status)
	assert.Contains(t, task.Envelope, "worked through: summarise the design; then: and list the risks")
}
