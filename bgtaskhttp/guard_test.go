package bgtaskhttp_test

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

// answer is what the service said to one request.
type answer struct {
	status int
	code   string // the error's code, if JSON
	msg    string
	header http.Header
}

// send makes one request to s's server; host, if set, is its Host header.
// It reads at most the head of an event stream.
func (s *svc) send(t *testing.T, method, path, host string, header map[string]string, body string) answer {
	t.Helper()
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, s.srv.URL+path, strings.NewReader(body))
	require.NoError(t, err)
	if host != "" {
		req.Host = host
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := s.srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	a := answer{status: resp.StatusCode, header: resp.Header}
	if resp.Header.Get("Content-Type") == "application/json" {
		var eb struct{ Error, Code string }
		b, _ := io.ReadAll(resp.Body)
		if json.Unmarshal(b, &eb) == nil {
			a.code, a.msg = eb.Code, eb.Error
		}
	}
	return a
}

// routes are one request to every route the Handler serves.
func routes(id, session string) []struct{ method, path, body string } {
	return []struct{ method, path, body string }{
		{"GET", "/", ""},
		{"GET", "/snapshot", ""},
		{"GET", "/tasks", ""},
		{"GET", "/tasks/" + id, ""},
		{"GET", "/events", ""},
		{"GET", "/view/view.js", ""},
		{"GET", "/nope", ""},
		{"POST", "/tasks/" + id + "/extend", `{"prompt":"more"}`},
		{"POST", "/sessions/" + session + "/close", ""},
		{"POST", "/tasks/" + id + "/close", ""},
		{"POST", "/tasks/" + id + "/cancel", ""},
	}
}

// A bearer token, as the README shows it: every route asks Authorize, and
// a refusal says nothing of why.
func TestAuthorizeIsAskedAboutEveryRequest(t *testing.T) {
	var asked atomic.Int64
	token := []byte("s3cret")
	s := newSvc(t, bgtaskhttp.Options{Keepalive: time.Millisecond, Authorize: func(r *http.Request) (string, error) {
		asked.Add(1)
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(got), token) != 1 {
			return "", errors.New("the token was wrong: s3cret expected")
		}
		return "", nil
	}})
	a := s.running(t, "chat")
	for _, rt := range routes(a.ID, "chat") {
		for _, bearer := range []string{"", "Bearer nope", "Bearer s3cret!"} {
			h := map[string]string{"Authorization": bearer, "Content-Type": "application/json"}
			got := s.send(t, rt.method, rt.path, "", h, rt.body)
			assert.Equal(t, http.StatusUnauthorized, got.status, "%s %s %q", rt.method, rt.path, bearer)
			assert.Equal(t, "unauthorized", got.code)
			assert.NotContains(t, got.msg, "s3cret", "the reason is not sent")
		}
	}
	now, err := s.m.Task(a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, now.Status, "no action ran")
	n := asked.Load()
	assert.Equal(t, int64(3*len(routes("", ""))), n, "asked once a request")

	ok := map[string]string{"Content-Type": "application/json", "Authorization": "Bearer s3cret"}
	for _, rt := range routes(a.ID, "chat") {
		got := s.send(t, rt.method, rt.path, "", ok, rt.body)
		assert.NotEqual(t, http.StatusUnauthorized, got.status, "%s %s", rt.method, rt.path)
	}
	assert.Equal(t, bgtask.StatusCancelled, func() bgtask.Status { now, _ = s.m.Task(a.ID); return now.Status }(), "the actions ran")
	nobody := &bgtaskhttp.Client{Base: s.srv.URL, HTTP: s.srv.Client()}
	_, err = nobody.Snapshot(s.ctx)
	var he *bgtaskhttp.Error
	require.ErrorAs(t, err, &he)
	assert.Equal(t, "unauthorized", he.Code)
}

// Read-only: the actions are refused, reads are not.
func TestReadOnlyRefusesEveryAction(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{ReadOnly: true})
	a := s.running(t, "chat")
	h := map[string]string{"Content-Type": "application/json"}
	for _, rt := range routes(a.ID, "chat") {
		got := s.send(t, rt.method, rt.path, "", h, rt.body)
		if rt.method == "POST" {
			assert.Equal(t, http.StatusForbidden, got.status, rt.path)
			assert.Equal(t, "read_only", got.code, rt.path)
		} else if rt.path != "/nope" {
			assert.Equal(t, http.StatusOK, got.status, rt.path)
		}
	}
	now, err := s.c.Task(s.ctx, a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, now.Status)
	assert.ErrorContains(t, testkit.StopErr(s.c.Stop(s.ctx, bgtask.Target{Task: a.ID})), "read_only")
}

// Only the loopback names by default, whatever the port or case; a name
// in Hosts, or any with "*".
func TestTheHostMustBeAllowed(t *testing.T) {
	loop := newSvc(t, bgtaskhttp.Options{})
	for _, host := range []string{"localhost", "LocalHost:8080", "localhost.", "127.0.0.1:9", "127.3.2.1", "[::1]:8080", "[::1]"} {
		assert.Equal(t, http.StatusOK, loop.send(t, "GET", "/snapshot", host, nil, "").status, host)
	}
	for _, host := range []string{"evil.example:18080", "localhost.evil.example", "127.0.0.1.evil.example", "0.0.0.0:8080", "[::2]:80", "10.0.0.1", "tasks.example"} {
		got := loop.send(t, "GET", "/snapshot", host, nil, "")
		assert.Equal(t, http.StatusForbidden, got.status, host)
		assert.Equal(t, "host_not_allowed", got.code, host)
		assert.Contains(t, got.msg, "Options.Hosts", "it says what to set")
	}
	named := newSvc(t, bgtaskhttp.Options{Hosts: []string{"Tasks.Example:443", "10.0.0.1"}})
	for host, want := range map[string]int{"tasks.example": 200, "TASKS.example:8443": 200, "10.0.0.1:80": 200, "localhost": 403, "127.0.0.1": 403, "evil.example": 403} {
		assert.Equal(t, want, named.send(t, "GET", "/snapshot", host, nil, "").status, host)
	}
	anyHost := newSvc(t, bgtaskhttp.Options{Hosts: []string{"*"}})
	assert.Equal(t, http.StatusOK, anyHost.send(t, "GET", "/snapshot", "evil.example", nil, "").status)
}

// A DNS-rebinding page (evil.example resolving to 127.0.0.1) sends its own
// name in both Host and Origin: it can neither act nor read.
func TestADNSRebindingPageCanNeitherActNorRead(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	rebind := map[string]string{"Origin": "http://evil.example:18080", "Sec-Fetch-Site": "same-origin", "Content-Type": "application/json"}
	for _, rt := range routes(a.ID, "chat") {
		got := s.send(t, rt.method, rt.path, "evil.example:18080", rebind, rt.body)
		assert.Equal(t, http.StatusForbidden, got.status, rt.path)
		assert.Equal(t, "host_not_allowed", got.code, rt.path)
	}
	now, err := s.c.Task(s.ctx, a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, now.Status, "not cancelled")
}

// A page of another origin cannot act: another host, another scheme, a
// cross-site fetch, an opaque origin.
func TestAPageOfAnotherOriginCannotAct(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	self := strings.TrimPrefix(s.srv.URL, "http://")
	for _, h := range []map[string]string{
		{"Origin": "http://evil.example"},
		{"Origin": "https://" + self}, // the same host, over another scheme
		{"Origin": "http://" + self + ".evil.example"},
		{"Origin": "null"},
		{"Origin": "http://" + self, "Sec-Fetch-Site": "cross-site"},
		{"Sec-Fetch-Site": "same-site"},
	} {
		h["Content-Type"] = "application/json"
		for _, rt := range routes(a.ID, "chat")[7:] {
			got := s.send(t, rt.method, rt.path, "", h, rt.body)
			assert.Equal(t, http.StatusForbidden, got.status, "%s %v", rt.path, h)
			assert.Equal(t, "cross_origin", got.code, "%s %v", rt.path, h)
		}
	}
	now, err := s.c.Task(s.ctx, a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, now.Status, "not cancelled")
	own := s.send(t, "POST", "/tasks/"+a.ID+"/cancel", "", map[string]string{"Origin": "http://" + strings.ToUpper(self), "Sec-Fetch-Site": "same-origin"}, "")
	assert.Equal(t, http.StatusOK, own.status, "the page's own request")
}

// Over TLS, the page's origin is https.
func TestOverTLSTheOriginIsHTTPS(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	srv := httptest.NewTLSServer(bgtaskhttp.Handler(s.m, bgtaskhttp.Options{}))
	defer srv.Close()
	post := func(origin string) int {
		req, _ := http.NewRequestWithContext(s.ctx, http.MethodPost, srv.URL+"/tasks/"+a.ID+"/cancel", nil)
		req.Header.Set("Origin", origin)
		resp, err := srv.Client().Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp.StatusCode
	}
	assert.Equal(t, http.StatusForbidden, post(strings.Replace(srv.URL, "https:", "http:", 1)))
	assert.Equal(t, http.StatusOK, post(srv.URL))
}

// Every answer forbids framing and sniffing and sends no Referer: pages,
// data, streams and refusals.
func TestEveryAnswerCarriesTheSecurityHeaders(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{Authorize: func(r *http.Request) (string, error) {
		if r.URL.Query().Has("deny") {
			return "", errors.New("no")
		}
		return "", nil
	}})
	a := s.running(t, "chat")
	for _, rt := range append(routes(a.ID, "chat")[:7], struct{ method, path, body string }{"GET", "/snapshot?deny", ""}) {
		for _, host := range []string{"", "evil.example"} {
			got := s.send(t, rt.method, rt.path, host, nil, "")
			assert.Contains(t, got.header.Get("Content-Security-Policy"), "frame-ancestors 'none'", rt.path)
			assert.Equal(t, "DENY", got.header.Get("X-Frame-Options"), rt.path)
			assert.Equal(t, "nosniff", got.header.Get("X-Content-Type-Options"), rt.path)
			assert.Equal(t, "no-referrer", got.header.Get("Referrer-Policy"), rt.path)
		}
	}
}

// An extend to a function that never takes the prompt answers 504 once
// ActionTimeout passed, not never.
func TestAnActionThatHangsAnswersAtItsDeadline(t *testing.T) {
	m := testkit.MustOpen(bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		<-ctx.Done() // never reads run.Prompts()
		return "", ctx.Err()
	}), bgtask.WithIDs(bgtask.SequentialIDs()))
	defer func() { assert.NoError(t, m.Shutdown(context.Background())) }()
	const bound = 200 * time.Millisecond
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{ActionTimeout: bound}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
	require.NoError(t, err)
	_, err = bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	c := &bgtaskhttp.Client{Base: srv.URL, HTTP: srv.Client()}
	began := time.Now()
	_, err = c.Extend(ctx, task.ID, "more")
	took := time.Since(began)
	var he *bgtaskhttp.Error
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusGatewayTimeout, he.Status)
	assert.Equal(t, "deadline_exceeded", he.Code)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.GreaterOrEqual(t, took, bound)
	assert.Less(t, took, 5*time.Second, "answered at its deadline")
}

// A body trickled in is cut at the deadline.
func TestASlowBodyIsCutAtTheDeadline(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{ActionTimeout: 100 * time.Millisecond})
	a := s.running(t, "chat")
	ctx, cancel := context.WithTimeout(s.ctx, 3*time.Second) // far more than the deadline
	defer cancel()
	pr, pw := io.Pipe()
	defer context.AfterFunc(ctx, func() { pw.CloseWithError(ctx.Err()) })() // the body ends with the request
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		_, _ = pw.Write([]byte(`{"prompt":`)) // and no more
	}()
	defer func() {
		cancel()
		<-wrote
	}()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.srv.URL+"/tasks/"+a.ID+"/extend", pr)
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.srv.Client().Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	assert.Equal(t, http.StatusGatewayTimeout, resp.StatusCode)
}

// A cursor naming no task is a bad argument, as the package doc says;
// an extend body with more after its object is refused.
func TestBadArgumentsAre400(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	_, err := s.c.Tasks(s.ctx, bgtask.Query{After: "task-404"})
	require.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	var he *bgtaskhttp.Error
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusBadRequest, he.Status)
	assert.Equal(t, "invalid_argument", he.Code)

	h := map[string]string{"Content-Type": "application/json"}
	for _, body := range []string{`{"prompt":"x"}{"prompt":"y"}`, `{"prompt":"x"} x`, `{"prompt":"x"}}`, `{"prompt":"x"}[]`, `{"prompt":`} {
		got := s.send(t, "POST", "/tasks/"+a.ID+"/extend", "", h, body)
		assert.Equal(t, http.StatusBadRequest, got.status, body)
		assert.Equal(t, "invalid_argument", got.code, body)
	}
	got := s.send(t, "POST", "/tasks/"+a.ID+"/extend", "", h, "{\"prompt\":\"x\"}\n\t ")
	assert.Equal(t, "unsupported", got.code, "white space after the object is fine")
}

// The actor Authorize names is who acted on every stop the request makes:
// a cancel, a close, a session's close; a name that is not one line of
// printable text is made one.
func TestTheActorAuthorizeNamesIsRecordedOnStops(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{Authorize: func(r *http.Request) (string, error) {
		return strings.ReplaceAll(r.Header.Get("X-User"), "<bell>", "\a\n "), nil // a name no header carries
	}})
	post := func(path, user string) (int, string) {
		if user == "" {
			return s.postWith(t, path, nil)
		}
		return s.postWith(t, path, map[string]string{"X-User": user})
	}
	a := s.running(t, "chat-1")
	code, body := post("/tasks/"+a.ID+"/cancel", "alice")
	require.Equal(t, http.StatusOK, code, body)
	ended, err := bgtasktest.WaitStatus(s.ctx, s.m, a.ID, bgtask.StatusCancelled)
	require.NoError(t, err)
	require.NotNil(t, ended.Stop)
	assert.Equal(t, bgtask.StopCause{Kind: bgtask.StopCancel, Actor: "alice"}, *ended.Stop)

	b := s.running(t, "chat-2")
	code, body = post("/tasks/"+b.ID+"/close", "bob<bell>")
	require.Equal(t, http.StatusOK, code, body)
	var rep bgtask.ClosureReport
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	assert.Equal(t, "bob", rep.Actor, "the bell, the line feed and the space dropped")
	ended, err = bgtasktest.WaitStatus(s.ctx, s.m, b.ID, bgtask.StatusCancelled)
	require.NoError(t, err)
	assert.Equal(t, "bob", ended.Stop.Actor)

	c := s.running(t, "chat-3")
	code, body = post("/sessions/chat-3/close", "")
	require.Equal(t, http.StatusOK, code, body)
	ended, err = bgtasktest.WaitStatus(s.ctx, s.m, c.ID, bgtask.StatusCancelled)
	require.NoError(t, err)
	assert.Empty(t, ended.Stop.Actor, "no one named")
}
