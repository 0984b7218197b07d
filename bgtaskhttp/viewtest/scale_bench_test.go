package viewtest

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp/viewtest/browser"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/bigtree"
)

// BenchmarkTheViewAtScale loads the live view of 10,000 and of 100,000
// tasks (trees of 100: bigtree) in headless Chromium, once per
// iteration, and reports (browser.ReportPaints, browser.ReportUnshown):
//   - ms/paint, min-ms/paint: the first contentful paint, the mean and the
//     fastest load. Target: under a second.
//   - html-bytes: the page's HTML. Target: at most 300 KB.
//   - renders/change: the renders the server made while 1,000 changes of
//     tasks the page does not show went by (each a line of progress of a
//     task of a tree on another page). Target: none.
//   - µs/change/page: the server's CPU for each such change with the page
//     open, beyond what it costs with none. Target: at most 2 ms.
//
// Run it with
//
//	cd bgtaskhttp/viewtest && go test -run '^$' -bench TheViewAtScale -benchtime 5x -timeout 30m .
func BenchmarkTheViewAtScale(b *testing.B) {
	path := chromium(b)
	for _, roots := range []int{100, 1000} {
		b.Run(fmt.Sprint(roots*100, "-tasks"), func(b *testing.B) {
			m, host := bigtree.Build(b, roots)
			srv, pages := counted(b, m)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
			defer cancel()
			tab := openTab(b, ctx, path)
			browser.ReportPaints(b, tab, srv.URL+"/")

			// The changes: progress of the running grandchildren of the
			// oldest roots (the page shows the newest); then one ends.
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
			browser.ReportUnshown(b, tab, srv.URL+"/", pages, 1000, func(i int) {
				require.NoError(b, host.Emit(bgtask.Event{SessionID: sessions[i%(len(sessions)-1)], Kind: bgtask.SessionBusy, Progress: fmt.Sprint("step ", i)}))
			}, func() {
				require.NoError(b, host.Idle(last.SessionID, "done"))
				_, err := bgtasktest.WaitStatus(ctx, m, last.ID, bgtask.StatusCompleted)
				require.NoError(b, err)
			})
		})
	}
}
