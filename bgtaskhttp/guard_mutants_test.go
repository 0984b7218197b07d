package bgtaskhttp_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

// gmService is a Handler over a Manager on a scripted host, served by a
// test server.
type gmService struct {
	m   *bgtask.Manager
	srv *httptest.Server
	ctx context.Context
}

func gmServe(t *testing.T, o bgtaskhttp.Options) *gmService {
	t.Helper()
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	s := &gmService{m: m, srv: httptest.NewServer(bgtaskhttp.Handler(m, o))}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	s.ctx = ctx
	t.Cleanup(func() {
		cancel()
		s.srv.CloseClientConnections()
		s.srv.Close()
		assert.NoError(t, m.Shutdown(context.Background()))
	})
	return s
}

// running launches a task and waits until it runs.
func (s *gmService) running(t *testing.T) bgtask.Task {
	t.Helper()
	task, err := s.m.Launch(s.ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m1"}}})
	require.NoError(t, err)
	got, err := bgtasktest.WaitStatus(s.ctx, s.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	return got
}

// post sends a POST to path with header and returns its status and error
// code (for a JSON error).
func (s *gmService) post(t *testing.T, path string, header map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(s.ctx, http.MethodPost, s.srv.URL+path, nil)
	require.NoError(t, err)
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := s.srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var body struct{ Code string }
	b, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(b, &body)
	return resp.StatusCode, body.Code
}

// A request the user typed (Sec-Fetch-Site: none: a bookmark, the address
// bar, not a script) may act, as the Handler's doc and sameOrigin's say:
// "its Sec-Fetch-Site, if sent, is same-origin (or none: typed, not
// scripted)".
func TestATypedRequestMayAct(t *testing.T) {
	s := gmServe(t, bgtaskhttp.Options{})
	a := s.running(t)
	code, errCode := s.post(t, "/tasks/"+a.ID+"/cancel", map[string]string{"Sec-Fetch-Site": "none"})
	require.Equal(t, http.StatusOK, code, "refused: %s", errCode)
	now, err := s.m.Task(a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, now.Status)
}

// An origin is its scheme, host and port: a page served on another port
// of the same host is another origin, and cannot act (Handler's doc: "an
// action from a browser page of another origin ... is refused").
func TestAPageOnAnotherPortCannotAct(t *testing.T) {
	s := gmServe(t, bgtaskhttp.Options{})
	a := s.running(t)
	u, err := url.Parse(s.srv.URL)
	require.NoError(t, err)
	other := "1"
	if u.Port() == other {
		other = "2"
	}
	for _, origin := range []string{
		"http://" + u.Hostname() + ":" + other, // the same host, another port
		"http://" + u.Hostname(),               // the same host, the default port
		"http://localhost:" + u.Port(),         // another host name, the same port
	} {
		code, errCode := s.post(t, "/tasks/"+a.ID+"/cancel", map[string]string{"Origin": origin})
		assert.Equal(t, http.StatusForbidden, code, origin)
		assert.Equal(t, "cross_origin", errCode, origin)
	}
	now, err := s.m.Task(a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, now.Status, "not cancelled")
	code, _ := s.post(t, "/tasks/"+a.ID+"/cancel", map[string]string{"Origin": s.srv.URL})
	assert.Equal(t, http.StatusOK, code, "the page's own origin")
}

// Read-only turns off every action, the health reset too (Options.ReadOnly:
// "turns the actions ... off"), and the page offers none of them (its
// actions are offered "unless o.ReadOnly"); without it, the page offers
// a live task's.
func TestReadOnlyRefusesTheHealthResetAndThePageOffersNoAction(t *testing.T) {
	for _, ro := range []bool{false, true} {
		s := gmServe(t, bgtaskhttp.Options{ReadOnly: ro})
		s.running(t)
		req, err := http.NewRequestWithContext(s.ctx, http.MethodGet, s.srv.URL+"/", nil)
		require.NoError(t, err)
		resp, err := s.srv.Client().Do(req)
		require.NoError(t, err)
		page, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		if !ro {
			assert.Contains(t, string(page), `data-action="cancel"`, "the page offers a live task's cancel")
			continue
		}
		assert.NotContains(t, string(page), `data-action=`, "a read-only page offers no action")
		code, errCode := s.post(t, "/health/reset", map[string]string{"Content-Type": "application/json"})
		assert.Equal(t, http.StatusForbidden, code)
		assert.Equal(t, "read_only", errCode)
	}
}
