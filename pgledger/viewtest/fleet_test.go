package viewtest

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtaskhttp/viewtest/browser"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/bgtask/bgtask/pgledger/fleetview"
	"github.com/bgtask/bgtask/pgledger/internal/fleettest"
	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
)

var url string

func TestMain(m *testing.M) { pgtest.Main(m, "fleetviewtest", &url) }

// process is one process of a test's fleet.
type process = fleettest.Process

// fleet joins n processes (members w0, w1, …) of a fresh ledger, which
// keeps every ended task.
func fleet(tb testing.TB, n int) []process {
	return fleettest.Join(tb, url, n, pgledger.NodeOptions{Poll: 100 * time.Millisecond, Retention: bgtask.Retention{MaxEnded: -1}})
}

// launch launches a task at p from parent; with running, it returns it
// once it runs.
func launch(tb testing.TB, ctx context.Context, p process, parent, desc string, running bool) bgtask.Task {
	tb.Helper()
	task, err := p.Node.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Description: desc, Prompt: "Research " + desc + " and report back.",
		Models: []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {ID: "backup"}}})
	require.NoError(tb, err)
	if !running {
		return task
	}
	got, err := bgtasktest.WaitStatus(ctx, p.Node.Manager(), task.ID, bgtask.StatusRunning)
	require.NoError(tb, err)
	return got
}

// serveView serves a fleet view of p's node, closed when the test ends,
// counting the renders of the tree page.
func serveView(tb testing.TB, ctx context.Context, p process, o bgtaskhttp.Options) (*httptest.Server, *atomic.Int64) {
	tb.Helper()
	v, err := fleetview.Open(ctx, p.Node)
	require.NoError(tb, err)
	h, pages := browser.Counted(bgtaskhttp.Handler(v, o))
	srv := httptest.NewServer(h)
	tb.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
		v.Close()
	})
	return srv, pages
}

// One page shows the whole fleet: every process's tasks, in trees that
// span processes, and the processes; a task another process owns is
// cancelled from it, by its owner, and its history is read from the
// ledger.
func TestTheFleetViewInABrowser(t *testing.T) {
	path := browser.Chromium(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ps := fleet(t, 3)
	var roots, kids []bgtask.Task
	for r := range 6 {
		root := launch(t, ctx, ps[r%3], fmt.Sprint("chat-", r), fmt.Sprintf("root %d at w%d", r, r%3), true)
		roots = append(roots, root)
		for k := range 2 {
			p := ps[(r+1+k)%3]
			kid := launch(t, ctx, p, root.SessionID, fmt.Sprintf("kid %d.%d at w%d", r, k, (r+1+k)%3), true)
			kids = append(kids, kid)
		}
	}
	require.NoError(t, ps[1].Host.Idle(kids[0].SessionID, "found it"))
	srv, _ := serveView(t, ctx, ps[0], bgtaskhttp.Options{Authorize: func(*http.Request) (string, error) { return "ops@example", nil }})
	tab := browser.OpenTab(t, ctx, path)
	browser.Run(t, tab, chromedp.Navigate(srv.URL+"/"))
	browser.Run(t, tab, chromedp.WaitVisible(`#conn.live`))
	for _, task := range append(append([]bgtask.Task{}, roots...), kids...) {
		browser.Run(t, tab, chromedp.WaitVisible(`li.task[data-id="`+task.ID+`"]`))
	}
	members := browser.Run(t, tab, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#processes tr.process.live")].map(r => r.dataset.member)`))
	assert.Equal(t, []string{"w0", "w1", "w2"}, members)
	browser.Run(t, tab, chromedp.WaitVisible(`li.task[data-id="`+kids[0].ID+`"][data-status="completed"]`))
	browser.Shot(t, tab, "fleet.png")
	browser.Shot(t, tab, "screen-fleet.png")

	// Cancel a task w2 owns, from w0's page, after the confirmation.
	victim := roots[2] // at w2
	browser.Run(t, tab, chromedp.Click(`li.task[data-id="`+victim.ID+`"] > .head button.cancel`))
	browser.Run(t, tab, chromedp.WaitVisible(`#confirm .yes`))
	browser.Run(t, tab, chromedp.Click(`#confirm .yes`))
	browser.Run(t, tab, chromedp.WaitVisible(`li.task[data-id="`+victim.ID+`"][data-status="cancelled"]`))
	got, err := ps[2].Node.Manager().Task(victim.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, got.Status, "cancelled by its owner")
	require.NotNil(t, got.Stop)
	assert.Equal(t, "ops@example", got.Stop.Actor)

	// Its history, from the ledger.
	browser.Run(t, tab, chromedp.Navigate(srv.URL+"/view/task?id="+victim.ID))
	browser.Run(t, tab, chromedp.WaitVisible(`#records tr.record`))
	kinds := browser.Run(t, tab, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#records tr.record")].map(r => r.dataset.kind)`))
	assert.Contains(t, kinds, "task_launched")
	browser.Shot(t, tab, "fleet-history.png")
}
