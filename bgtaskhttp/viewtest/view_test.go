package viewtest

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtaskhttp/viewtest/browser"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

// serve starts a Manager on a scripted host and serves it with o, all
// stopped when the test ends.
func serve(t testing.TB, o bgtaskhttp.Options) (*bgtask.Manager, *bgtasktest.Host, *httptest.Server) {
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	srv := httptest.NewServer(bgtaskhttp.Handler(m, o))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
		_ = m.Shutdown(context.Background())
	})
	return m, host, srv
}

// The browser's helpers, by their short names.
var (
	chromium   = browser.Chromium
	openTab    = browser.OpenTab
	shot       = browser.Shot
	firstPaint = browser.FirstPaint
)

// run runs one browser action and returns its result (browser.Run).
func run[T any](t testing.TB, tab context.Context, a chromedp.Action[T]) T {
	t.Helper()
	return browser.Run(t, tab, a)
}

// row is the CSS selector of a task's row.
func row(id string) string { return `li.task[data-id="` + id + `"]` }

// The page follows the Manager live: rows appear and change as tasks
// launch, retry and end, and a cancel asked on the page (after its
// confirmation) shows cancelled only once the host confirmed the child
// stopped.
func TestTheLiveViewInABrowser(t *testing.T) {
	browser := chromium(t)
	m, host, srv := serve(t, bgtaskhttp.Options{Keepalive: time.Second})

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tab := openTab(t, ctx, browser)

	models := []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {Provider: "google", ID: "gemini"}, {ID: "router-backup"}}
	launch := func(parent, desc string) bgtask.Task {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Description: desc, Prompt: desc, Models: models})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		return got
	}
	before := launch("chat-1", "before the page")
	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	run(t, tab, chromedp.WaitVisible(row(before.ID)))
	run(t, tab, chromedp.WaitVisible(`#conn.live`))

	// Launch and fail tasks while the page is open: rows appear, in order,
	// a child under its parent.
	flaky := launch("chat-1", "flaky")
	require.NoError(t, host.Fail(flaky.SessionID, errors.New("403 Forbidden: provider is forbidden")))
	second, err := bgtasktest.WaitFor(ctx, m, flaky.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	require.NoError(t, host.Fail(second.SessionID, errors.New("429 Too Many Requests")))
	third, err := bgtasktest.WaitFor(ctx, m, flaky.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 3 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	kid := launch(third.SessionID, "a subagent")
	run(t, tab, chromedp.WaitVisible(row(flaky.ID)+` ul.kids > `+row(kid.ID)))
	require.NoError(t, host.Idle(kid.SessionID, "kid done"))
	_, err = bgtasktest.WaitStatus(ctx, m, kid.ID, bgtask.StatusCompleted)
	require.NoError(t, err)
	require.NoError(t, host.Idle(third.SessionID, "answered on the backup"))
	run(t, tab, chromedp.WaitVisible(row(flaky.ID)+` tr.attempt[data-number="3"][data-status="completed"]`))
	attempts := run(t, tab, chromedp.Evaluate[[]string](`[...document.querySelectorAll('`+row(flaky.ID)+` > table tr.attempt')].map(a =>
		[a.dataset.number, a.dataset.status, a.querySelector(".model").textContent, a.querySelector(".session").textContent].join(" "))`))
	assert.Equal(t, []string{"1 error openai/gpt-5 " + flaky.SessionID, "2 error google/gemini " + second.SessionID,
		"3 completed router-backup " + third.SessionID}, attempts, "each attempt, in order")

	// Cancel from the page while the host's abort hangs: the page asks
	// first; the row stays running until the host confirms.
	other := launch("chat-2", "another chat")
	run(t, tab, chromedp.WaitVisible(row(other.ID)))
	host.HangAborts(1)
	calls := len(host.Starts()) + len(host.Aborts())
	run(t, tab, chromedp.Click(row(other.ID)+` button.cancel`))
	run(t, tab, chromedp.WaitVisible(`#confirm .yes`))
	asked := run(t, tab, chromedp.Text(`#confirm .ask`))
	assert.Contains(t, asked, "Cancel task "+other.ID)
	assert.Len(t, host.Aborts(), calls-len(host.Starts()), "nothing is done before the confirmation")
	run(t, tab, chromedp.Click(`#confirm .yes`))
	require.NoError(t, host.AwaitCalls(ctx, calls+1), "the page's cancel reached the host")
	shown := run(t, tab, chromedp.AttributeValue(row(other.ID), "data-status"))
	assert.Equal(t, "running", shown.Value, "not cancelled before the host confirmed")
	host.Release()
	run(t, tab, chromedp.WaitVisible(row(other.ID)+`[data-status="cancelled"]`))

	// Usage and budgets, live: a report shows on its task's row, with the
	// budget it spends from; the report that spends the budget turns the
	// budget's line into a warning.
	spender, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat-3", Description: "on a budget", Prompt: "spend", Models: models,
		Budget: &bgtask.Budget{Tokens: 1000, SoftPercent: 100}})
	require.NoError(t, err)
	spender, err = bgtasktest.WaitStatus(ctx, m, spender.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	run(t, tab, chromedp.WaitVisible(row(spender.ID)))
	require.NoError(t, host.Emit(bgtask.Event{SessionID: spender.SessionID, Kind: bgtask.SessionUsage,
		Usage: bgtask.Usage{InputTokens: 400, CachedTokens: 100, OutputTokens: 100, Requests: 1, Cost: 250_000}}))
	run(t, tab, chromedp.WaitVisible(row(spender.ID)+` > .spend .usage`))
	assert.Equal(t, "500 tokens · 1 request · cost 0.25", run(t, tab, chromedp.Text(row(spender.ID)+` > .spend .usage`)))
	budget := run(t, tab, chromedp.Text(row(spender.ID)+` > .spend .budget`))
	assert.Equal(t, "budget: spent tokens 500 of 1000, cost 0.25, requests 1 · left tokens 500", budget)
	require.NoError(t, host.Emit(bgtask.Event{SessionID: spender.SessionID, Kind: bgtask.SessionBusy,
		Usage: bgtask.Usage{InputTokens: 600, OutputTokens: 20, Requests: 1}}))
	run(t, tab, chromedp.WaitVisible(row(spender.ID)+` > .spend .budget.exceeded`))
	budget = run(t, tab, chromedp.Text(row(spender.ID)+` > .spend .budget.exceeded`))
	assert.Contains(t, budget, "spent tokens 1120 of 1000")
	assert.Contains(t, budget, "EXCEEDED: TOKENS", "the hard limit reached, as the page shows it (in capitals)")
	warn := run(t, tab, chromedp.Evaluate[map[string]string](`(() => { const s = getComputedStyle(document.querySelector('`+row(spender.ID)+` > .spend .budget.exceeded'));
		return {color: s.color, background: s.backgroundColor}; })()`))
	assert.Equal(t, map[string]string{"color": "rgb(159, 18, 57)", "background": "rgb(254, 226, 226)"}, warn, "a visible warning, not the muted line")
	run(t, tab, chromedp.WaitVisible(row(spender.ID)+`[data-status="cancelled"]`))
	stop := run(t, tab, chromedp.Text(row(spender.ID)+` > .state .stop`))
	assert.Equal(t, "stopped: the budget of task "+spender.ID+" ran out of tokens", stop)
	shot(t, tab, "live-view.png")
}

// bigPage is a Manager of 10,000 tasks, served, and a browser tab.
type bigPage struct {
	tab         context.Context
	m           *bgtask.Manager
	srv         *httptest.Server
	roots, kids []bgtask.Task // in launch order
}

// tenThousand serves a Manager of 10,000 tasks (100 roots, each with 9
// children of 10 each; the grandchildren of the first 30 roots ended) and
// opens a browser tab, all within d and closed when the test ends.
func tenThousand(t testing.TB, d time.Duration) bigPage {
	t.Helper()
	browser := chromium(t)
	m, host, srv := serve(t, bgtaskhttp.Options{Buffer: 1 << 16})
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	p := bigPage{tab: openTab(t, ctx, browser), m: m, srv: srv}
	launch := func(parent, desc string, meta map[string]string) bgtask.Task {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Description: desc, Metadata: meta,
			Prompt: "Research " + desc + " and report back in under 200 words.", Models: []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {ID: "backup"}}})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		return got
	}
	for r := range 100 {
		root := launch(fmt.Sprint("chat-", r%10), fmt.Sprint("root ", r), map[string]string{"ticket": fmt.Sprint("T-", r)})
		p.roots = append(p.roots, root)
		for k := range 9 {
			kid := launch(root.SessionID, fmt.Sprintf("kid %d.%d", r, k), nil)
			p.kids = append(p.kids, kid)
			for g := range 10 {
				gk := launch(kid.SessionID, fmt.Sprintf("grandkid %d.%d.%d", r, k, g), nil)
				if r < 30 {
					require.NoError(t, host.Idle(gk.SessionID, "found it"))
				}
			}
		}
	}
	snap := m.Snapshot()
	require.Len(t, snap.Tasks, 10_000)
	var ended []string
	for _, task := range snap.Tasks {
		if strings.HasPrefix(task.Description, "grandkid ") {
			var r int
			_, _ = fmt.Sscanf(task.Description, "grandkid %d.", &r)
			if r < 30 {
				_, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusCompleted)
				require.NoError(t, err)
				ended = append(ended, task.ID)
			}
		}
	}
	require.Len(t, ended, 2700)
	return p
}

// 10,000 tasks in trees: the page paints, and the tree, the filters, the
// search, the detail page and an action with its confirmation all work
// at that size. How fast it paints is BenchmarkTheViewAtScale's
// to say: a timed assertion here would fail on a busy machine.
func TestTheLiveViewAt10000Tasks(t *testing.T) {
	p := tenThousand(t, 3*time.Minute)
	tab, m, srv, roots, kids := p.tab, p.m, p.srv, p.roots, p.kids

	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	paint := run(t, tab, firstPaint())
	t.Logf("10,000 tasks: first contentful paint %.0f ms", paint)
	assert.Greater(t, paint, 0.0, "the browser painted the page")
	top := run(t, tab, chromedp.Evaluate[map[string]int](`({roots: document.querySelectorAll("ul.tree > li.task").length,
		kids: document.querySelectorAll("ul.tree > li.task > ul.kids > li.task").length,
		collapsed: document.querySelectorAll("details.sub[data-lazy]").length})`))
	assert.Equal(t, 30, top["roots"], "a page of roots")
	assert.Equal(t, 30*7, top["kids"], "7 of their 9 children shown: a page renders at most 240 rows")
	assert.Equal(t, 30*7, top["collapsed"], "the third level collapsed")
	shot(t, tab, "tree-10000.png")
	shot(t, tab, "screen-tree-10000.png")

	// Open a collapsed subtree: its ten children load.
	newest := roots[len(roots)-1] // all are live; the newest is first
	kid := kids[len(kids)-1]
	run(t, tab, chromedp.WaitVisible(row(newest.ID)))
	run(t, tab, chromedp.Click(row(kid.ID)+` > details.sub > summary`))
	run(t, tab, chromedp.WaitVisible(row(kid.ID)+` li.task[data-id]`))
	n := run(t, tab, chromedp.Evaluate[int](`document.querySelectorAll('`+row(kid.ID)+` > details.sub li.task').length`))
	assert.Equal(t, 10, n)

	// Filter: completed only, from the form.
	run(t, tab, chromedp.Click(`#filters input[name=status][value=completed]`))
	run(t, tab, chromedp.Click(`#filters button[type=submit]`))
	run(t, tab, chromedp.WaitVisible(`li.task[data-status="completed"]`))
	statuses := run(t, tab, chromedp.Evaluate[[]string](`[...new Set([...document.querySelectorAll("li.task")].map(r => r.dataset.status))]`))
	assert.Equal(t, []string{"completed"}, statuses)
	shown := run(t, tab, chromedp.Text(`.where .shown`))
	assert.Equal(t, "matches 1–100 of 2700", shown)
	shot(t, tab, "filter-completed.png")

	// Search by metadata, from the form: one root, with its path empty.
	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	run(t, tab, chromedp.SendKeys(`#filters input[name=q]`, "T-42\n"))
	run(t, tab, chromedp.WaitVisible(row(roots[42].ID)))
	found := run(t, tab, chromedp.Evaluate[[]string](`[...document.querySelectorAll("li.task")].map(r => r.dataset.id)`))
	assert.Equal(t, []string{roots[42].ID}, found)

	// The detail page: its timeline, and its children.
	run(t, tab, chromedp.Click(row(roots[42].ID)+` a.id`))
	run(t, tab, chromedp.WaitVisible(`#timeline pre`))
	timeline := run(t, tab, chromedp.Text(`#timeline pre`))
	assert.Equal(t, bgtask.Timeline(mustTask(t, m, roots[42].ID)), timeline)
	children := run(t, tab, chromedp.Evaluate[int](`document.querySelectorAll("#children ul.tree > li.task").length`))
	assert.Equal(t, 9, children)
	shot(t, tab, "detail.png")
	shot(t, tab, "screen-detail.png")

	// An action with its confirmation: close the branch of a root.
	run(t, tab, chromedp.Click(`ul.tree.detail `+row(roots[42].ID)+` button.close`))
	run(t, tab, chromedp.WaitVisible(`#confirm .yes`))
	asked := run(t, tab, chromedp.Text(`#confirm .ask`))
	assert.Contains(t, asked, "Close the branch of task "+roots[42].ID)
	shot(t, tab, "confirm.png")
	run(t, tab, chromedp.Click(`#confirm .yes`))
	run(t, tab, chromedp.WaitVisible(`ul.tree.detail `+row(roots[42].ID)+`[data-status="cancelled"]`))
	stopped := 0
	for _, task := range m.Snapshot().Tasks {
		if strings.HasPrefix(task.Description, "kid 42.") || strings.HasPrefix(task.Description, "grandkid 42.") {
			assert.True(t, task.Status.Terminal(), "%s (%s) stopped by the closure", task.ID, task.Description)
			stopped++
		}
	}
	assert.Equal(t, 90+9, stopped)
}

func mustTask(t testing.TB, m *bgtask.Manager, id string) bgtask.Task {
	t.Helper()
	task, err := m.Task(id)
	require.NoError(t, err)
	return task
}
