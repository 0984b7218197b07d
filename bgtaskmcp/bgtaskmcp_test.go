package bgtaskmcp_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskmcp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// served is a Manager on a scripted host, served over streamable HTTP.
type served struct {
	m    *bgtask.Manager
	host *bgtasktest.Host
	url  string
	ctx  context.Context
}

func serve(t *testing.T) *served {
	t.Helper()
	host := bgtasktest.NewHost()
	m, err := bgtask.Open(context.Background(), host)
	require.NoError(t, err)
	host.Attach(m)
	s, err := bgtaskmcp.New(m, bgtaskmcp.Options{MaxPerClient: 2, Launch: func(_ context.Context, c bgtaskmcp.Caller, in bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
		return bgtask.Spec{Prompt: in.Prompt, Description: in.Description, Models: []bgtask.Model{{Provider: "a", ID: "one"}, {Provider: "b", ID: "two"}}}, nil
	}})
	require.NoError(t, err)
	srv := httptest.NewServer(mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s }, nil))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(func() {
		cancel()
		srv.CloseClientConnections()
		srv.Close()
		_ = m.Shutdown(context.Background())
	})
	return &served{m: m, host: host, url: srv.URL, ctx: ctx}
}

// client connects a new MCP client, closed at the test's end.
func (s *served) client(t *testing.T) *mcp.ClientSession {
	t.Helper()
	c := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil)
	cs, err := c.Connect(s.ctx, &mcp.StreamableClientTransport{Endpoint: s.url}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cs.Close() })
	return cs
}

// call calls a tool and decodes its structured content into out; it
// returns the result's text and whether it is a tool error.
func call(t *testing.T, cs *mcp.ClientSession, ctx context.Context, name string, args map[string]any, out any) (string, bool) {
	t.Helper()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: name, Arguments: args})
	require.NoError(t, err, "a tool error is a result, not a protocol error")
	var text []string
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			text = append(text, tc.Text)
		}
	}
	if out != nil && !res.IsError {
		b, err := json.Marshal(res.StructuredContent)
		require.NoError(t, err)
		require.NoError(t, json.Unmarshal(b, out))
	}
	return strings.Join(text, "\n"), res.IsError
}

// A task launched over MCP runs, falls back across models, and ends with
// its answer: get, wait and the envelope say so; a second one is
// cancelled while it runs, and reads cancelled once its child stopped.
func TestLaunchWaitAndCancelOverMCP(t *testing.T) {
	s := serve(t)
	cs := s.client(t)
	var task bgtaskmcp.TaskView
	text, isErr := call(t, cs, s.ctx, "launch_task", map[string]any{"prompt": "find the bug", "description": "bug hunt"}, &task)
	require.False(t, isErr, text)
	require.NotEmpty(t, task.ID)

	running, err := bgtasktest.WaitStatus(s.ctx, s.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, s.host.Fail(running.SessionID, errors.New("429 Too Many Requests")))
	retried, err := bgtasktest.WaitFor(s.ctx, s.m, task.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.SessionID != "" })
	require.NoError(t, err)
	require.NoError(t, s.host.Idle(retried.SessionID, "it is in parse.go"))

	var done bgtaskmcp.TaskView
	text, isErr = call(t, cs, s.ctx, "wait_task", map[string]any{"id": task.ID, "seconds": 10}, &done)
	require.False(t, isErr, text)
	assert.Equal(t, "completed", done.Status)
	assert.Equal(t, 2, done.Attempts, "the fallback to the second model")
	assert.Contains(t, done.Envelope, "it is in parse.go")
	assert.Contains(t, text, "it is in parse.go", "the model reads the envelope")
	assert.Contains(t, done.Timeline, "b/two")

	var other bgtaskmcp.TaskView
	_, isErr = call(t, cs, s.ctx, "launch_task", map[string]any{"prompt": "second"}, &other)
	require.False(t, isErr)
	_, err = bgtasktest.WaitStatus(s.ctx, s.m, other.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	var stopped bgtaskmcp.StopOutput
	text, isErr = call(t, cs, s.ctx, "cancel_task", map[string]any{"id": other.ID}, &stopped)
	require.False(t, isErr, text)
	assert.Equal(t, []string{other.ID}, stopped.Stopped)
	assert.Equal(t, "cancelled", stopped.Task.Status)

	var list bgtaskmcp.ListOutput
	_, isErr = call(t, cs, s.ctx, "list_tasks", map[string]any{}, &list)
	require.False(t, isErr)
	assert.Len(t, list.Tasks, 2)
}

// Two clients do not see each other's tasks: one's id is unknown to the
// other, for reading, waiting, stopping and extending, and its list has
// none of them.
func TestTwoClientsCannotSeeEachOthersTasks(t *testing.T) {
	s := serve(t)
	alice, bob := s.client(t), s.client(t)
	var task bgtaskmcp.TaskView
	_, isErr := call(t, alice, s.ctx, "launch_task", map[string]any{"prompt": "alice's"}, &task)
	require.False(t, isErr)
	for _, tool := range []string{"get_task", "wait_task", "cancel_task", "close_task"} {
		text, isErr := call(t, bob, s.ctx, tool, map[string]any{"id": task.ID}, nil)
		assert.True(t, isErr, tool)
		assert.Contains(t, text, "unknown task", tool)
	}
	text, isErr := call(t, bob, s.ctx, "extend_task", map[string]any{"id": task.ID, "prompt": "mine now"}, nil)
	assert.True(t, isErr)
	assert.Contains(t, text, "unknown task")
	var list bgtaskmcp.ListOutput
	_, isErr = call(t, bob, s.ctx, "list_tasks", map[string]any{}, &list)
	require.False(t, isErr)
	assert.Empty(t, list.Tasks)
	got, err := s.m.Task(task.ID)
	require.NoError(t, err)
	assert.False(t, got.Status.Terminal(), "bob stopped nothing")
}

// Bad arguments get a tool error that names what is wrong, never a
// crash; the per-client cap refuses a launch past it.
func TestBadArgumentsAreToolErrors(t *testing.T) {
	s := serve(t)
	cs := s.client(t)
	for _, c := range []struct {
		tool string
		args map[string]any
		says string
	}{
		{"launch_task", map[string]any{}, "prompt"},
		{"launch_task", map[string]any{"prompt": "   "}, "prompt"},
		{"launch_task", map[string]any{"prompt": 7}, "prompt"},
		{"get_task", map[string]any{"id": ""}, "id"},
		{"get_task", map[string]any{"id": "no-such-task"}, "unknown task"},
		{"wait_task", map[string]any{"id": "x", "seconds": "soon"}, "seconds"},
		{"list_tasks", map[string]any{"limit": 1000}, "limit"},
		{"list_tasks", map[string]any{"status": []string{"bogus"}}, "bogus"},
	} {
		text, isErr := call(t, cs, s.ctx, c.tool, c.args, nil)
		assert.True(t, isErr, "%s %v: %s", c.tool, c.args, text)
		assert.Contains(t, text, c.says, "%s %v", c.tool, c.args)
	}
	for range 2 {
		_, isErr := call(t, cs, s.ctx, "launch_task", map[string]any{"prompt": "work"}, nil)
		require.False(t, isErr)
	}
	text, isErr := call(t, cs, s.ctx, "launch_task", map[string]any{"prompt": "one too many"}, nil)
	assert.True(t, isErr)
	assert.Contains(t, text, "the most this server runs for one client")
}
