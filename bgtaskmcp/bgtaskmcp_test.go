package bgtaskmcp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskmcp"
	"github.com/bgtask/bgtask/bgtaskmcp/wiretest"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestMain runs the tests, or, when a test re-executed this binary as an
// MCP server over stdio (serveEnv names its journal), that server.
func TestMain(m *testing.M) {
	if dir := os.Getenv(serveEnv); dir != "" {
		if err := serveStdio(dir); err != nil {
			fmt.Fprintln(os.Stderr, "server:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// serveEnv names the journal directory of a server this binary runs.
const serveEnv = "BGTASKMCP_TEST_SERVE"

// serveStdio serves, over stdio, a Manager with a file journal in dir
// whose subagents answer a prompt that says "quick" at once, and work on
// any other until they are stopped.
func serveStdio(dir string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	j, err := bgtask.OpenFileJournal(dir)
	if err != nil {
		return err
	}
	work := func(ctx context.Context, run bgtask.Run) (string, error) {
		if strings.Contains(run.Prompt, "quick") {
			return "done: " + run.Prompt, nil
		}
		<-ctx.Done()
		return "", ctx.Err()
	}
	m, err := bgtask.Open(ctx, bgtask.NewFuncHost(work), bgtask.WithJournal(j))
	if err != nil {
		return err
	}
	defer func() { _ = m.Shutdown(context.Background()) }()
	s, err := bgtaskmcp.New(m, bgtaskmcp.Options{Launch: func(_ context.Context, _ bgtaskmcp.Caller, in bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
		return bgtask.Spec{Prompt: in.Prompt, Models: []bgtask.Model{{Provider: "local", ID: "worker"}}}, nil
	}})
	if err != nil {
		return err
	}
	return s.Run(ctx, &mcp.StdioTransport{})
}

// served is a Manager on a scripted host, served over streamable HTTP.
type served struct {
	m    *bgtask.Manager
	host *bgtasktest.Host
	url  string
	ctx  context.Context
}

// server is a Manager on a scripted host, shut down when the test ends,
// and an MCP server of it with o; o.Launch nil launches the prompt on two
// models.
func server(t testing.TB, o bgtaskmcp.Options) (*bgtask.Manager, *bgtasktest.Host, *bgtaskmcp.Server) {
	t.Helper()
	host := bgtasktest.NewHost()
	m, err := bgtask.Open(context.Background(), host)
	require.NoError(t, err)
	host.Attach(m)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	if o.Launch == nil {
		o.Launch = func(_ context.Context, _ bgtaskmcp.Caller, in bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
			return bgtask.Spec{Prompt: in.Prompt, Description: in.Description, Models: []bgtask.Model{{Provider: "a", ID: "one"}, {Provider: "b", ID: "two"}}}, nil
		}
	}
	s, err := bgtaskmcp.New(m, o)
	require.NoError(t, err)
	return m, host, s
}

func serve(t *testing.T) *served {
	t.Helper()
	m, host, s := server(t, bgtaskmcp.Options{MaxPerClient: 2})
	srv := httptest.NewServer(s.Handler(nil))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(func() { // before the Manager's shutdown: cleanups run last first
		cancel()
		srv.CloseClientConnections()
		srv.Close()
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

// A running task's lines of progress reach a client that waits for it,
// as MCP progress notifications of its call.
func TestProgressReachesTheClient(t *testing.T) {
	s := serve(t)
	heard := make(chan string, 16)
	c := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, &mcp.ClientOptions{
		ProgressNotificationHandler: func(_ context.Context, req *mcp.ProgressNotificationClientRequest) { heard <- req.Params.Message },
	})
	cs, err := c.Connect(s.ctx, &mcp.StreamableClientTransport{Endpoint: s.url}, nil)
	require.NoError(t, err)
	defer cs.Close()
	var task bgtaskmcp.TaskView
	_, isErr := call(t, cs, s.ctx, "launch_task", map[string]any{"prompt": "work"}, &task)
	require.False(t, isErr)
	running, err := bgtasktest.WaitStatus(s.ctx, s.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, s.host.Emit(bgtask.Event{SessionID: running.SessionID, Kind: bgtask.SessionBusy, Progress: "reading parse.go"}))

	params := &mcp.CallToolParams{Name: "wait_task", Arguments: map[string]any{"id": task.ID, "seconds": 20}}
	params.SetProgressToken("wait-1")
	result := make(chan *mcp.CallToolResult, 1)
	go func() {
		res, err := cs.CallTool(s.ctx, params)
		assert.NoError(t, err)
		result <- res
	}()
	select {
	case msg := <-heard:
		assert.Equal(t, "reading parse.go", msg)
	case <-s.ctx.Done():
		t.Fatal("no progress notification")
	}
	require.NoError(t, s.host.Idle(running.SessionID, "found it"))
	res := <-result
	require.NotNil(t, res)
	assert.False(t, res.IsError)
}

// stdio starts this binary as an MCP server over stdio, on the journal in
// dir, and connects a client to it; closing the session ends the server.
func stdio(t *testing.T, ctx context.Context, dir string) *mcp.ClientSession {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), serveEnv+"="+dir)
	cmd.Stderr = os.Stderr
	c := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil)
	cs, err := c.Connect(ctx, &mcp.CommandTransport{Command: cmd}, nil)
	require.NoError(t, err)
	return cs
}

// Over stdio, with the server a process of its own and a file journal: a
// task launched, then the server restarted, and the client goes on
// polling its task ids — the ended one has its answer, the one the
// restart cut says how it ended — and launches anew.
func TestAClientGoesOnPollingAcrossARestartOverStdio(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()
	cs := stdio(t, ctx, dir)
	var quick, long bgtaskmcp.TaskView
	_, isErr := call(t, cs, ctx, "launch_task", map[string]any{"prompt": "a quick one"}, &quick)
	require.False(t, isErr)
	_, isErr = call(t, cs, ctx, "launch_task", map[string]any{"prompt": "a long one"}, &long)
	require.False(t, isErr)
	var done bgtaskmcp.TaskView
	_, isErr = call(t, cs, ctx, "wait_task", map[string]any{"id": quick.ID, "seconds": 20}, &done)
	require.False(t, isErr)
	require.Equal(t, "completed", done.Status)
	require.NoError(t, cs.Close()) // the server process ends

	again := stdio(t, ctx, dir)
	defer again.Close()
	var after bgtaskmcp.TaskView
	text, isErr := call(t, again, ctx, "get_task", map[string]any{"id": quick.ID}, &after)
	require.False(t, isErr, text)
	assert.Equal(t, "completed", after.Status)
	assert.Contains(t, after.Envelope, "done: a quick one")
	text, isErr = call(t, again, ctx, "get_task", map[string]any{"id": long.ID}, &after)
	require.False(t, isErr, "the task the restart cut is still the client's: %s", text)
	assert.NotEmpty(t, after.Timeline)
	var fresh bgtaskmcp.TaskView
	_, isErr = call(t, again, ctx, "launch_task", map[string]any{"prompt": "quick, after the restart"}, &fresh)
	require.False(t, isErr)
	_, isErr = call(t, again, ctx, "wait_task", map[string]any{"id": fresh.ID, "seconds": 20}, &done)
	require.False(t, isErr)
	assert.Equal(t, "completed", done.Status)
}

// stdioConn starts the server as stdio does, and returns a raw
// connection to it (a client of the task methods); closing it ends the
// server.
func stdioConn(t *testing.T, ctx context.Context, dir string) *wiretest.Conn {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), serveEnv+"="+dir)
	cmd.Stderr = os.Stderr
	conn, err := (&mcp.CommandTransport{Command: cmd}).Connect(ctx)
	require.NoError(t, err)
	return &wiretest.Conn{TB: t, C: conn}
}

// Over stdio, a client of the tasks extension persists its task ids and
// goes on polling them across a restart of the server (a file journal):
// the one that ended has its result inline, the one the restart cut has
// ended with an error result that says so.
func TestATaskClientPollsAcrossARestartOverStdio(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()
	c := stdioConn(t, ctx, dir)
	launch := func(prompt string) string {
		res, err := c.Call(ctx, "tools/call", map[string]any{"name": "launch_task", "arguments": map[string]any{"prompt": prompt}})
		require.Nil(t, err)
		require.Equal(t, "task", res["resultType"])
		return res["taskId"].(string)
	}
	quick, long := launch("a quick one"), launch("a long one")
	_, err := c.Call(ctx, "tools/call", map[string]any{"name": "wait_task", "arguments": map[string]any{"id": quick, "seconds": 20}})
	require.Nil(t, err)
	working, err := c.Call(ctx, "tasks/get", map[string]any{"taskId": long})
	require.Nil(t, err)
	assert.Equal(t, "working", working["status"])
	require.NoError(t, c.C.Close()) // the server process ends

	c = stdioConn(t, ctx, dir)
	defer c.C.Close()
	got, err := c.Call(ctx, "tasks/get", map[string]any{"taskId": quick})
	require.Nil(t, err)
	assert.Equal(t, "completed", got["status"])
	res, _ := got["result"].(map[string]any)
	require.NotNil(t, res)
	assert.Contains(t, res["content"].([]any)[0].(map[string]any)["text"], "done: a quick one")
	cut, err := c.Call(ctx, "tasks/get", map[string]any{"taskId": long})
	require.Nil(t, err, "the task the restart cut is still the client's")
	assert.Equal(t, "completed", cut["status"], "it ended: with a tool error, not a protocol one")
	res, _ = cut["result"].(map[string]any)
	require.NotNil(t, res)
	assert.Equal(t, true, res["isError"])
	assert.Equal(t, "interrupt", res["structuredContent"].(map[string]any)["status"])
}

// A harness's launch function that fails, or panics, refuses the launch
// with its words; the server goes on serving.
func TestALaunchFunctionThatFailsRefusesTheLaunch(t *testing.T) {
	m, _, s := server(t, bgtaskmcp.Options{Launch: func(_ context.Context, _ bgtaskmcp.Caller, in bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
		if in.Agent == "panic" {
			panic("a bug in the harness")
		}
		return bgtask.Spec{}, errors.New("no agent named " + in.Agent)
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs := inMemory(t, ctx, s)
	text, isErr := call(t, cs, ctx, "launch_task", map[string]any{"prompt": "p", "agent": "ghost"}, nil)
	assert.True(t, isErr)
	assert.Contains(t, text, "no agent named ghost")
	text, isErr = call(t, cs, ctx, "launch_task", map[string]any{"prompt": "p", "agent": "panic"}, nil)
	assert.True(t, isErr)
	assert.Contains(t, text, "a bug in the harness")
	text, isErr = call(t, cs, ctx, "list_tasks", map[string]any{}, nil)
	assert.False(t, isErr, "still serving: %s", text)
	assert.Empty(t, m.Snapshot().Tasks, "nothing launched")

	_, err := bgtaskmcp.New(nil, bgtaskmcp.Options{})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	var none *bgtask.Manager
	_, err = bgtaskmcp.New(none, bgtaskmcp.Options{Launch: func(context.Context, bgtaskmcp.Caller, bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
		return bgtask.Spec{}, nil
	}})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument, "a nil *Manager is no Source")
	_, err = bgtaskmcp.New(m, bgtaskmcp.Options{})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument, "Launch is required")
}

// A stateless HTTP server with no token verifier has no caller to bind a
// task to: its tools refuse, rather than let every client share one.
func TestAStatelessServerWithoutIdentitiesRefuses(t *testing.T) {
	m, _, s := server(t, bgtaskmcp.Options{})
	srv := httptest.NewServer(s.Handler(&mcp.StreamableHTTPOptions{Stateless: true}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(ctx, &mcp.StreamableClientTransport{Endpoint: srv.URL}, nil)
	require.NoError(t, err)
	defer cs.Close()
	for tool, args := range map[string]map[string]any{"launch_task": {"prompt": "p"}, "list_tasks": {}, "get_task": {"id": "x"}, "cancel_task": {"id": "x"}} {
		text, isErr := call(t, cs, ctx, tool, args, nil)
		assert.True(t, isErr, tool)
		assert.Contains(t, text, "names none", tool)
	}
	assert.Empty(t, m.Snapshot().Tasks)
}

// Launches at once from one caller pass its cap together no more than
// one at a time would: with a cap of 2 and six launches whose launch
// function holds them all, two launch and four are refused at once.
func TestLaunchesAtOnceDoNotPassTheCap(t *testing.T) {
	entered, release := make(chan struct{}, 6), make(chan struct{})
	m, _, s := server(t, bgtaskmcp.Options{MaxPerClient: 2, Launch: func(_ context.Context, _ bgtaskmcp.Caller, in bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
		entered <- struct{}{}
		<-release
		return bgtask.Spec{Prompt: in.Prompt, Models: []bgtask.Model{{Provider: "a", ID: "one"}}}, nil
	}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cs := inMemory(t, ctx, s)
	type result struct {
		text  string
		isErr bool
	}
	results := make(chan result, 6)
	for range 6 {
		go func() {
			res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "launch_task", Arguments: map[string]any{"prompt": "work"}})
			if err != nil {
				results <- result{err.Error(), true}
				return
			}
			results <- result{res.Content[0].(*mcp.TextContent).Text, res.IsError}
		}()
	}
	for range 4 {
		r := <-results
		assert.True(t, r.isErr, r.text)
		assert.Contains(t, r.text, "the most this server runs for one client")
	}
	for range 2 {
		<-entered
	}
	close(release)
	for range 2 {
		r := <-results
		assert.False(t, r.isErr, r.text)
	}
	assert.Len(t, m.Snapshot().Tasks, 2)
}

// inMemory connects the SDK's client to s in memory, both closed when
// the test ends.
func inMemory(t *testing.T, ctx context.Context, s *bgtaskmcp.Server) *mcp.ClientSession {
	t.Helper()
	st, ct := mcp.NewInMemoryTransports()
	ss, err := s.Connect(ctx, st, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ss.Close() })
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(ctx, ct, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cs.Close() })
	return cs
}
