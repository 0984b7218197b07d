// Package fleettest joins the processes of a test's fleet: nodes of one
// fresh ledger, each on a bgtasktest host whose session ids start with
// its member's name, as if every process talked to one session service.
// pgledger/fleetview's tests and pgledger/viewtest's use it.
package fleettest

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

// Process is one process of a test's fleet: its node and its host.
type Process struct {
	Node *pgledger.Node
	Host *bgtasktest.Host
}

// named is a host whose session ids start with its process's name.
type named struct {
	*bgtasktest.Host
	prefix string
}

func (n named) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	id, err := n.Host.StartSession(ctx, req)
	if err != nil {
		return "", err
	}
	return n.prefix + id, nil
}

var ledgers atomic.Int64

// Join joins n processes (members w0, w1, …) of a fresh ledger of the
// database at url, with o (its Ledger, Member and Host are Join's; Poll
// 0 is 50 ms), all closed when the test ends.
func Join(tb testing.TB, url string, n int, o pgledger.NodeOptions) []Process {
	tb.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(tb, err)
	tb.Cleanup(pool.Close)
	require.NoError(tb, pgledger.Migrate(context.Background(), pool))
	o.Ledger = fmt.Sprintf("%s-%d", tb.Name(), ledgers.Add(1))
	if o.Poll == 0 {
		o.Poll = 50 * time.Millisecond
	}
	out := make([]Process, n)
	for i := range out {
		h := bgtasktest.NewHost()
		o.Member = fmt.Sprintf("w%d", i)
		o.Host = named{h, o.Member + "-"}
		node, err := pgledger.Join(context.Background(), pool, o)
		require.NoError(tb, err)
		h.Attach(node.Manager())
		tb.Cleanup(func() {
			c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = node.Close(c)
		})
		out[i] = Process{node, h}
	}
	return out
}
