package pgledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Retention: what the ledger keeps of what has ended.
//
// Each Manager bounds what its own member keeps (bgtask.WithRetention:
// its compaction drops the records and identity rows of the tasks it
// forgets). The rest is the fleet's, and the nodes prune it
// (NodeOptions.Retention), one node at a time per ledger, about once a
// minute (a row of bgtask_retention says when the ledger was last pruned:
// the node that moves it prunes), each statement a bounded batch that
// skips the rows others hold (FOR UPDATE SKIP LOCKED), so that nothing
// waits on it for long:
//
//   - the change of an ended task (bgtask_changes), once it ended longer
//     ago than MaxAge — and beyond the MaxEnded newest ended, with a
//     MaxEnded — except the ledger's newest change (Snapshot.Seq never
//     goes back). The change of a live task is never pruned; Snapshot
//     leaves out, as of now, what is past MaxAge.
//   - a closure that ended longer ago than MaxAge, with its stops. A
//     closure whose opener's lease has ended holds no fence: it is closed
//     (as the member's next life would close it), and pruned in its turn.
//   - a parent's row (bgtask_parents) with nothing live and no round open,
//     unchanged for MaxAge. Its round number is not lost: the ledger's
//     round floor is raised above it in the same transaction, and a row
//     made again for any parent starts above the floor, so an all_complete
//     id ('all_complete:<parent>:<round>') never repeats.
//   - the data of a dead member — its records, tasks and sessions, never
//     its row of bgtask_members, whose fence must keep growing — once it is
//     idle (closed with nothing live and no event routed to it, or found
//     so: its lease ended, with no live task and nothing in its inbox) and
//     its lease ended longer ago than MaxAge, so that all its tasks ended
//     longer ago than that. Not while a live task was launched from one of
//     its sessions (a Manager keeps such a task too: a closure walks the
//     branch through it). All of it goes in one transaction that holds the
//     member's row: an Open of the member waits for it, and replays
//     nothing (a new member, at a greater fence) — never half of it. A
//     member with more than memberPruneMax records is left as it is (and
//     logged).
//   - launches left in flight (bgtask_launching) by a member whose lease
//     has ended (none of them can land), of a task that landed (a fence
//     check that ran late left it), or for longer than launchStale.

// DefaultRetainFor is how long the ledger keeps, by default, the change of
// a task that ended, a closure that ended, the row of a parent with
// nothing live, and the data of a dead member (NodeOptions.Retention).
const DefaultRetainFor = 24 * time.Hour

const (
	minRetainFor   = time.Minute      // a shorter MaxAge is this
	pruneBatch     = 1000             // the rows one statement prunes at most
	closureBatch   = 100              // the closures one statement prunes at most (with their stops)
	pruneFor       = 30 * time.Second // one pass's work at most: the rest waits for the next pass
	memberPruneMax = 200_000          // the records of a dead member pruned at once at most
	launchStale    = time.Hour        // a launch in flight for longer is left over
	pruneEvery     = time.Minute      // how often a node offers to prune its ledger
)

// retention is NodeOptions.Retention as the pruning reads it.
type retention struct {
	age      time.Duration // 0: no age bound
	maxEnded int           // 0: no count bound
}

// retentionOf reads r as the fleet does: MaxAge 0 is DefaultRetainFor, a
// negative MaxAge no age bound, and one below minRetainFor is that;
// MaxEnded 0 (or negative) is no count bound (the Managers bound what
// each member keeps).
func retentionOf(r bgtask.Retention) retention {
	out := retention{age: r.MaxAge, maxEnded: max(r.MaxEnded, 0)}
	switch {
	case out.age == 0:
		out.age = DefaultRetainFor
	case out.age < 0:
		out.age = 0
	case out.age < minRetainFor:
		out.age = minRetainFor
	}
	return out
}

// Retention is what the ledger keeps of the tasks that ended, as the
// node reads NodeOptions.Retention, in bgtask.Retention's terms: MaxAge
// the age bound (0: none), MaxEnded the count bound (-1: none). A
// fleet's view (fleetview) keeps what the ledger keeps.
func (n *Node) Retention() bgtask.Retention {
	r := retentionOf(n.o.Retention)
	out := bgtask.Retention{MaxAge: r.age, MaxEnded: r.maxEnded}
	if out.MaxEnded == 0 {
		out.MaxEnded = -1
	}
	return out
}

// ageArg is the age bound as a statement's argument: nil for none.
func (r retention) ageArg() any {
	if r.age <= 0 {
		return nil
	}
	return r.age
}

// pruned says what one pass pruned.
type pruned struct {
	Changes, Closures, Stops, Parents, Members int // rows deleted (Members: members whose data went)
	Closed, Idled                              int // closures of dead openers closed; dead members found idle
	Launching                                  int // left-over launches deleted
}

func (p pruned) any() bool { return p != pruned{} }

// pruneHook is a test's view of a node's pruning (NodeOptions.prune):
// every (how often the node offers to prune; 0: pruneEvery) and done
// (hears every pass).
type pruneHook struct {
	every time.Duration
	done  chan<- pruned
}

// startRetention starts the node's pruning of its ledger, on a goroutine
// the node joins at Close.
func (n *Node) startRetention(ctx context.Context) {
	n.goOwned(func() { n.retain(ctx) })
}

// retain offers to prune the ledger every pruneEvery until ctx ends; the
// node that claims the pass prunes.
func (n *Node) retain(ctx context.Context) {
	r := retentionOf(n.o.Retention)
	every := func() time.Duration {
		if h := n.o.prune; h != nil && h.every > 0 {
			return h.every
		}
		return pruneEvery
	}
	periodically(ctx, every, func(d time.Duration) {
		mine, err := claimPrune(ctx, n.pool, n.o.Ledger, d)
		if err != nil || !mine {
			return
		}
		p, err := pruneLedger(ctx, n.pool, n.o.Ledger, r, n.o.Logger.Warn)
		switch {
		case err != nil && ctx.Err() == nil:
			n.o.Logger.Warn("pgledger: pruning the ledger", "err", err, "pruned", fmt.Sprintf("%+v", p))
		case p.any():
			n.o.Logger.Info("pgledger: pruned the ledger", "pruned", fmt.Sprintf("%+v", p))
		}
		if h := n.o.prune; h != nil && err == nil {
			select {
			case h.done <- p:
			case <-ctx.Done():
			}
		}
	})
}

// claimPrune takes ledger's pass for this node if no node took one in the
// last every.
func claimPrune(ctx context.Context, pool *pgxpool.Pool, ledger string, every time.Duration) (bool, error) {
	tag, err := pool.Exec(ctx, `INSERT INTO bgtask_retention AS r (ledger, pruned_at) VALUES ($1, now())
ON CONFLICT (ledger) DO UPDATE SET pruned_at = now() WHERE r.pruned_at <= now() - $2::interval`, ledger, every)
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// pruneLedger prunes ledger as r says (see Retention above), in batches,
// for pruneFor at most; warn hears a dead member left as it is.
func pruneLedger(ctx context.Context, pool *pgxpool.Pool, ledger string, r retention, warn func(string, ...any)) (pruned, error) {
	ctx, cancel := context.WithTimeout(ctx, pruneFor)
	defer cancel()
	var p pruned
	// batches runs one statement until a run prunes fewer than limit rows.
	batches := func(count *int, limit int, sql string, args ...any) error {
		for {
			var n int
			if err := pool.QueryRow(ctx, sql, append([]any{ledger, limit}, args...)...).Scan(&n); err != nil {
				return err
			}
			*count += n
			if n < limit {
				return nil
			}
		}
	}
	steps := []func() error{
		func() error { return batches(&p.Closed, pruneBatch, closeInert) },
		func() error {
			tag, err := pool.Exec(ctx, idleDead, ledger)
			p.Idled += int(tag.RowsAffected())
			return err
		},
		func() error { return batches(&p.Launching, pruneBatch, pruneLaunching, launchStale) },
		func() error { return pruneChanges(ctx, pool, ledger, r, &p.Changes) },
	}
	if r.age > 0 {
		steps = append(steps,
			func() error {
				for {
					var closures, stops int
					if err := pool.QueryRow(ctx, pruneClosures, ledger, closureBatch, r.age).Scan(&closures, &stops); err != nil {
						return err
					}
					p.Closures, p.Stops = p.Closures+closures, p.Stops+stops
					if closures < closureBatch {
						return nil
					}
				}
			},
			func() error { return batches(&p.Parents, pruneBatch, pruneParents, r.age) },
			func() error { return pruneMembers(ctx, pool, ledger, r, &p.Members, warn) },
		)
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return p, err
		}
	}
	return p, nil
}

// closeInert closes (at most $2 of) ledger $1's open closures whose
// opener's lease has ended: their fence no longer holds, and the opener's
// next life would close them.
const closeInert = `WITH c AS (
  UPDATE bgtask_closures SET closed_at = now() WHERE id IN (
    SELECT k.id FROM bgtask_closures k
     WHERE k.ledger = $1 AND k.closed_at IS NULL AND NOT bgtask_closure_live(k.ledger, k.member)
     LIMIT $2 FOR UPDATE SKIP LOCKED)
  RETURNING 1)
SELECT count(*) FROM c`

// idleDead marks idle the members of ledger $1 whose lease has ended
// with no live task and nothing in their inbox, as a clean close would
// have: the takeover poll passes them by (it takes over only members
// with live tasks or events), and their data may be pruned in its time.
const idleDead = `UPDATE bgtask_members m SET idle = true
 WHERE m.ledger = $1 AND NOT m.idle AND m.expires_at <= now()
   AND NOT EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = m.ledger AND t.member = m.member AND NOT t.ended)
   AND NOT EXISTS (SELECT 1 FROM bgtask_inbox i WHERE i.ledger = m.ledger AND i.member = m.member)`

// pruneLaunching deletes (at most $2 of) ledger $1's launches left in
// flight: by a member whose lease has ended (its task_launched cannot
// land now; its next life would clear them), whose task landed (a fence
// check that ran late left it), or for longer than $3.
const pruneLaunching = `WITH d AS (
  DELETE FROM bgtask_launching d USING (
    SELECT l.task_id FROM bgtask_launching l
     WHERE l.ledger = $1 AND (l.at < now() - $3::interval OR NOT EXISTS (
           SELECT 1 FROM bgtask_members m WHERE m.ledger = l.ledger AND m.member = l.member AND m.expires_at > now())
           OR EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = l.ledger AND t.task_id = l.task_id))
     LIMIT $2 FOR UPDATE SKIP LOCKED) x
   WHERE d.ledger = $1 AND d.task_id = x.task_id
  RETURNING 1)
SELECT count(*) FROM d`

// pruneClosures deletes (at most $2 of) ledger $1's closures that ended
// longer ago than $3, and their stops; it returns how many of each.
const pruneClosures = `WITH k AS (
  SELECT coalesce(array_agg(id), '{}') AS ids FROM (
    SELECT id FROM bgtask_closures WHERE ledger = $1 AND closed_at < now() - $3::interval
     ORDER BY closed_at LIMIT $2 FOR UPDATE SKIP LOCKED) x),
s AS (DELETE FROM bgtask_stops WHERE closure_id = ANY((SELECT ids FROM k)::bigint[]) RETURNING 1),
d AS (DELETE FROM bgtask_closures WHERE id = ANY((SELECT ids FROM k)::bigint[]) RETURNING 1)
SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM s)`

// pruneParents deletes (at most $2 of) ledger $1's parent rows with
// nothing live and no round open, unchanged for $3, and raises the
// ledger's round floor to the greatest round they had, in the same
// transaction (see bgtask_parent_row).
const pruneParents = `WITH gone AS (
  DELETE FROM bgtask_parents p USING (
    SELECT parent_session FROM bgtask_parents
     WHERE ledger = $1 AND live <= 0 AND cardinality(round_tasks) = 0 AND touched < now() - $3::interval
     ORDER BY touched LIMIT $2 FOR UPDATE SKIP LOCKED) x
   WHERE p.ledger = $1 AND p.parent_session = x.parent_session
  RETURNING p.round),
f AS (
  INSERT INTO bgtask_retention AS f (ledger, round_floor) SELECT $1, max(round) FROM gone HAVING count(*) > 0
  ON CONFLICT (ledger) DO UPDATE SET round_floor = greatest(f.round_floor, EXCLUDED.round_floor))
SELECT count(*) FROM gone`

// changesEdge is when the $2-th newest ended task of ledger $1 ended
// (MaxEnded): the changes that ended before it go.
const changesEdge = `SELECT ended_at FROM bgtask_changes WHERE ledger = $1 AND ended_at IS NOT NULL
 ORDER BY ended_at DESC OFFSET $2 - 1 LIMIT 1`

// pruneChangesBefore deletes (at most $2 of) ledger $1's changes of tasks
// that ended before $3, the oldest first, except the ledger's newest
// change. (The rows are found by when they ended, and deleted by id: an
// array, whatever the planner makes of a LIMIT's estimate.)
const pruneChangesBefore = `WITH d AS (
  DELETE FROM bgtask_changes WHERE id = ANY((SELECT coalesce(array_agg(id), '{}') FROM (
    SELECT c.id FROM bgtask_changes c
     WHERE c.ledger = $1 AND c.ended_at < $3
       AND c.id <> (SELECT max(id) FROM bgtask_changes WHERE ledger = $1)
     ORDER BY c.ended_at LIMIT $2 FOR UPDATE SKIP LOCKED) x)::bigint[])
  RETURNING 1)
SELECT count(*) FROM d`

// pruneChanges deletes the changes of the tasks that ended longer ago
// than r.age, or before the r.maxEnded newest ended.
func pruneChanges(ctx context.Context, pool *pgxpool.Pool, ledger string, r retention, count *int) error {
	var cut *time.Time
	if r.age > 0 {
		var at time.Time
		if err := pool.QueryRow(ctx, `SELECT now() - $1::interval`, r.age).Scan(&at); err != nil {
			return err
		}
		cut = &at
	}
	if r.maxEnded > 0 {
		var at time.Time
		err := pool.QueryRow(ctx, changesEdge, ledger, r.maxEnded).Scan(&at)
		switch {
		case errors.Is(err, pgx.ErrNoRows): // fewer ended than that
		case err != nil:
			return err
		case cut == nil || at.After(*cut):
			cut = &at
		}
	}
	if cut == nil {
		return nil
	}
	for {
		var n int
		if err := pool.QueryRow(ctx, pruneChangesBefore, ledger, pruneBatch, *cut).Scan(&n); err != nil {
			return err
		}
		*count += n
		if n < pruneBatch {
			return nil
		}
	}
}

// deadMembers lists (at most $2 of) ledger $1's idle members whose lease
// ended longer ago than $3 and whose data is not pruned yet, by name after
// $4 (a member left as it is — busy, or locked — is not listed again in
// the pass).
const deadMembers = `SELECT member FROM bgtask_members
 WHERE ledger = $1 AND idle AND fence > pruned_fence AND expires_at < now() - $3::interval AND member > $4
 ORDER BY member LIMIT $2`

// pruneMembers prunes the data of ledger's dead members (see Retention
// above), one member per transaction.
func pruneMembers(ctx context.Context, pool *pgxpool.Pool, ledger string, r retention, count *int, warn func(string, ...any)) error {
	for after := ""; ; {
		rows, err := pool.Query(ctx, deadMembers, ledger, pruneBatch, r.age, after)
		if err != nil {
			return err
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		for _, name := range names {
			gone, err := pruneMember(ctx, pool, ledger, name, r, warn)
			if err != nil {
				return err
			}
			if gone {
				*count++
			}
		}
		if len(names) < pruneBatch {
			return nil
		}
		after = names[len(names)-1]
	}
}

// pruneMember deletes dead member name's records, tasks and sessions in
// one transaction, holding its row (an Open of it waits), if it is still
// idle and dead past r.age, nothing of it is live, and no live task was
// launched from one of its sessions; its row stays (its fence keeps
// growing), marked pruned at its fence. It reports whether it did.
func pruneMember(ctx context.Context, pool *pgxpool.Pool, ledger, name string, r retention, warn func(string, ...any)) (bool, error) {
	gone, tooBig := false, false
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var fence int64
		err := tx.QueryRow(ctx, `SELECT fence FROM bgtask_members
 WHERE ledger = $1 AND member = $2 AND idle AND fence > pruned_fence AND expires_at < now() - $3::interval
 FOR UPDATE SKIP LOCKED`, ledger, name, r.age).Scan(&fence)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // opened again, pruned by another node, or held by one
		}
		if err != nil {
			return err
		}
		var busy bool
		var records int
		if err := tx.QueryRow(ctx, memberBusy, ledger, name, memberPruneMax).Scan(&busy, &records); err != nil {
			return err
		}
		if busy {
			return nil // looked at again at the next pass
		}
		if records > memberPruneMax {
			tooBig = true // told once the transaction is over: the logger is user code
		} else {
			for _, q := range []string{
				`DELETE FROM bgtask_records WHERE ledger = $1 AND member = $2`,
				`DELETE FROM bgtask_sessions WHERE ledger = $1 AND member = $2`,
				`DELETE FROM bgtask_tasks WHERE ledger = $1 AND member = $2`,
			} {
				if _, err := tx.Exec(ctx, q, ledger, name); err != nil {
					return err
				}
			}
			gone = true
		}
		_, err = tx.Exec(ctx, `UPDATE bgtask_members SET pruned_fence = fence WHERE ledger = $1 AND member = $2`, ledger, name)
		return err
	})
	if tooBig && err == nil {
		warn("pgledger: the data of a dead member is too large to prune at once; it is left as it is",
			"member", name, "records", fmt.Sprintf("more than %d", memberPruneMax))
	}
	return gone && err == nil, err
}

// memberBusy says whether member $2 of ledger $1 has a live task, an
// event in its inbox, or a session that launched a live task (of any
// member); and how many records it has, counted up to $3 + 1.
const memberBusy = `SELECT
  EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = $1 AND t.member = $2 AND NOT t.ended)
  OR EXISTS (SELECT 1 FROM bgtask_inbox i WHERE i.ledger = $1 AND i.member = $2)
  OR EXISTS (SELECT 1 FROM bgtask_sessions s JOIN bgtask_tasks c ON c.ledger = s.ledger AND c.parent_session = s.session_id
              WHERE s.ledger = $1 AND s.member = $2 AND NOT c.ended),
  (SELECT count(*) FROM (SELECT 1 FROM bgtask_records WHERE ledger = $1 AND member = $2 LIMIT $3 + 1) r)`
