package bgtaskmcp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// Native tasks. A client that speaks MCP tasks gets launch_task's answer
// as a task of the protocol's, and follows it with the protocol's task
// methods, in one of two forms:
//
//   - the tasks extension (Extension, MCP 2026-07-28): a tools/call
//     whose _meta declares the extension is answered with a
//     CreateTaskResult (resultType "task"); tasks/get (the result inline
//     once it ended), tasks/update and tasks/cancel follow it;
//   - the 2025-11-25 experimental form: a tools/call with params.task is
//     answered with {task}; tasks/get, tasks/result, tasks/list and
//     tasks/cancel follow it.
//
// The SDK (v1.8.0) refuses a method it does not know before any of its
// middleware runs. So a layer in front of it — wrap for a connection,
// front for HTTP — renames a request of a task method into a tools/call
// of a tool of that method's name (no tools/list shows it), and the
// server's middleware (native) answers it: the SDK's session,
// authentication and protocol checks run on it as on any call. Nor can
// the SDK send a notification it does not know: notify sends one as a
// progress notification marked in its _meta, which the same layer
// unwraps on the way out (unwrap).

// Extension is the MCP tasks extension's identifier, which a Server
// declares in its capabilities.
const Extension = "io.modelcontextprotocol/tasks"

// taskMethods are the methods the layer in front of the SDK renames.
var taskMethods = map[string]bool{"tasks/get": true, "tasks/update": true, "tasks/cancel": true, "tasks/result": true, "tasks/list": true}

// metaTask is the _meta key a 2025-11-25 tools/call's params.task is
// moved to (the SDK keeps _meta, and drops fields it does not know).
const metaTask = "bgtaskmcp/task"

// extVersion is the protocol version that has the extension in place of
// the 2025-11-25 form.
const extVersion = "2026-07-28"

// rename makes a request of a task method — or a subscriptions/listen
// that names tasks — a tools/call the SDK takes, and moves a tools/call's
// params.task into its _meta; it reports whether it changed req. Params
// it cannot read are left for the SDK to refuse.
func rename(req *jsonrpc.Request) bool {
	if !taskMethods[req.Method] && req.Method != "tools/call" && req.Method != methodListen {
		return false
	}
	var p map[string]json.RawMessage
	if len(req.Params) > 0 && json.Unmarshal(req.Params, &p) != nil {
		return false
	}
	if p == nil {
		p = map[string]json.RawMessage{}
	}
	var meta map[string]json.RawMessage
	if raw, ok := p["_meta"]; ok && json.Unmarshal(raw, &meta) != nil {
		return false
	}
	if req.Method == "tools/call" {
		task, ok := p["task"]
		if !ok {
			return false
		}
		if meta == nil {
			meta = map[string]json.RawMessage{}
		}
		meta[metaTask] = task
		delete(p, "task")
	} else {
		if req.Method == methodListen {
			var n struct {
				Notifications map[string]json.RawMessage `json:"notifications"`
			}
			if json.Unmarshal(req.Params, &n) != nil || n.Notifications["taskIds"] == nil {
				return false // the SDK's: no task in it
			}
		}
		args := map[string]json.RawMessage{}
		for k, v := range p {
			if k != "_meta" {
				args[k] = v
			}
		}
		if req.Method == methodListen { // its notifications name it
			args[argRequestID], _ = json.Marshal(req.ID.Raw())
		}
		a, _ := json.Marshal(args)
		n, _ := json.Marshal(req.Method)
		p = map[string]json.RawMessage{"name": n, "arguments": a}
		req.Method = "tools/call"
	}
	if meta != nil {
		p["_meta"], _ = json.Marshal(meta)
	}
	req.Params, _ = json.Marshal(p)
	return true
}

// methodListen is the method a client subscribes with (2026-07-28).
const methodListen = "subscriptions/listen"

// argRequestID is the argument a renamed subscriptions/listen carries
// its request's id in.
const argRequestID = "bgtaskmcp/requestId"

// metaNotify marks a progress notification of this package's that
// carries a notification the SDK has no method for: its value is that
// method, and the progress message its params. The layer in front of the
// SDK (conn.Write, sseRewriter) unwraps it on the way out.
const metaNotify = "bgtaskmcp/notify"

// notify sends method with params on the stream of the request whose
// context is ctx, through the SDK.
func notify(ctx context.Context, ss *mcp.ServerSession, method string, params any) error {
	b, err := json.Marshal(params)
	if err != nil {
		return err
	}
	return ss.NotifyProgress(ctx, &mcp.ProgressNotificationParams{Meta: mcp.Meta{metaNotify: method}, Message: string(b)})
}

// unwrap makes a progress notification that notify sent the
// notification it carries; it reports whether it changed msg.
func unwrap(msg *jsonrpc.Request) bool {
	if msg.Method != "notifications/progress" || msg.ID.IsValid() {
		return false
	}
	var p struct {
		Meta    map[string]any `json:"_meta"`
		Message string         `json:"message"`
	}
	if json.Unmarshal(msg.Params, &p) != nil {
		return false
	}
	method, ok := p.Meta[metaNotify].(string)
	if !ok || !json.Valid([]byte(p.Message)) {
		return false
	}
	msg.Method, msg.Params = method, json.RawMessage(p.Message)
	return true
}

// wrap is t with the task methods: a Server's Run and Connect wrap their
// transport in it.
func wrap(t mcp.Transport) mcp.Transport {
	if t == nil {
		return nil
	}
	if _, ok := t.(transport); ok {
		return t
	}
	return transport{t}
}

type transport struct{ mcp.Transport }

func (t transport) Connect(ctx context.Context) (mcp.Connection, error) {
	c, err := t.Transport.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return conn{c}, nil
}

type conn struct{ mcp.Connection }

func (c conn) Read(ctx context.Context) (jsonrpc.Message, error) {
	m, err := c.Connection.Read(ctx)
	if req, ok := m.(*jsonrpc.Request); ok && err == nil {
		rename(req)
	}
	return m, err
}

func (c conn) Write(ctx context.Context, m jsonrpc.Message) error {
	if req, ok := m.(*jsonrpc.Request); ok {
		out := *req
		if unwrap(&out) {
			m = &out
		}
	}
	return c.Connection.Write(ctx, m)
}

// front is next, a streamable HTTP handler of a Server's (o its
// options), with the task methods. A request of tasks/get, tasks/update
// or tasks/cancel under the 2026-07-28 protocol must carry the header
// Mcp-Name with its task's id, as the extension says, so that a load
// balancer can route by it; any process of a fleet (a Source of a
// fleetview.View) answers for any task.
func front(next http.Handler, o *mcp.StreamableHTTPOptions) http.Handler {
	limit := int64(mcp.DefaultMaxRequestBodyBytes)
	if o != nil && o.MaxRequestBodyBytes != 0 {
		limit = o.MaxRequestBodyBytes
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.Body == nil {
			sw := &sseRewriter{w: w}
			next.ServeHTTP(sw, r)
			sw.end()
			return
		}
		var in io.Reader = r.Body
		if limit > 0 {
			in = io.LimitReader(r.Body, limit+1)
		}
		body, err := io.ReadAll(in)
		if err != nil {
			http.Error(w, "reading the request: "+err.Error(), http.StatusBadRequest)
			return
		}
		if limit > 0 && int64(len(body)) > limit {
			http.Error(w, fmt.Sprintf("the request is over %d bytes", limit), http.StatusRequestEntityTooLarge)
			return
		}
		if msg, err := jsonrpc.DecodeMessage(body); err == nil {
			if req, ok := msg.(*jsonrpc.Request); ok {
				method := req.Method
				if err := routed(r.Header, req); err != nil {
					writeError(w, req.ID, mcp.CodeHeaderMismatch, err.Error(), http.StatusBadRequest)
					return
				}
				if rename(req) {
					if b, err := jsonrpc.EncodeMessage(req); err == nil {
						body = b
						if r.Header.Get("Mcp-Method") != "" {
							r.Header.Set("Mcp-Method", req.Method)
							if method != req.Method {
								r.Header.Set("Mcp-Name", method)
							}
						}
					}
				}
			}
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		sw := &sseRewriter{w: w}
		next.ServeHTTP(sw, r)
		sw.end()
	})
}

// sseRewriter passes a response on, each server-sent event whole, with
// the notifications notify wrapped unwrapped (a JSON answer as it is).
type sseRewriter struct {
	w    http.ResponseWriter
	sse  bool   // decided at the first write
	seen bool   // the first write came
	buf  []byte // an event not whole yet
}

func (s *sseRewriter) Header() http.Header { return s.w.Header() }

func (s *sseRewriter) WriteHeader(code int) {
	s.decide()
	s.w.WriteHeader(code)
}

func (s *sseRewriter) decide() {
	if !s.seen {
		s.seen = true
		s.sse = strings.HasPrefix(s.w.Header().Get("Content-Type"), "text/event-stream")
	}
}

func (s *sseRewriter) Write(p []byte) (int, error) {
	s.decide()
	if !s.sse {
		return s.w.Write(p)
	}
	s.buf = append(s.buf, p...)
	for {
		i := bytes.Index(s.buf, []byte("\n\n"))
		if i < 0 {
			return len(p), nil
		}
		event := s.buf[:i+2]
		if _, err := s.w.Write(unwrapEvent(event)); err != nil {
			return 0, err
		}
		s.buf = s.buf[i+2:]
	}
}

// Flush flushes the events that are whole.
func (s *sseRewriter) Flush() {
	_ = http.NewResponseController(s.w).Flush()
}

// Unwrap is for http.ResponseController.
func (s *sseRewriter) Unwrap() http.ResponseWriter { return s.w }

// end writes what is left: a last event that never ended.
func (s *sseRewriter) end() {
	if len(s.buf) > 0 {
		_, _ = s.w.Write(s.buf)
		s.buf = nil
	}
}

// unwrapEvent is an event with its data, if a notification notify
// wrapped, unwrapped.
func unwrapEvent(event []byte) []byte {
	lines := bytes.Split(event, []byte("\n"))
	for i, l := range lines {
		data, ok := bytes.CutPrefix(l, []byte("data: "))
		if !ok {
			continue
		}
		msg, err := jsonrpc.DecodeMessage(data)
		req, isReq := msg.(*jsonrpc.Request)
		if err != nil || !isReq || !unwrap(req) {
			continue
		}
		if b, err := jsonrpc.EncodeMessage(req); err == nil {
			lines[i] = append([]byte("data: "), b...)
		}
	}
	return bytes.Join(lines, []byte("\n"))
}

// routed checks the routing header of a request of a task method: under
// the 2026-07-28 protocol, Mcp-Name is its params.taskId.
func routed(h http.Header, req *jsonrpc.Request) error {
	if req.Method != "tasks/get" && req.Method != "tasks/update" && req.Method != "tasks/cancel" {
		return nil
	}
	if v := h.Get("Mcp-Protocol-Version"); v == "" || v < extVersion {
		return nil
	}
	var p struct {
		TaskID string `json:"taskId"`
	}
	_ = json.Unmarshal(req.Params, &p)
	if got := h.Get("Mcp-Name"); got != p.TaskID {
		return fmt.Errorf("header mismatch: Mcp-Name is %q and params.taskId %q: a request of %s names its task in both", got, p.TaskID, req.Method)
	}
	return nil
}

// writeError answers id with a JSON-RPC error, at HTTP status.
func writeError(w http.ResponseWriter, id jsonrpc.ID, code int64, msg string, status int) {
	b, err := jsonrpc.EncodeMessage(&jsonrpc.Response{ID: id, Error: &jsonrpc.Error{Code: code, Message: msg}})
	if err != nil {
		http.Error(w, msg, status)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// native is the server's middleware: it answers the task methods, makes
// launch_task's answer a task for a client that asked for one, and
// declares the 2025-11-25 form where the SDK has no field for it.
func (t *tools) native(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		switch method {
		case "tools/call":
			r, ok := req.(*mcp.CallToolRequest)
			if !ok || r.Params == nil {
				break
			}
			if taskMethods[r.Params.Name] || r.Params.Name == methodListen {
				return t.taskMethod(ctx, r)
			}
			_, old := r.Params.Meta[metaTask]
			ext := declares(r.Params.Meta)
			if !old && !ext {
				break
			}
			if r.Params.Name != "launch_task" {
				if old {
					return nil, &jsonrpc.Error{Code: jsonrpc.CodeMethodNotFound, Message: fmt.Sprintf("tool %s does not run as a task: only launch_task does", r.Params.Name)}
				}
				break
			}
			return t.asTask(ctx, method, r, next, ext)
		case "initialize":
			res, err := next(ctx, method, req)
			if err != nil {
				return res, err
			}
			return patched(res, func(m map[string]any) {
				if caps, ok := m["capabilities"].(map[string]any); ok && m["protocolVersion"] == "2025-11-25" { // the form's version
					caps["tasks"] = map[string]any{"list": map[string]any{}, "cancel": map[string]any{}, "requests": map[string]any{"tools": map[string]any{"call": map[string]any{}}}}
				}
			})
		case "tools/list":
			res, err := next(ctx, method, req)
			if err != nil {
				return res, err
			}
			return patched(res, func(m map[string]any) {
				tools, _ := m["tools"].([]any)
				for _, tool := range tools {
					if tm, ok := tool.(map[string]any); ok && tm["name"] == "launch_task" {
						tm["execution"] = map[string]any{"taskSupport": "optional"}
					}
				}
			})
		}
		return next(ctx, method, req)
	}
}

// declares says whether a request's _meta declares the tasks extension.
func declares(meta map[string]any) bool {
	v, ok := meta[mcp.MetaKeyClientCapabilities]
	if !ok {
		return false
	}
	b, err := json.Marshal(v)
	if err != nil {
		return false
	}
	var caps struct {
		Extensions map[string]json.RawMessage `json:"extensions"`
	}
	if json.Unmarshal(b, &caps) != nil {
		return false
	}
	_, ok = caps.Extensions[Extension]
	return ok
}

// rawResult is a result the SDK has no type for, as a JSON object.
type rawResult struct {
	mcp.ResultBase
	fields map[string]any
}

func (r *rawResult) MarshalJSON() ([]byte, error) {
	m := make(map[string]any, len(r.fields)+1)
	for k, v := range r.fields {
		m[k] = v
	}
	if len(r.Meta) > 0 {
		m["_meta"] = r.Meta
	}
	return json.Marshal(m)
}

// patched is res with edit applied to its JSON; res as it is if it
// cannot be read back.
func patched(res mcp.Result, edit func(map[string]any)) (mcp.Result, error) {
	b, err := json.Marshal(res)
	if err != nil {
		return res, nil
	}
	var m map[string]any
	if json.Unmarshal(b, &m) != nil {
		return res, nil
	}
	edit(m)
	out := &rawResult{fields: m}
	if meta, ok := m["_meta"].(map[string]any); ok {
		out.Meta = meta
		delete(m, "_meta")
	}
	return out, nil
}

// A protoTask is a task as either form carries it: the extension's names
// (ttlMs, pollIntervalMs) or the 2025-11-25 form's (ttl, pollInterval).
type protoTask struct {
	TaskID        string `json:"taskId"`
	Status        string `json:"status"`
	StatusMessage string `json:"statusMessage,omitempty"`
	CreatedAt     string `json:"createdAt"`
	LastUpdatedAt string `json:"lastUpdatedAt"`
}

// extTask is the extension's Task, and a DetailedTask's result.
type extTask struct {
	mcp.ResultBase
	ResultType string `json:"resultType,omitempty"` // none in a notification
	protoTask
	TTLMs          *int64              `json:"ttlMs"`
	PollIntervalMs int64               `json:"pollIntervalMs"`
	Result         *mcp.CallToolResult `json:"result,omitempty"`
}

// oldTask is the 2025-11-25 form's Task.
type oldTask struct {
	protoTask
	TTL          *int64 `json:"ttl"`
	PollInterval int64  `json:"pollInterval"`
}

// oldTaskResult is a 2025-11-25 tasks/get or tasks/cancel result.
type oldTaskResult struct {
	mcp.ResultBase
	oldTask
}

// oldCreated is the 2025-11-25 form's CreateTaskResult.
type oldCreated struct {
	mcp.ResultBase
	Task oldTask `json:"task"`
}

// oldList is the 2025-11-25 form's tasks/list result.
type oldList struct {
	mcp.ResultBase
	Tasks      []oldTask `json:"tasks"`
	NextCursor string    `json:"nextCursor,omitempty"`
}

// ack is the extension's empty acknowledgement.
type ack struct {
	mcp.ResultBase
	ResultType string `json:"resultType"`
}

// protoOf is task as a protocol's task: its status and times.
func protoOf(task bgtask.Task) protoTask {
	p := protoTask{TaskID: task.ID, Status: "working", StatusMessage: task.Progress}
	switch task.Status {
	case bgtask.StatusCancelled:
		p.Status, p.StatusMessage = "cancelled", "cancelled"
	case bgtask.StatusCompleted, bgtask.StatusError, bgtask.StatusInterrupt:
		p.Status, p.StatusMessage = "completed", string(task.Status)
	}
	last := task.LaunchedAt
	for _, a := range task.Attempts {
		for _, at := range []time.Time{a.StartedAt, a.CompletedAt} {
			if at.After(last) {
				last = at
			}
		}
	}
	p.CreatedAt, p.LastUpdatedAt = stamp(task.LaunchedAt), stamp(last)
	return p
}

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// toolResult is the tool result a task's protocol task ends with: its
// envelope for the model, the task for the client, an error for a task
// that ended in one (an answer of the tool's, not of the protocol).
func toolResult(task bgtask.Task) *mcp.CallToolResult {
	v := viewOf(task)
	res := said(v)
	res.StructuredContent = v
	res.IsError = task.Status != bgtask.StatusCompleted
	return res
}

func (t *tools) ext(task bgtask.Task, resultType string) *extTask {
	e := &extTask{ResultType: resultType, protoTask: protoOf(task), PollIntervalMs: t.o.PollInterval.Milliseconds()}
	if task.Status.Terminal() && task.Status != bgtask.StatusCancelled {
		e.Result = toolResult(task)
	}
	return e
}

func (t *tools) old(task bgtask.Task) oldTask {
	return oldTask{protoTask: protoOf(task), PollInterval: t.o.PollInterval.Milliseconds()}
}

// asTask runs launch_task, and answers a client that asked for a task
// with its task, once it is durable.
func (t *tools) asTask(ctx context.Context, method string, r *mcp.CallToolRequest, next mcp.MethodHandler, ext bool) (mcp.Result, error) {
	res, err := next(ctx, method, r)
	if err != nil {
		return res, err
	}
	tr, ok := res.(*mcp.CallToolResult)
	if !ok || tr.IsError {
		return res, nil // refused: the tool's error, as it is
	}
	b, err := json.Marshal(tr.StructuredContent)
	var v TaskView
	if err == nil {
		err = json.Unmarshal(b, &v)
	}
	if err != nil || v.ID == "" {
		return res, nil
	}
	task, err := t.m.Task(v.ID)
	if err != nil {
		return nil, &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: "the task launched, and cannot be read: " + err.Error()}
	}
	if ext {
		return t.ext(task, "task"), nil
	}
	return &oldCreated{Task: t.old(task)}, nil
}

// errParams is the JSON-RPC error of a request's bad or unknown task.
func errParams(err error) error {
	return &jsonrpc.Error{Code: jsonrpc.CodeInvalidParams, Message: err.Error()}
}

// taskMethod answers a request of a task method (renamed a tools/call).
func (t *tools) taskMethod(ctx context.Context, r *mcp.CallToolRequest) (mcp.Result, error) {
	method := r.Params.Name
	ext := declares(r.Params.Meta)
	if !ext && method == methodListen || !ext && (r.ProtocolVersion() == "" || r.ProtocolVersion() >= extVersion) {
		data, _ := json.Marshal(map[string]any{"requiredCapabilities": map[string]any{"extensions": map[string]any{Extension: map[string]any{}}}})
		what := method
		if method == methodListen {
			what = "a subscriptions/listen of taskIds"
		}
		return nil, &jsonrpc.Error{Code: mcp.CodeMissingRequiredClientCapabilities, Message: "Missing required client capability: " + what + " is the tasks extension's, and this request does not declare it", Data: data}
	}
	if method == methodListen {
		return t.listen(ctx, r)
	}
	if ext && (method == "tasks/result" || method == "tasks/list") || !ext && method == "tasks/update" {
		form := "the 2025-11-25 form's, which the tasks extension replaced"
		if !ext {
			form = "the tasks extension's (declare it in the request's _meta)"
		}
		return nil, &jsonrpc.Error{Code: jsonrpc.CodeMethodNotFound, Message: fmt.Sprintf("%s is %s", method, form)}
	}
	var in struct {
		TaskID string `json:"taskId"`
		Cursor string `json:"cursor"`
	}
	if len(r.Params.Arguments) > 0 {
		if err := json.Unmarshal(r.Params.Arguments, &in); err != nil {
			return nil, errParams(fmt.Errorf("%s: params: %v", method, err))
		}
	}
	if method == "tasks/list" {
		return t.listOld(r, in.Cursor)
	}
	if in.TaskID == "" {
		return nil, errParams(fmt.Errorf("%s: taskId is required", method))
	}
	task, err := t.own(r, in.TaskID)
	if err != nil {
		return nil, errParams(err)
	}
	c, _ := callerOf(r)
	switch method {
	case "tasks/get":
		if ext {
			return t.ext(task, "complete"), nil
		}
		return &oldTaskResult{oldTask: t.old(task)}, nil
	case "tasks/update":
		return &ack{ResultType: "complete"}, nil // no task of bgtask asks its client for input
	case "tasks/cancel":
		if ext { // cooperative: asked, not awaited
			if _, err := t.m.Stop(bgtask.WithActor(ctx, c.ID), bgtask.Target{Task: task.ID, NoWait: true}); err != nil {
				return nil, &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: err.Error()}
			}
			return &ack{ResultType: "complete"}, nil
		}
		if task.Status.Terminal() {
			return nil, errParams(fmt.Errorf("task %s has ended (%s): there is nothing to cancel", task.ID, task.Status))
		}
		// It answers once the child stopped, or at MaxWait with the task as
		// it is then (still working: honest, and the stop goes on).
		sctx, cancel := context.WithTimeout(bgtask.WithActor(ctx, c.ID), t.o.MaxWait)
		defer cancel()
		if _, err := t.m.Stop(sctx, bgtask.Target{Task: task.ID}); err != nil && sctx.Err() == nil {
			return nil, &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: err.Error()}
		}
		if now, err := t.m.Task(task.ID); err == nil {
			task = now
		}
		return &oldTaskResult{oldTask: t.old(task)}, nil
	default: // tasks/result: once it ended
		done, err := t.waitEnd(ctx, task.ID)
		if err != nil {
			return nil, &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: err.Error()}
		}
		res := toolResult(done)
		res.Meta = mcp.Meta{"io.modelcontextprotocol/related-task": map[string]any{"taskId": done.ID}}
		return res, nil
	}
}

// listen is a subscriptions/listen that names tasks: it acknowledges the
// caller's tasks among them, sends each one's state as notifications/tasks
// (what tasks/get would answer), then each change of its status or its
// status message, until the client leaves (or the source closes). Other
// kinds of notification asked in the same listen are not agreed to: a
// client asks for them in a listen of their own.
func (t *tools) listen(ctx context.Context, r *mcp.CallToolRequest) (mcp.Result, error) {
	var in struct {
		Notifications struct {
			TaskIDs []string `json:"taskIds"`
		} `json:"notifications"`
		RequestID json.RawMessage `json:"bgtaskmcp/requestId"`
	}
	if err := json.Unmarshal(r.Params.Arguments, &in); err != nil {
		return nil, errParams(fmt.Errorf("%s: params: %v", methodListen, err))
	}
	var rid any
	_ = json.Unmarshal(in.RequestID, &rid)
	meta := mcp.Meta{mcp.MetaKeySubscriptionID: rid}
	agreed, watched := []string{}, map[string]bool{}
	for _, id := range in.Notifications.TaskIDs {
		if _, err := t.own(r, id); err == nil && !watched[id] {
			agreed, watched[id] = append(agreed, id), true
		}
	}
	sub, err := t.m.Subscribe(ctx, 0) // before the first states: no change between is missed
	if err != nil {
		return nil, &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: err.Error()}
	}
	defer func() { sub.Close() }()
	if err := notify(ctx, r.Session, "notifications/subscriptions/acknowledged", map[string]any{"_meta": meta, "notifications": map[string]any{"taskIds": agreed}}); err != nil {
		return nil, err
	}
	done := &ack{ResultType: "complete"}
	done.Meta = meta
	if len(agreed) == 0 {
		return done, nil
	}
	sent := map[string]string{} // by task: the status and message sent last
	send := func(task bgtask.Task) error {
		e := t.ext(task, "")
		if key := e.Status + "\x00" + e.StatusMessage; sent[task.ID] != key {
			sent[task.ID] = key
			e.Meta = meta
			return notify(ctx, r.Session, "notifications/tasks", e)
		}
		return nil
	}
	states := func() error {
		for _, id := range agreed {
			if task, err := t.m.Task(id); err == nil {
				if err := send(task); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := states(); err != nil {
		return done, nil // the client is gone
	}
	for {
		select {
		case c, open := <-sub.C:
			if open {
				if watched[c.Task.ID] && send(c.Task) != nil {
					return done, nil
				}
				continue
			}
			if !errors.Is(sub.Err(), bgtask.ErrLagged) || ctx.Err() != nil {
				return done, nil
			}
			if sub, err = t.m.Subscribe(ctx, 0); err != nil || states() != nil { // lagged: from the states again
				return done, nil
			}
		case <-ctx.Done():
			return done, nil
		}
	}
}

// listOld is the 2025-11-25 form's tasks/list: the caller's tasks, a
// page at a time.
func (t *tools) listOld(r *mcp.CallToolRequest, cursor string) (mcp.Result, error) {
	c, err := callerOf(r)
	if err != nil {
		return nil, errParams(err)
	}
	q := bgtask.Query{Metadata: map[string]string{clientKey: c.ID}, Limit: 50}
	if cursor != "" {
		if _, err := t.own(r, cursor); err != nil {
			return nil, errParams(fmt.Errorf("cursor: %w", err))
		}
		q.After = cursor
	}
	p, err := t.m.Tasks(q)
	if err != nil {
		return nil, &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: err.Error()}
	}
	out := &oldList{Tasks: []oldTask{}, NextCursor: p.Next}
	for _, task := range p.Tasks {
		out.Tasks = append(out.Tasks, t.old(task))
	}
	return out, nil
}

// waitEnd waits until task id ended, or ctx ends: the task then, or
// ctx's error.
func (t *tools) waitEnd(ctx context.Context, id string) (bgtask.Task, error) {
	for {
		sub, err := t.m.Subscribe(ctx, 0)
		if err != nil {
			return bgtask.Task{}, err
		}
		task, err := t.m.Task(id)
		if err != nil || task.Status.Terminal() {
			sub.Close()
			return task, err
		}
		for c := range sub.C {
			if c.Task.ID == id && c.Task.Status.Terminal() {
				sub.Close()
				return c.Task, nil
			}
		}
		sub.Close()
		if err := ctx.Err(); err != nil {
			return bgtask.Task{}, err
		}
		if !errors.Is(sub.Err(), bgtask.ErrLagged) {
			return bgtask.Task{}, fmt.Errorf("waiting for task %s: %w", id, cmpErr(sub.Err(), errors.New("the source closed")))
		}
	}
}

func cmpErr(err, or error) error {
	if err != nil {
		return err
	}
	return or
}
