package viewtest

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

// The header says "connecting…" from the moment the page's script runs
// until the stream opens, then "live"; "static" once the service refused
// the stream three times in a row, and, in a page whose script does not
// run, from the start.
func TestTheHeaderSaysHowThePageFollows(t *testing.T) {
	browser := chromium(t)
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	h := bgtaskhttp.Handler(m, bgtaskhttp.Options{Keepalive: time.Second})
	held := make(chan struct{})
	var refuse atomic.Bool
	var refused atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/events" {
			if refuse.Load() {
				refused.Add(1)
				http.Error(w, "no streams today", http.StatusServiceUnavailable)
				return
			}
			select { // the stream is slow to come, as a big snapshot's is
			case <-held:
			case <-r.Context().Done():
				return
			}
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
		_ = m.Shutdown(context.Background())
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tab := openTab(t, ctx, browser)

	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	assert.Equal(t, "connecting…", run(t, tab, chromedp.Text(`#conn`)), "not static while the stream is on its way")
	close(held)
	run(t, tab, chromedp.WaitVisible(`#conn.live`))
	assert.Equal(t, "live", run(t, tab, chromedp.Text(`#conn`)))

	refuse.Store(true)
	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	run(t, tab, chromedp.WaitVisible(`#conn.static`))
	assert.Equal(t, "static", run(t, tab, chromedp.Text(`#conn`)))
	assert.Equal(t, int32(3), refused.Load(), "static after the third refusal in a row, and no try after it")

	_, err := chromedp.Call(tab, emulation.SetScriptExecutionDisabled, emulation.SetScriptExecutionDisabledParams{Value: true})
	require.NoError(t, err)
	refuse.Store(false)
	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	assert.Equal(t, "static", run(t, tab, chromedp.Text(`#conn`)), "no script: the page does not follow")
}

// The script says relative times as the server does (span in view.go),
// and moves them on from the server's clock: said again at once, they
// read the same.
func TestThePageSaysRelativeTimesAsTheServerDoes(t *testing.T) {
	browser := chromium(t)
	launched := time.Now().Add(-(2*time.Hour + 5*time.Minute + 30*time.Second))
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()), bgtask.WithClock(bgtasktest.NewClock(launched)))
	host.Attach(m)
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
		_ = m.Shutdown(context.Background())
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
	require.NoError(t, err)
	_, err = bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	tab := openTab(t, ctx, browser)
	run(t, tab, chromedp.Navigate(srv.URL+"/"))
	sel := row(task.ID) + ` .times time.rel`
	served := run(t, tab, chromedp.Text(sel))
	assert.Equal(t, "2 h 5 min", served)
	run(t, tab, chromedp.Evaluate[any](`relTimes()`))
	assert.Equal(t, served, run(t, tab, chromedp.Text(sel)), "the script says it as the server did")

	said := run(t, tab, chromedp.Evaluate[[]string](`[0, 999, 45000, 3600000, 7500000, 93600000+59*60000, 259200000, -40000, -5400000].map(ago)`))
	assert.Equal(t, []string{"just now", "just now", "45 s ago", "1 h ago", "2 h 5 min ago", "1 d 2 h ago", "3 d ago", "in 40 s", "in 1 h 30 min"}, said,
		"the cases of view.go's TestATimeIsAbsoluteAndRelative")
}
