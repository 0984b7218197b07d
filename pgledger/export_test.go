package pgledger

import (
	"context"
	"github.com/bgtask/bgtask"
	"time"
)

// abandon stops the journal as a crash would: its writer and heartbeat
// end, its lease is left to expire, and nothing more it is given lands.
func (j *Journal) abandon() {
	j.mu.Lock()
	if j.failed == nil {
		j.failed = ErrClosed
	}
	j.closed = true
	j.mu.Unlock()
	close(j.stop)
	j.done.Wait()
}

// kill stops the node as a crash would: its loop ends, its journals
// write nothing more and keep their leases until they expire, and its
// Managers' goroutines are joined (what they do no longer lands).
func (n *Node) kill() {
	n.mu.Lock()
	n.closed = true
	n.mu.Unlock()
	n.cancel()
	n.done.Wait()
	for _, mb := range n.owned() {
		mb.j.abandon()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = mb.m.Shutdown(ctx)
		cancel()
	}
}

// DBURL is where TestMain (package pgledger_test) puts the test
// database's URL.
var DBURL = &dbURL

// NewAnswering is a host whose sessions answer at once (bench_test.go),
// for the package's external tests; Bind gives it its Manager.
func NewAnswering() *answering { return &answering{} }

func (h *answering) Bind(m *bgtask.Manager) { h.m.Store(m) }

// Lifecycles32 is lifecycles32 (bench_test.go), for the external tests.
var Lifecycles32 = lifecycles32
