package pgledger

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
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
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT reltuples FROM pg_class WHERE oid = 'bgtask_claims'::regclass`).Scan(&n))
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
		_, err = conn.Exec(ctx(t), `INSERT INTO bgtask_claims (ledger, parent_session, member, until)
SELECT $1, 'p-' || g, 'w0', now() FROM generate_series($2::bigint, $3::bigint) g`, f.ledger, first, filled-1)
		require.NoError(t, err)
		_, err = conn.Exec(ctx(t), `SELECT pg_stat_force_next_flush()`)
		require.NoError(t, err)
	}
	before := reltuples()
	fill(analyzeFloor / 2)
	tables, err := analyzeStale(ctx(t), f.pool, analyzeFloor)
	require.NoError(t, err)
	assert.NotContains(t, tables, "bgtask_claims", "fewer changes than the floor")

	fill(analyzeFloor + int(max(before, 0)))
	tables, err = analyzeStale(ctx(t), f.pool, analyzeFloor)
	require.NoError(t, err)
	assert.Contains(t, tables, "bgtask_claims")
	assert.GreaterOrEqual(t, reltuples(), before+float64(analyzeFloor*3/2), "its statistics count the rows it holds now")

	tables, err = analyzeStale(ctx(t), f.pool, analyzeFloor)
	require.NoError(t, err)
	assert.NotContains(t, tables, "bgtask_claims", "not again: nothing changed since")
}

// The write of a round's last final summary marks its all_complete ready
// (the summary it writes counted, though the statement cannot see its own
// row), and a deliverer claims a ready all_complete without counting its
// round's summaries. A row a deliverer holds is left unmarked, and the
// write does not wait for it.
func TestAnAllCompleteIsReadyWithItsLastSummary(t *testing.T) {
	f := newFixture(t)
	ns := f.nodes(newService(), 1, 0) // no Notifier: the test writes and claims by hand
	for _, q := range []string{
		`INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, round_tasks)
VALUES ($1, '', 'all_complete:P:1', 'P', 'all_complete', '{t1,t2}'), ($1, '', 'all_complete:Q:1', 'Q', 'all_complete', '{t3}')`,
	} {
		_, err := f.pool.Exec(ctx(t), q, f.ledger)
		require.NoError(t, err)
	}
	summary := func(parent, task string) *noteWrite {
		n := bgtask.Notification{Kind: bgtask.NotifyFinalSummary, ID: "final:" + task, ParentSessionID: parent, TaskID: task}
		return &noteWrite{member: "w0", note: n, body: []byte(fmt.Sprintf(`{"kind":"final_summary","taskID":%q}`, task))}
	}
	ready := func(parent string) (r bool) {
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT ready FROM bgtask_outbox WHERE ledger = $1 AND parent_session = $2 AND kind = 'all_complete'`,
			f.ledger, parent).Scan(&r))
		return r
	}
	require.NoError(t, ns[0].writeNotes(ctx(t), []*noteWrite{summary("P", "t1")}))
	assert.False(t, ready("P"), "t2's summary is not written yet")

	// Q's all_complete is held (as a deliverer's claim holds its rows).
	tx, err := f.pool.Begin(ctx(t))
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(ctx(t), `SELECT 1 FROM bgtask_outbox WHERE ledger = $1 AND parent_session = 'Q' FOR UPDATE`, f.ledger)
	require.NoError(t, err)
	c, cancel := context.WithTimeout(ctx(t), 10*time.Second) // failure detection only
	defer cancel()
	require.NoError(t, ns[0].writeNotes(c, []*noteWrite{summary("P", "t2"), summary("Q", "t3")}), "not held up by Q's held row")
	require.NoError(t, tx.Rollback(ctx(t)))
	assert.True(t, ready("P"), "both of P's summaries are written")
	assert.False(t, ready("Q"), "Q's row was held: the deliverer counts its round itself")

	// A ready all_complete is claimed on the flag alone: here its round's
	// summary is not in the outbox at all, and still it is claimed.
	_, err = f.pool.Exec(ctx(t), `INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, round_tasks, ready)
VALUES ($1, '', 'all_complete:R:1', 'R', 'all_complete', '{t9}', true)`, f.ledger)
	require.NoError(t, err)
	_, claimed, err := ns[0].exchange(ctx(t), f.pool, nil, true, nil, 5)
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"P", "Q", "R"}, parentsOf(claimed), "P ready, Q's summary counted, R on its flag")
}
