package bgtaskhttp_test

import (
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

// shownTask is a task row as the served HTML has it.
type shownTask struct {
	ID, Status string
	Under      string // the row it is nested in ("" for a top row)
	Lazy       bool   // its subtree is collapsed, loaded when opened
	Buttons    []string
	Spend      string // the text of its usage and budget line, spaces collapsed
	Warn       bool   // that line warns: its budget is exceeded
}

// rowsOf reads the task rows of a served page: each li.task, the row it
// is nested in, whether its subtree is collapsed, its buttons, and its
// usage and budget line. It
// parses the HTML as a browser would nest it (encoding/xml in its HTML
// mode), so a row outside its parent's list is seen as such.
func rowsOf(t *testing.T, page string) []shownTask {
	t.Helper()
	d := xml.NewDecoder(strings.NewReader(page))
	d.Strict, d.AutoClose, d.Entity = false, xml.HTMLAutoClose, xml.HTMLEntity
	type open struct {
		name  string
		row   int  // index into rows, or -1
		spend bool // a row's div.spend
	}
	var stack []open
	var rows []shownTask
	current := func() int {
		for i := len(stack) - 1; i >= 0; i-- {
			if stack[i].row >= 0 {
				return stack[i].row
			}
		}
		return -1
	}
	inSpend := func() bool {
		for i := len(stack) - 1; i >= 0 && stack[i].row < 0; i-- {
			if stack[i].spend {
				return true
			}
		}
		return false
	}
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		switch e := tok.(type) {
		case xml.StartElement:
			attr := func(name string) string {
				for _, a := range e.Attr {
					if a.Name.Local == name {
						return a.Value
					}
				}
				return ""
			}
			o := open{name: e.Name.Local, row: -1}
			switch {
			case e.Name.Local == "li" && strings.Contains(attr("class"), "task"):
				r := shownTask{ID: attr("data-id"), Status: attr("data-status")}
				if up := current(); up >= 0 {
					r.Under = rows[up].ID
				}
				rows = append(rows, r)
				o.row = len(rows) - 1
			case e.Name.Local == "details" && attr("data-lazy") != "":
				if up := current(); up >= 0 {
					rows[up].Lazy = true
				}
			case e.Name.Local == "button" && attr("data-action") != "":
				if up := current(); up >= 0 {
					rows[up].Buttons = append(rows[up].Buttons, attr("data-action"))
				}
			case e.Name.Local == "div" && attr("class") == "spend":
				o.spend = true
			case e.Name.Local == "span" && strings.Contains(attr("class"), "budget") && strings.Contains(attr("class"), "exceeded"):
				if up := current(); up >= 0 && inSpend() {
					rows[up].Warn = true
				}
			}
			stack = append(stack, o)
		case xml.CharData:
			if up := current(); up >= 0 && inSpend() {
				rows[up].Spend += string(e)
			}
		case xml.EndElement:
			for i := len(stack) - 1; i >= 0; i-- { // close up to its start, as HTML does
				if stack[i].name == e.Name.Local {
					stack = stack[:i]
					break
				}
			}
		}
	}
	for i := range rows {
		rows[i].Spend = strings.Join(strings.Fields(rows[i].Spend), " ")
	}
	return rows
}

// get fetches a page of s and returns its status and body.
func (s *svc) get(t *testing.T, path string) (int, string, http.Header) {
	t.Helper()
	return fetchFrom(t, s.ctx, s.srv, path)
}

// fetch gets path of srv: its status and body.
func fetch(t *testing.T, srv *httptest.Server, path string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	code, body, _ := fetchFrom(t, ctx, srv, path)
	return code, body
}

func fetchFrom(t *testing.T, ctx context.Context, srv *httptest.Server, path string) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+path, nil)
	require.NoError(t, err)
	res, err := srv.Client().Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(b), res.Header
}

// launchUnder launches a running task from the session parent.
func (s *svc) launchUnder(t *testing.T, parent, desc string, meta map[string]string) bgtask.Task {
	t.Helper()
	task, err := s.m.Launch(s.ctx, bgtask.Spec{ParentSessionID: parent, Description: desc, Prompt: "do " + desc,
		Metadata: meta, Models: []bgtask.Model{{Provider: "p", ID: "m1"}, {ID: "m2"}}})
	require.NoError(t, err)
	got, err := bgtasktest.WaitStatus(s.ctx, s.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	return got
}

func (s *svc) complete(t *testing.T, task bgtask.Task) {
	t.Helper()
	require.NoError(t, s.host.Idle(task.SessionID, "done: "+task.Description))
	_, err := bgtasktest.WaitStatus(s.ctx, s.m, task.ID, bgtask.StatusCompleted)
	require.NoError(t, err)
}

func ids(rows []shownTask) []string {
	var out []string
	for _, r := range rows {
		out = append(out, r.ID)
	}
	return out
}

func find(rows []shownTask, id string) (shownTask, bool) {
	for _, r := range rows {
		if r.ID == id {
			return r, true
		}
	}
	return shownTask{}, false
}

// The page, loaded plainly (no script), shows the tree: each task nested
// under the task whose session launched it, two levels open and the rest
// collapsed, loaded by its own route.
func TestThePageIsATreeRenderedOnTheServer(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	root := s.launchUnder(t, "chat-1", "root", nil)
	kid := s.launchUnder(t, root.SessionID, "kid", nil)
	grandkid := s.launchUnder(t, kid.SessionID, "grandkid", nil)
	deep := s.launchUnder(t, grandkid.SessionID, "deep", nil)
	other := s.launchUnder(t, "chat-2", "other chat", nil)

	code, body, h := s.get(t, "/")
	require.Equal(t, http.StatusOK, code)
	assert.Contains(t, h.Get("Content-Security-Policy"), "frame-ancestors 'none'")
	rows := rowsOf(t, body)
	assert.ElementsMatch(t, []string{root.ID, kid.ID, other.ID}, ids(rows), "two levels open; the rest is collapsed")
	r, _ := find(rows, root.ID)
	assert.Equal(t, "", r.Under)
	assert.False(t, r.Lazy, "the root's children are shown")
	k, _ := find(rows, kid.ID)
	assert.Equal(t, root.ID, k.Under, "the child is nested in the task that launched it")
	assert.True(t, k.Lazy, "past the second level, collapsed")
	assert.Contains(t, body, "2 tasks below")

	code, body, _ = s.get(t, "/view/children?id="+url.QueryEscape(kid.ID))
	require.Equal(t, http.StatusOK, code)
	rows = rowsOf(t, body)
	require.Equal(t, []string{grandkid.ID}, ids(rows))
	assert.True(t, rows[0].Lazy, "opened one level at a time")
	_, body, _ = s.get(t, "/view/children?id="+url.QueryEscape(grandkid.ID))
	assert.Equal(t, []string{deep.ID}, ids(rowsOf(t, body)))

	code, _, _ = s.get(t, "/view/children?id=nope")
	assert.Equal(t, http.StatusNotFound, code)
}

// Live tasks come first (a root whose subtree is live counts as live),
// then the newest; ended ones follow.
func TestThePageShowsRunningFirst(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	old := s.launchUnder(t, "chat-1", "old, still running", nil)
	done := s.launchUnder(t, "chat-1", "ended", nil)
	busyRoot := s.launchUnder(t, "chat-1", "ended, with a running child", nil)
	s.launchUnder(t, busyRoot.SessionID, "running child", nil)
	newest := s.launchUnder(t, "chat-1", "newest", nil)
	s.complete(t, done)
	require.NoError(t, testkit.StopErr(s.m.Stop(s.ctx, bgtask.Target{Task: busyRoot.ID}))) // a cancel stops the task, not what it launched

	_, body, _ := s.get(t, "/")
	var top []string
	for _, r := range rowsOf(t, body) {
		if r.Under == "" {
			top = append(top, r.ID)
		}
	}
	assert.Equal(t, []string{newest.ID, busyRoot.ID, old.ID, done.ID}, top)
}

// Filters by status and parent, and a search by id, id prefix,
// description and metadata, each as a plain GET.
func TestThePageFiltersAndSearches(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.launchUnder(t, "chat-1", "Summarise the logs", map[string]string{"ticket": "OPS-42"})
	b := s.launchUnder(t, a.SessionID, "fetch the logs", nil)
	c := s.launchUnder(t, "chat-2", "write a poem", map[string]string{"team": "docs"})
	s.complete(t, c)

	for _, tc := range []struct {
		query string
		want  []string
	}{
		{"status=completed", []string{c.ID}},
		{"status=running", []string{a.ID, b.ID}},
		{"status=running&status=completed", []string{a.ID, b.ID, c.ID}},
		{"q=" + url.QueryEscape(b.ID), []string{b.ID}},
		{"q=" + url.QueryEscape(b.ID[:len(b.ID)-1]), nil}, // filled below: every id with that prefix
		{"q=LOGS", []string{a.ID, b.ID}},
		{"q=ops-42", []string{a.ID}},
		{"q=team", []string{c.ID}},
		{"q=nothing-matches", nil},
		{"parent=chat-2", []string{c.ID}},
		{"parent=" + a.ID, []string{b.ID}},
		{"parent=" + url.QueryEscape(a.SessionID), []string{b.ID}},
		{"parent=chat-1&q=fetch", []string{b.ID}},
	} {
		want := tc.want
		if tc.query == "q="+url.QueryEscape(b.ID[:len(b.ID)-1]) {
			for _, task := range s.m.Snapshot().Tasks {
				if strings.HasPrefix(task.ID, b.ID[:len(b.ID)-1]) {
					want = append(want, task.ID)
				}
			}
			require.NotEmpty(t, want)
		}
		code, body, _ := s.get(t, "/?"+tc.query)
		require.Equal(t, http.StatusOK, code, tc.query)
		assert.ElementsMatch(t, want, ids(rowsOf(t, body)), tc.query)
	}
	code, body, _ := s.get(t, "/?status=runing")
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Contains(t, body, `unknown status &#34;runing&#34;`)
	code, _, _ = s.get(t, "/?page=-1")
	assert.Equal(t, http.StatusBadRequest, code)
}

// A search result names the path from its root, and so does a detail.
func TestASearchResultShowsItsPath(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	a := s.launchUnder(t, "chat-1", "a", nil)
	b := s.launchUnder(t, a.SessionID, "b", nil)
	c := s.launchUnder(t, b.SessionID, "needle", nil)
	_, body, _ := s.get(t, "/?q=needle")
	require.Equal(t, []string{c.ID}, ids(rowsOf(t, body)))
	assert.Regexp(t, `in <a href="/view/task\?id=`+a.ID+`">`+a.ID+`</a> › <a href="/view/task\?id=`+b.ID+`">`, body)
}

// Roots are paged: a page costs the same at 10,000 tasks as at 10.
func TestThePageIsPaged(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	var all []bgtask.Task
	for i := range 70 {
		task, err := s.m.Launch(s.ctx, bgtask.Spec{ParentSessionID: fmt.Sprint("chat-", i), Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err)
		all = append(all, task)
	}
	seen := map[string]bool{}
	for page, want := range []int{30, 30, 10} {
		_, body, _ := s.get(t, fmt.Sprintf("/?page=%d", page))
		rows := rowsOf(t, body)
		assert.Len(t, rows, want, "page %d", page)
		for _, r := range rows {
			assert.False(t, seen[r.ID], "%s on two pages", r.ID)
			seen[r.ID] = true
		}
		assert.Equal(t, page < 2, strings.Contains(body, `rel="next"`), "page %d", page)
	}
	assert.Len(t, seen, len(all))
}

// The detail page: the task's facts, attempts, timeline, its history
// (Manager.History: here what the Manager holds, with its lines of
// progress), the outcome, the envelope, and what it launched.
func TestTheDetailPage(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	task := s.launchUnder(t, "chat-1", "flaky <b>bold</b>", map[string]string{"ticket": "T-1"})
	require.NoError(t, s.host.Fail(task.SessionID, errors.New("429 Too Many Requests")))
	second, err := bgtasktest.WaitFor(s.ctx, s.m, task.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	kid := s.launchUnder(t, second.SessionID, "kid", nil)
	s.complete(t, kid)
	s.complete(t, second)
	ended, err := s.m.Task(task.ID)
	require.NoError(t, err)

	code, body, h := s.get(t, "/view/task?id="+url.QueryEscape(task.ID))
	require.Equal(t, http.StatusOK, code)
	assert.Contains(t, h.Get("Content-Security-Policy"), "script-src 'self'")
	assert.Contains(t, body, "flaky &lt;b&gt;bold&lt;/b&gt;", "escaped")
	assert.NotContains(t, body, "<b>bold</b>")
	assert.Contains(t, body, "T-1")
	assert.Contains(t, body, "429 Too Many Requests")
	for _, part := range []string{bgtask.Timeline(ended), bgtask.Envelope(ended)} {
		var esc strings.Builder
		require.NoError(t, xml.EscapeText(&esc, []byte(part)))
		assert.Contains(t, strings.ReplaceAll(body, "&#39;", "'"), strings.ReplaceAll(strings.ReplaceAll(esc.String(), "&#39;", "'"), "&#xA;", "\n"))
	}
	assert.Contains(t, body, "attempt 1 created on ", "its history: the fallback")
	assert.Contains(t, body, "attempt 2 created on ")
	assert.Contains(t, body, `data-kind="attempt_finalized"`)
	assert.Contains(t, body, `id="outcome"`)
	rows := rowsOf(t, body)
	require.Len(t, rows, 2, "the task, and what it launched")
	assert.Equal(t, task.ID, rows[0].ID)
	assert.Equal(t, kid.ID, rows[1].ID)

	code, _, _ = s.get(t, "/view/task?id=unknown")
	assert.Equal(t, http.StatusNotFound, code)
}

// A history that cannot be read is said on the page, which is served.
func TestTheDetailPageWithAnUnreadableHistory(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	j, err := bgtask.OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	host := bgtasktest.NewHost()
	m, err := bgtask.Open(ctx, host, bgtask.WithJournal(unreadable{j}))
	require.NoError(t, err)
	host.Attach(m)
	defer func() { assert.NoError(t, m.Shutdown(context.Background())) }()
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
	require.NoError(t, err)
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	defer srv.Close()
	code, body := fetch(t, srv, "/view/task?id="+url.QueryEscape(task.ID))
	assert.Equal(t, http.StatusOK, code)
	assert.Contains(t, body, "journal unreadable")
}

// unreadable is a journal whose records of a task cannot be read back.
type unreadable struct{ bgtask.Journal }

func (unreadable) TaskRecords(context.Context, string) ([]bgtask.Record, error) {
	return nil, errors.New("journal unreadable")
}

// Actions are offered only where they apply, and not at all read-only.
func TestThePageOffersActionsWhereTheyApply(t *testing.T) {
	s := newSvcOf(t, bgtaskhttp.Options{}, true)
	live := s.launchUnder(t, "chat-1", "live", nil)
	done := s.launchUnder(t, "chat-1", "done", nil)
	s.complete(t, done)
	_, body, _ := s.get(t, "/")
	r, _ := find(rowsOf(t, body), live.ID)
	assert.Equal(t, []string{"cancel", "close", "extend"}, r.Buttons)
	r, _ = find(rowsOf(t, body), done.ID)
	assert.Empty(t, r.Buttons, "an ended task can be neither stopped nor extended")
	assert.Contains(t, body, `<dialog id="confirm">`, "actions ask first")

	ro := newSvc(t, bgtaskhttp.Options{ReadOnly: true})
	ro.launchUnder(t, "chat-1", "live", nil)
	_, body, _ = ro.get(t, "/")
	for _, r := range rowsOf(t, body) {
		assert.Empty(t, r.Buttons, "read-only: no actions")
	}
}

// The page's script and style are served from this origin, as the page's
// policy allows.
func TestThePageAssetsAreServed(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	for path, ctype := range map[string]string{"/view/view.js": "text/javascript", "/view/view.css": "text/css"} {
		code, body, h := s.get(t, path)
		assert.Equal(t, http.StatusOK, code)
		assert.Contains(t, h.Get("Content-Type"), ctype)
		assert.NotEmpty(t, body)
	}
}

// With a file journal, the detail page shows a task's records from the
// journal (Manager.History), with the restart between its start and its
// end marked; GET /tasks/{id}/history and Client.History give the same.
func TestTheDetailPageShowsTheJournalsRecordsAcrossARestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dir := t.TempDir()
	host := bgtasktest.NewHost()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	m, err := bgtask.Open(ctx, host, bgtask.WithJournal(j))
	require.NoError(t, err)
	host.Attach(m)
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
	require.NoError(t, err)
	task, err = bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	host.FailAborts(1, errors.New("the process died"))
	require.Error(t, m.Shutdown(ctx), "its run is left running, as by a crash")

	j, err = bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	host = bgtasktest.NewHost() // knows no session: the run is found lost, and ended
	m, err = bgtask.Open(ctx, host, bgtask.WithJournal(j))
	require.NoError(t, err)
	host.Attach(m)
	defer func() { assert.NoError(t, m.Shutdown(context.Background())) }()
	_, err = m.Wait(ctx, task.ID)
	require.NoError(t, err)
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	defer srv.Close()
	code, body := fetch(t, srv, "/view/task?id="+url.QueryEscape(task.ID))
	require.Equal(t, http.StatusOK, code)
	launched := strings.Index(body, `data-kind="task_launched"`)
	restart := strings.Index(body, `<tr class="record restart" data-kind="epoch">`)
	finalized := strings.LastIndex(body, `data-kind="attempt_finalized"`)
	require.True(t, launched >= 0 && restart >= 0 && finalized >= 0, "launch, restart and end shown:\n%s", body)
	assert.Less(t, launched, restart)
	assert.Less(t, restart, finalized, "the restart is between the task's start and its end")

	c := &bgtaskhttp.Client{Base: srv.URL}
	h, err := c.History(ctx, task.ID)
	require.NoError(t, err)
	want, err := m.History(ctx, task.ID)
	require.NoError(t, err)
	require.Len(t, h, len(want))
	for i := range want {
		assert.Equal(t, want[i].Seq, h[i].Seq)
		assert.Equal(t, want[i].Kind, h[i].Kind)
		assert.Equal(t, want[i].Change, h[i].Change)
		assert.True(t, want[i].At.Equal(h[i].At))
	}
	_, err = c.History(ctx, "no-such-task")
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	_, err = c.History(ctx, " ")
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
}

// Ids are the caller's: one that looks like a path, a query or a script
// stays one path segment of its own detail link, and the page escapes it.
func TestIdsAreEscapedInLinks(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	for _, id := range []string{"x/../../snapshot", "a?b#c", "..", "javascript:alert(1)", `"><script>alert(1)</script>`} {
		task, err := s.m.Launch(s.ctx, bgtask.Spec{ID: id, ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err, id)
		_, body, _ := s.get(t, "/")
		link := `href="/view/task?id=` + strings.ReplaceAll(url.QueryEscape(id), "+", "%20") + `"`
		assert.True(t, strings.Contains(strings.ToLower(body), strings.ToLower(link)), "%s: %s", id, link)
		assert.NotContains(t, body, "<script>alert", id)
		code, body, _ := s.get(t, "/view/task?id="+url.QueryEscape(id))
		assert.Equal(t, http.StatusOK, code, id)
		assert.Equal(t, []string{task.ID}, ids(rowsOf(t, body))[:1], id)
	}
}

// An error page is served under the page's own policy too.
func TestErrorPagesKeepThePagesPolicy(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	for path, code := range map[string]int{"/view/task?id=nope": 404, "/?status=nope": 400, "/?page=3": 404, "/view/children?id=nope": 404} {
		got, body, h := s.get(t, path)
		assert.Equal(t, code, got, path)
		assert.Contains(t, h.Get("Content-Security-Policy"), "script-src 'self'", path)
		assert.Equal(t, "no-cache", h.Get("Cache-Control"), path)
		assert.Contains(t, body, `class="error"`, path)
	}
}

// View alone is guarded as Handler is.
func TestViewAloneIsGuarded(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	s.launchUnder(t, "chat", "secret work", nil)
	for _, o := range []bgtaskhttp.Options{{}, {Authorize: func(*http.Request) (string, error) { return "", errors.New("no") }}} {
		h := bgtaskhttp.View(s.m, o)
		req := httptest.NewRequest(http.MethodGet, "http://evil.example/", nil)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		assert.Equal(t, http.StatusForbidden, w.Code, "a rebinding host")
		assert.NotContains(t, w.Body.String(), "secret work")
		req = httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
		w = httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if o.Authorize != nil {
			assert.Equal(t, http.StatusUnauthorized, w.Code)
			assert.NotContains(t, w.Body.String(), "secret work")
		} else {
			assert.Equal(t, http.StatusOK, w.Code)
			assert.Contains(t, w.Body.String(), "secret work")
		}
	}
}

// A forgotten task's detail page says so, and shows what the journal
// still holds of it.
func TestTheDetailPageOfAForgottenTask(t *testing.T) {
	host := bgtasktest.NewHost()
	j, err := bgtask.OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	m := testkit.MustOpen(host, bgtask.WithJournal(j), bgtask.WithIDs(bgtask.SequentialIDs()), bgtask.WithRetention(bgtask.Retention{MaxEnded: 1}))
	host.Attach(m)
	defer func() { assert.NoError(t, m.Shutdown(context.Background())) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var first bgtask.Task
	for i := range 3 {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: fmt.Sprint("chat-", i), Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err)
		task, err = bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		require.NoError(t, host.Idle(task.SessionID, "ok"))
		_, err = m.Wait(ctx, task.ID)
		require.NoError(t, err)
		if i == 0 {
			first = task
		}
	}
	_, err = m.Task(first.ID)
	require.ErrorIs(t, err, bgtask.ErrForgotten)
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	defer srv.Close()
	code, body := fetch(t, srv, "/view/task?id="+url.QueryEscape(first.ID))
	assert.Equal(t, http.StatusNotFound, code)
	assert.Contains(t, body, "forgotten")
	assert.Contains(t, body, `data-kind="task_launched"`, "its records, from the journal")
}

// Matches are listed in the tree's order: each parent before its
// children, the trees as the page orders them (the newest live first).
func TestMatchesComeInTheTreesOrder(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	older := s.launchUnder(t, "chat-1", "older", nil)
	olderKid := s.launchUnder(t, older.SessionID, "older's kid", nil)
	newer := s.launchUnder(t, "chat-2", "newer", nil)
	newerKid := s.launchUnder(t, newer.SessionID, "newer's kid", nil)
	_, body, _ := s.get(t, "/?status=running")
	assert.Equal(t, []string{newer.ID, newerKid.ID, older.ID, olderKid.ID}, ids(rowsOf(t, body)))
}

// Each task's row shows its usage (tokens, requests, cost) and the budget
// it spends from (what was spent of each limit, what is left); a budget
// whose hard limit was reached warns, on the rows of every task that
// spends from it. The detail page has each attempt's usage, the budget's
// holder, and the API's task has both (usage, budget).
func TestThePageShowsUsageAndBudgets(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	root, err := s.m.Launch(s.ctx, bgtask.Spec{ParentSessionID: "chat-1", Description: "root", Prompt: "p", Models: []bgtask.Model{{ID: "m"}},
		Budget: &bgtask.Budget{Tokens: 1000, Spawns: 5, SoftPercent: 100}})
	require.NoError(t, err)
	root, err = bgtasktest.WaitStatus(s.ctx, s.m, root.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	kid := s.launchUnder(t, root.SessionID, "kid", nil)
	other := s.launchUnder(t, "chat-2", "no budget", nil)
	require.NoError(t, s.host.Emit(bgtask.Event{SessionID: kid.SessionID, Kind: bgtask.SessionUsage,
		Usage: bgtask.Usage{InputTokens: 400, CachedTokens: 100, OutputTokens: 100, Requests: 1, Cost: 250_000}}))

	_, body, _ := s.get(t, "/")
	r, _ := find(rowsOf(t, body), root.ID)
	assert.Equal(t, "tree of 2 tasks: 500 tokens · 1 request · cost 0.25 budget: spent tokens 500 of 1000, cost 0.25, requests 1, spawns 1 of 5 · left tokens 500, spawns 4", r.Spend,
		"the branch's spending, on the row of the task that holds the budget (which used nothing itself)")
	assert.False(t, r.Warn)
	k, _ := find(rowsOf(t, body), kid.ID)
	assert.Equal(t, "500 tokens · 1 request · cost 0.25 budget of "+root.ID+": spent tokens 500 of 1000, cost 0.25, requests 1, spawns 1 of 5 · left tokens 500, spawns 4", k.Spend)
	o, _ := find(rowsOf(t, body), other.ID)
	assert.Empty(t, o.Spend, "no usage, no budget: no line")

	// The root's report brings the tokens to their limit: the branch stops.
	require.NoError(t, s.host.Emit(bgtask.Event{SessionID: root.SessionID, Kind: bgtask.SessionBusy,
		Usage: bgtask.Usage{InputTokens: 500, OutputTokens: 100, Requests: 2, Cost: bgtask.CostUnit}}))
	for _, id := range []string{root.ID, kid.ID} {
		_, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusCancelled)
		require.NoError(t, err)
	}
	_, body, _ = s.get(t, "/")
	rows := rowsOf(t, body)
	r, _ = find(rows, root.ID)
	assert.Equal(t, "600 tokens · 2 requests · cost 1.00 tree of 2 tasks: 1100 tokens · 3 requests · cost 1.25 budget: spent tokens 1100 of 1000, cost 1.25, requests 3, spawns 1 of 5 · left tokens 0, spawns 4 · exceeded: tokens (branch stopped, launches refused)", r.Spend)
	assert.True(t, r.Warn, "an exceeded budget warns")
	k, _ = find(rows, kid.ID)
	assert.True(t, k.Warn, "on every row that spends from it")
	assert.Contains(t, k.Spend, "budget of "+root.ID+": spent tokens 1100 of 1000")
	assert.Contains(t, body, `<span class="budget exceeded" data-holder="`+root.ID+`">`)
	assert.Contains(t, body, "stopped: the budget of task "+root.ID+" ran out of tokens", "the stop cause says why")

	_, body, _ = s.get(t, "/view/task?id="+url.QueryEscape(kid.ID))
	assert.Contains(t, body, `<dt>usage</dt><dd class="usage">500 tokens (400 in, 100 cached, 100 out), 1 request, cost 0.25</dd>`,
		"in full; a single attempt's is the total, not repeated")
	assert.Contains(t, body, `budget of <a href="/view/task?id=`+root.ID+`">`+root.ID+`</a>`)
	assert.Contains(t, body, "Usage: 500 tokens", "the timeline's usage line")

	got, err := s.c.Task(s.ctx, kid.ID)
	require.NoError(t, err)
	require.NotNil(t, got.Usage, "the API's task has its usage")
	assert.Equal(t, int64(500), got.Usage.Total.Tokens())
	require.NotNil(t, got.Budget)
	assert.Equal(t, bgtask.LimitTokens, got.Budget.Exceeded)
}
