package pgledger

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/jackc/pgx/v5/pgxpool"
)

// taskRecordsSQL reads task $2's records from its member's, where they
// lie (bgtask_tasks.first_seq to last_seq; to the end while it is live),
// with the member's records of no task among them. There is no index by
// task (it would cost every record a write): an ended task's read is
// bounded by the records its member wrote while it lived, a live task's
// by those since its first.
const taskRecordsSQL = `SELECT r.seq, r.kind, r.task_id, r.attempt_id, r.token, r.data
  FROM bgtask_tasks t JOIN bgtask_records r ON r.ledger = t.ledger AND r.member = t.member
   AND r.seq >= coalesce(t.first_seq, 0) AND (NOT t.ended OR r.seq <= t.last_seq OR t.last_seq IS NULL)
 WHERE t.ledger = $1 AND t.task_id = $2 AND (r.task_id = $2 OR r.task_id = '')
 ORDER BY r.seq`

// TaskRecords returns task id's records, whichever member of the ledger
// wrote them, in order, with the records of no task between its first
// and its last (the optional method of bgtask.Journal that
// Manager.History reads); none for a task the ledger holds no row of.
func (j *Journal) TaskRecords(ctx context.Context, id string) ([]bgtask.Record, error) {
	if err := j.failedErr(); err != nil {
		return nil, err
	}
	return taskRecords(ctx, j.pool, j.ledger, id)
}

// taskRecords is TaskRecords of ledger's task id, read from pool.
func taskRecords(ctx context.Context, pool *pgxpool.Pool, ledger, id string) ([]bgtask.Record, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	rows, err := pool.Query(ctx, taskRecordsSQL, ledger, id)
	if err != nil {
		return nil, dbErr("reading a task's records", err)
	}
	defer rows.Close()
	var out []bgtask.Record
	last := -1 // in out: the task's own last record
	for rows.Next() {
		var r bgtask.Record
		var seq int64
		if err := rows.Scan(&seq, &r.Kind, &r.TaskID, &r.AttemptID, &r.Token, &r.Data); err != nil {
			return nil, fmt.Errorf("pgledger: reading a task's records: %w", err)
		}
		r.Seq = uint64(seq)
		out = append(out, r)
		if r.TaskID == id {
			last = len(out) - 1
		}
	}
	if err := rows.Err(); err != nil {
		return nil, dbErr("reading a task's records", err)
	}
	return out[:last+1], nil
}

// History is task id's history (bgtask.Manager.History), whichever
// process of the fleet owns it: a Manager of this node that holds it
// tells it (with its lines of progress); any other task's is read from
// the ledger's records (without them: they live in the memory of the
// process that runs it). A task no Manager here holds and the ledger has
// no records of is bgtask.ErrUnknownTask.
func (n *Node) History(ctx context.Context, id string) ([]bgtask.RecordView, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if strings.TrimSpace(id) == "" {
		return nil, fmt.Errorf("%w: History of a blank task id", bgtask.ErrInvalidArgument)
	}
	if _, err := n.Task(id); err == nil {
		for _, m := range n.Managers() {
			views, err := m.History(ctx, id)
			if !errors.Is(err, bgtask.ErrUnknownTask) && !errors.Is(err, bgtask.ErrForgotten) {
				return views, err
			}
		}
	}
	recs, err := taskRecords(ctx, n.pool, n.o.Ledger, id)
	if err != nil {
		return nil, err
	}
	v, err := fleet.History(recs, id)
	if err != nil {
		return nil, err
	}
	views := v.([]bgtask.RecordView)
	if views == nil {
		return nil, fmt.Errorf("%w: %q", bgtask.ErrUnknownTask, id)
	}
	return views, nil
}
