package bgtaskmcp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskmcp"
	"github.com/bgtask/bgtask/bgtaskmcp/wiretest"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// authed serves a Manager on a scripted host over streamable HTTP behind
// a bearer token whose text is its user's name.
func authed(t testing.TB, opts *mcp.StreamableHTTPOptions) *served {
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
// routing header that names another task -32020 (one with none is
// served), the 2025-11-25 form's methods not found.
func TestTheTasksExtensionOverHTTP(t *testing.T) {
	s := authed(t, &mcp.StreamableHTTPOptions{Stateless: true}) // the SDK takes 2026-07-28 on a stateless server only
	alice := &wiretest.Client{TB: t, URL: s.url, Token: "alice", Version: "2026-07-28", Extension: true}

	disc := alice.Call(s.ctx, "server/discover", nil, "")
	require.Nil(t, disc.Err)
	caps, _ := disc.Result["capabilities"].(map[string]any)
	exts, _ := caps["extensions"].(map[string]any)
	assert.Contains(t, exts, bgtaskmcp.Extension, "declared in server/discover")

	created := alice.Launch(s.ctx, "find the bug", nil)
	require.Nil(t, created.Err)
	assert.Equal(t, "task", created.Result["resultType"])
	id, _ := created.Result["taskId"].(string)
	require.NotEmpty(t, id)
	assert.Equal(t, "working", created.Result["status"])
	assert.Nil(t, created.Result["ttlMs"], "no time bound: the Manager's retention keeps it")
	assert.EqualValues(t, 2000, created.Result["pollIntervalMs"])
	_, err := time.Parse(time.RFC3339Nano, created.Result["createdAt"].(string))
	require.NoError(t, err)

	got := alice.Get(s.ctx, id) // resolves at once: durable before the answer
	require.Nil(t, got.Err)
	assert.Equal(t, "complete", got.Result["resultType"])
	assert.Equal(t, "working", got.Result["status"])
	assert.NotContains(t, got.Result, "result")

	running, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, s.host.Fail(running.SessionID, errors.New("429 Too Many Requests")))
	retried, err := bgtasktest.WaitFor(s.ctx, s.m, id, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.SessionID != "" })
	require.NoError(t, err)
	assert.Equal(t, "working", alice.Get(s.ctx, id).Result["status"], "a retry is still work")
	require.NoError(t, s.host.Idle(retried.SessionID, "it is in parse.go"))
	_, err = s.m.Wait(s.ctx, id)
	require.NoError(t, err)

	done := alice.Get(s.ctx, id)
	require.Nil(t, done.Err)
	assert.Equal(t, "completed", done.Result["status"])
	res, _ := done.Result["result"].(map[string]any)
	require.NotNil(t, res, "a completed task carries its result inline")
	assert.NotEqual(t, true, res["isError"], "completed: no error")
	content, _ := res["content"].([]any)
	require.Len(t, content, 1)
	assert.Contains(t, content[0].(map[string]any)["text"], "it is in parse.go", "the envelope, for the model")
	structured, _ := res["structuredContent"].(map[string]any)
	assert.EqualValues(t, 2, structured["attempts"], "the fallback to the second model")

	// Cancel: acknowledged at once, cancelled once the child stopped.
	second := alice.Launch(s.ctx, "second", nil)
	require.Nil(t, second.Err)
	id2 := second.Result["taskId"].(string)
	_, err = bgtasktest.WaitStatus(s.ctx, s.m, id2, bgtask.StatusRunning)
	require.NoError(t, err)
	ack := alice.Call(s.ctx, "tasks/cancel", map[string]any{"taskId": id2}, id2)
	require.Nil(t, ack.Err)
	assert.Equal(t, map[string]any{"resultType": "complete"}, withoutMeta(ack.Result))
	_, err = bgtasktest.WaitStatus(s.ctx, s.m, id2, bgtask.StatusCancelled)
	require.NoError(t, err)
	cancelled := alice.Get(s.ctx, id2)
	assert.Equal(t, "cancelled", cancelled.Result["status"])
	assert.NotContains(t, cancelled.Result, "result")

	upd := alice.Call(s.ctx, "tasks/update", map[string]any{"taskId": id, "inputResponses": map[string]any{"never-asked": map[string]any{"action": "accept"}}}, id)
	require.Nil(t, upd.Err, "responses to keys never asked are ignored")
	assert.Equal(t, "complete", upd.Result["resultType"])

	bob := &wiretest.Client{TB: t, URL: s.url, Token: "bob", Version: "2026-07-28", Extension: true}
	for _, method := range []string{"tasks/get", "tasks/cancel", "tasks/update"} {
		a := bob.Call(s.ctx, method, map[string]any{"taskId": id}, id)
		require.NotNil(t, a.Err, method)
		assert.EqualValues(t, jsonrpc.CodeInvalidParams, a.Err.Code, "%s of alice's task: as of none", method)
		assert.Contains(t, a.Err.Message, "unknown task")
		assert.Equal(t, http.StatusBadRequest, a.Status)
	}
	none := alice.Get(s.ctx, "no-such-task")
	require.NotNil(t, none.Err)
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, none.Err.Code)
	blank := alice.Call(s.ctx, "tasks/get", map[string]any{}, "")
	require.NotNil(t, blank.Err)
	assert.Contains(t, blank.Err.Message, "taskId is required")

	undeclared := &wiretest.Client{TB: t, URL: s.url, Token: "alice", Version: "2026-07-28"}
	a := undeclared.Get(s.ctx, id)
	require.NotNil(t, a.Err)
	assert.EqualValues(t, mcp.CodeMissingRequiredClientCapabilities, a.Err.Code)
	assert.Contains(t, string(a.Err.Data), bgtaskmcp.Extension)
	plain := undeclared.Launch(s.ctx, "no task for me", nil)
	require.Nil(t, plain.Err)
	assert.NotEqual(t, "task", plain.Result["resultType"], "a client that did not declare the extension gets no task")
	assert.Contains(t, plain.Result, "structuredContent")

	wrong := alice.Call(s.ctx, "tasks/get", map[string]any{"taskId": id}, "another-id")
	require.NotNil(t, wrong.Err, "an Mcp-Name that is not the task's")
	assert.EqualValues(t, mcp.CodeHeaderMismatch, wrong.Err.Code)
	assert.Equal(t, http.StatusBadRequest, wrong.Status)
	unnamed := alice.Call(s.ctx, "tasks/get", map[string]any{"taskId": id}, "")
	require.Nil(t, unnamed.Err, "no Mcp-Name: this process answers it")
	assert.Equal(t, "completed", unnamed.Result["status"])
	for _, method := range []string{"tasks/list", "tasks/result"} {
		a := alice.Call(s.ctx, method, map[string]any{"taskId": id}, id)
		require.NotNil(t, a.Err, method)
		assert.EqualValues(t, jsonrpc.CodeMethodNotFound, a.Err.Code, method)
	}
	other := alice.Call(s.ctx, "tools/call", map[string]any{"name": "get_task", "arguments": map[string]any{"id": id}}, "get_task")
	require.Nil(t, other.Err)
	assert.NotEqual(t, "task", other.Result["resultType"], "only launch_task answers with a task")
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
	c := &wiretest.Client{TB: t, URL: s.url, Version: "2025-11-25"}
	init := c.Initialize(s.ctx)
	caps, _ := init.Result["capabilities"].(map[string]any)
	assert.Equal(t, map[string]any{"list": map[string]any{}, "cancel": map[string]any{}, "requests": map[string]any{"tools": map[string]any{"call": map[string]any{}}}}, caps["tasks"])
	assert.Contains(t, caps, "tools", "the SDK's own capabilities are kept")

	list := c.Call(s.ctx, "tools/list", nil, "")
	require.Nil(t, list.Err)
	support := map[string]any{}
	for _, tool := range list.Result["tools"].([]any) {
		tm := tool.(map[string]any)
		if ex, ok := tm["execution"].(map[string]any); ok {
			support[tm["name"].(string)] = ex["taskSupport"]
		}
	}
	assert.Equal(t, map[string]any{"launch_task": "optional"}, support)
	for _, tool := range list.Result["tools"].([]any) {
		assert.NotContains(t, tool.(map[string]any)["name"], "/", "no task method shows as a tool")
	}

	created := c.Launch(s.ctx, "find the bug", map[string]any{"task": map[string]any{"ttl": 60000}})
	require.Nil(t, created.Err)
	task, _ := created.Result["task"].(map[string]any)
	require.NotNil(t, task, "the 2025-11-25 CreateTaskResult: {task}")
	id, _ := task["taskId"].(string)
	require.NotEmpty(t, id)
	assert.Equal(t, "working", task["status"])
	assert.EqualValues(t, 2000, task["pollInterval"])

	got := c.Call(s.ctx, "tasks/get", map[string]any{"taskId": id}, "")
	require.Nil(t, got.Err)
	assert.Equal(t, "working", got.Result["status"])
	assert.NotContains(t, got.Result, "result", "the result is tasks/result's")

	var wg sync.WaitGroup
	var result wiretest.Answer
	wg.Add(1)
	go func() { // tasks/result waits for the end
		defer wg.Done()
		result = c.Call(s.ctx, "tasks/result", map[string]any{"taskId": id}, "")
	}()
	running, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, s.host.Idle(running.SessionID, "it is in parse.go"))
	wg.Wait()
	require.Nil(t, result.Err)
	content, _ := result.Result["content"].([]any)
	require.Len(t, content, 1)
	assert.Contains(t, content[0].(map[string]any)["text"], "it is in parse.go")
	meta, _ := result.Result["_meta"].(map[string]any)
	assert.Equal(t, map[string]any{"taskId": id}, meta["io.modelcontextprotocol/related-task"])

	second := c.Launch(s.ctx, "second", map[string]any{"task": map[string]any{}})
	require.Nil(t, second.Err)
	id2 := second.Result["task"].(map[string]any)["taskId"].(string)
	_, err = bgtasktest.WaitStatus(s.ctx, s.m, id2, bgtask.StatusRunning)
	require.NoError(t, err)
	cancelled := c.Call(s.ctx, "tasks/cancel", map[string]any{"taskId": id2}, "")
	require.Nil(t, cancelled.Err)
	assert.Equal(t, "cancelled", cancelled.Result["status"], "the 2025-11-25 cancel answers once the child stopped")
	again := c.Call(s.ctx, "tasks/cancel", map[string]any{"taskId": id}, "")
	require.NotNil(t, again.Err, "a task that ended cannot be cancelled")
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, again.Err.Code)

	all := c.Call(s.ctx, "tasks/list", nil, "")
	require.Nil(t, all.Err)
	var ids []string
	for _, tk := range all.Result["tasks"].([]any) {
		ids = append(ids, tk.(map[string]any)["taskId"].(string))
	}
	assert.Equal(t, []string{id, id2}, ids)

	other := &wiretest.Client{TB: t, URL: s.url, Version: "2025-11-25"}
	other.Initialize(s.ctx)
	theirs := other.Call(s.ctx, "tasks/list", nil, "")
	require.Nil(t, theirs.Err)
	assert.Empty(t, theirs.Result["tasks"], "another session lists none of them")
	a := other.Call(s.ctx, "tasks/get", map[string]any{"taskId": id}, "")
	require.NotNil(t, a.Err)
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, a.Err.Code)

	refused := c.Call(s.ctx, "tools/call", map[string]any{"name": "get_task", "arguments": map[string]any{"id": id}, "task": map[string]any{}}, "")
	require.NotNil(t, refused.Err, "get_task does not run as a task")
	assert.EqualValues(t, jsonrpc.CodeMethodNotFound, refused.Err.Code)
	upd := c.Call(s.ctx, "tasks/update", map[string]any{"taskId": id}, "")
	require.NotNil(t, upd.Err, "tasks/update is the extension's")
	assert.EqualValues(t, jsonrpc.CodeMethodNotFound, upd.Err.Code)
}

// Over a connection (stdio, or here in memory), the task methods reach
// the server through Transport: a client of the extension launches,
// polls and cancels there too.
func TestTheTasksExtensionOverAConnection(t *testing.T) {
	m, host, c, ctx := connected(t)
	decode := func(res map[string]any, err *jsonrpc.Error) map[string]any {
		t.Helper()
		require.Nil(t, err)
		return res
	}
	call := c.Call
	created := decode(call(ctx, "tools/call", map[string]any{"name": "launch_task", "arguments": map[string]any{"prompt": "work"}}))
	require.Equal(t, "task", created["resultType"])
	id := created["taskId"].(string)
	running, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	assert.Equal(t, "working", decode(call(ctx, "tasks/get", map[string]any{"taskId": id}))["status"])
	assert.Equal(t, "complete", decode(call(ctx, "tasks/cancel", map[string]any{"taskId": id}))["resultType"])
	_, err = bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusCancelled)
	require.NoError(t, err)
	assert.Equal(t, "cancelled", decode(call(ctx, "tasks/get", map[string]any{"taskId": id}))["status"])
	assert.Contains(t, host.Aborts(), running.SessionID, "the child was stopped")
	_, werr := call(ctx, "tasks/get", map[string]any{"taskId": "nope"})
	require.NotNil(t, werr)
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, werr.Code)
}

// The layer in front of the SDK reads a request body only as far as the
// handler's limit, and a task request it cannot read goes on to the SDK,
// which refuses it: an error, never a crash.
func TestTheLayerBoundsAndPassesOnWhatItCannotRead(t *testing.T) {
	s := authed(t, &mcp.StreamableHTTPOptions{Stateless: true, MaxRequestBodyBytes: 1024})
	post := func(body string) (int, string) {
		req, err := http.NewRequestWithContext(s.ctx, http.MethodPost, s.url, strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer alice")
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	status, _ := post(`{"jsonrpc":"2.0","id":1,"method":"tasks/get","params":{"taskId":"` + strings.Repeat("x", 2048) + `"}}`)
	assert.Equal(t, http.StatusRequestEntityTooLarge, status)
	for _, body := range []string{
		`{"jsonrpc":"2.0","id":1,"method":"tasks/get","params":[1]}`,
		`{"jsonrpc":"2.0","id":1,"method":"tasks/get","params":{"taskId":7}}`,
		`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"launch_task","task":{}, "_meta": 5}}`,
		`[{"jsonrpc":"2.0","id":1,"method":"tasks/get","params":{"taskId":"x"}}]`,
		`not json`,
	} {
		status, text := post(body)
		assert.GreaterOrEqual(t, status, 200, body)
		if status == http.StatusOK {
			assert.Contains(t, text, `"error"`, body)
		}
	}
	alice := &wiretest.Client{TB: t, URL: s.url, Token: "alice", Version: "2026-07-28", Extension: true}
	assert.Nil(t, alice.Launch(s.ctx, "still serving", nil).Err)
}

// recvMsg is the next message of a stream.
func recvMsg(t *testing.T, ctx context.Context, c <-chan map[string]any) map[string]any {
	t.Helper()
	select {
	case m, ok := <-c:
		require.True(t, ok, "the stream ended")
		return m
	case <-ctx.Done():
		require.FailNow(t, "no message came")
		return nil
	}
}

// notifications/tasks over HTTP: a subscriptions/listen that names tasks
// is acknowledged with the caller's tasks among them (not another's,
// not one that is none), then brings each one's state, then each change
// to its end, with the result inline, as tasks/get answers it; a client
// that did not declare the extension is refused (-32021); and the
// server's handler ends when the client leaves (goleak checks).
func TestTaskNotificationsOverHTTP(t *testing.T) {
	s := authed(t, &mcp.StreamableHTTPOptions{Stateless: true})
	alice := &wiretest.Client{TB: t, URL: s.url, Token: "alice", Version: "2026-07-28", Extension: true}
	bob := &wiretest.Client{TB: t, URL: s.url, Token: "bob", Version: "2026-07-28", Extension: true}
	id := alice.Launch(s.ctx, "watched", nil).Result["taskId"].(string)
	bobs := bob.Launch(s.ctx, "bob's", nil).Result["taskId"].(string)
	running, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusRunning)
	require.NoError(t, err)

	st := alice.Listen(s.ctx, []string{id, bobs, "no-such-task", id})
	defer st.Close()
	ack := recvMsg(t, s.ctx, st.C)
	require.Equal(t, "notifications/subscriptions/acknowledged", ack["method"], "%v", ack)
	params := ack["params"].(map[string]any)
	assert.Equal(t, map[string]any{"taskIds": []any{id}}, params["notifications"], "only the caller's tasks, once")
	assert.NotNil(t, params["_meta"].(map[string]any)[mcp.MetaKeySubscriptionID])

	first := recvMsg(t, s.ctx, st.C)
	require.Equal(t, "notifications/tasks", first["method"])
	state := first["params"].(map[string]any)
	assert.Equal(t, id, state["taskId"])
	assert.Equal(t, "working", state["status"])
	assert.NotContains(t, state, "resultType", "a notification is a task, not a result")

	require.NoError(t, s.host.Emit(bgtask.Event{SessionID: running.SessionID, Kind: bgtask.SessionBusy, Progress: "reading parse.go"}))
	moved := recvMsg(t, s.ctx, st.C)["params"].(map[string]any)
	assert.Equal(t, "working", moved["status"])
	assert.Equal(t, "reading parse.go", moved["statusMessage"])

	require.NoError(t, s.host.Idle(running.SessionID, "it is in parse.go"))
	end := recvMsg(t, s.ctx, st.C)["params"].(map[string]any)
	assert.Equal(t, "completed", end["status"])
	res := end["result"].(map[string]any)
	assert.Contains(t, res["content"].([]any)[0].(map[string]any)["text"], "it is in parse.go", "the result inline, as tasks/get has it")
	got := alice.Get(s.ctx, id).Result
	delete(got, "resultType")
	delete(got, "_meta")
	delete(end, "_meta")
	assert.Equal(t, got, end, "identical to what tasks/get answers")

	plain := authed(t, &mcp.StreamableHTTPOptions{Stateless: true, JSONResponse: true}) // a listen streams all the same
	carol := &wiretest.Client{TB: t, URL: plain.url, Token: "carol", Version: "2026-07-28", Extension: true}
	cid := carol.Launch(plain.ctx, "watched", nil).Result["taskId"].(string)
	streamed := carol.Listen(plain.ctx, []string{cid})
	defer streamed.Close()
	assert.Equal(t, "notifications/subscriptions/acknowledged", recvMsg(t, plain.ctx, streamed.C)["method"])
	assert.Equal(t, "notifications/tasks", recvMsg(t, plain.ctx, streamed.C)["method"])

	undeclared := &wiretest.Client{TB: t, URL: s.url, Token: "alice", Version: "2026-07-28"}
	refused := undeclared.Listen(s.ctx, []string{id})
	defer refused.Close()
	answer := recvMsg(t, s.ctx, refused.C)
	require.Contains(t, answer, "error", "%v", answer)
	assert.EqualValues(t, mcp.CodeMissingRequiredClientCapabilities, answer["error"].(map[string]any)["code"])
}

// notifications/tasks on a connection: the listen's stream is the
// connection, and a cancel of the listen ends it with its result.
func TestTaskNotificationsOverAConnection(t *testing.T) {
	m, host, c, ctx := connected(t)
	created, werr := c.Call(ctx, "tools/call", map[string]any{"name": "launch_task", "arguments": map[string]any{"prompt": "work"}})
	require.Nil(t, werr)
	id := created["taskId"].(string)
	running, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	lid := c.Send(ctx, "subscriptions/listen", map[string]any{"notifications": map[string]any{"taskIds": []string{id}}})
	next := func() *jsonrpc.Request {
		t.Helper()
		msg := c.Next(ctx)
		req, ok := msg.(*jsonrpc.Request)
		require.True(t, ok, "%#v", msg)
		return req
	}
	assert.Equal(t, "notifications/subscriptions/acknowledged", next().Method)
	assert.Equal(t, "notifications/tasks", next().Method)
	require.NoError(t, host.Idle(running.SessionID, "done"))
	end := next()
	assert.Equal(t, "notifications/tasks", end.Method)
	assert.Contains(t, string(end.Params), `"status":"completed"`)
	c.Notify(ctx, "notifications/cancelled", map[string]any{"requestId": lid.Raw()})
	msg := c.Next(ctx)
	resp, ok := msg.(*jsonrpc.Response)
	require.True(t, ok, "%#v", msg)
	assert.Equal(t, lid, resp.ID, "the listen ends with its result")
}

// connected is a Manager on a scripted host, served on a pipe (piped).
func connected(t *testing.T) (*bgtask.Manager, *bgtasktest.Host, *wiretest.Conn, context.Context) {
	t.Helper()
	m, host, s := server(t, bgtaskmcp.Options{})
	c, _, ctx := piped(t, s)
	return m, host, c, ctx
}

// piped serves s through Server.Connect on an mcp.IOTransport over an
// in-memory pipe (the layer wraps it, as it does stdio), with a client
// of the task methods on its other end; all closed when the test ends.
func piped(t *testing.T, s *bgtaskmcp.Server) (*wiretest.Conn, *mcp.ServerSession, context.Context) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	a, b := net.Pipe()
	ss, err := s.Connect(ctx, &mcp.IOTransport{Reader: a, Writer: a}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = ss.Close() })
	conn, err := (&mcp.IOTransport{Reader: b, Writer: b}).Connect(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return &wiretest.Conn{TB: t, C: conn}, ss, ctx
}

// pausing is a Manager whose first read of a task after a subscription
// waits until the test lets it go: a listen's first read of its tasks
// then comes after changes its subscription already holds.
type pausing struct {
	*bgtask.Manager
	subscribed chan struct{} // closed at the first Subscribe
	reading    chan struct{} // told when that read waits
	release    chan struct{}
	once, read sync.Once
}

func (p *pausing) Subscribe(ctx context.Context, buffer int) (*bgtask.Subscription, error) {
	sub, err := p.Manager.Subscribe(ctx, buffer)
	p.once.Do(func() { close(p.subscribed) })
	return sub, err
}

func (p *pausing) Task(id string) (bgtask.Task, error) {
	select {
	case <-p.subscribed:
		p.read.Do(func() {
			p.reading <- struct{}{}
			<-p.release
		})
	default:
	}
	return p.Manager.Task(id)
}

// A listen never tells a task's state older than one it told: here the
// task ends while the listen's subscription holds its earlier changes
// and before the listen reads it, and the listen tells the end alone.
// The listen ends with its session (the server's own close, not the
// client's leaving).
func TestAListenNeverGoesBack(t *testing.T) {
	m, host, _ := server(t, bgtaskmcp.Options{})
	p := &pausing{Manager: m, subscribed: make(chan struct{}), reading: make(chan struct{}), release: make(chan struct{})}
	s, err := bgtaskmcp.New(p, bgtaskmcp.Options{Launch: func(_ context.Context, _ bgtaskmcp.Caller, in bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
		return bgtask.Spec{Prompt: in.Prompt, Models: []bgtask.Model{{Provider: "a", ID: "one"}}}, nil
	}})
	require.NoError(t, err)
	c, ss, ctx := piped(t, s)
	conn := c.C
	created, werr := c.Call(ctx, "tools/call", map[string]any{"name": "launch_task", "arguments": map[string]any{"prompt": "work"}})
	require.Nil(t, werr)
	id := created["taskId"].(string)
	running, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
	require.NoError(t, err)

	c.Send(ctx, "subscriptions/listen", map[string]any{"notifications": map[string]any{"taskIds": []string{id}}})
	<-p.reading // subscribed, about to read the task
	require.NoError(t, host.Emit(bgtask.Event{SessionID: running.SessionID, Kind: bgtask.SessionBusy, Progress: "reading"}))
	require.NoError(t, host.Idle(running.SessionID, "done"))
	_, err = m.Wait(ctx, id)
	require.NoError(t, err)
	close(p.release)

	next := func() *jsonrpc.Request {
		t.Helper()
		req, ok := c.Next(ctx).(*jsonrpc.Request)
		require.True(t, ok)
		return req
	}
	assert.Equal(t, "notifications/subscriptions/acknowledged", next().Method)
	end := next()
	assert.Equal(t, "notifications/tasks", end.Method)
	assert.Contains(t, string(end.Params), `"status":"completed"`, "the state it read first: the end")

	closed := make(chan error, 1)
	go func() { closed <- ss.Close() }() // ends the listen, which only waits
	for {
		msg, err := conn.Read(ctx)
		if err != nil {
			break // the server closed the connection: nothing came after the end
		}
		if req, ok := msg.(*jsonrpc.Request); ok {
			assert.NotEqual(t, "notifications/tasks", req.Method, "a state after the end: %s", req.Params)
		}
	}
	select {
	case err := <-closed:
		assert.NoError(t, err)
	case <-ctx.Done():
		t.Fatal("the session's close waited for the listen")
	}
}

// tasks/result of the 2025-11-25 form waits at most Options.MaxWait, and
// says the task still works; a listen may name at most 100 tasks.
func TestTheWaitsAreBounded(t *testing.T) {
	m, _, s := server(t, bgtaskmcp.Options{MaxWait: 50 * time.Millisecond})
	srv := httptest.NewServer(s.Handler(nil))
	t.Cleanup(func() { // after the session's end, a cleanup of the client's
		srv.CloseClientConnections()
		srv.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	c := &wiretest.Client{TB: t, URL: srv.URL, Version: "2025-11-25"}
	c.Initialize(ctx)
	id := c.Launch(ctx, "long", map[string]any{"task": map[string]any{}}).Result["task"].(map[string]any)["taskId"].(string)
	_, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	a := c.Call(ctx, "tasks/result", map[string]any{"taskId": id}, "")
	require.NotNil(t, a.Err)
	assert.Contains(t, a.Err.Message, "still working")

	_, _, conn, cctx := connected(t)
	many := make([]string, 101)
	for i := range many {
		many[i] = fmt.Sprint("t-", i)
	}
	_, werr := conn.Call(cctx, "subscriptions/listen", map[string]any{"notifications": map[string]any{"taskIds": many}})
	require.NotNil(t, werr)
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, werr.Code)
	assert.Contains(t, werr.Message, "over the 100")
}

// bearer adds a bearer token to each request.
type bearer string

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+string(b))
	return http.DefaultTransport.RoundTrip(r)
}

// getParams and getResult are tasks/get's, as a client of the go-sdk
// declares them for mcp.CallCustomMethod.
type getParams struct {
	mcp.ParamsBase
	TaskID string `json:"taskId"`
}

type getResult struct {
	mcp.ResultBase
	TaskID string              `json:"taskId"`
	Status string              `json:"status"`
	Result *mcp.CallToolResult `json:"result"`
}

// The SDK's own client, declaring the extension in its capabilities,
// polls with tasks/get (mcp.CallCustomMethod) over streamable HTTP: the
// task methods are the SDK's custom methods, and any client of it can
// call them.
func TestTheSDKsClientPollsWithTasksGet(t *testing.T) {
	s := authed(t, &mcp.StreamableHTTPOptions{Stateless: true})
	c := mcp.NewClient(&mcp.Implementation{Name: "sdk", Version: "v0"}, &mcp.ClientOptions{
		Capabilities: &mcp.ClientCapabilities{Extensions: map[string]any{bgtaskmcp.Extension: map[string]any{}}}})
	require.NoError(t, mcp.AddSendingCustomMethod[*getParams, *getResult](c, "tasks/get"))
	cs, err := c.Connect(s.ctx, &mcp.StreamableClientTransport{Endpoint: s.url, HTTPClient: &http.Client{Transport: bearer("carol")}}, nil)
	require.NoError(t, err)
	defer cs.Close()
	var list bgtaskmcp.ListOutput
	_, isErr := call(t, cs, s.ctx, "launch_task", map[string]any{"prompt": "from the SDK"}, nil) // a task: the SDK's CallToolResult cannot hold its id
	require.False(t, isErr)
	_, isErr = call(t, cs, s.ctx, "list_tasks", map[string]any{}, &list)
	require.False(t, isErr)
	require.Len(t, list.Tasks, 1)
	id := list.Tasks[0].ID

	got, err := mcp.CallCustomMethod[*getParams, *getResult](s.ctx, cs, "tasks/get", &getParams{TaskID: id})
	require.NoError(t, err)
	assert.Equal(t, "working", got.Status)
	running, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, s.host.Idle(running.SessionID, "hello from the task"))
	_, err = s.m.Wait(s.ctx, id)
	require.NoError(t, err)
	got, err = mcp.CallCustomMethod[*getParams, *getResult](s.ctx, cs, "tasks/get", &getParams{TaskID: id})
	require.NoError(t, err)
	assert.Equal(t, "completed", got.Status)
	require.NotNil(t, got.Result)
	assert.Contains(t, got.Result.Content[0].(*mcp.TextContent).Text, "hello from the task")
	_, err = mcp.CallCustomMethod[*getParams, *getResult](s.ctx, cs, "tasks/get", &getParams{TaskID: "not-mine"})
	var werr *jsonrpc.Error
	require.ErrorAs(t, err, &werr)
	assert.EqualValues(t, jsonrpc.CodeInvalidParams, werr.Code)
}
