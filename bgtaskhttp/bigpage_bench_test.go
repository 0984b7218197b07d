package bgtaskhttp_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/internal/bigtree"
)

// BenchmarkThePage measures what the tree page costs the server at
// 10,000 and 100,000 tasks: a render (ns/op) and its size (bytes/page),
// and GET /snapshot's size, gzipped and plain.
//
//	go test -run '^$' -bench ThePage -benchtime 20x ./bgtaskhttp/
func BenchmarkThePage(b *testing.B) {
	for _, roots := range []int{100, 1000} {
		b.Run(fmt.Sprint(roots*100, "-tasks"), func(b *testing.B) {
			m, _ := bigtree.Build(b, roots)
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
