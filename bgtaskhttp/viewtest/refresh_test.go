package viewtest

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strconv"
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
	"github.com/bgtask/bgtask/internal/testkit"
)

// counted serves m, counting the renders of the tree page.
func counted(t testing.TB, m *bgtask.Manager) (*httptest.Server, *atomic.Int64) {
	h, pages := browser.Counted(bgtaskhttp.Handler(m, bgtaskhttp.Options{Keepalive: time.Second}))
	srv := httptest.NewServer(h)
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
	})
	return srv, pages
}

// A change the tree page does not show costs the server nothing: the
// page moves its counts on by itself and asks for no render. A change
// it shows — a task of a shown tree, a new root — is rendered, once.
func TestThePageRendersOnlyWhatItShows(t *testing.T) {
	browser := chromium(t)
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	t.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	launch := func(parent, desc string) bgtask.Task {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Description: desc, Prompt: "do " + desc, Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
		require.NoError(t, err)
		return got
	}
	type tree struct{ root, kid, grandkid bgtask.Task }
	var trees []tree // the oldest first: page 1 shows the newest 30 roots
	for r := range 40 {
		root := launch(fmt.Sprint("chat-", r), fmt.Sprint("root ", r))
		kid := launch(root.SessionID, fmt.Sprint("kid ", r))
		trees = append(trees, tree{root, kid, launch(kid.SessionID, fmt.Sprint("grandkid ", r))})
	}
	srv, pages := counted(t, m)
	tab := openTab(t, ctx, browser)
	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	run(t, tab, chromedp.WaitVisible(`#conn.live`))
	require.Equal(t, int64(1), pages.Load())
	asked := func() int {
		return run(t, tab, chromedp.Evaluate[int](`Number(document.documentElement.dataset.asked || 0)`))
	}
	count := func(status string) int {
		s := run(t, tab, chromedp.Text(`#counts a.count.`+status+` b`))
		n, err := strconv.Atoi(s)
		require.NoError(t, err)
		return n
	}
	require.Equal(t, 120, count("running"))
	require.Equal(t, 0, asked())
	shown := func(id string) bool {
		return run(t, tab, chromedp.Evaluate[bool](`!!document.querySelector('li.task[data-id="`+id+`"]')`))
	}
	require.False(t, shown(trees[0].root.ID), "the oldest roots are on page 2")
	require.True(t, shown(trees[39].root.ID))

	// Not shown: the trees of roots on page 2. Their changes move the
	// counts, and ask for nothing.
	for _, tr := range trees[:5] {
		require.NoError(t, host.Idle(tr.grandkid.SessionID, "done"))
		_, err := bgtasktest.WaitStatus(ctx, m, tr.grandkid.ID, bgtask.StatusCompleted)
		require.NoError(t, err)
	}
	run(t, tab, chromedp.Poll[bool](`document.querySelector("#counts a.count.completed b").textContent === "5"`))
	assert.Equal(t, 115, count("running"), "the counts moved on in the page")
	assert.Equal(t, 0, asked(), "no render asked for what the page does not show")

	// Shown: a grandchild of a root on page 1 (collapsed under its kid):
	// one render, which shows it.
	tr := trees[39]
	require.NoError(t, host.Idle(tr.grandkid.SessionID, "done"))
	run(t, tab, chromedp.Poll[bool](`document.querySelector("#counts a.count.completed b").textContent === "6"`))
	assert.GreaterOrEqual(t, asked(), 1)
	run(t, tab, chromedp.Poll[bool](fmt.Sprintf(`Number(document.querySelector("#main").dataset.seq) >= %d`, m.Snapshot().Seq)))
	assert.Equal(t, int64(2), pages.Load(), "one render")
	assert.Equal(t, 6, count("completed"), "the render's counts agree with the page's own")

	// A new root is shown: one more render.
	fresh := launch("chat-new", "a new root")
	run(t, tab, chromedp.WaitVisible(`li.task[data-id="`+fresh.ID+`"][data-status="running"]`))
	assert.GreaterOrEqual(t, pages.Load(), int64(3))
	assert.Equal(t, 120-6+1, count("running"), "a new task counted")

	// One task's children, named by the task's id: a new child names the
	// task's session, and is shown.
	run(t, tab, chromedp.Navigate(srv.URL+"/?parent="+trees[39].root.ID))
	run(t, tab, chromedp.WaitVisible(`#conn.live`))
	run(t, tab, chromedp.WaitVisible(`li.task[data-id="`+trees[39].kid.ID+`"]`))
	kid := launch(trees[39].root.SessionID, "a new child")
	run(t, tab, chromedp.WaitVisible(`li.task[data-id="`+kid.ID+`"][data-status="running"]`))
}
