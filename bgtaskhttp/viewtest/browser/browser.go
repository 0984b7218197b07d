// Package browser drives headless Chromium for the tests of the live
// view (this module's, and the fleet view's in pgledger/viewtest): it
// finds the browser, opens a tab that stays off the network, runs
// actions, saves screenshots as CI artifacts, and reads the first paint.
package browser

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

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
