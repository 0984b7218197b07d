package bgtaskhttp_test

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
)

// tableIDs are the task ids of a table page's rows, in order.
func tableIDs(body string) []string {
	var out []string
	for _, m := range regexp.MustCompile(`<tr data-id="([^"]*)">`).FindAllStringSubmatch(body, -1) {
		out = append(out, m[1])
	}
	return out
}

// The table page: a row a task, filtered and sorted as its URL says, its
// columns sortable by a link, and every row its filters select exported
// as JSON; a bad filter is said, on the page and in the export.
func TestTheTablePage(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	done := s.launchUnder(t, "chat-1", "done", nil)
	s.complete(t, done)
	failed := s.launchUnder(t, "chat-2", "failed", nil)
	require.NoError(t, s.host.Fail(failed.SessionID, errors.New("429 Too Many Requests")))
	retried, err := bgtasktest.WaitFor(s.ctx, s.m, failed.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	require.NoError(t, s.host.Fail(retried.SessionID, errors.New("403 Forbidden")))
	_, err = bgtasktest.WaitStatus(s.ctx, s.m, failed.ID, bgtask.StatusError)
	require.NoError(t, err)
	live := s.launchUnder(t, "chat-3", "live", nil)

	code, body, h := s.get(t, "/view/table")
	require.Equal(t, http.StatusOK, code)
	assert.Contains(t, h.Get("Content-Security-Policy"), "script-src 'self'")
	assert.Equal(t, []string{live.ID, failed.ID, done.ID}, tableIDs(body), "newest first")
	assert.Contains(t, body, "forbidden", "the failure's class")

	_, body, _ = s.get(t, "/view/table?sort=started&order=asc")
	assert.Equal(t, []string{done.ID, failed.ID, live.ID}, tableIDs(body))
	assert.Contains(t, body, `aria-sort="ascending"`)
	_, body, _ = s.get(t, "/view/table?class=forbidden")
	assert.Equal(t, []string{failed.ID}, tableIDs(body))
	_, body, _ = s.get(t, "/view/table?status=running&status=completed")
	assert.Equal(t, []string{live.ID, done.ID}, tableIDs(body))
	_, body, _ = s.get(t, "/view/table?model=p")
	assert.Equal(t, []string{live.ID, done.ID}, tableIDs(body), "the provider's model: failed ended on its second")

	code, body, h = s.get(t, "/view/table?status=error&status=completed&format=json")
	require.Equal(t, http.StatusOK, code)
	assert.Contains(t, h.Get("Content-Type"), "application/json")
	var export struct {
		Total int           `json:"total"`
		Tasks []bgtask.Task `json:"tasks"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &export))
	assert.Equal(t, 2, export.Total)
	require.Len(t, export.Tasks, 2)
	assert.Equal(t, failed.ID, export.Tasks[0].ID)
	assert.Equal(t, bgtask.StatusError, export.Tasks[0].Status)

	code, body, _ = s.get(t, "/view/table?sort=price")
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Contains(t, body, `sort &#34;price&#34;`)
	code, body, _ = s.get(t, "/view/table?from=yesterday&format=json")
	assert.Equal(t, http.StatusBadRequest, code)
	assert.Contains(t, body, `"code":"invalid_argument"`)

	// Every link of the page keeps its filters, and sorting starts over.
	_, body, _ = s.get(t, "/view/table?agent=&class=forbidden&limit=1")
	for _, m := range regexp.MustCompile(`href="(/view/table\?[^"]*)"`).FindAllStringSubmatch(body, -1) {
		u, err := url.Parse(strings.ReplaceAll(m[1], "&amp;", "&"))
		require.NoError(t, err)
		if u.RawQuery == "" {
			continue // clear
		}
		assert.Equal(t, "forbidden", u.Query().Get("class"), m[1])
	}
}

// The chart page draws its four charts as SVG, in the page, with no
// inline style (the page's policy forbids it) and no script.
func TestTheChartPage(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	done := s.launchUnder(t, "chat-1", "done", nil)
	s.complete(t, done)
	code, body, _ := s.get(t, "/view/charts")
	require.Equal(t, http.StatusOK, code)
	assert.Equal(t, 4, strings.Count(body, `<svg class="chart"`))
	for _, title := range []string{"Launches and ends per minute", "Failures by class", "Run time", "Cost per model"} {
		assert.Contains(t, body, title)
	}
	assert.NotContains(t, body, "style=")
	assert.NotContains(t, body, "<script>")
}

// A bulk action stops what a table's filters select, once its count is
// confirmed: a cancel the live tasks, a close every task's branch, each
// with the actor Authorize named; a selection that changed since the
// count was stated stops nothing; the page offers both, with the counts.
func TestBulkActionsOnWhatAFilterSelects(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{Authorize: func(*http.Request) (string, error) { return "carol", nil }})
	done := s.launchUnder(t, "chat-1", "done", nil)
	s.complete(t, done)
	a := s.running(t, "chat-2")
	b := s.running(t, "chat-3")
	post := func(path string) (int, string) { return s.postWith(t, path, nil) }

	_, body, _ := s.get(t, "/view/table")
	assert.Contains(t, body, `data-action="bulk-cancel"`)
	assert.Contains(t, body, `data-count="2">cancel the 2 live</button>`, "the live ones of the three")
	assert.Contains(t, body, `data-count="3">close the 3 branches</button>`)

	code, body := post("/tasks/cancel?expect=3")
	assert.Equal(t, http.StatusConflict, code, "three confirmed, two live now")
	assert.Contains(t, body, `"code":"selection_changed"`)
	assert.Contains(t, body, "select 2 tasks now")
	code, _ = post("/tasks/cancel")
	assert.Equal(t, http.StatusBadRequest, code, "no count confirmed")
	code, _ = post("/tasks/cancel?status=bogus&expect=0")
	assert.Equal(t, http.StatusBadRequest, code)
	for _, id := range []string{a.ID, b.ID} {
		got, err := s.m.Task(id)
		require.NoError(t, err)
		assert.Equal(t, bgtask.StatusRunning, got.Status, "nothing was stopped")
	}

	code, body = post("/tasks/cancel?status=running&expect=2")
	require.Equal(t, http.StatusOK, code, body)
	var rep bgtaskhttp.BulkReport
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	assert.ElementsMatch(t, []string{a.ID, b.ID}, rep.Asked)
	assert.Empty(t, rep.Refused)
	for _, id := range []string{a.ID, b.ID} {
		got, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusCancelled)
		require.NoError(t, err)
		assert.Equal(t, "carol", got.Stop.Actor, "who acted")
	}
	got, err := s.m.Task(done.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, got.Status, "an ended task is no cancel's")

	c := s.running(t, "chat-4")
	kid := s.running(t, c.SessionID)
	code, body = post("/tasks/close?" + url.Values{"status": {"running"}, "expect": {"2"}}.Encode())
	require.Equal(t, http.StatusOK, code, body)
	for _, id := range []string{c.ID, kid.ID} {
		_, err := bgtasktest.WaitStatus(s.ctx, s.m, id, bgtask.StatusCancelled)
		require.NoError(t, err)
	}

	ro := newSvc(t, bgtaskhttp.Options{ReadOnly: true})
	ro.running(t, "chat-5")
	_, body, _ = ro.get(t, "/view/table")
	assert.NotContains(t, body, `data-action="bulk-cancel"`, "read-only: no action offered")
}

// postWith posts no body to path with headers, and returns the status and
// the body of the answer.
func (s *svc) postWith(t *testing.T, path string, headers map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(s.ctx, http.MethodPost, s.srv.URL+path, nil)
	require.NoError(t, err)
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	res, err := s.srv.Client().Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(b)
}
