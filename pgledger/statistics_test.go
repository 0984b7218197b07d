package pgledger

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A table that filled since its statistics were taken (a queue table
// analyzed empty, then a burst) is analyzed, its plans planned again with
// what it holds; one that did not change by more than it held is left
// alone, and so is one changed by fewer rows than the floor.
func TestStaleStatisticsAreTakenAgain(t *testing.T) {
	f := newFixture(t)
	require.NoError(t, Migrate(ctx(t), f.pool))
	_, err := analyzeStale(ctx(t), f.pool, 0) // everything current to begin with
	require.NoError(t, err)
	reltuples := func() (n float64) {
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT reltuples FROM pg_class WHERE oid = 'bgtask_launching'::regclass`).Scan(&n))
		return n
	}
	// Inserted on one connection, whose counts are then sent to the
	// server's statistics at once (they are sent lazily otherwise). The
	// parent sessions are numbered from 0 in the test's own ledger.
	var filled int64
	fill := func(rows int) {
		conn, err := f.pool.Acquire(ctx(t))
		require.NoError(t, err)
		defer conn.Release()
		first := filled
		filled += int64(rows)
		_, err = conn.Exec(ctx(t), `INSERT INTO bgtask_launching (ledger, task_id, parent_session, member)
SELECT $1, 't-' || g, 'p', 'w0' FROM generate_series($2::bigint, $3::bigint) g`, f.ledger, first, filled-1)
		require.NoError(t, err)
		_, err = conn.Exec(ctx(t), `SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
	}
	before := reltuples()
	fill(analyzeFloor / 2)
	tables, err := analyzeStale(ctx(t), f.pool, analyzeFloor)
	require.NoError(t, err)
	assert.NotContains(t, tables, "bgtask_launching", "fewer changes than the floor")

	fill(analyzeFloor + int(max(before, 0)))
	tables, err = analyzeStale(ctx(t), f.pool, analyzeFloor)
	require.NoError(t, err)
	assert.Contains(t, tables, "bgtask_launching")
	assert.GreaterOrEqual(t, reltuples(), before+float64(analyzeFloor*3/2), "its statistics count the rows it holds now")

	tables, err = analyzeStale(ctx(t), f.pool, analyzeFloor)
	require.NoError(t, err)
	assert.NotContains(t, tables, "bgtask_launching", "not again: nothing changed since")
}
