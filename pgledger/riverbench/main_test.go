package riverbench

import (
	"context"
	"testing"
	"time"

	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMain runs the binary's tests and benchmarks on one PostgreSQL
// server started for it (pgtest), and fails if a goroutine is left behind
// (goleak): River's client is stopped, and pgledger's nodes closed, by
// each run.
func TestMain(m *testing.M) {
	pgtest.Main(m, "riverbench", &dbURL)
}

// Every system of BenchmarkCompare, run for a few lifecycles, ends every
// one of them as it should — River's jobs completed, pgledger's tasks
// completed with both their notifications delivered, none twice — and its
// measurement counted something: the harness measures what it says.
func TestEverySystemEndsEveryLifecycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s, err := openServer(ctx)
	require.NoError(t, err)
	defer s.close()
	p := plan{count: 50, warm: 10, inflight: 16, conns: 8}
	fs, err := compare(ctx, s, p, systems(*flagWorkers))
	require.NoError(t, err)
	for _, f := range fs {
		assert.Equal(t, p.count, f.ended, "%s: lifecycles ended", f.name)
		assert.Zero(t, f.dups, "%s: notifications delivered twice", f.name)
		assert.Positive(t, f.stmts, "%s: statements", f.name)
		assert.Positive(t, f.wal, "%s: WAL", f.name)
		assert.Positive(t, f.took, "%s: time", f.name)
	}
	t.Logf("\n%s", table(fs))
}
