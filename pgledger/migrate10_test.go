package pgledger

import (
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Migration 10 moves what the old outbox held: each notification still to
// deliver, in order, an all_complete with the latest summary of each of
// its round's tasks; and the summaries of the tasks of rounds still open
// go to bgtask_finals, so that the round's all_complete, made after the
// upgrade, has them.
func TestMigration10MovesTheOutbox(t *testing.T) {
	pool := ownSchema(t, "bgtask_migrate10")

	// Version 9, by hand, as a fleet of the previous release left it.
	_, err := pool.Exec(ctx(t), `CREATE TABLE bgtask_schema (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	for v := range 9 {
		_, err = pool.Exec(ctx(t), migrations[v])
		require.NoError(t, err, "migration %d", v+1)
		_, err = pool.Exec(ctx(t), `INSERT INTO bgtask_schema (version) VALUES ($1)`, v+1)
		require.NoError(t, err)
	}
	for _, q := range []string{
		// P's round 1 told but not delivered: t1's summary written twice
		// (produced again after a crash), the later one is the round's.
		`INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, task_id, body, delivered_at)
VALUES ('L', 'w', 'final:t1', 'P', 'final_summary', 't1', '{"id":"final:t1","task":{"id":"t1","result":"old"}}', now())`,
		`INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, task_id, body)
VALUES ('L', 'w', 'final:t1b', 'P', 'final_summary', 't1', '{"id":"final:t1b","task":{"id":"t1","result":"new"}}')`,
		`INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, round_tasks)
VALUES ('L', '', 'all_complete:P:1', 'P', 'all_complete', '{t1}')`,
		// Q's round open: t2 ended (its summary delivered, kept), t3 live.
		`INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, task_id, body, delivered_at)
VALUES ('L', 'w', 'final:t2', 'Q', 'final_summary', 't2', '{"id":"final:t2","task":{"id":"t2"}}', now())`,
		`INSERT INTO bgtask_parents (ledger, parent_session, live, round, round_tasks) VALUES ('L', 'Q', 1, 1, '{t2,t3}')`,
		`INSERT INTO bgtask_claims (ledger, parent_session, member, until) VALUES ('L', 'P', 'w', now())`,
	} {
		_, err := pool.Exec(ctx(t), q)
		require.NoError(t, err, q)
	}
	require.NoError(t, Migrate(ctx(t), pool))

	rows, err := pool.Query(ctx(t), `SELECT note_id, kind, body, part FROM bgtask_notes WHERE ledger = 'L' ORDER BY id`)
	require.NoError(t, err)
	type note struct {
		ID, Kind, Body string
		Part           int
	}
	notes, err := pgx.CollectRows(rows, pgx.RowToStructByPos[note])
	require.NoError(t, err)
	require.Len(t, notes, 2, "the pending rows, and no delivered one")
	assert.Equal(t, "final:t1b", notes[0].ID)
	assert.Equal(t, "all_complete:P:1", notes[1].ID)
	assert.Equal(t, partOf("P"), notes[1].Part)
	var sums []struct {
		Task struct{ Result string } `json:"task"`
	}
	require.NoError(t, json.Unmarshal([]byte(notes[1].Body), &sums), notes[1].Body)
	require.Len(t, sums, 1, "one summary a task")
	assert.Equal(t, "new", sums[0].Task.Result, "the latest")

	var kept []string
	require.NoError(t, pool.QueryRow(ctx(t), `SELECT array_agg(task_id ORDER BY task_id) FROM bgtask_finals WHERE ledger = 'L' AND parent_session = 'Q'`).Scan(&kept))
	assert.Equal(t, []string{"t2"}, kept, "the open round's ended task keeps its summary")
	var gone bool
	require.NoError(t, pool.QueryRow(ctx(t), `SELECT to_regclass('bgtask_outbox') IS NULL AND to_regclass('bgtask_claims') IS NULL`).Scan(&gone))
	assert.True(t, gone, "the old tables are dropped")
}
