package bgtaskhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"net/http/httptest"
	"net/url"
	"regexp"
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

// extendsOn says, for each task of a page, whether its row offers extend.
func extendsOn(rows []shownTask) map[string]bool {
	out := map[string]bool{}
	for _, r := range rows {
		out[r.ID] = false
		for _, b := range r.Buttons {
			out[r.ID] = out[r.ID] || b == "extend"
		}
	}
	return out
}

// Extend is offered only on a task that could take a prompt now: one
// that runs, on a session, and is not being stopped, on a host that takes
// prompts; never on one that ended, and never read-only.
func TestExtendIsOfferedOnlyOnATaskThatRuns(t *testing.T) {
	s := newSvcOf(t, bgtaskhttp.Options{}, true)
	running := s.launchUnder(t, "chat-1", "running", nil)
	done := s.launchUnder(t, "chat-2", "done", nil)
	s.complete(t, done)
	stopping := s.launchUnder(t, "chat-3", "being stopped", nil)
	s.host.HangAborts(1)
	_, err := s.m.Stop(s.ctx, bgtask.Target{Task: stopping.ID, NoWait: true})
	require.NoError(t, err)
	got, err := s.m.Task(stopping.ID)
	require.NoError(t, err)
	require.Equal(t, bgtask.StatusRunning, got.Status, "its child has not stopped yet")
	require.NotNil(t, got.Stop)

	_, body, _ := s.get(t, "/")
	assert.Equal(t, map[string]bool{running.ID: true, done.ID: false, stopping.ID: false}, extendsOn(rowsOf(t, body)))
	_, body, _ = s.get(t, "/view/task?id="+url.QueryEscape(done.ID))
	assert.False(t, extendsOn(rowsOf(t, body))[done.ID], "nor on its detail page")
	s.host.Release()

	// A host that takes no prompts: extend would answer 409 unsupported,
	// so none is offered.
	deaf := newSvc(t, bgtaskhttp.Options{})
	running = deaf.launchUnder(t, "chat-1", "running", nil)
	_, body, _ = deaf.get(t, "/")
	assert.Equal(t, map[string]bool{running.ID: false}, extendsOn(rowsOf(t, body)))
	_, err = deaf.c.Extend(deaf.ctx, running.ID, "more")
	assert.ErrorIs(t, err, errors.ErrUnsupported)
}

// The outcome on the detail page is the JSON a person reads: what the
// task said, "<" and all (escaped for HTML, not as \u003c), and it reads
// back as the task's outcome.
func TestTheOutcomeReadsAsItWasSaid(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	task := s.launchUnder(t, "chat-1", "markup", nil)
	require.NoError(t, s.host.Idle(task.SessionID, `use <b>bold</b> & "quotes"`))
	ended, err := bgtasktest.WaitStatus(s.ctx, s.m, task.ID, bgtask.StatusCompleted)
	require.NoError(t, err)
	require.NotNil(t, ended.Outcome)

	_, body, _ := s.get(t, "/view/task?id="+url.QueryEscape(task.ID))
	m := regexp.MustCompile(`(?s)<section id="outcome"><h2>Outcome</h2><pre>(.*?)</pre>`).FindStringSubmatch(body)
	require.NotNil(t, m, body)
	shown := m[1]
	assert.NotContains(t, shown, `\u003c`)
	assert.NotContains(t, shown, `\u0026`)
	assert.Contains(t, shown, `&lt;b&gt;bold&lt;/b&gt;`, "escaped for HTML, once")
	var back bgtask.Outcome
	require.NoError(t, json.Unmarshal([]byte(html.UnescapeString(shown)), &back), "what the page shows is the outcome's JSON")
	assert.Equal(t, *ended.Outcome, back)
}

// Times are absolute (UTC, the same for every reader), machine-readable
// (<time datetime>), and relative to when the page was rendered: "in
// progress for" a live task, how long ago an ended one ended.
func TestTimesAreAbsoluteAndRelative(t *testing.T) {
	launched := time.Now().Add(-(2*time.Hour + 5*time.Minute + 30*time.Second)).Truncate(time.Millisecond)
	clk := bgtasktest.NewClock(launched) // the Manager's clock: what it stamps the task with
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()), bgtask.WithClock(clk))
	host.Attach(m)
	defer func() { assert.NoError(t, m.Shutdown(context.Background())) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
	require.NoError(t, err)
	task, err = bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.True(t, task.LaunchedAt.Equal(launched))
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	defer srv.Close()

	stamp := launched.UTC().Format("2006-01-02T15:04:05.000Z")
	abs := launched.UTC().Format("2006-01-02 15:04:05") + " UTC"
	_, body := fetch(t, srv, "/")
	assert.Contains(t, body, `launched <time datetime="`+stamp+`">`+abs+`</time> · in progress for <time class="rel" data-form="for" datetime="`+stamp+`"`)
	assert.Regexp(t, `in progress for <time [^>]*>2 h 5 min</time>`, body, "computed on the server, from when it rendered")
	assert.Regexp(t, `<main id="main" [^>]*data-now="\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"`, body, "the script moves the relative times on from the render's time")

	clk.Advance(90 * time.Second) // the task ends 90 s after its launch, by its Manager's clock
	require.NoError(t, host.Idle(task.SessionID, "ok"))
	_, err = bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusCompleted)
	require.NoError(t, err)
	_, body = fetch(t, srv, "/")
	assert.Regexp(t, `launched <time datetime="`+regexp.QuoteMeta(stamp)+`">[^<]+</time> · took 1m30s · ended <time class="rel" data-form="ago" datetime="[^"]+" title="[^"]+ UTC">2 h 4 min ago</time>`, body)
	_, body = fetch(t, srv, "/view/task?id="+url.QueryEscape(task.ID))
	assert.Regexp(t, `<dt>launched</dt><dd><time datetime="`+regexp.QuoteMeta(stamp)+`">`+regexp.QuoteMeta(abs)+`</time> \(<time class="rel" data-form="ago" [^>]*>2 h 5 min ago</time>\)</dd>`, body)
	assert.Regexp(t, `<dt>ended</dt><dd><time datetime="[^"]+">[^<]+ UTC</time> \(<time [^>]*>2 h 4 min ago</time>\), after 1m30s</dd>`, body)
}

// A root's row sums what its whole tree used, budget or not; the rows
// below it and a root with no task below it have no such line.
func TestARootShowsWhatItsTreeUsed(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	root := s.launchUnder(t, "chat-1", "root", nil)
	kid := s.launchUnder(t, root.SessionID, "kid", nil)
	grandkid := s.launchUnder(t, kid.SessionID, "grandkid", nil)
	alone := s.launchUnder(t, "chat-2", "alone", nil)
	for ses, u := range map[string]bgtask.Usage{
		root.SessionID:     {InputTokens: 100, OutputTokens: 10, Requests: 1, Cost: 100_000},
		grandkid.SessionID: {InputTokens: 1000, OutputTokens: 200, Requests: 2, Cost: 2_000_000},
		alone.SessionID:    {InputTokens: 5, Requests: 1},
	} {
		require.NoError(t, s.host.Emit(bgtask.Event{SessionID: ses, Kind: bgtask.SessionUsage, Usage: u}))
	}
	_, body, _ := s.get(t, "/")
	rows := rowsOf(t, body)
	r, _ := find(rows, root.ID)
	assert.Equal(t, "110 tokens · 1 request · cost 0.10 tree of 3 tasks: 1310 tokens · 3 requests · cost 2.10", r.Spend,
		"its own usage, then its tree's: a grandchild's counts")
	k, _ := find(rows, kid.ID)
	assert.Empty(t, k.Spend, "a row below the top has none")
	a, _ := find(rows, alone.ID)
	assert.Equal(t, "5 tokens · 1 request · cost 0.00", a.Spend, "no task below it: its usage is its tree's")

	_, body, _ = s.get(t, "/?parent="+url.QueryEscape(root.ID)) // the kid at the top of a listing
	k, _ = find(rowsOf(t, body), kid.ID)
	assert.Equal(t, "tree of 2 tasks: 1200 tokens · 2 requests · cost 2.00", k.Spend)
	_, body, _ = s.get(t, "/view/task?id="+url.QueryEscape(root.ID))
	assert.True(t, strings.Contains(body, `<dt>tree usage</dt><dd class="tree-usage">1310 tokens (1100 in, 210 out), 3 requests, cost 2.10, of 3 tasks`), body)
}

// A page renders a bounded number of rows, whatever the tasks: with a
// full page of roots, each shows fewer children (and a link to the
// rest); with few roots, each shows up to twelve.
func TestAPageRendersABoundedNumberOfRows(t *testing.T) {
	s := newSvc(t, bgtaskhttp.Options{})
	var roots []bgtask.Task
	for r := range 30 {
		root := s.launchUnder(t, fmt.Sprint("chat-", r), fmt.Sprint("root ", r), nil)
		roots = append(roots, root)
		for k := range 12 {
			s.launchUnder(t, root.SessionID, fmt.Sprintf("kid %d.%d", r, k), nil)
		}
	}
	_, body, _ := s.get(t, "/")
	rows := rowsOf(t, body)
	assert.LessOrEqual(t, len(rows), 240)
	assert.Equal(t, 30+30*7, len(rows), "7 children of each of 30 roots")
	assert.Equal(t, 30, strings.Count(body, ">5 more</a>"), "each root links to the rest")

	_, body, _ = s.get(t, "/?parent="+roots[0].SessionID) // one task's children: a flat page of them
	assert.Len(t, rowsOf(t, body), 12)
	_, body, _ = s.get(t, "/view/task?id="+roots[0].ID)
	assert.Contains(t, body, roots[0].ID)
	assert.Equal(t, 12, strings.Count(body, `data-depth="1"`), "a task's own page shows its twelve children")
}
