package bgtaskmcp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
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
//     once it ended), tasks/update and tasks/cancel follow it, and a
//     subscriptions/listen of taskIds brings notifications/tasks;
//   - the 2025-11-25 experimental form, in a session of that version: a
//     tools/call with params.task is answered with {task}; tasks/get,
//     tasks/result, tasks/list and tasks/cancel follow it.
//
// The task methods are custom methods of the SDK's
// (mcp.AddReceivingCustomMethod); the server's middleware (native) puts
// each request's caller where they find it, answers launch_task with a
// task, and takes a listen of tasks. What the SDK cannot carry goes
// through the layer in wire.go.

// Extension is the MCP tasks extension's identifier, which a Server
// declares in its capabilities.
const Extension = "io.modelcontextprotocol/tasks"

// The protocol versions: the extension's, and the 2025-11-25 form's.
const (
	extVersion = "2026-07-28"
	oldVersion = "2025-11-25"
)

// methodListen is the method a client subscribes with (2026-07-28).
const methodListen = "subscriptions/listen"

// taskMethods are the task methods, of either form.
var taskMethods = []string{"tasks/get", "tasks/update", "tasks/cancel", "tasks/result", "tasks/list"}

// taskParams are a task method's params.
type taskParams struct {
	mcp.ParamsBase
	TaskID         string          `json:"taskId,omitempty"`
	Cursor         string          `json:"cursor,omitempty"`
	InputResponses json.RawMessage `json:"inputResponses,omitempty"`
}

// taskRequest is a task method's request, as the SDK made it.
type taskRequest = mcp.ServerRequest[*taskParams]

// requestKey is the context key of a task method's request (native puts
// it there; the methods' handlers, given only its params, read it).
type requestKey struct{}

// addTaskMethods registers the task methods on s.
func (t *tools) addTaskMethods(s *mcp.Server) error {
	for _, method := range taskMethods {
		err := mcp.AddReceivingCustomMethod(s, method, func(ctx context.Context, _ *mcp.ServerSession, _ *taskParams) (mcp.Result, error) {
			r, ok := ctx.Value(requestKey{}).(*taskRequest)
			if !ok {
				return nil, &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: method + ": the server's middleware did not run"}
			}
			return t.taskMethod(ctx, method, r)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// native is the server's middleware: it hands a task method its request,
// makes launch_task's answer a task for a client that asked for one,
// takes a listen of tasks, and declares the 2025-11-25 form where the
// SDK has no field for it.
func (t *tools) native(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		switch r := req.(type) {
		case *taskRequest:
			return next(context.WithValue(ctx, requestKey{}, r), method, req)
		case *mcp.SubscriptionsListenRequest:
			if r.Params != nil {
				if _, ok := r.Params.Meta[metaTaskIDs]; ok {
					return t.listen(ctx, r)
				}
			}
		case *mcp.CallToolRequest:
			if r.Params == nil || r.Params.Name != "launch_task" {
				if r.Params != nil && r.Params.Meta[metaTask] != nil && r.ProtocolVersion() == oldVersion {
					return nil, &jsonrpc.Error{Code: jsonrpc.CodeMethodNotFound, Message: fmt.Sprintf("tool %s does not run as a task: only launch_task does", r.Params.Name)}
				}
				break
			}
			if ext := declares(r.Params.Meta); ext || r.Params.Meta[metaTask] != nil && r.ProtocolVersion() == oldVersion {
				return t.asTask(ctx, method, r, next, ext)
			}
		case *mcp.ServerRequest[*mcp.InitializeParams]:
			res, err := next(ctx, method, req)
			if err != nil {
				return res, err
			}
			return patched(res, func(m map[string]any) {
				if caps, ok := m["capabilities"].(map[string]any); ok && m["protocolVersion"] == oldVersion {
					caps["tasks"] = map[string]any{"list": map[string]any{}, "cancel": map[string]any{}, "requests": map[string]any{"tools": map[string]any{"call": map[string]any{}}}}
				}
			})
		case *mcp.ListToolsRequest:
			res, err := next(ctx, method, req)
			if err != nil || r.ProtocolVersion() != oldVersion {
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
		return nil, &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: fmt.Sprintf("task %s launched, and cannot be read: %v", v.ID, err)}
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

// errInternal is the JSON-RPC error of a failure of the server's.
func errInternal(err error) error {
	return &jsonrpc.Error{Code: jsonrpc.CodeInternalError, Message: err.Error()}
}

// errUndeclared is the extension's error for a request that needs it
// and does not declare it.
func errUndeclared(what string) error {
	data, _ := json.Marshal(map[string]any{"requiredCapabilities": map[string]any{"extensions": map[string]any{Extension: map[string]any{}}}})
	return &jsonrpc.Error{Code: mcp.CodeMissingRequiredClientCapabilities, Message: "Missing required client capability: " + what + " is the tasks extension's, and this request does not declare it", Data: data}
}

// taskMethod answers a request of a task method. The extension's form
// is a request's that declares it; the 2025-11-25 form's, one of a
// session of that version.
func (t *tools) taskMethod(ctx context.Context, method string, r *taskRequest) (mcp.Result, error) {
	p := r.Params
	if p == nil {
		p = &taskParams{}
	}
	ext := declares(p.Meta)
	if !ext {
		switch v := r.ProtocolVersion(); {
		case v == oldVersion:
		case v != "" && v < oldVersion:
			return nil, &jsonrpc.Error{Code: jsonrpc.CodeMethodNotFound, Message: fmt.Sprintf("%s: protocol version %s has no tasks", method, v)}
		default:
			return nil, errUndeclared(method)
		}
	}
	if ext && (method == "tasks/result" || method == "tasks/list") || !ext && method == "tasks/update" {
		form := "the 2025-11-25 form's, which the tasks extension replaced"
		if !ext {
			form = "the tasks extension's (declare it in the request's _meta)"
		}
		return nil, &jsonrpc.Error{Code: jsonrpc.CodeMethodNotFound, Message: fmt.Sprintf("%s is %s", method, form)}
	}
	c, err := callerOf(r)
	if err != nil {
		return nil, errParams(err)
	}
	if method == "tasks/list" {
		return t.listOld(c, p.Cursor)
	}
	if p.TaskID == "" {
		return nil, errParams(fmt.Errorf("%s: taskId is required", method))
	}
	task, err := t.own(c, p.TaskID)
	if err != nil {
		return nil, errParams(err)
	}
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
				return nil, errInternal(err)
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
			return nil, errInternal(err)
		}
		if now, err := t.m.Task(task.ID); err == nil {
			task = now
		}
		return &oldTaskResult{oldTask: t.old(task)}, nil
	default: // tasks/result: once it ended, within MaxWait
		wctx, cancel := context.WithTimeout(ctx, t.o.MaxWait)
		defer cancel()
		done, err := t.waitEnd(wctx, task.ID)
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			return nil, errInternal(fmt.Errorf("task %s is still working after %s: ask tasks/result again", task.ID, t.o.MaxWait))
		}
		if err != nil {
			return nil, errInternal(err)
		}
		res := toolResult(done)
		res.Meta = mcp.Meta{"io.modelcontextprotocol/related-task": map[string]any{"taskId": done.ID}}
		return res, nil
	}
}

// maxListened bounds the tasks one listen names.
const maxListened = 100

// listen takes a subscriptions/listen that names tasks: it acknowledges
// the caller's tasks among them, sends each one's state as
// notifications/tasks (what tasks/get would answer), then each change of
// its status or status message, until the listen ends (the client
// leaves, or the session closes) or the source closes. Other kinds of
// notification asked in the same listen are not agreed to: a client asks
// for them in a listen of its own.
func (t *tools) listen(ctx context.Context, r *mcp.SubscriptionsListenRequest) (mcp.Result, error) {
	if !declares(r.Params.Meta) {
		return nil, errUndeclared("a subscriptions/listen of taskIds")
	}
	c, err := callerOf(r)
	if err != nil {
		return nil, errParams(err)
	}
	var ids []string
	if b, err := json.Marshal(r.Params.Meta[metaTaskIDs]); err != nil || json.Unmarshal(b, &ids) != nil {
		return nil, errParams(errors.New("subscriptions/listen: notifications.taskIds is a list of task ids"))
	}
	if len(ids) > maxListened {
		return nil, errParams(fmt.Errorf("subscriptions/listen: %d taskIds, over the %d one listen may name", len(ids), maxListened))
	}
	meta := mcp.Meta{mcp.MetaKeySubscriptionID: r.Params.Meta[metaRequestID]}
	agreed, watched := []string{}, map[string]bool{}
	for _, id := range ids {
		if watched[id] {
			continue
		}
		if _, err := t.own(c, id); err == nil {
			agreed, watched[id] = append(agreed, id), true
		}
	}
	release, err := t.holdListen(c)
	if err != nil {
		return nil, errParams(err)
	}
	defer release()
	sub, err := t.m.Subscribe(ctx, 0) // before the first states: no change between is missed
	if err != nil {
		return nil, errInternal(err)
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
	type state struct {
		rev uint64
		key string
	}
	sent := map[string]state{} // by task: what was sent last
	send := func(task bgtask.Task) error {
		was, ok := sent[task.ID]
		if ok && task.Revision < was.rev {
			return nil // older than what was sent: a change the first read already had
		}
		e := t.ext(task, "")
		key := e.Status + "\x00" + e.StatusMessage
		sent[task.ID] = state{task.Revision, key}
		if key == was.key {
			return nil
		}
		e.Meta = meta
		return notify(ctx, r.Session, "notifications/tasks", e)
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
	if states() != nil {
		return done, nil // the client is gone
	}
	for {
		select {
		case ch, open := <-sub.C:
			if open {
				if watched[ch.Task.ID] && send(ch.Task) != nil {
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

// listOld is the 2025-11-25 form's tasks/list: the caller's tasks, 50 a
// page.
func (t *tools) listOld(c Caller, cursor string) (mcp.Result, error) {
	q := bgtask.Query{Metadata: map[string]string{clientKey: c.ID}, Limit: 50}
	if cursor != "" {
		if _, err := t.own(c, cursor); err != nil {
			return nil, errParams(fmt.Errorf("cursor: %w", err))
		}
		q.After = cursor
	}
	p, err := t.m.Tasks(q)
	if err != nil {
		return nil, errInternal(err)
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
