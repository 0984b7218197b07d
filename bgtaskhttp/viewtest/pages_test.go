package viewtest

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
)

// The table, the charts and a task's history, in a browser: the table
// sorts by a column's link, a bulk cancel of what the filters select asks
// first with the count and stops exactly those, the charts draw, and the
// detail page shows the fallback's history. Each page is saved as an
// artifact to look at.
func TestTheTableChartsAndHistoryInABrowser(t *testing.T) {
	browser := chromium(t)
	m, host, srv := serve(t, bgtaskhttp.Options{Keepalive: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tab := openTab(t, ctx, browser)

	models := []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {Provider: "google", ID: "gemini"}}
	launch := func(parent, agent string) bgtask.Task {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Agent: agent, Description: agent + " work", Prompt: "p", Models: models})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		return got
	}
	var running []bgtask.Task
	for i := range 6 {
		task := launch(fmt.Sprintf("chat-%d", i), []string{"explore", "review"}[i%2])
		switch i % 3 {
		case 0:
			require.NoError(t, host.Emit(bgtask.Event{SessionID: task.SessionID, Kind: bgtask.SessionUsage,
				Usage: bgtask.Usage{InputTokens: int64(100 * (i + 1)), Requests: 1, Cost: bgtask.Cost(50_000 * (i + 1))}}))
			require.NoError(t, host.Idle(task.SessionID, "done"))
			_, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusCompleted)
			require.NoError(t, err)
		case 1:
			require.NoError(t, host.Fail(task.SessionID, errors.New("403 Forbidden")))
			second, err := bgtasktest.WaitFor(ctx, m, task.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning })
			require.NoError(t, err)
			require.NoError(t, host.Fail(second.SessionID, errors.New("429 Too Many Requests")))
			_, err = bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusError)
			require.NoError(t, err)
		default:
			running = append(running, task)
		}
	}

	run(t, tab, chromedp.Navigate(srv.URL+"/view/table"))
	run(t, tab, chromedp.WaitVisible(`table.tasks tbody tr`))
	ids := func() []string {
		return run(t, tab, chromedp.Evaluate[[]string](`[...document.querySelectorAll('table.tasks tbody tr')].map(r => r.dataset.id)`))
	}
	assert.Len(t, ids(), 6)
	shot(t, tab, "table.png")
	run(t, tab, chromedp.Click(`table.tasks th a[href*="sort=cost"]`))
	run(t, tab, chromedp.WaitVisible(`th[aria-sort] a[href*="sort=cost"]`))
	first := ids()[0]
	got, err := m.Task(first)
	require.NoError(t, err)
	require.NotNil(t, got.Usage, "the most expensive first")
	assert.Equal(t, bgtask.Cost(50_000*4), got.Usage.Total.Cost)

	// A bulk cancel of the live tasks of the "review" agent.
	run(t, tab, chromedp.Navigate(srv.URL+"/view/table?agent=review"))
	run(t, tab, chromedp.WaitVisible(`button[data-action="bulk-cancel"]`))
	run(t, tab, chromedp.Click(`button[data-action="bulk-cancel"]`))
	run(t, tab, chromedp.WaitVisible(`#confirm .yes`))
	asked := run(t, tab, chromedp.Text(`#confirm .ask`))
	var review []bgtask.Task
	for _, r := range running {
		if r.Agent == "review" {
			review = append(review, r)
		}
	}
	require.NotEmpty(t, review)
	assert.Contains(t, asked, fmt.Sprintf("Cancel %d live task", len(review)), "the confirmation states the count")
	run(t, tab, chromedp.Click(`#confirm .yes`))
	for _, r := range running {
		want := bgtask.StatusRunning
		if r.Agent == "review" {
			want = bgtask.StatusCancelled
		}
		if want == bgtask.StatusCancelled {
			_, err := bgtasktest.WaitStatus(ctx, m, r.ID, want)
			require.NoError(t, err)
		}
	}
	for _, r := range running {
		if r.Agent != "review" {
			t2, err := m.Task(r.ID)
			require.NoError(t, err)
			assert.Equal(t, bgtask.StatusRunning, t2.Status, "a task the filters did not select runs on")
		}
	}

	run(t, tab, chromedp.Navigate(srv.URL+"/view/charts"))
	run(t, tab, chromedp.WaitVisible(`svg.chart`))
	n := run(t, tab, chromedp.Evaluate[int](`document.querySelectorAll('svg.chart').length`))
	assert.Equal(t, 4, n)
	shot(t, tab, "charts.png")

	failed := ""
	for _, task := range m.Snapshot().Tasks {
		if task.Status == bgtask.StatusError {
			failed = task.ID
		}
	}
	require.NotEmpty(t, failed)
	run(t, tab, chromedp.Navigate(srv.URL+"/view/task?id="+failed))
	run(t, tab, chromedp.WaitVisible(`#records table.records`))
	kinds := run(t, tab, chromedp.Evaluate[[]string](`[...document.querySelectorAll('#records tr.record')].map(r => r.dataset.kind)`))
	assert.Contains(t, kinds, "attempt_created")
	assert.Contains(t, kinds, "attempt_finalized")
	shot(t, tab, "history.png")
}
