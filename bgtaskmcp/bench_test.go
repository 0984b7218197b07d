package bgtaskmcp_test

import (
	"strconv"
	"testing"

	"github.com/bgtask/bgtask/bgtaskmcp/wiretest"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/require"
)

// What a poll costs over streamable HTTP (stateless, a bearer token; the
// 2026-07-28 protocol): tasks/get, a custom method of the SDK's, beside the
// get_task tool the SDK serves alone, and a launch answered as a task.
//
//	go test -run '^$' -bench TheTaskMethods -benchtime 2000x .
func BenchmarkTheTaskMethods(b *testing.B) {
	s := authed(b, &mcp.StreamableHTTPOptions{Stateless: true})
	c := &wiretest.Client{TB: b, URL: s.url, Token: "alice", Version: "2026-07-28", Extension: true}
	id := c.Launch(s.ctx, "polled", nil).Result["taskId"].(string)
	b.Run("tasks/get", func(b *testing.B) {
		for b.Loop() {
			require.Equal(b, "working", c.Get(s.ctx, id).Result["status"])
		}
	})
	b.Run("get_task tool", func(b *testing.B) {
		for b.Loop() {
			a := c.Call(s.ctx, "tools/call", map[string]any{"name": "get_task", "arguments": map[string]any{"id": id}}, "get_task")
			require.Nil(b, a.Err)
		}
	})
	b.Run("launch as a task", func(b *testing.B) {
		n := 0
		for b.Loop() {
			n++
			c.Token = "user-" + strconv.Itoa(n) // one each: the cap is per caller
			require.Equal(b, "task", c.Launch(s.ctx, "more", nil).Result["resultType"])
		}
	})
}
