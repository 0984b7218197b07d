// Package browser drives headless Chromium for the tests of the live
// view (this module's, and the fleet view's in pgledger/viewtest): it
// finds the browser, opens a tab that stays off the network, runs
// actions, saves screenshots as CI artifacts, and reads the first paint.
package browser

import (
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Chromium finds the browser to drive.
func Chromium(t testing.TB) string {
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

// OpenTab starts a headless browser (flags that keep it off the network)
// and returns a tab of it, both closed when the test ends.
func OpenTab(t testing.TB, ctx context.Context, browser string) context.Context {
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

// Run runs one browser action and returns its result.
func Run[T any](t testing.TB, tab context.Context, a chromedp.Action[T]) T {
	t.Helper()
	v, err := chromedp.Run(tab, a)
	require.NoError(t, err)
	return v
}

// Shot saves a screenshot of the tab as an artifact (BGTASK_ARTIFACTS, or
// the test's directory).
func Shot(t testing.TB, tab context.Context, name string) {
	t.Helper()
	var png []byte
	if strings.HasPrefix(name, "screen-") { // what the window shows, as a PNG
		png = Run(t, tab, chromedp.CaptureScreenshot())
	} else { // the whole page, as a JPEG
		png = Run(t, tab, chromedp.FullScreenshot(85))
		name = strings.TrimSuffix(name, ".png") + ".jpg"
	}
	dir := os.Getenv("BGTASK_ARTIFACTS")
	if dir == "" {
		dir = t.TempDir()
	}
	path := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(path, png, 0o644))
	t.Logf("screenshot: %s (%d bytes)", path, len(png))
	assert.Greater(t, len(png), 10_000, "a page, not a blank")
}

// FirstPaint is the page's first contentful paint (ms from its
// navigation), as the browser measured it: it waits for the browser to
// report it, which may come after the load that chromedp.Navigate waits
// for.
func FirstPaint() chromedp.Action[float64] {
	return chromedp.Evaluate[float64](`new Promise(resolve => {
		const fcp = list => list.find(e => e.name === "first-contentful-paint");
		const seen = fcp(performance.getEntriesByType("paint"));
		if (seen) return resolve(seen.startTime);
		new PerformanceObserver((list, o) => {
			const e = fcp(list.getEntries());
			if (e) { o.disconnect(); resolve(e.startTime); }
		}).observe({type: "paint", buffered: true});
	})`, chromedp.EvalAwaitPromise)
}

// Counted is h, counting the renders of the tree page ("GET /").
func Counted(h http.Handler) (http.Handler, *atomic.Int64) {
	var pages atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/" {
			pages.Add(1)
		}
		h.ServeHTTP(w, r)
	}), &pages
}

// ReportPaints loads the page at url once, then once per iteration of b,
// and reports the browser's first contentful paint (ms/paint: the mean;
// min-ms/paint: the fastest load, the page's own cost, since what else
// the machine runs only adds time) and the page's HTML (html-bytes).
func ReportPaints(b *testing.B, tab context.Context, url string) {
	b.Helper()
	Run(b, tab, chromedp.Navigate(url)) // the renderer starts: not counted
	var paints []float64
	b.ResetTimer()
	for b.Loop() {
		Run(b, tab, chromedp.Navigate(url))
		paints = append(paints, Run(b, tab, FirstPaint()))
	}
	b.StopTimer()
	var sum float64
	for _, p := range paints {
		sum += p
	}
	b.ReportMetric(sum/float64(len(paints)), "ms/paint")
	b.ReportMetric(slices.Min(paints), "min-ms/paint")
	resp, err := http.Get(url)
	require.NoError(b, err)
	html, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	b.ReportMetric(float64(len(html)), "html-bytes")
}

// ReportUnshown measures what n changes the page at url does not show
// cost the server: change(i) makes the i-th (0 ≤ i < 2n), and end ends a
// task the page does not show either, whose count the page then moves
// on: once it did, it had every change before. It reports the renders
// the changes asked for (renders/change: pages counts them, Counted) and
// the process's CPU for each change with the page open beyond what it
// costs with none (µs/change/page).
func ReportUnshown(b *testing.B, tab context.Context, url string, pages *atomic.Int64, n int, change func(i int), end func()) {
	b.Helper()
	Run(b, tab, chromedp.Navigate("about:blank")) // no page open
	before := cpu()
	for i := range n {
		change(i)
	}
	alone := cpu() - before
	Run(b, tab, chromedp.Navigate(url))
	Run(b, tab, chromedp.WaitVisible(`#conn.live`))
	rendered := pages.Load()
	completed := Run(b, tab, chromedp.Text(`#counts a.count.completed b`))
	before = cpu()
	for i := range n {
		change(n + i)
	}
	end()
	Run(b, tab, chromedp.Poll[bool](`document.querySelector("#counts a.count.completed b").textContent !== "`+completed+`"`, chromedp.WithPollingTimeout(2*time.Minute)))
	open := cpu() - before // until the page had every change
	b.ReportMetric(float64(pages.Load()-rendered)/float64(n), "renders/change")
	b.ReportMetric(float64(max(open-alone, 0).Microseconds())/float64(n), "µs/change/page")
}

// cpu is the CPU time this process used so far (user and system).
func cpu() time.Duration {
	var u syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &u)
	return time.Duration(u.Utime.Nano() + u.Stime.Nano())
}
