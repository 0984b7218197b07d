package viewtest

import (
	"context"
	"flag"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtaskhttp/viewtest/browser"
	"github.com/bgtask/bgtask/bgtasktest"
)

var fleetRoots = flag.Int("fleet.roots", 1000, "BenchmarkTheFleetViewAt100000Tasks's trees (of 100 tasks each)")

// BenchmarkTheFleetViewAt100000Tasks serves a fleet of three processes
// on one PostgreSQL ledger, 100,000 tasks in trees of 100 that span the
// processes (a root at one, its 9 children at the next, their 10 children
// each at the third), through one fleet view, and reports what
// bgtaskhttp/viewtest's BenchmarkTheViewAtScale does of one Manager:
// ms/paint and min-ms/paint (first contentful paint, target under a
// second), html-bytes (target at most 300 KB), renders/change and
// µs/change/page (the changes of tasks the page does not show: targets
// none, and at most 2 ms), and open-ms: how long the view took to read
// the ledger when it opened.
//
//	cd pgledger/viewtest && go test -run '^$' -bench FleetViewAt -benchtime 5x -timeout 60m .
func BenchmarkTheFleetViewAt100000Tasks(b *testing.B) {
	path := browser.Chromium(b)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Minute)
	defer cancel()
	ps := fleet(b, 3)
	roots := *fleetRoots
	var mu sync.Mutex
	var grandkids []struct {
		p  process
		id string
	}
	var wg sync.WaitGroup
	work := make(chan int)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range work {
				root := launch(b, ctx, ps[r%3], fmt.Sprint("chat-", r%10), fmt.Sprint("root ", r), true)
				for k := range 9 {
					kid := launch(b, ctx, ps[(r+1)%3], root.SessionID, fmt.Sprintf("kid %d.%d", r, k), true)
					for g := range 10 {
						gk := launch(b, ctx, ps[(r+2)%3], kid.SessionID, fmt.Sprintf("grandkid %d.%d.%d", r, k, g), false)
						if r < roots/2 { // the older half: on pages the first does not show
							mu.Lock()
							grandkids = append(grandkids, struct {
								p  process
								id string
							}{ps[(r+2)%3], gk.ID})
							mu.Unlock()
						}
					}
				}
			}
		}()
	}
	for r := range roots {
		work <- r
	}
	close(work)
	wg.Wait()
	opened := time.Now()
	srv, pages := serveView(b, ctx, ps[0], bgtaskhttp.Options{})
	openMS := float64(time.Since(opened).Milliseconds())
	tab := browser.OpenTab(b, ctx, path)
	browser.ReportPaints(b, tab, srv.URL+"/") // resets the timer, and the metrics reported before
	b.ReportMetric(openMS, "open-ms")

	// Progress of grandchildren the first page does not show, each at its
	// owner; then one of them ends.
	type run struct {
		p       process
		session string
	}
	var runs []run
	for _, g := range grandkids[:200] {
		t, err := bgtasktest.WaitStatus(ctx, g.p.Node.Manager(), g.id, bgtask.StatusRunning)
		require.NoError(b, err)
		runs = append(runs, run{g.p, t.SessionID})
	}
	browser.ReportUnshown(b, tab, srv.URL+"/", pages, 1000, func(i int) {
		r := runs[i%(len(runs)-1)]
		require.NoError(b, r.p.Host.Emit(bgtask.Event{SessionID: r.session, Kind: bgtask.SessionBusy, Progress: fmt.Sprint("step ", i)}))
	}, func() {
		last := runs[len(runs)-1]
		require.NoError(b, last.p.Host.Idle(last.session, "done"))
	})
}
