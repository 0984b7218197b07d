package bgtaskhttp_test

import (
	"os"
	"testing"

	"github.com/bgtask/bgtask/bgtaskhttp"
)

func TestScratchDump(t *testing.T) {
	m, _ := forest(t, 3)
	h := bgtaskhttp.Handler(m, bgtaskhttp.Options{})
	b := serveBody(t, h, "/", nil).body
	os.WriteFile("/tmp/page.html", b, 0o644)
	t.Logf("%d bytes", len(b))
}
