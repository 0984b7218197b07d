// Package wiretest is a client of an MCP server's task methods for
// tests: it speaks JSON-RPC over streamable HTTP itself, as a client of
// the tasks extension (2026-07-28, sessionless, named by its bearer
// token) or of the 2025-11-25 form (in a session) does. The go-sdk
// client has no task methods.
package wiretest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/bgtask/bgtask/bgtaskmcp"
	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/require"
)

// Client is one client of an MCP endpoint.
type Client struct {
	TB  testing.TB
	URL string
	// Token is its bearer token ("" none).
	Token string
	// Version is the protocol version it speaks: "2026-07-28" sends the
	// per-request _meta and the standard headers; an older one needs a
	// session (Initialize).
	Version string
	// Extension declares the tasks extension on each request.
	Extension bool
	// Session is its Mcp-Session-Id, once a server gave it one.
	Session string
	// Header is added to each request.
	Header http.Header
	n      int
}

// Answer is one JSON-RPC answer, and its HTTP status.
type Answer struct {
	Status int
	Result map[string]any
	Err    *jsonrpc.Error
}

// Call sends method with params; name is the Mcp-Name header ("" none).
func (c *Client) Call(ctx context.Context, method string, params map[string]any, name string) Answer {
	c.TB.Helper()
	if params == nil {
		params = map[string]any{}
	}
	if c.Version >= "2026-07-28" {
		params["_meta"] = meta(c.Version, c.Extension)
	}
	c.n++
	body, err := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": c.n, "method": method, "params": params})
	require.NoError(c.TB, err)
	req := c.request(ctx, http.MethodPost, body)
	if c.Version >= "2026-07-28" {
		req.Header.Set("Mcp-Method", method)
	}
	if name != "" {
		req.Header.Set("Mcp-Name", name)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(c.TB, err)
	defer resp.Body.Close()
	if id := resp.Header.Get("Mcp-Session-Id"); id != "" {
		c.Session = id
	}
	raw, err := io.ReadAll(resp.Body)
	require.NoError(c.TB, err)
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		for _, line := range strings.Split(string(raw), "\n") { // the answer is the stream's data line that has an id
			if d, ok := strings.CutPrefix(line, "data: "); ok && strings.Contains(d, `"id"`) {
				raw = []byte(d)
			}
		}
	}
	var out struct {
		Result map[string]any `json:"result"`
		Error  *jsonrpc.Error `json:"error"`
	}
	require.NoError(c.TB, json.Unmarshal(raw, &out), "%d %s", resp.StatusCode, raw)
	return Answer{Status: resp.StatusCode, Result: out.Result, Err: out.Error}
}

func (c *Client) request(ctx context.Context, method string, body []byte) *http.Request {
	req, err := http.NewRequestWithContext(ctx, method, c.URL, bytes.NewReader(body))
	require.NoError(c.TB, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Mcp-Protocol-Version", c.Version)
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	if c.Session != "" {
		req.Header.Set("Mcp-Session-Id", c.Session)
	}
	for k, vs := range c.Header {
		req.Header[k] = vs
	}
	return req
}

// Initialize opens a session of c.Version (before 2026-07-28): initialize,
// then notifications/initialized. The session ends when the test ends.
func (c *Client) Initialize(ctx context.Context) Answer {
	c.TB.Helper()
	a := c.Call(ctx, "initialize", map[string]any{"protocolVersion": c.Version, "capabilities": map[string]any{},
		"clientInfo": map[string]any{"name": "wiretest", "version": "v0"}}, "")
	require.Nil(c.TB, a.Err)
	require.NotEmpty(c.TB, c.Session)
	resp, err := http.DefaultClient.Do(c.request(ctx, http.MethodPost, fmt.Appendf(nil, `{"jsonrpc":"2.0","method":%q}`, "notifications/initialized")))
	require.NoError(c.TB, err)
	_ = resp.Body.Close()
	require.Equal(c.TB, http.StatusAccepted, resp.StatusCode)
	c.TB.Cleanup(func() { // a stateful server keeps a session until its client ends it
		resp, err := http.DefaultClient.Do(c.request(context.Background(), http.MethodDelete, nil))
		if err == nil {
			_ = resp.Body.Close()
		}
	})
	return a
}

// Launch calls launch_task with prompt, and the params in extra.
func (c *Client) Launch(ctx context.Context, prompt string, extra map[string]any) Answer {
	params := map[string]any{"name": "launch_task", "arguments": map[string]any{"prompt": prompt}}
	for k, v := range extra {
		params[k] = v
	}
	return c.Call(ctx, "tools/call", params, "launch_task")
}

// Get is tasks/get of id, named in Mcp-Name as the extension asks.
func (c *Client) Get(ctx context.Context, id string) Answer {
	return c.Call(ctx, "tasks/get", map[string]any{"taskId": id}, id)
}

// Conn is a client of the tasks extension on a connection (stdio, or in
// memory): it writes each request and reads until its answer.
type Conn struct {
	TB testing.TB
	C  mcp.Connection
	n  int64
}

// Call sends method with params, declaring the extension under the
// 2026-07-28 protocol: the result, or the JSON-RPC error.
func (c *Conn) Call(ctx context.Context, method string, params map[string]any) (map[string]any, *jsonrpc.Error) {
	c.TB.Helper()
	id, b := c.request(method, params)
	require.NoError(c.TB, c.C.Write(ctx, &jsonrpc.Request{ID: id, Method: method, Params: b}))
	for {
		msg, err := c.C.Read(ctx)
		require.NoError(c.TB, err)
		r, ok := msg.(*jsonrpc.Response)
		if !ok || r.ID != id {
			continue
		}
		if r.Error != nil {
			var werr *jsonrpc.Error
			require.ErrorAs(c.TB, r.Error, &werr)
			return nil, werr
		}
		var out map[string]any
		require.NoError(c.TB, json.Unmarshal(r.Result, &out))
		return out, nil
	}
}

// Stream is a long-lived answer: the messages of a subscriptions/listen.
type Stream struct {
	// C delivers each message of the stream, decoded; it is closed when
	// the stream ends.
	C      <-chan map[string]any
	cancel context.CancelFunc
	done   chan struct{}
}

// Close leaves the stream (the request is cancelled) and waits until
// its reader stopped.
func (s *Stream) Close() {
	s.cancel()
	<-s.done
}

// Listen sends subscriptions/listen of taskIDs and returns its stream.
func (c *Client) Listen(ctx context.Context, taskIDs []string) *Stream {
	c.TB.Helper()
	params := map[string]any{"notifications": map[string]any{"taskIds": taskIDs}}
	if c.Version >= "2026-07-28" {
		params["_meta"] = meta(c.Version, c.Extension)
	}
	c.n++
	body, err := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": c.n, "method": "subscriptions/listen", "params": params})
	require.NoError(c.TB, err)
	ctx, cancel := context.WithCancel(ctx)
	req := c.request(ctx, http.MethodPost, body)
	req.Header.Set("Mcp-Method", "subscriptions/listen")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		require.NoError(c.TB, err)
	}
	ch := make(chan map[string]any, 64)
	s := &Stream{C: ch, cancel: cancel, done: make(chan struct{})}
	go func() { // joined by Close
		defer close(s.done)
		defer close(ch)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
		for sc.Scan() {
			line := sc.Text()
			if d, ok := strings.CutPrefix(line, "data: "); ok || (!strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") && line != "") {
				if !ok {
					d = line
				}
				var m map[string]any
				if json.Unmarshal([]byte(d), &m) == nil {
					select {
					case ch <- m:
					case <-ctx.Done():
						return
					}
				}
			}
		}
	}()
	return s
}

// Send writes a request of method with params (declaring the extension
// as Call does) and returns its id, without waiting for its answer: Next
// reads what comes.
func (c *Conn) Send(ctx context.Context, method string, params map[string]any) jsonrpc.ID {
	c.TB.Helper()
	id, b := c.request(method, params)
	require.NoError(c.TB, c.C.Write(ctx, &jsonrpc.Request{ID: id, Method: method, Params: b}))
	return id
}

// Notify writes a notification.
func (c *Conn) Notify(ctx context.Context, method string, params map[string]any) {
	c.TB.Helper()
	b, err := json.Marshal(params)
	require.NoError(c.TB, err)
	require.NoError(c.TB, c.C.Write(ctx, &jsonrpc.Request{Method: method, Params: b}))
}

// Next reads the next message.
func (c *Conn) Next(ctx context.Context) jsonrpc.Message {
	c.TB.Helper()
	msg, err := c.C.Read(ctx)
	require.NoError(c.TB, err)
	return msg
}

func (c *Conn) request(method string, params map[string]any) (jsonrpc.ID, json.RawMessage) {
	if params == nil {
		params = map[string]any{}
	}
	params["_meta"] = meta("2026-07-28", true)
	b, err := json.Marshal(params)
	require.NoError(c.TB, err)
	c.n++
	id, err := jsonrpc.MakeID(float64(c.n))
	require.NoError(c.TB, err)
	return id, b
}

// meta is the per-request _meta of a client of version, declaring the
// tasks extension if ext.
func meta(version string, ext bool) map[string]any {
	caps := map[string]any{}
	if ext {
		caps["extensions"] = map[string]any{bgtaskmcp.Extension: map[string]any{}}
	}
	return map[string]any{mcp.MetaKeyProtocolVersion: version, mcp.MetaKeyClientCapabilities: caps,
		mcp.MetaKeyClientInfo: map[string]any{"name": "wiretest", "version": "v0"}}
}
