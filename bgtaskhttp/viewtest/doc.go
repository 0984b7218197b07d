// Package viewtest drives bgtaskhttp's live view in a real browser
// (headless Chromium, through chromedp). It is a module of its own so that
// the root module never requires chromedp. Its test needs a Chromium: it
// looks at BGTASK_CHROMIUM, then chromium and chromium-browser on PATH; it
// skips without one, unless BGTASK_BROWSER_TEST=1 (as .ci/run sets it),
// when it fails.
package viewtest
