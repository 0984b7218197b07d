package bgtaskhttp_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/stretchr/testify/require"
)

// forest launches roots trees of 100 tasks each (a root, 9 children, 10
// grandchildren each) on a new Manager, the grandchildren of every third
// root ended.
func forest(tb testing.TB, roots int) (*bgtask.Manager, *bgtasktest.Host) {
	tb.Helper()
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()), bgtask.WithRetention(bgtask.Retention{MaxEnded: -1}))
	host.Attach(m)
	tb.Cleanup(func() { _ = m.Shutdown(context.Background()) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	models := []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {ID: "backup"}}
	launch := func(parent, desc string) bgtask.Task {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Description: desc, Prompt: "Research " + desc + " and report back in under 200 words.", Models: models})
		require.NoError(tb, err)
		return task
	}
	running := func(id string) bgtask.Task {
		got, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusRunning)
		require.NoError(tb, err)
		return got
	}
	var wg sync.WaitGroup
	work := make(chan int)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range work {
				root := running(launch(fmt.Sprint("chat-", r%10), fmt.Sprint("root ", r)).ID)
				for k := range 9 {
					kid := running(launch(root.SessionID, fmt.Sprintf("kid %d.%d", r, k)).ID)
					var gks []bgtask.Task
					for g := range 10 {
						gks = append(gks, launch(kid.SessionID, fmt.Sprintf("grandkid %d.%d.%d", r, k, g)))
					}
					for _, gk := range gks {
						gk = running(gk.ID)
						if r%3 == 0 {
							require.NoError(tb, host.Idle(gk.SessionID, "found it"))
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
	return m, host
}

// BenchmarkThePage measures what the tree page costs the server at
// 10,000 and 100,000 tasks: a render (ns/op) and its size (bytes/page),
// and GET /snapshot's size, gzipped and plain.
//
//	go test -run '^$' -bench ThePage -benchtime 20x ./bgtaskhttp/
func BenchmarkThePage(b *testing.B) {
	for _, roots := range []int{100, 1000} {
		b.Run(fmt.Sprint(roots*100, "-tasks"), func(b *testing.B) {
			m, _ := forest(b, roots)
			h := bgtaskhttp.Handler(m, bgtaskhttp.Options{})
			var size int
			b.Run("render", func(b *testing.B) {
				for b.Loop() {
					size = len(serveBody(b, h, "/", nil).body)
				}
				b.ReportMetric(float64(size), "bytes/page")
			})
			b.Run("snapshot", func(b *testing.B) { // GET /snapshot, gzipped as browsers and the Client ask
				var plain int
				for b.Loop() {
					size = len(serveBody(b, h, "/snapshot", http.Header{"Accept-Encoding": {"gzip"}}).body)
				}
				plain = len(serveBody(b, h, "/snapshot", nil).body)
				b.ReportMetric(float64(size), "gzip-bytes")
				b.ReportMetric(float64(plain), "bytes")
			})
		})
	}
}

// served is one answer of a handler.
type served struct {
	code int
	head http.Header
	body []byte
}

// serveBody serves a GET of path from h, in process.
func serveBody(tb testing.TB, h http.Handler, path string, head http.Header) served {
	tb.Helper()
	w := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodGet, path, nil)
	r.Host = "127.0.0.1"
	for k, v := range head {
		r.Header[k] = v
	}
	h.ServeHTTP(w, r)
	if w.Code != http.StatusOK && w.Code != http.StatusNotModified {
		tb.Fatalf("GET %s: %d %s", path, w.Code, w.Body.String())
	}
	return served{w.Code, w.Header(), w.Body.Bytes()}
}
