package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
)

// outboxChannel is the channel NOTIFY wakes the deliverers on; the
// payload is the ledger.
const outboxChannel = "bgtask_outbox"

// Delivery across processes. With NodeOptions.Notifier, every Manager of
// the node is given an outbox as its notifier: a notification is
// "delivered" for the Manager once it is a row of bgtask_outbox (the
// insert is idempotent on the member and Notification.ID, so a
// notification produced again after a crash is one row). The node's
// deliverer then hands the rows to the Notifier, per parent session in
// the order they were written, one process per parent at a time (a claim
// row, renewed as it delivers, taken over once it expires): exactly once
// without a crash, at least once across one, each with its stable ID.
//
// NotifyAllComplete is not the Managers' (each sees only its own tasks):
// bgtask_append makes it in the commit that ends a parent round's last
// live task, whichever process that commit is from, and the deliverer
// tells it once the final summary of each task of the round is in the
// outbox (or claimGrace after the round ended, with those that are).
const (
	claimFor   = 30 * time.Second // a parent's claim, renewed as it delivers
	notifyFor  = 10 * time.Second // one Notify call's bound
	claimGrace = time.Minute      // how long an all_complete waits for its round's summaries
)

// outboxNotifier is a Manager's notifier in a node with a Notifier.
type outboxNotifier struct {
	n      *Node
	member string
	j      *Journal // the member's: while it lives, a database away is waited out
}

func (o outboxNotifier) Notify(ctx context.Context, note bgtask.Notification) error {
	if note.Kind == bgtask.NotifyAllComplete {
		return nil // the ledger's own, made in the database
	}
	body, err := json.Marshal(note)
	if err != nil {
		return fmt.Errorf("pgledger: encoding a notification: %w", err)
	}
	// A database that does not answer is asked again until it does (the
	// Manager gives a notification up after a few refusals), as long as
	// the member's journal lives: once it failed, the member's next life
	// produces what is owed again.
	for wait := time.Duration(0); ; {
		err = o.insert(ctx, note, body)
		if err == nil || !transient(err) || ctx.Err() != nil || o.j.failedErr() != nil {
			break
		}
		wait = retryWait(wait)
		sleepCtx(ctx, wait)
	}
	if err != nil {
		return dbErr("writing a notification to the outbox", err)
	}
	return nil
}

// insert writes note to the outbox, once (idempotent on its ID).
func (o outboxNotifier) insert(ctx context.Context, note bgtask.Notification, body []byte) error {
	_, err := o.n.pool.Exec(ctx, `WITH ins AS (
  INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, task_id, body)
  VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (ledger, member, note_id) DO NOTHING RETURNING 1)
SELECT pg_notify($8, $1) FROM ins`, o.n.o.Ledger, o.member, note.ID, note.ParentSessionID, string(note.Kind), note.TaskID, body, outboxChannel)
	return err
}

// wakeDeliverer makes the deliverer look at the outbox now.
func (n *Node) wakeDeliverer() {
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

// deliverLoop delivers the outbox until ctx ends: at once when woken,
// and every Poll.
func (n *Node) deliverLoop(ctx context.Context) {
	defer n.done.Done()
	t := time.NewTicker(n.o.Poll)
	defer t.Stop()
	for {
		n.deliverAll(ctx)
		select {
		case <-ctx.Done():
			return
		case <-n.wake:
		case <-t.C:
		}
	}
}

// deliverAll delivers the rows of every parent with some pending whose
// claim this node can take, except those waiting out a failure.
func (n *Node) deliverAll(ctx context.Context) {
	rows, err := n.pool.Query(ctx, `SELECT DISTINCT o.parent_session FROM bgtask_outbox o
 WHERE o.ledger = $1 AND o.delivered_at IS NULL
   AND NOT EXISTS (SELECT 1 FROM bgtask_claims c WHERE c.ledger = o.ledger AND c.parent_session = o.parent_session
                   AND c.until > now() AND c.member <> $2)
 LIMIT 1000`, n.o.Ledger, n.o.Member)
	if err != nil {
		return
	}
	parents, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	now := time.Now()
	for _, p := range parents {
		if b, ok := n.backoff[p]; ok && now.Before(b.next) {
			continue
		}
		if ctx.Err() != nil || !n.claim(ctx, p) {
			continue
		}
		if n.deliverParent(ctx, p) {
			delete(n.backoff, p)
		} else {
			b := n.backoff[p]
			b.wait = min(max(2*b.wait, n.o.Poll), maxBackoff)
			b.next = time.Now().Add(b.wait)
			n.backoff[p] = b
		}
		_, _ = n.pool.Exec(ctx, `DELETE FROM bgtask_claims WHERE ledger = $1 AND parent_session = $2 AND member = $3`, n.o.Ledger, p, n.o.Member)
	}
}

// maxBackoff bounds the wait before a parent whose delivery failed is
// tried again.
const maxBackoff = time.Minute

// backoff is a parent's wait after a failed delivery (the deliverer's own:
// one goroutine uses it).
type backoff struct {
	wait time.Duration
	next time.Time
}

// claim takes (or renews) parent's claim for this node.
func (n *Node) claim(ctx context.Context, parent string) bool {
	var who string
	err := n.pool.QueryRow(ctx, `INSERT INTO bgtask_claims AS c (ledger, parent_session, member, until)
VALUES ($1, $2, $3, now() + $4::interval)
ON CONFLICT (ledger, parent_session) DO UPDATE SET member = EXCLUDED.member, until = EXCLUDED.until
 WHERE c.until <= now() OR c.member = EXCLUDED.member
RETURNING member`, n.o.Ledger, parent, n.o.Member, claimFor).Scan(&who)
	return err == nil && who == n.o.Member
}

// outboxRow is one pending row of the outbox.
type outboxRow struct {
	id     int64
	noteID string
	kind   string
	task   string
	body   []byte
	round  []string
	age    time.Duration
}

// deliverParent delivers parent's pending rows in order while it holds
// the claim, and reports false if a delivery failed: it stops there (the
// order is kept; it is tried again after a backoff). An all_complete
// waiting for its round's summaries lets only those summaries past it,
// wherever they are behind it: a summary may be written after the next
// round's rows (its round's all_complete comes first), and nothing else
// passes the waiting all_complete.
func (n *Node) deliverParent(ctx context.Context, parent string) bool {
	for ctx.Err() == nil {
		pending, err := n.pending(ctx, parent)
		if err != nil {
			return false
		}
		sent := 0
		var waiting map[string]bool // the round tasks of an all_complete that waits
		for _, r := range pending {
			if waiting != nil && !(r.kind == string(bgtask.NotifyFinalSummary) && waiting[r.task]) {
				continue // after the waiting all_complete: not yet
			}
			note, ok, err := n.noteOf(ctx, parent, r)
			if err != nil {
				return false
			}
			if !ok {
				if waiting == nil {
					waiting = map[string]bool{}
				}
				for _, id := range r.round {
					waiting[id] = true
				}
				continue
			}
			if err := n.notify(ctx, note); err != nil {
				n.o.Logger.Warn("pgledger: delivering a notification failed; it is tried again", "parent", parent, "id", note.ID, "err", err)
				return false
			}
			if !n.delivered(parent, r) {
				return true // the claim was lost (or the database is away): whoever holds it goes on
			}
			sent++
		}
		if sent == 0 {
			return true
		}
	}
	return true
}

// pending returns parent's undelivered rows, oldest first.
func (n *Node) pending(ctx context.Context, parent string) ([]outboxRow, error) {
	rows, err := n.pool.Query(ctx, `SELECT id, note_id, kind, task_id, coalesce(body::text, ''), coalesce(round_tasks, '{}'), now() - made
  FROM bgtask_outbox WHERE ledger = $1 AND parent_session = $2 AND delivered_at IS NULL ORDER BY id LIMIT 100`, n.o.Ledger, parent)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (outboxRow, error) {
		var r outboxRow
		var body string
		err := row.Scan(&r.id, &r.noteID, &r.kind, &r.task, &body, &r.round, &r.age)
		r.body = []byte(body)
		return r, err
	})
}

// noteOf is the notification row r tells: its body, or for an
// all_complete the round's tasks as their final summaries show them —
// once each of those was delivered (false until then, for up to
// claimGrace: the round's last summary is written after the commit that
// made the all_complete).
func (n *Node) noteOf(ctx context.Context, parent string, r outboxRow) (bgtask.Notification, bool, error) {
	var note bgtask.Notification
	if r.kind != string(bgtask.NotifyAllComplete) {
		err := json.Unmarshal(r.body, &note)
		return note, err == nil, err
	}
	round := slices.Compact(slices.Sorted(slices.Values(r.round)))
	rows, err := n.pool.Query(ctx, `SELECT DISTINCT ON (task_id) body::text FROM bgtask_outbox
 WHERE ledger = $1 AND kind = 'final_summary' AND task_id = ANY($2) AND delivered_at IS NOT NULL ORDER BY task_id, id`, n.o.Ledger, round)
	if err != nil {
		return note, false, err
	}
	bodies, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return note, false, err
	}
	if len(bodies) < len(round) && r.age < claimGrace {
		return note, false, nil
	}
	byID := map[string]bgtask.Task{}
	for _, b := range bodies {
		var s bgtask.Notification
		if json.Unmarshal([]byte(b), &s) == nil {
			byID[s.TaskID] = s.Task
		}
	}
	tasks := make([]bgtask.Task, 0, len(r.round))
	seen := map[string]bool{}
	for _, id := range r.round { // in the order the round's tasks were launched
		if t, ok := byID[id]; ok && !seen[id] {
			seen[id] = true
			tasks = append(tasks, t)
		}
	}
	note = bgtask.AllComplete(parent, tasks)
	note.ID = r.noteID
	return note, true, nil
}

// notify hands note to the Notifier, bounded by notifyFor: the call runs
// on a goroutine of its own, so that a Notifier that ignores its context
// holds up nothing but itself (Close waits for it, bounded by its own
// context). A call that outlives the bound is taken as failed: its row is
// delivered again, at least once.
func (n *Node) notify(ctx context.Context, note bgtask.Notification) error {
	ctx, cancel := context.WithTimeout(ctx, notifyFor)
	defer cancel()
	done := make(chan error, 1)
	n.stray.Add(1)
	go func() {
		defer n.stray.Done()
		done <- n.callNotifier(ctx, note)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		select {
		case err := <-done: // it returned as the node closed: what it said counts
			return err
		default:
		}
		return fmt.Errorf("pgledger: the Notifier did not return in %s: %w", notifyFor, ctx.Err())
	}
}

// callNotifier is the Notifier's call, which never panics through.
func (n *Node) callNotifier(ctx context.Context, note bgtask.Notification) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("pgledger: the Notifier panicked: %v", r)
		}
	}()
	if err = n.o.Notifier.Notify(ctx, note); err != nil {
		err = errors.New(safeText(err))
	}
	return err
}

// delivered marks row r of parent delivered, if this node still holds the
// parent's claim (renewing it): a final summary stays (as delivered) until
// its round's all_complete is told; an all_complete takes its round's
// summaries with it; any other row goes. It reports whether it did. It
// runs on a context of its own: a delivery that returned as the node
// closes is still marked.
func (n *Node) delivered(parent string, r outboxRow) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const held = `WITH c AS (UPDATE bgtask_claims SET until = now() + $4::interval
  WHERE ledger = $1 AND parent_session = $2 AND member = $3 AND until > now() RETURNING 1) `
	var q string
	switch r.kind {
	case string(bgtask.NotifyFinalSummary):
		q = held + `UPDATE bgtask_outbox SET delivered_at = now() WHERE id = $5 AND EXISTS (SELECT 1 FROM c)`
	case string(bgtask.NotifyAllComplete):
		q = held + `DELETE FROM bgtask_outbox WHERE EXISTS (SELECT 1 FROM c) AND (id = $5
   OR (ledger = $1 AND kind = 'final_summary' AND task_id = ANY($6) AND delivered_at IS NOT NULL))`
	default:
		q = held + `DELETE FROM bgtask_outbox WHERE id = $5 AND EXISTS (SELECT 1 FROM c)`
	}
	args := []any{n.o.Ledger, parent, n.o.Member, claimFor, r.id}
	if r.kind == string(bgtask.NotifyAllComplete) {
		args = append(args, r.round)
	}
	tag, err := n.pool.Exec(ctx, q, args...)
	if err != nil {
		n.o.Logger.Warn("pgledger: marking a notification delivered", "id", r.noteID, "err", err)
		return false
	}
	if tag.RowsAffected() == 0 {
		return false
	}
	if n.o.marked != nil {
		n.o.marked(r.noteID)
	}
	return true
}
