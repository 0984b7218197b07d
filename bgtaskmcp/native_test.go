package bgtaskmcp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskmcp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// wire is a client that speaks JSON-RPC to an MCP endpoint itself, as a
// client of the tasks extension (version 2026-07-28, sessionless, its
// bearer token naming it) or of the 2025-11-25 form (a session) does:
// the go-sdk client has no task methods.
type wire struct {
	t       *testing.T
	url     string
	token   string
	version string
	ext     bool   // declare the tasks extension on each request
	session string // Mcp-Session-Id, once initialized (2025-11-25)
	n       int
}

// answer is one JSON-RPC answer, and its HTTP status.
type answer struct {
	status int
	result map[string]any
	err    *jsonrpc.Error
}

// call sends method with params; name is the Mcp-Name header ("" none).
func (c *wire) call(ctx context.Context, method string, params map[string]any, name string) answer {
	c.t.Helper()
	if params == nil {
		params = map[string]any{}
	}
	if c.version >= "2026-07-28" {
		caps := map[string]any{}
		if c.ext {
			caps["extensions"] = map[string]any{bgtaskmcp.Extension: map[string]any{}}
		}
		params["_meta"] = map[string]any{mcp.MetaKeyProtocolVersion: c.version, mcp.MetaKeyClientCapabilities: caps,
			mcp.MetaKeyClientInfo: map[string]any{"name": "wire", "version": "v0"}}
	}
	c.n++
	body, err := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": c.n, "method": method, "params": params})
	require.NoError(c.t, err)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, bytes.NewReader(body))
	require.NoError(c.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Mcp-Protocol-Version", c.version)
	if c.version >= "2026-07-28" {
		req.Header.Set("Mcp-Method", method)
	}
	if name != "" {
		req.Header.Set("Mcp-Name", name)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	if c.session != "" {
		req.Header.Set("Mcp-Session-Id", c.session)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(c.t, err)
	defer resp.Body.Close()
	if id := resp.Header.Get("Mcp-Session-Id"); id != "" {
		c.session = id
	}
	raw, err := io.ReadAll(resp.Body)
	require.NoError(c.t, err)
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		for _, line := range strings.Split(string(raw), "\n") { // the answer is the stream's data line that has an id
			if d, ok := strings.CutPrefix(line, "data: "); ok && strings.Contains(d, `"id"`) {
				raw = []byte(d)
			}
		}
	}
	var out struct {
		Result map[string]any  `json:"result"`
		Error  *jsonrpc.Error  `json:"error"`
		ID     json.RawMessage `json:"id"`
	}
	require.NoError(c.t, json.Unmarshal(raw, &out), "%d %s", resp.StatusCode, raw)
	return answer{status: resp.StatusCode, result: out.Result, err: out.Error}
}

// end ends the client's session, if it has one, when the test ends (a
// session of a stateful server lives until its client ends it).
func (c *wire) end(ctx context.Context) {
	c.t.Cleanup(func() {
		if c.session == "" {
			return
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodDelete, c.url, nil)
		require.NoError(c.t, err)
		req.Header.Set("Mcp-Session-Id", c.session)
		req.Header.Set("Mcp-Protocol-Version", c.version)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(c.t, err)
		_ = resp.Body.Close()
	})
}

// notify sends a notification.
func (c *wire) notify(ctx context.Context, method string) {
	c.t.Helper()
	body := fmt.Sprintf(`{"jsonrpc":"2.0","method":%q}`, method)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, strings.NewReader(body))
	require.NoError(c.t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Mcp-Protocol-Version", c.version)
	req.Header.Set("Mcp-Session-Id", c.session)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(c.t, err)
	_ = resp.Body.Close()
	require.Equal(c.t, http.StatusAccepted, resp.StatusCode)
}

// launch calls launch_task with prompt.
func (c *wire) launch(ctx context.Context, prompt string, extra map[string]any) answer {
	params := map[string]any{"name": "launch_task", "arguments": map[string]any{"prompt": prompt}}
	for k, v := range extra {
		params[k] = v
	}
	return c.call(ctx, "tools/call", params, "launch_task")
}

// get is tasks/get of id, named in Mcp-Name as the extension asks.
func (c *wire) get(ctx context.Context, id string) answer {
	return c.call(ctx, "tasks/get", map[string]any{"taskId": id}, id)
}

// authed serves a Manager on a scripted host over streamable HTTP behind
// a bearer token whose text is its user's name.
func authed(t *testing.T, opts *mcp.StreamableHTTPOptions) *served {
	t.Helper()
	m, host, s := server(t, bgtaskmcp.Options{MaxPerClient: 4})
	verify := func(_ context.Context, token string, _ *http.Request) (*auth.TokenInfo, error) {
		if token == "" {
			return nil, auth.ErrInvalidToken
		}
		return &auth.TokenInfo{UserID: token, Expiration: time.Now().Add(time.Hour)}, nil
	}
	srv := httptest.NewServer(auth.RequireBearerToken(verify, nil)(s.Handler(opts)))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(func() {
		cancel()
		srv.CloseClientConnections()
		srv.Close()
	})
	return &served{m: m, host: host, url: srv.URL, ctx: ctx}
}

// The tasks extension, as a 2026-07-28 client speaks it over HTTP: the
// server declares it; a launch whose request declares it is answered
// with a task, durable at once; tasks/get follows it across a fallback
// to its answer, inline; tasks/cancel is acknowledged and the task then
// reads cancelled; tasks/update is acknowledged; and the protocol's
// errors are the extension's: a task of another caller or none is
// -32602, a request that does not declare the extension -32021, a
// routing header that does not name the task -32020, the 2025-11-25
// form's methods not found.
func TestTheTasksExtensionOverHTTP(t *testing.T) {
	s := authed(t, &mcp.StreamableHTTPOptions{Stateless: true}) // the SDK takes 2026-07-28 on a stateless server only
	alice := &wire{t: t, url: s.url, token: "alice", version: "2026-07-28", ext: true}

	disc := alice.call(s.ctx, "server/discover", nil, "")
	require.Nil(t, disc.err)
	caps, _ := disc.result["capabilities"].(map[string]any)
	exts, _ := caps["extensions"].(map[string]any)
	assert.Contains(t, exts, bgtaskmcp.Extension, "declared in server/discover")

	created := alice.launch(s.ctx, "find the bug", nil)
	require.Nil(t, created.err)
	assert.Equal(t, "task", created.result["resultType"])
	id, _ := created.result["taskId"].(string)
	require.NotEmpty(t, id)
	assert.Equal(t, "working", created.result["status"])
	assert.Nil(t, created.result["ttlMs"], "no time bound: the Manager's retention keeps it")
	assert.EqualValues(t, 2000, created.result["pollIntervalMs"])
	_, err := time.Parse(time.RFC3339Nano, created.result["createdAt"].(string))
	require.NoError(t, err)

	got := alice.get(s.ctx, id) // resolves at once: durable before the answer
	require.Nil(t, got.err)
	assert.Equal(t, "complete", got.result["resultType"])
	assert.Equal(t, "working", got.result["status"])
	assert.NotContains(t, got.result, "result")

	running, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, s.host.Fail(running.SessionID, errors.New("429 Too Many Requests")))
	retried, err := bgtasktest.WaitFor(s.ctx, s.m, id, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.SessionID != "" })
	require.NoError(t, err)
	assert.Equal(t, "working", alice.get(s.ctx, id).result["status"], "a retry is still work")
	require.NoError(t, s.host.Idle(retried.SessionID, "it is in parse.go"))
	_, err = s.m.Wait(s.ctx, id)
	require.NoError(t, err)

	done := alice.get(s.ctx, id)
	require.Nil(t, done.err)
	assert.Equal(t, "completed", done.result["status"])
	res, _ := done.result["result"].(map[string]any)
	require.NotNil(t, res, "a completed task carries its result inline")
	assert.NotEqual(t, true, res["isError"], "completed: no error")
	content, _ := res["content"].([]any)
	require.Len(t, content, 1)
	assert.Contains(t, content[0].(map[string]any)["text"], "it is in parse.go", "the envelope, for the model")
	structured, _ := res["structuredContent"].(map[string]any)
	assert.EqualValues(t, 2, structured["attempts"], "the fallback to the second model")

	// Cancel: acknowledged at once, cancelled once the child stopped.
	second := alice.launch(s.ctx, "second", nil)
	require.Nil(t, second.err)
	id2 := second.result["taskId"].(string)
	_, err = bgtasktest.WaitStatus(s.ctx, s.m, id2, bgtask.StatusRunning)
	require.NoError(t, err)
	ack := alice.call(s.ctx, "tasks/cancel", map[string]any{"taskId": id2}, id2)
	require.Nil(t, ack.err)
	assert.Equal(t, map[string]any{"resultType": "complete"}, withoutMeta(ack.result))
	_, err = bgtasktest.WaitStatus(s.ctx, s.m, id2, bgtask.StatusCancelled)
	require.NoError(t, err)
	cancelled := alice.get(s.ctx, id2)
	assert.Equal(t, "cancelled", cancelled.result["status"])
	assert.NotContains(t, cancelled.result, "result")

	upd := alice.call(s.ctx, "tasks/update", map[string]any{"taskId": id, "inputResponses": map[string]any{"never-asked": map[string]any{"action": "accept"}}}, id)
	require.Nil(t, upd.err, "responses to keys never asked are ignored")
	assert.Equal(t, "complete", upd.result["resultType"])

	bob := &wire{t: t, url: s.url, token: "bob", version: "2026-07-28", ext: true}
	for _, method := range []string{"tasks/get", "tasks/cancel", "tasks/update"} {
		a := bob.call(s.ctx, method, map[string]any{"taskId": id}, id)
		require.NotNil(t, a.err, method)
		assert.EqualValues(t, jsonrpc.CodeInvalidParams, a.err.Code, "%s of alice's task: as of none", method)
		assert.Contains(t, a.err.Message, "unknown task")
		assert.Equal(t, http.StatusBadRequest, a.status)
	}
	none := alice.get(s.ctx, "no-such-task")
	require.NotNil(t, none.err)
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, none.err.Code)
	blank := alice.call(s.ctx, "tasks/get", map[string]any{}, "")
	require.NotNil(t, blank.err)
	assert.Contains(t, blank.err.Message, "taskId is required")

	undeclared := &wire{t: t, url: s.url, token: "alice", version: "2026-07-28"}
	a := undeclared.get(s.ctx, id)
	require.NotNil(t, a.err)
	assert.EqualValues(t, mcp.CodeMissingRequiredClientCapabilities, a.err.Code)
	assert.Contains(t, string(a.err.Data), bgtaskmcp.Extension)
	plain := undeclared.launch(s.ctx, "no task for me", nil)
	require.Nil(t, plain.err)
	assert.NotEqual(t, "task", plain.result["resultType"], "a client that did not declare the extension gets no task")
	assert.Contains(t, plain.result, "structuredContent")

	for _, name := range []string{"", "another-id"} {
		a := alice.call(s.ctx, "tasks/get", map[string]any{"taskId": id}, name)
		require.NotNil(t, a.err, "Mcp-Name %q", name)
		assert.EqualValues(t, mcp.CodeHeaderMismatch, a.err.Code)
		assert.Equal(t, http.StatusBadRequest, a.status)
	}
	for _, method := range []string{"tasks/list", "tasks/result"} {
		a := alice.call(s.ctx, method, map[string]any{"taskId": id}, id)
		require.NotNil(t, a.err, method)
		assert.EqualValues(t, jsonrpc.CodeMethodNotFound, a.err.Code, method)
	}
	other := alice.call(s.ctx, "tools/call", map[string]any{"name": "get_task", "arguments": map[string]any{"id": id}}, "get_task")
	require.Nil(t, other.err)
	assert.NotEqual(t, "task", other.result["resultType"], "only launch_task answers with a task")
}

// withoutMeta is m without its _meta (the SDK names itself there).
func withoutMeta(m map[string]any) map[string]any {
	out := map[string]any{}
	for k, v := range m {
		if k != "_meta" {
			out[k] = v
		}
	}
	return out
}

// The 2025-11-25 form, as a client of that version speaks it over HTTP
// in a session: initialize declares tasks, tools/list marks launch_task
// as one that may run as a task, a tools/call with params.task is
// answered with {task}, and tasks/get, tasks/list, tasks/result (which
// waits for the end) and tasks/cancel follow it; another session sees
// none of it, and a task of another tool is refused.
func TestThe2025FormOverHTTP(t *testing.T) {
	s := serve(t)
	c := &wire{t: t, url: s.url, version: "2025-11-25"}
	c.end(s.ctx)
	init := c.call(s.ctx, "initialize", map[string]any{"protocolVersion": "2025-11-25", "capabilities": map[string]any{}, "clientInfo": map[string]any{"name": "old", "version": "v0"}}, "")
	require.Nil(t, init.err)
	require.NotEmpty(t, c.session)
	caps, _ := init.result["capabilities"].(map[string]any)
	assert.Equal(t, map[string]any{"list": map[string]any{}, "cancel": map[string]any{}, "requests": map[string]any{"tools": map[string]any{"call": map[string]any{}}}}, caps["tasks"])
	assert.Contains(t, caps, "tools", "the SDK's own capabilities are kept")
	c.notify(s.ctx, "notifications/initialized")

	list := c.call(s.ctx, "tools/list", nil, "")
	require.Nil(t, list.err)
	support := map[string]any{}
	for _, tool := range list.result["tools"].([]any) {
		tm := tool.(map[string]any)
		if ex, ok := tm["execution"].(map[string]any); ok {
			support[tm["name"].(string)] = ex["taskSupport"]
		}
	}
	assert.Equal(t, map[string]any{"launch_task": "optional"}, support)
	for _, tool := range list.result["tools"].([]any) {
		assert.NotContains(t, tool.(map[string]any)["name"], "/", "no task method shows as a tool")
	}

	created := c.launch(s.ctx, "find the bug", map[string]any{"task": map[string]any{"ttl": 60000}})
	require.Nil(t, created.err)
	task, _ := created.result["task"].(map[string]any)
	require.NotNil(t, task, "the 2025-11-25 CreateTaskResult: {task}")
	id, _ := task["taskId"].(string)
	require.NotEmpty(t, id)
	assert.Equal(t, "working", task["status"])
	assert.EqualValues(t, 2000, task["pollInterval"])

	got := c.call(s.ctx, "tasks/get", map[string]any{"taskId": id}, "")
	require.Nil(t, got.err)
	assert.Equal(t, "working", got.result["status"])
	assert.NotContains(t, got.result, "result", "the result is tasks/result's")

	var wg sync.WaitGroup
	var result answer
	wg.Add(1)
	go func() { // tasks/result waits for the end
		defer wg.Done()
		result = c.call(s.ctx, "tasks/result", map[string]any{"taskId": id}, "")
	}()
	running, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, s.host.Idle(running.SessionID, "it is in parse.go"))
	wg.Wait()
	require.Nil(t, result.err)
	content, _ := result.result["content"].([]any)
	require.Len(t, content, 1)
	assert.Contains(t, content[0].(map[string]any)["text"], "it is in parse.go")
	meta, _ := result.result["_meta"].(map[string]any)
	assert.Equal(t, map[string]any{"taskId": id}, meta["io.modelcontextprotocol/related-task"])

	second := c.launch(s.ctx, "second", map[string]any{"task": map[string]any{}})
	require.Nil(t, second.err)
	id2 := second.result["task"].(map[string]any)["taskId"].(string)
	_, err = bgtasktest.WaitStatus(s.ctx, s.m, id2, bgtask.StatusRunning)
	require.NoError(t, err)
	cancelled := c.call(s.ctx, "tasks/cancel", map[string]any{"taskId": id2}, "")
	require.Nil(t, cancelled.err)
	assert.Equal(t, "cancelled", cancelled.result["status"], "the 2025-11-25 cancel answers once the child stopped")
	again := c.call(s.ctx, "tasks/cancel", map[string]any{"taskId": id}, "")
	require.NotNil(t, again.err, "a task that ended cannot be cancelled")
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, again.err.Code)

	all := c.call(s.ctx, "tasks/list", nil, "")
	require.Nil(t, all.err)
	var ids []string
	for _, tk := range all.result["tasks"].([]any) {
		ids = append(ids, tk.(map[string]any)["taskId"].(string))
	}
	assert.Equal(t, []string{id, id2}, ids)

	other := &wire{t: t, url: s.url, version: "2025-11-25"}
	other.end(s.ctx)
	require.Nil(t, other.call(s.ctx, "initialize", map[string]any{"protocolVersion": "2025-11-25", "capabilities": map[string]any{}, "clientInfo": map[string]any{"name": "other", "version": "v0"}}, "").err)
	other.notify(s.ctx, "notifications/initialized")
	theirs := other.call(s.ctx, "tasks/list", nil, "")
	require.Nil(t, theirs.err)
	assert.Empty(t, theirs.result["tasks"], "another session lists none of them")
	a := other.call(s.ctx, "tasks/get", map[string]any{"taskId": id}, "")
	require.NotNil(t, a.err)
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, a.err.Code)

	refused := c.call(s.ctx, "tools/call", map[string]any{"name": "get_task", "arguments": map[string]any{"id": id}, "task": map[string]any{}}, "")
	require.NotNil(t, refused.err, "get_task does not run as a task")
	assert.EqualValues(t, jsonrpc.CodeMethodNotFound, refused.err.Code)
	upd := c.call(s.ctx, "tasks/update", map[string]any{"taskId": id}, "")
	require.NotNil(t, upd.err, "tasks/update is the extension's")
	assert.EqualValues(t, jsonrpc.CodeMethodNotFound, upd.err.Code)
}

// Over a connection (stdio, or here in memory), the task methods reach
// the server through Transport: a client of the extension launches,
// polls and cancels there too.
func TestTheTasksExtensionOverAConnection(t *testing.T) {
	m, host, s := server(t, bgtaskmcp.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, ct := mcp.NewInMemoryTransports()
	ss, err := s.Connect(ctx, st, nil)
	require.NoError(t, err)
	defer ss.Close()
	conn, err := ct.Connect(ctx)
	require.NoError(t, err)
	defer conn.Close()
	n := int64(0)
	call := func(method string, params map[string]any) *jsonrpc.Response {
		t.Helper()
		params["_meta"] = map[string]any{mcp.MetaKeyProtocolVersion: "2026-07-28", mcp.MetaKeyClientInfo: map[string]any{"name": "conn", "version": "v0"},
			mcp.MetaKeyClientCapabilities: map[string]any{"extensions": map[string]any{bgtaskmcp.Extension: map[string]any{}}}}
		b, err := json.Marshal(params)
		require.NoError(t, err)
		n++
		id, err := jsonrpc.MakeID(float64(n))
		require.NoError(t, err)
		require.NoError(t, conn.Write(ctx, &jsonrpc.Request{ID: id, Method: method, Params: b}))
		for {
			msg, err := conn.Read(ctx)
			require.NoError(t, err)
			if r, ok := msg.(*jsonrpc.Response); ok && r.ID == id {
				return r
			}
		}
	}
	decode := func(r *jsonrpc.Response) map[string]any {
		t.Helper()
		require.NoError(t, r.Error)
		var out map[string]any
		require.NoError(t, json.Unmarshal(r.Result, &out))
		return out
	}
	created := decode(call("tools/call", map[string]any{"name": "launch_task", "arguments": map[string]any{"prompt": "work"}}))
	require.Equal(t, "task", created["resultType"])
	id := created["taskId"].(string)
	running, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	assert.Equal(t, "working", decode(call("tasks/get", map[string]any{"taskId": id}))["status"])
	assert.Equal(t, "complete", decode(call("tasks/cancel", map[string]any{"taskId": id}))["resultType"])
	_, err = bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusCancelled)
	require.NoError(t, err)
	assert.Equal(t, "cancelled", decode(call("tasks/get", map[string]any{"taskId": id}))["status"])
	assert.Contains(t, host.Aborts(), running.SessionID, "the child was stopped")
	r := call("tasks/get", map[string]any{"taskId": "nope"})
	var werr *jsonrpc.Error
	require.ErrorAs(t, r.Error, &werr)
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, werr.Code)
}
