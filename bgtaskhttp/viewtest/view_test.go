package viewtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
)

// chromium finds the browser to drive.
func chromium(t *testing.T) string {
	for _, p := range []string{os.Getenv("BGTASK_CHROMIUM"), "chromium", "chromium-browser"} {
		if p == "" {
			continue
		}
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	if os.Getenv("BGTASK_BROWSER_TEST") == "1" {
		t.Fatal("no Chromium found (BGTASK_CHROMIUM, chromium, chromium-browser), and BGTASK_BROWSER_TEST=1")
	}
	t.Skip("no Chromium: set BGTASK_CHROMIUM, or install chromium")
	return ""
}

// openTab starts a headless browser (flags that keep it off the network)
// and returns a tab of it, both closed when the test ends.
func openTab(t *testing.T, ctx context.Context, browser string) context.Context {
	alloc, stopAlloc := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(browser), chromedp.NoSandbox, chromedp.Headless, chromedp.DisableGPU,
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.Flag("disable-quic", true), chromedp.NoFirstRun,
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1200, 900))...)
	tab, closeTab := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		closeTab()
		stopAlloc()
	})
	return tab
}

// serve starts a Manager on a scripted host and serves it with o, all
// stopped when the test ends.
func serve(t *testing.T, o bgtaskhttp.Options) (*bgtask.Manager, *bgtasktest.Host, *httptest.Server) {
	host := bgtasktest.NewHost()
	m := bgtask.New(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	srv := httptest.NewServer(bgtaskhttp.Handler(m, o))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
		_ = m.Shutdown(context.Background())
	})
	return m, host, srv
}

// run runs one browser action and returns its result.
func run[T any](t *testing.T, tab context.Context, a chromedp.Action[T]) T {
	t.Helper()
	v, err := chromedp.Run(tab, a)
	require.NoError(t, err)
	return v
}

// pageTask is what the page shows of a task.
type pageTask struct {
	ID       string   `json:"id"`
	Parent   string   `json:"parent"`
	Status   string   `json:"status"`
	Attempts []string `json:"attempts"` // "number status model session", in row order
}

const readPage = `[...document.querySelectorAll(".task")].map(r => ({
	id: r.dataset.id,
	parent: r.closest("section.parent").dataset.parent,
	status: r.dataset.status,
	attempts: [...r.querySelectorAll("tr.attempt")].map(a =>
		[a.dataset.number, a.dataset.status, a.querySelector(".model").textContent, a.querySelector(".session").textContent].join(" ")),
}))`

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
	run(t, tab, chromedp.WaitVisible(`#task-`+before.ID))

	// Launch and fail tasks while the page is open: rows appear, in order.
	flaky := launch("chat-1", "flaky")
	require.NoError(t, host.Fail(flaky.SessionID, errors.New("403 Forbidden: provider is forbidden")))
	second, err := bgtasktest.WaitFor(ctx, m, flaky.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	require.NoError(t, host.Fail(second.SessionID, errors.New("429 Too Many Requests")))
	third, err := bgtasktest.WaitFor(ctx, m, flaky.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 3 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	require.NoError(t, host.Idle(third.SessionID, "answered on the backup"))
	run(t, tab, chromedp.WaitVisible(`#task-`+flaky.ID+` tr.attempt[data-number="3"][data-status="completed"]`))
	other := launch("chat-2", "another chat")

	// Cancel from the page while the host's abort hangs: the row stays
	// running until the host confirms.
	host.HangAborts(1)
	calls := len(host.Starts()) + len(host.Aborts())
	run(t, tab, chromedp.Click(`#task-`+other.ID+` button.cancel`))
	require.NoError(t, host.AwaitCalls(ctx, calls+1), "the page's cancel reached the host")
	shown := run(t, tab, chromedp.AttributeValue(`#task-`+other.ID, "data-status"))
	assert.Equal(t, "running", shown.Value, "not cancelled before the host confirmed")
	host.Release()
	run(t, tab, chromedp.WaitVisible(`#task-`+other.ID+`[data-status="cancelled"]`))

	// The page agrees with the snapshot.
	got := run(t, tab, chromedp.Evaluate[[]pageTask](readPage))
	snap := m.Snapshot()
	var want []pageTask
	for _, task := range snap.Tasks {
		p := pageTask{ID: task.ID, Parent: task.ParentSessionID, Status: string(task.Status)}
		for _, a := range task.Attempts {
			p.Attempts = append(p.Attempts, fmt.Sprintf("%d %s %s %s", a.Number, a.Status, a.Model, a.SessionID))
		}
		want = append(want, p)
	}
	assert.ElementsMatch(t, want, got)
	for _, p := range got {
		if p.ID == flaky.ID {
			require.Len(t, p.Attempts, 3)
			assert.Equal(t, "1 error openai/gpt-5 ses-2", p.Attempts[0], "in order")
			assert.Equal(t, "3 completed router-backup ses-4", p.Attempts[2])
		}
	}

	png := run(t, tab, chromedp.FullScreenshot(100))
	dir := os.Getenv("BGTASK_ARTIFACTS")
	if dir == "" {
		dir = t.TempDir()
	}
	path := filepath.Join(dir, "live-view.png")
	require.NoError(t, os.WriteFile(path, png, 0o644))
	t.Logf("screenshot: %s (%d bytes)", path, len(png))
	assert.Greater(t, len(png), 10_000, "a page, not a blank")
	b, _ := json.Marshal(got)
	t.Logf("page: %s", b)
}

// A thousand tasks: the page shows them all, grouped, and keeps up with
// their changes.
func TestTheLiveViewWithAThousandTasks(t *testing.T) {
	browser := chromium(t)
	m, host, srv := serve(t, bgtaskhttp.Options{Buffer: 1 << 16})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	tab := openTab(t, ctx, browser)

	var last bgtask.Task
	for i := range 1000 {
		var err error
		last, err = m.Launch(ctx, bgtask.Spec{ParentSessionID: fmt.Sprintf("chat-%d", i%20), Description: fmt.Sprint("task ", i), Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err)
	}
	_, err := bgtasktest.WaitStatus(ctx, m, last.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	start := time.Now()
	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	run(t, tab, chromedp.WaitVisible(`#task-`+last.ID))
	loaded := time.Since(start)
	for _, task := range m.Snapshot().Tasks[:500] { // half of them end while the page watches
		if task.SessionID != "" {
			require.NoError(t, host.Idle(task.SessionID, "ok"))
		}
	}
	ended := m.Snapshot().Tasks[499]
	// The changes come in order, and the page renders what arrived: once
	// the last one to end shows, every one before it does.
	run(t, tab, chromedp.WaitVisible(`#task-`+ended.ID+`[data-status="completed"]`))
	counts := run(t, tab, chromedp.Evaluate[map[string]int](`({rows: document.querySelectorAll(".task").length,
		groups: document.querySelectorAll("section.parent").length,
		completed: document.querySelectorAll('.task[data-status="completed"]').length})`))
	assert.Equal(t, 1000, counts["rows"])
	assert.Equal(t, 20, counts["groups"])
	assert.Equal(t, 500, counts["completed"], "every change reached the page")
	t.Logf("1000 tasks: first render %s", loaded)
}
