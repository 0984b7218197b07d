package wiretest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/bgtask/bgtask/bgtaskmcp/wiretest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The client sends what a client of each version sends, and reads an
// answer as JSON or as an event stream; a listen's stream delivers each
// message and ends when it is closed.
func TestTheClientSpeaksTheWire(t *testing.T) {
	got := make(chan *http.Request, 8)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var msg struct {
			ID     int            `json:"id"`
			Method string         `json:"method"`
			Params map[string]any `json:"params"`
		}
		_ = json.Unmarshal(body, &msg)
		got <- r
		switch msg.Method {
		case "tasks/get":
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"jsonrpc":"2.0","id":%d,"error":{"code":-32602,"message":"unknown task"}}`, msg.ID)
		case "subscriptions/listen":
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/tasks\",\"params\":{\"status\":\"working\"}}\n\n")
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		default:
			w.Header().Set("Content-Type", "text/event-stream")
			w.Header().Set("Mcp-Session-Id", "s-1")
			fmt.Fprintf(w, "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":%d,\"result\":{\"method\":%q,\"meta\":%v}}\n\n", msg.ID, msg.Method, msg.Params["_meta"] != nil)
		}
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := &wiretest.Client{TB: t, URL: srv.URL, Token: "alice", Version: "2026-07-28", Extension: true}

	a := c.Call(ctx, "tools/call", map[string]any{"name": "x"}, "x")
	require.Nil(t, a.Err)
	assert.Equal(t, map[string]any{"method": "tools/call", "meta": true}, a.Result, "read from the event stream")
	assert.Equal(t, "s-1", c.Session)
	r := <-got
	assert.Equal(t, "Bearer alice", r.Header.Get("Authorization"))
	assert.Equal(t, "tools/call", r.Header.Get("Mcp-Method"))
	assert.Equal(t, "x", r.Header.Get("Mcp-Name"))

	a = c.Get(ctx, "t-1")
	require.NotNil(t, a.Err)
	assert.EqualValues(t, -32602, a.Err.Code)
	assert.Equal(t, "t-1", (<-got).Header.Get("Mcp-Name"))

	st := c.Listen(ctx, []string{"t-1"})
	<-got
	m := <-st.C
	assert.Equal(t, "notifications/tasks", m["method"])
	st.Close()
	_, open := <-st.C
	assert.False(t, open, "closed once the stream ended")

	old := &wiretest.Client{TB: t, URL: srv.URL, Version: "2025-11-25"}
	a = old.Call(ctx, "tools/list", nil, "")
	assert.Equal(t, false, a.Result["meta"], "an older client sends no per-request _meta")
	assert.Empty(t, (<-got).Header.Get("Mcp-Method"))
}
