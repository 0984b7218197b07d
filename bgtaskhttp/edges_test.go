package bgtaskhttp_test

import (
	"context"
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
	"github.com/bgtask/bgtask/mirror"
)

// ask makes one request of s, with a body of ctype if ctype is set, and
// returns its status and its JSON error's code and message.
func (s *svc) ask(t *testing.T, method, path, ctype, body string) (int, struct{ Error, Code string }) {
	t.Helper()
	h := map[string]string{}
	if ctype != "" {
		h["Content-Type"] = ctype
	}
	a := s.send(t, method, path, "", h, body)
	return a.status, struct{ Error, Code string }{a.msg, a.code}
}

// A status the API does not know is refused, naming it and the ones it
// knows, as the command line refuses it; it is not a filter that matches
// nothing.
func TestAnUnknownStatusIsABadArgument(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	code, eb := s.ask(t, http.MethodGet, "/tasks?status=running&status=bogus", "", "")
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Equal(t, "invalid_argument", eb.Code)
	assert.Equal(t, `invalid argument: unknown status "bogus": the statuses are pending, running, completed, error, cancelled, interrupt`, eb.Error)

	_, err := s.c.Tasks(s.ctx, bgtask.Query{Statuses: []bgtask.Status{"Running"}})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument, "the names are exact")
	p, err := s.c.Tasks(s.ctx, bgtask.Query{Statuses: []bgtask.Status{bgtask.StatusRunning}})
	require.NoError(t, err)
	require.Len(t, p.Tasks, 1, "a known status still filters")
	assert.Equal(t, a.ID, p.Tasks[0].ID)
}

// A body field a route does not take is refused, named, whatever else the
// body holds: {"promt": …} is a typo, not an Extend with no prompt.
func TestAnUnknownBodyFieldIsABadArgument(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	code, eb := s.ask(t, http.MethodPost, "/tasks/"+a.ID+"/extend", "application/json", `{"promt": "x"}`)
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Equal(t, "invalid_argument", eb.Code)
	assert.Equal(t, `invalid argument: the body has an unknown field "promt"; this route takes "prompt"`, eb.Error)
	code, eb = s.ask(t, http.MethodPost, "/tasks/"+a.ID+"/extend", "application/json", `{"prompt": "x", "model": "m"}`)
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Contains(t, eb.Error, `unknown field "model"`, "even beside a prompt")

	code, eb = s.ask(t, http.MethodPost, "/health/reset", "application/json", `{"kee": "openai"}`)
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Equal(t, "invalid_argument", eb.Code)
	assert.Equal(t, `invalid argument: the body has an unknown field "kee"; this route takes "key"`, eb.Error)
}

// Every bad argument says "invalid argument" once: the code says what
// kind, the message why.
func TestEveryBadArgumentSaysSoOnce(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.running(t, "chat")
	extend := "/tasks/" + a.ID + "/extend"
	for _, c := range []struct{ method, path, ctype, body string }{
		{http.MethodGet, "/tasks?limit=-5", "", ""},
		{http.MethodGet, "/tasks?limit=5000", "", ""},
		{http.MethodGet, "/tasks?limit=x", "", ""},
		{http.MethodGet, "/tasks?after=nope", "", ""},
		{http.MethodGet, "/tasks?status=bogus", "", ""},
		{http.MethodPost, extend, "text/plain", `{"prompt": "x"}`},
		{http.MethodPost, extend, "application/json", `{"promt": "x"}`},
		{http.MethodPost, extend, "application/json", `{"prompt": 1}`},
		{http.MethodPost, extend, "application/json", `{"prompt": "x"} {}`},
		{http.MethodPost, extend, "application/json", `{}`},
		{http.MethodPost, "/health/reset", "application/json", `{"kee": "x"}`},
		{http.MethodPost, "/sessions/%20/close", "", ""},
	} {
		code, eb := s.ask(t, c.method, c.path, c.ctype, c.body)
		what := c.method + " " + c.path + " " + c.body
		assert.Equal(t, http.StatusBadRequest, code, what)
		assert.Equal(t, "invalid_argument", eb.Code, what)
		assert.Equal(t, 1, strings.Count(eb.Error, "invalid argument"), "%s: %s", what, eb.Error)
	}
}

// A Client whose address is no http(s) URL says which value is wrong and
// what to write, naming no Go field; it sends nothing.
func TestAClientSaysWhatIsWrongWithItsAddress(t *testing.T) {
	ctx := context.Background()
	for base, want := range map[string]string{
		"localhost:8080":    `bgtaskhttp: the service's address "localhost:8080" is not an http:// or https:// URL: write http://localhost:8080`,
		"127.0.0.1:9/":      `bgtaskhttp: the service's address "127.0.0.1:9/" is not an http:// or https:// URL: write http://127.0.0.1:9/`,
		"":                  `bgtaskhttp: the service's address "" is not an http:// or https:// URL: write it as http://host:port`,
		"ftp://example.com": `bgtaskhttp: the service's address "ftp://example.com" is not an http:// or https:// URL`,
	} {
		c := &bgtaskhttp.Client{Base: base}
		err := c.Follow(ctx, &mirror.Mirror{}, nil)
		require.Error(t, err, base)
		assert.Equal(t, want, err.Error())
		assert.NotContains(t, err.Error(), "Client.Base")
		_, err = c.Snapshot(ctx)
		require.Error(t, err, base)
		assert.Equal(t, want, err.Error(), "every call says the same")
	}
}

// A call that names no task is refused before anything is sent.
func TestAClientCallWithNoTaskIDIsRefused(t *testing.T) {
	var asked atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { asked.Add(1) }))
	defer srv.Close()
	c := &bgtaskhttp.Client{Base: srv.URL}
	_, err := c.Task(context.Background(), "")
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	assert.EqualError(t, err, "invalid argument: a task id is required")
	_, err = c.Extend(context.Background(), " ", "more")
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	_, err = c.Stop(context.Background(), bgtask.Target{Task: ""})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	assert.Zero(t, asked.Load(), "nothing was sent")
}

// An answer no bgtask service gives is said as such: the server, the
// request, its status and content type, and a short excerpt of its text,
// not the page it sent.
func TestAServerThatIsNoBgtaskServiceIsSaidSo(t *testing.T) {
	page := "<!doctype html><html><head><title>Bad Gateway</title><style>body { color: red; }</style>" +
		"<script>var x = 1;</script></head><body><h1>502 Bad Gateway</h1><p>nginx &amp; friends</p>" +
		strings.Repeat("<p>filler</p>\n", 2000) + "</body></html>"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		if r.URL.Path == "/events" {
			w.WriteHeader(http.StatusBadGateway)
		}
		_, _ = io.WriteString(w, page)
	}))
	defer srv.Close()
	giveUp := func(err error, _ time.Duration) error { return err }
	c := &bgtaskhttp.Client{Base: srv.URL, Reconnect: giveUp}
	err := c.Follow(context.Background(), &mirror.Mirror{}, nil)
	require.Error(t, err)
	msg := err.Error()
	assert.True(t, strings.HasPrefix(msg, "bgtaskhttp: the server at "+srv.URL+" did not answer as a bgtask server (GET /events: 502 Bad Gateway, Content-Type text/html): \"Bad Gateway 502 Bad Gateway nginx & friends filler filler"), msg)
	assert.Less(t, len(msg), 300, "an excerpt, not the page: %s", msg)
	assert.NotContains(t, msg, "<")
	assert.NotContains(t, msg, "color: red")
	var he *bgtaskhttp.Error
	require.ErrorAs(t, err, &he)
	assert.Equal(t, http.StatusBadGateway, he.Status)
	assert.Equal(t, "http", he.Code)

	// A page that answers 200 to every path: /events is no stream, and a
	// read gets no JSON error either.
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = io.WriteString(w, page)
	}))
	defer ok.Close()
	err = (&bgtaskhttp.Client{Base: ok.URL, Reconnect: giveUp}).Follow(context.Background(), &mirror.Mirror{}, nil)
	require.Error(t, err)
	msg = err.Error()
	assert.True(t, strings.HasPrefix(msg, "bgtaskhttp: the server at "+ok.URL+" did not answer as a bgtask server (GET /events: 200 OK, Content-Type text/html; charset=utf-8): not an event stream: \"Bad Gateway"), msg)
	assert.Less(t, len(msg), 300, "an excerpt, not the page: %s", msg)
}

// A stream opened again says how it took up: resumed after the last event
// (the service sent ": resumed"), or from a new snapshot.
func TestFollowSaysHowAStreamOpenedAgainTookUp(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srv := streamOf(t, func(n int, w http.ResponseWriter, r *http.Request) {
		switch n {
		case 1:
			snapshot(t, w, 1, "a") // id 1-1; then the stream ends
		case 2:
			_, _ = io.WriteString(w, ": resumed\n\n") // nothing missed; then it ends
		default:
			snapshot(t, w, 3, "a", "b") // a new snapshot
			<-r.Context().Done()
		}
	})
	type tookUp struct {
		after    string
		snapshot bool
	}
	calls := make(chan tookUp, 3)
	c := &bgtaskhttp.Client{Base: srv.URL, Reconnected: func(after string, snapshot bool) { calls <- tookUp{after, snapshot} }}
	var mir mirror.Mirror
	fctx, stop := context.WithCancel(ctx)
	followed := make(chan error, 1)
	go func() { followed <- c.Follow(fctx, &mir, nil) }()
	require.NoError(t, mir.Wait(ctx, func(tasks []bgtask.Task) bool { return len(tasks) == 2 }))
	stop()
	assert.ErrorIs(t, <-followed, context.Canceled)
	close(calls)
	var got []tookUp
	for c := range calls {
		got = append(got, c)
	}
	assert.Equal(t, []tookUp{{"1-1", false}, {"1-1", true}}, got, "not on the first stream; once on each stream opened again")
}
