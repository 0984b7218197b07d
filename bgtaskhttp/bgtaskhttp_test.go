package bgtaskhttp_test

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/bgtask/bgtask/mirror"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type svc struct {
	m    *bgtask.Manager
	host *bgtasktest.Host
	srv  *httptest.Server
	c    *bgtaskhttp.Client
	ctx  context.Context
}

func newSvc(t *testing.T, o bgtaskhttp.Options) *svc {
	t.Helper()
	return newSvcOf(t, o, false)
}

// prompting is a test host that takes prompts (bgtask.Prompter).
type prompting struct{ *bgtasktest.Host }

func (prompting) PromptSession(context.Context, bgtask.PromptRequest) error { return nil }

// newSvcOf is newSvc; with prompts its host takes prompts (Extend).
func newSvcOf(t *testing.T, o bgtaskhttp.Options, prompts bool) *svc {
	t.Helper()
	s := &svc{host: bgtasktest.NewHost()}
	var h bgtask.Host = s.host
	if prompts {
		h = prompting{s.host}
	}
	s.m = testkit.MustOpen(h, bgtask.WithIDs(bgtask.SequentialIDs()))
	s.host.Attach(s.m)
	s.srv = httptest.NewServer(bgtaskhttp.Handler(s.m, o))
	s.c = &bgtaskhttp.Client{Base: s.srv.URL, HTTP: s.srv.Client()}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	s.ctx = ctx
	t.Cleanup(func() {
		cancel()
		s.srv.CloseClientConnections()
		s.srv.Close()
		assert.NoError(t, s.m.Shutdown(context.Background()))
	})
	return s
}

func (s *svc) running(t *testing.T, parent string) bgtask.Task {
	t.Helper()
	task, err := s.m.Launch(s.ctx, bgtask.Spec{ParentSessionID: parent, Prompt: "p", Models: []bgtask.Model{{ID: "m1"}, {ID: "m2"}}})
	require.NoError(t, err)
	got, err := bgtasktest.WaitStatus(s.ctx, s.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	return got
}

func TestTheAPIServesTasksAndActsOnThem(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	b := s.running(t, a.SessionID)
	s.running(t, "other")

	page, err := s.c.Tasks(s.ctx, bgtask.Query{Root: "chat"})
	require.NoError(t, err)
	require.Len(t, page.Tasks, 2)
	assert.Equal(t, []string{a.ID, b.ID}, []string{page.Tasks[0].ID, page.Tasks[1].ID})
	first, err := s.c.Tasks(s.ctx, bgtask.Query{Statuses: []bgtask.Status{bgtask.StatusRunning}, Limit: 2})
	require.NoError(t, err)
	assert.Equal(t, b.ID, first.Next)
	rest, err := s.c.Tasks(s.ctx, bgtask.Query{Statuses: []bgtask.Status{bgtask.StatusRunning}, Limit: 2, After: first.Next})
	require.NoError(t, err)
	assert.Len(t, rest.Tasks, 1)

	got, err := s.c.Task(s.ctx, a.ID)
	require.NoError(t, err)
	assert.Equal(t, a.SessionID, got.SessionID)
	snap, err := s.c.Snapshot(s.ctx)
	require.NoError(t, err)
	assert.Len(t, snap.Tasks, 3)

	_, err = s.c.Task(s.ctx, "nope")
	require.ErrorIs(t, err, bgtask.ErrUnknownTask, "the sentinel, across the wire")
	var he *bgtaskhttp.Error
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusNotFound, he.Status)
	assert.Equal(t, "unknown_task", he.Code)

	_, err = s.c.Tasks(s.ctx, bgtask.Query{Limit: 5000})
	require.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusBadRequest, he.Status)

	_, err = s.c.Extend(s.ctx, a.ID, "more")
	assert.ErrorIs(t, err, errors.ErrUnsupported)

	rep, err := s.c.Stop(s.ctx, bgtask.Target{Task: a.ID, Tree: true})
	require.NoError(t, err)
	assert.Len(t, rep.Stopped, 2, "the task and the one its session launched")
	_, err = s.c.Stop(s.ctx, bgtask.Target{Session: " "})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)

	other := s.running(t, "third")
	require.NoError(t, testkit.StopErr(s.c.Stop(s.ctx, bgtask.Target{Task: other.ID})))
	done, err := s.c.Task(s.ctx, other.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, done.Status)
}

func TestABranchThatDidNotStopIsAConflictWithItsReport(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	s.host.FailAborts(1, errors.New("session service busy"))
	rep, err := s.c.Stop(s.ctx, bgtask.Target{Session: "chat"})
	require.ErrorIs(t, err, bgtask.ErrBranchNotStopped)
	require.Len(t, rep.Failed, 1)
	assert.Equal(t, a.ID, rep.Failed[0].TaskID)
}

func TestAMirrorFollowsTheStreamAcrossAReconnect(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{Keepalive: 10 * time.Millisecond})
	a := s.running(t, "chat")
	var mir mirror.Mirror
	ready := make(chan struct{})
	ctx, stop := context.WithCancel(s.ctx)
	followed := make(chan error, 1)
	go func() { followed <- s.c.Follow(ctx, &mir, ready) }()
	<-ready
	require.NoError(t, s.host.Idle(a.SessionID, "answer"))
	b := s.running(t, "chat")
	s.srv.CloseClientConnections() // a dropped connection: Follow reconnects with Last-Event-ID
	require.NoError(t, s.host.Fail(b.SessionID, bgtask.Permanent(errors.New("bad request"))))
	c := s.running(t, "chat")
	want := []string{a.ID, b.ID, c.ID}
	require.NoError(t, mir.Wait(s.ctx, func(tasks []bgtask.Task) bool {
		if len(tasks) != 3 {
			return false
		}
		for i, task := range tasks {
			if task.ID != want[i] {
				return false
			}
		}
		return tasks[0].Status == bgtask.StatusCompleted && tasks[1].Status == bgtask.StatusError && tasks[2].Status == bgtask.StatusRunning
	}))
	stop()
	assert.ErrorIs(t, <-followed, context.Canceled)
}

func TestTheStreamResumesWithoutASnapshotWhenNothingWasMissed(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{Keepalive: 5 * time.Millisecond})
	s.running(t, "chat")
	snap, err := s.c.Snapshot(s.ctx)
	require.NoError(t, err)
	read := func(lastID string) []string {
		ctx, cancel := context.WithCancel(s.ctx)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.srv.URL+"/events", nil)
		if lastID != "" {
			req.Header.Set("Last-Event-ID", lastID)
		}
		resp, err := s.srv.Client().Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		assert.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
		rd := bufio.NewReader(resp.Body)
		var lines []string
		for len(lines) < 4 {
			l, err := rd.ReadString('\n')
			require.NoError(t, err)
			if l = strings.TrimSpace(l); l != "" {
				lines = append(lines, l)
			}
		}
		return lines
	}
	fresh := read("")
	assert.True(t, strings.HasPrefix(fresh[0], "id: "), "%v", fresh)
	assert.Equal(t, "event: snapshot", fresh[1])
	id := strings.TrimPrefix(fresh[0], "id: ")
	assert.True(t, strings.HasPrefix(id, strconv.FormatUint(snap.Epoch, 10)+":"), "the id names the epoch: %s", id)
	resumed := read(id)
	assert.Equal(t, ": resumed", resumed[0], "it missed nothing: no snapshot")
	assert.Equal(t, ": keepalive", resumed[1])
	stale := read("1:0")
	assert.Equal(t, "event: snapshot", stale[1], "another epoch: a snapshot")
}

func TestTheLiveViewIsServedAtTheRoot(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	resp, err := s.srv.Client().Get(s.srv.URL + "/")
	require.NoError(t, err)
	defer resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "text/html; charset=utf-8", resp.Header.Get("Content-Type"))
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	page := string(b)
	assert.NotContains(t, page, "http://", "nothing is fetched from elsewhere")
	assert.NotContains(t, page, "https://")
	missing, err := s.srv.Client().Get(s.srv.URL + "/nope")
	require.NoError(t, err)
	missing.Body.Close()
	assert.Equal(t, http.StatusNotFound, missing.StatusCode)
}

func TestTheAPIRefusesCrossSiteRequestsAndBadBodies(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	post := func(path, ctype, body string, headers map[string]string) *http.Response {
		req, _ := http.NewRequestWithContext(s.ctx, http.MethodPost, s.srv.URL+path, strings.NewReader(body))
		if ctype != "" {
			req.Header.Set("Content-Type", ctype)
		}
		for k, v := range headers {
			req.Header.Set(k, v)
		}
		resp, err := s.srv.Client().Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	assert.Equal(t, http.StatusForbidden, post("/tasks/"+a.ID+"/cancel", "", "", map[string]string{"Sec-Fetch-Site": "cross-site"}).StatusCode)
	assert.Equal(t, http.StatusForbidden, post("/tasks/"+a.ID+"/extend", "application/json", `{"prompt":"x"}`, map[string]string{"Origin": "http://evil.example"}).StatusCode)
	assert.Equal(t, http.StatusBadRequest, post("/tasks/"+a.ID+"/extend", "text/plain", `{"prompt":"x"}`, nil).StatusCode, "only JSON")
	assert.Equal(t, http.StatusRequestEntityTooLarge, post("/tasks/"+a.ID+"/extend", "application/json", `{"prompt":"`+strings.Repeat("x", 2<<20)+`"}`, nil).StatusCode)
	got, err := s.c.Task(s.ctx, a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, got.Status, "nothing was cancelled")
	assert.Equal(t, http.StatusOK, post("/tasks/"+a.ID+"/cancel", "", "", map[string]string{"Sec-Fetch-Site": "same-origin", "Origin": s.srv.URL}).StatusCode, "the page's own request")

	_, err = s.c.Stop(s.ctx, bgtask.Target{Session: "nobody"})
	assert.ErrorIs(t, err, bgtask.ErrUnknownSession)
	assert.Panics(t, func() { bgtaskhttp.Handler(nil, bgtaskhttp.Options{}) })
	bad := &bgtaskhttp.Client{Base: ""}
	var mir mirror.Mirror
	assert.ErrorContains(t, bad.Follow(s.ctx, &mir, nil), "is not an http:// or https:// URL")
}

func TestFollowStopsOnARefusal(t *testing.T) {
	refuse := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"error":"no such thing","code":"unknown_task"}`))
	}))
	defer refuse.Close()
	var mir mirror.Mirror
	err := (&bgtaskhttp.Client{Base: refuse.URL}).Follow(context.Background(), &mir, nil)
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask, "a 4xx ends Follow with the service's error")
}

// Client.Stop applies Manager.Stop's rules before it sends anything, and
// refuses a cause it could not carry; the task is left as it was.
func TestClientStopRefusesATargetTheManagerWouldRefuse(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	for name, tg := range map[string]bgtask.Target{
		"zero":             {},
		"task and session": {Task: a.ID, Session: "chat"},
		"tree alone":       {Tree: true},
		"a cause":          {Task: a.ID, Cause: &bgtask.StopCause{Kind: bgtask.StopClosure, Root: "elsewhere"}},
	} {
		_, err := s.c.Stop(s.ctx, tg)
		assert.ErrorIs(t, err, bgtask.ErrInvalidArgument, name)
	}
	got, err := s.c.Task(s.ctx, a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, got.Status, "nothing was stopped")
}

// What may be large is gzipped for a client that takes it — the Client
// does, and reads it back — and plain for one that does not.
func TestLargeAnswersAreGzippedForWhoTakesThem(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	for range 3 {
		s.running(t, "chat")
	}
	for _, path := range []string{"/snapshot", "/tasks", "/view/table?format=json"} {
		req, err := http.NewRequestWithContext(s.ctx, http.MethodGet, s.srv.URL+path, nil)
		require.NoError(t, err)
		req.Header.Set("Accept-Encoding", "br, gzip;q=0.8")
		resp, err := http.DefaultTransport.RoundTrip(req) // the transport does not unzip what it did not ask for
		require.NoError(t, err)
		assert.Equal(t, "gzip", resp.Header.Get("Content-Encoding"), path)
		z, err := gzip.NewReader(resp.Body)
		require.NoError(t, err, path)
		var v map[string]any
		require.NoError(t, json.NewDecoder(z).Decode(&v), path)
		resp.Body.Close()
		assert.NotEmpty(t, v, path)

		req.Header.Set("Accept-Encoding", "gzip;q=0, identity")
		resp, err = http.DefaultTransport.RoundTrip(req)
		require.NoError(t, err)
		assert.Empty(t, resp.Header.Get("Content-Encoding"), "%s: refused gzip", path)
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&v), path)
		resp.Body.Close()
	}
	snap, err := s.c.Snapshot(s.ctx)
	require.NoError(t, err)
	assert.Len(t, snap.Tasks, 3, "the Client reads it back")
}
