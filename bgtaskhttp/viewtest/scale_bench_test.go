package viewtest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/bigtree"
)

// BenchmarkTheViewAtScale loads the live view of 10,000 and of 100,000
// tasks (trees of 100: bigtree) in headless Chromium, once per
// iteration, and reports:
//
//   - ms/paint, min-ms/paint: the browser's first contentful paint (the
//     mean, and the fastest load: the page's own cost, since what else
//     the machine runs only adds time). Target: under a second.
//
//   - html-bytes: the page's HTML. Target: at most 300 KB.
//
//   - renders/change: the page renders the server made while 1,000
//     changes of tasks the page does not show went by (each a line of
//     progress of a task of a tree on another page). Target: none.
//
//   - µs/change/page: the server's CPU for each such change with the
//     page open, less what it costs with no page open (the stream's
//     share). Target: at most 2 ms.
//
//     cd bgtaskhttp/viewtest && go test -run '^$' -bench TheViewAtScale -benchtime 5x -timeout 30m .
func BenchmarkTheViewAtScale(b *testing.B) {
	browser := chromium(b)
	for _, roots := range []int{100, 1000} {
		b.Run(fmt.Sprint(roots*100, "-tasks"), func(b *testing.B) {
			m, host := bigtree.Build(b, roots)
			srv, pages := counted(b, m)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
			defer cancel()
			tab := openTab(b, ctx, browser)
			run(b, tab, chromedp.Navigate(srv.URL+"/")) // the renderer starts: not counted
			var paints []float64
			b.ResetTimer()
			for b.Loop() {
				run(b, tab, chromedp.Navigate(srv.URL+"/"))
				paints = append(paints, run(b, tab, firstPaint()))
			}
			b.StopTimer()
			var sum float64
			for _, p := range paints {
				sum += p
			}
			b.ReportMetric(sum/float64(len(paints)), "ms/paint")
			b.ReportMetric(slices.Min(paints), "min-ms/paint")
			resp, err := http.Get(srv.URL + "/")
			require.NoError(b, err)
			html, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			b.ReportMetric(float64(len(html)), "html-bytes")

			// The changes: progress of the running grandchildren of the
			// oldest roots (the page shows the newest), then one ends: once
			// the page counted it, it had every change before.
			var sessions []string
			var last bgtask.Task
			snap := m.Snapshot()
			slices.SortFunc(snap.Tasks, func(a, b bgtask.Task) int { return a.LaunchedAt.Compare(b.LaunchedAt) })
			for _, t := range snap.Tasks[:len(snap.Tasks)/2] {
				if t.Depth == 3 && t.Status == bgtask.StatusRunning {
					sessions = append(sessions, t.SessionID)
					last = t
				}
			}
			const changes = 1000
			burst := func(from int) {
				for i := range changes {
					require.NoError(b, host.Emit(bgtask.Event{SessionID: sessions[(from+i)%(len(sessions)-1)], Kind: bgtask.SessionBusy, Progress: fmt.Sprint("step ", from+i)}))
				}
			}
			run(b, tab, chromedp.Navigate("about:blank")) // no page open
			before := cpu()
			burst(0)
			alone := cpu() - before
			run(b, tab, chromedp.Navigate(srv.URL+"/"))
			run(b, tab, chromedp.WaitVisible(`#conn.live`))
			rendered := pages.Load()
			completed := run(b, tab, chromedp.Text(`#counts a.count.completed b`))
			before = cpu()
			burst(changes)
			require.NoError(b, host.Idle(last.SessionID, "done"))
			_, err = bgtasktest.WaitStatus(ctx, m, last.ID, bgtask.StatusCompleted)
			require.NoError(b, err)
			run(b, tab, chromedp.Poll[bool](`document.querySelector("#counts a.count.completed b").textContent !== "`+completed+`"`))
			open := cpu() - before // until the page had every change
			b.ReportMetric(float64(pages.Load()-rendered)/changes, "renders/change")
			b.ReportMetric(float64(max(open-alone, 0).Microseconds())/changes, "µs/change/page")
		})
	}
}

// cpu is the CPU time this process used so far (user and system).
func cpu() time.Duration {
	var u syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &u)
	return time.Duration(u.Utime.Nano() + u.Stime.Nano())
}
