package mcpfleet

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskmcp"
	"github.com/bgtask/bgtask/bgtaskmcp/wiretest"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/bgtask/bgtask/pgledger/fleetview"
	"github.com/bgtask/bgtask/pgledger/internal/fleettest"
	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var url string

func TestMain(m *testing.M) { pgtest.Main(m, "mcpfleet", &url) }

// served is a fleet whose every process serves MCP, and the balancer in
// front of them.
type served struct {
	ps    []fleettest.Process
	views []*fleetview.View
	url   string
}

// serve joins n processes, each an MCP server of a fleet view behind a
// bearer token whose text is its user (its handler: the processes share
// this test's process), and a balancer that sends each
// request to the next process in turn, whatever Mcp-Name says (or to the
// one its header X-Process names): any one must answer for any task.
func serve(t *testing.T, n int) *served {
	t.Helper()
	ps := fleettest.Join(t, url, n, pgledger.NodeOptions{Poll: 100 * time.Millisecond})
	verify := func(_ context.Context, token string, _ *http.Request) (*auth.TokenInfo, error) {
		return &auth.TokenInfo{UserID: token, Expiration: time.Now().Add(time.Hour)}, nil
	}
	s := &served{ps: ps}
	var backends []http.Handler
	for _, p := range ps {
		v, err := fleetview.Open(context.Background(), p.Node)
		require.NoError(t, err)
		s.views = append(s.views, v)
		srv, err := bgtaskmcp.New(v, bgtaskmcp.Options{Launch: func(_ context.Context, _ bgtaskmcp.Caller, in bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
			return bgtask.Spec{Prompt: in.Prompt, Models: []bgtask.Model{{Provider: "a", ID: "one"}, {Provider: "b", ID: "two"}}}, nil
		}})
		require.NoError(t, err)
		backends = append(backends, auth.RequireBearerToken(verify, nil)(srv.Handler(&mcp.StreamableHTTPOptions{Stateless: true})))
		t.Cleanup(v.Close)
	}
	var next atomic.Int64
	lb := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := int(next.Add(1)-1) % len(backends)
		if p := r.Header.Get("X-Process"); p != "" { // a test's choice
			i, _ = strconv.Atoi(p)
		}
		backends[i].ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		lb.CloseClientConnections()
		lb.Close()
	})
	s.url = lb.URL
	return s
}

// owner is the process whose Manager runs task id.
func (s *served) owner(t *testing.T, id string) fleettest.Process {
	t.Helper()
	for _, p := range s.ps {
		if _, err := p.Node.Manager().Task(id); err == nil {
			return p
		}
	}
	require.Fail(t, "no process runs task "+id)
	return fleettest.Process{}
}

// A client of the tasks extension, in front of a three-process fleet
// whose balancer sends each request to the next process: a task created
// at one is found at once at the next (durable creation, fleet-wide);
// polls at every process follow it across a fallback to its answer; a
// cancel at a process that does not run the task reaches its owner, and
// every process then reads it cancelled; another user finds none of it
// at any process.
func TestAnyProcessAnswersForAnyTask(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := serve(t, 3)
	alice := &wiretest.Client{TB: t, URL: s.url, Token: "alice", Version: "2026-07-28", Extension: true}

	created := alice.Launch(ctx, "find the bug", nil)
	require.Nil(t, created.Err)
	require.Equal(t, "task", created.Result["resultType"])
	id := created.Result["taskId"].(string)
	for range 3 { // each process in turn, at once
		got := alice.Get(ctx, id)
		require.Nil(t, got.Err, "found at every process once created")
		assert.Equal(t, "working", got.Result["status"])
	}

	p := s.owner(t, id)
	running, err := bgtasktest.WaitStatus(ctx, p.Node.Manager(), id, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, p.Host.Fail(running.SessionID, errors.New("429 Too Many Requests")))
	retried, err := bgtasktest.WaitFor(ctx, p.Node.Manager(), id, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.SessionID != "" })
	require.NoError(t, err)
	require.NoError(t, p.Host.Idle(retried.SessionID, "it is in parse.go"))
	_, err = p.Node.Manager().Wait(ctx, id)
	require.NoError(t, err)
	s.seen(t, ctx, id, bgtask.StatusCompleted)
	for range 3 {
		done := alice.Get(ctx, id)
		require.Nil(t, done.Err)
		assert.Equal(t, "completed", done.Result["status"])
		res, _ := done.Result["result"].(map[string]any)
		require.NotNil(t, res)
		assert.Contains(t, res["content"].([]any)[0].(map[string]any)["text"], "it is in parse.go")
		assert.EqualValues(t, 2, res["structuredContent"].(map[string]any)["attempts"])
	}

	second := alice.Launch(ctx, "second", nil)
	require.Nil(t, second.Err)
	id2 := second.Result["taskId"].(string)
	p2 := s.owner(t, id2)
	_, err = bgtasktest.WaitStatus(ctx, p2.Node.Manager(), id2, bgtask.StatusRunning)
	require.NoError(t, err)
	other := 0
	for s.ps[other].Node == p2.Node {
		other++
	}
	alice.Header = http.Header{"X-Process": {strconv.Itoa(other)}} // to a process that does not run it
	ack := alice.Call(ctx, "tasks/cancel", map[string]any{"taskId": id2}, id2)
	alice.Header = nil
	require.Nil(t, ack.Err)
	assert.Equal(t, "complete", ack.Result["resultType"])
	_, err = bgtasktest.WaitStatus(ctx, p2.Node.Manager(), id2, bgtask.StatusCancelled)
	require.NoError(t, err)
	s.seen(t, ctx, id2, bgtask.StatusCancelled)
	for range 3 {
		assert.Equal(t, "cancelled", alice.Get(ctx, id2).Result["status"])
	}

	bob := &wiretest.Client{TB: t, URL: s.url, Token: "bob", Version: "2026-07-28", Extension: true}
	for range 3 {
		a := bob.Get(ctx, id)
		require.NotNil(t, a.Err, "alice's task, asked at each process")
		assert.Contains(t, a.Err.Message, "unknown task")
	}
}

// seen waits until every process's view holds task id in status (a
// view follows the ledger's change stream, a moment behind its owner).
func (s *served) seen(t *testing.T, ctx context.Context, id string, status bgtask.Status) {
	t.Helper()
	for _, v := range s.views {
		sub, err := v.Subscribe(ctx, 0)
		require.NoError(t, err)
		for {
			if got, err := v.Task(id); err == nil && got.Status == status {
				break
			}
			_, open := <-sub.C
			require.True(t, open, "the view's changes ended: %v", sub.Err())
		}
		sub.Close()
	}
}
