package bgtaskmcp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// The layer in front of the SDK. The task methods are the SDK's own
// custom methods (mcp.AddReceivingCustomMethod), and a CreateTaskResult
// is the server's middleware's; three things the SDK (v1.8.0) cannot
// carry take a thin layer on the wire, around the bytes of stdio (or an
// mcp.IOTransport) and around the HTTP handler:
//
//   - a 2025-11-25 tools/call's params.task, which the SDK drops: the
//     layer moves it into the request's _meta (metaTask);
//   - a subscriptions/listen's notifications.taskIds, which it drops
//     too: moved into _meta (metaTaskIDs), with the request's id
//     (metaRequestID), which its notifications name;
//   - notifications/tasks and the listen's acknowledgement with task
//     ids, methods it cannot send: notify sends each as a progress
//     notification marked in its _meta (metaNotify), and the layer
//     unwraps it on the way out.
//
// The SDK's own connection stays in place (the layer rewrites bytes, not
// messages), so its session handling is untouched.

const (
	metaTask      = "bgtaskmcp/task"      // a 2025-11-25 tools/call's params.task
	metaTaskIDs   = "bgtaskmcp/taskIds"   // a subscriptions/listen's notifications.taskIds
	metaRequestID = "bgtaskmcp/requestId" // that listen's request id
	metaNotify    = "bgtaskmcp/notify"    // a wrapped notification's method
)

// carry moves what the SDK would drop of req into its _meta; it reports
// whether it changed req. Params it cannot read are left for the SDK to
// refuse.
func carry(req *jsonrpc.Request) bool {
	if req.Method != "tools/call" && req.Method != methodListen {
		return false
	}
	var p map[string]json.RawMessage
	if len(req.Params) == 0 || json.Unmarshal(req.Params, &p) != nil || p == nil {
		return false
	}
	var moved map[string]json.RawMessage
	if req.Method == "tools/call" {
		task, ok := p["task"]
		if !ok {
			return false
		}
		moved = map[string]json.RawMessage{metaTask: task}
	} else {
		var n struct {
			Notifications struct {
				TaskIDs json.RawMessage `json:"taskIds"`
			} `json:"notifications"`
		}
		if json.Unmarshal(req.Params, &n) != nil || n.Notifications.TaskIDs == nil {
			return false // the SDK's: no task in it
		}
		id, _ := json.Marshal(req.ID.Raw())
		moved = map[string]json.RawMessage{metaTaskIDs: n.Notifications.TaskIDs, metaRequestID: id}
	}
	meta := map[string]json.RawMessage{}
	if raw, ok := p["_meta"]; ok && json.Unmarshal(raw, &meta) != nil {
		return false
	}
	for k, v := range moved {
		meta[k] = v
	}
	p["_meta"], _ = json.Marshal(meta)
	b, err := json.Marshal(p)
	if err != nil {
		return false
	}
	req.Params = b
	return true
}

// notify sends method with params on the stream of the request whose
// context is ctx, through the SDK, for the layer to unwrap.
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

// edit is line (a JSON-RPC message) with f applied to it, if it is a
// request or a notification that f changes; else line as it is.
func edit(line []byte, f func(*jsonrpc.Request) bool) []byte {
	msg, err := jsonrpc.DecodeMessage(line)
	req, ok := msg.(*jsonrpc.Request)
	if err != nil || !ok || !f(req) {
		return line
	}
	b, err := jsonrpc.EncodeMessage(req)
	if err != nil {
		return line
	}
	return b
}

// wrap is t with the layer: stdio and an mcp.IOTransport are rewritten
// line by line; any other transport is t, which serves the tools, the
// extension's CreateTaskResult and the task methods, but not the
// 2025-11-25 form's creation nor listens of tasks.
func wrap(t mcp.Transport) mcp.Transport {
	switch t := t.(type) {
	case *mcp.StdioTransport:
		return &mcp.IOTransport{Reader: carrying(os.Stdin, t.MaxLineLength), Writer: unwrapping(nopCloser{os.Stdout}), MaxLineLength: t.MaxLineLength}
	case *mcp.IOTransport:
		if _, done := t.Reader.(*lineReader); done {
			return t
		}
		return &mcp.IOTransport{Reader: carrying(t.Reader, t.MaxLineLength), Writer: unwrapping(t.Writer), MaxLineLength: t.MaxLineLength}
	}
	return t
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }

// lineReader reads src a line at a time, each through carry; a line
// over max bytes, and all after it, are passed on as they are (the SDK
// refuses it).
type lineReader struct {
	src  io.ReadCloser
	r    *bufio.Reader
	max  int
	out  []byte
	raw  bool
	err  error
	line []byte
}

func carrying(src io.ReadCloser, max int) *lineReader {
	if max == 0 {
		max = mcp.DefaultMaxLineLength
	}
	return &lineReader{src: src, r: bufio.NewReader(src), max: max}
}

func (l *lineReader) Read(p []byte) (int, error) {
	for len(l.out) == 0 {
		if l.err != nil {
			return 0, l.err
		}
		if l.raw {
			return l.r.Read(p)
		}
		chunk, err := l.r.ReadSlice('\n')
		l.line = append(l.line, chunk...)
		switch {
		case err == bufio.ErrBufferFull:
			if l.max > 0 && len(l.line) > l.max {
				l.out, l.line, l.raw = l.line, nil, true
			}
			continue
		case err != nil:
			l.out, l.line, l.err = l.line, nil, err
		default:
			l.out, l.line = edit(l.line, carry), nil
			if !bytes.HasSuffix(l.out, []byte("\n")) {
				l.out = append(l.out, '\n')
			}
		}
	}
	n := copy(p, l.out)
	l.out = l.out[n:]
	return n, nil
}

func (l *lineReader) Close() error { return l.src.Close() }

// framed passes what is written on to w a unit at a time (each ending
// in sep), each through f; a unit not whole yet waits for the rest.
type framed struct {
	w   io.Writer
	sep []byte
	f   func([]byte) []byte
	buf []byte
}

func (w *framed) Write(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	for {
		i := bytes.Index(w.buf, w.sep)
		if i < 0 {
			return len(p), nil
		}
		end := i + len(w.sep)
		if _, err := w.w.Write(w.f(w.buf[:end])); err != nil {
			return 0, err
		}
		w.buf = w.buf[end:]
	}
}

// rest writes what is left: a last unit that never ended.
func (w *framed) rest() {
	if len(w.buf) > 0 {
		_, _ = w.w.Write(w.buf)
		w.buf = nil
	}
}

// lineWriter unwraps each line written to it (a message the SDK wrote).
type lineWriter struct {
	framed
	c io.Closer
}

func unwrapping(w io.WriteCloser) *lineWriter {
	return &lineWriter{framed: framed{w: w, sep: []byte("\n"), f: func(line []byte) []byte {
		out := edit(bytes.TrimSuffix(line, []byte("\n")), unwrap)
		return append(out[:len(out):len(out)], '\n')
	}}, c: w}
}

func (w *lineWriter) Close() error {
	w.rest()
	return w.c.Close()
}

// front is next, a streamable HTTP handler of a Server's (o its
// options), with the layer. A request of tasks/get, tasks/update or
// tasks/cancel under the 2026-07-28 protocol must carry the header
// Mcp-Name with its task's id, as the extension says, so that a load
// balancer can route by it; any process of a fleet (a Source of a
// fleetview.View) answers for any task.
func front(next http.Handler, o *mcp.StreamableHTTPOptions) http.Handler {
	limit := int64(mcp.DefaultMaxRequestBodyBytes)
	if o != nil && o.MaxRequestBodyBytes != 0 {
		limit = o.MaxRequestBodyBytes
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && r.Body != nil {
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
					if err := routed(r.Header, req); err != nil {
						writeError(w, req.ID, mcp.CodeHeaderMismatch, err.Error(), http.StatusBadRequest)
						return
					}
					if carry(req) {
						if b, err := jsonrpc.EncodeMessage(req); err == nil {
							body = b
						}
					}
				}
			}
			r.Body = io.NopCloser(bytes.NewReader(body))
			r.ContentLength = int64(len(body))
		}
		sw := &sseRewriter{w: w}
		sw.framed = framed{w: w, sep: []byte("\n\n"), f: unwrapEvent}
		next.ServeHTTP(sw, r)
		sw.rest()
	})
}

// routed checks the routing header of a request of a task method: under
// the 2026-07-28 protocol, Mcp-Name, if it is there, is its
// params.taskId. One without it is served: this process can answer it,
// and the go-sdk client (v1.8.0) sends none for a custom method; a
// balancer that routes by it needs it.
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
	if got, ok := h["Mcp-Name"]; ok && (len(got) != 1 || got[0] != p.TaskID) {
		return fmt.Errorf("header mismatch: Mcp-Name is %q and params.taskId %q: a request of %s names its task in both", strings.Join(got, ", "), p.TaskID, req.Method)
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

// sseRewriter passes a response on: an event stream an event at a time,
// each with what notify wrapped unwrapped; any other answer as it is.
type sseRewriter struct {
	framed
	w    http.ResponseWriter
	sse  bool // decided at the first write
	seen bool
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
	return s.framed.Write(p)
}

// Flush flushes the events that are whole.
func (s *sseRewriter) Flush() { _ = http.NewResponseController(s.w).Flush() }

// Unwrap is for http.ResponseController.
func (s *sseRewriter) Unwrap() http.ResponseWriter { return s.w }

// unwrapEvent is an event with its data, if notify wrapped it,
// unwrapped.
func unwrapEvent(event []byte) []byte {
	lines := bytes.Split(event, []byte("\n"))
	for i, l := range lines {
		if data, ok := bytes.CutPrefix(l, []byte("data: ")); ok {
			lines[i] = append([]byte("data: "), edit(data, unwrap)...)
		}
	}
	return bytes.Join(lines, []byte("\n"))
}
