package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/jackc/pgx/v5"
)

// outboxChannel is the channel NOTIFY wakes the deliverers on; the
// payload is the ledger.
const outboxChannel = "bgtask_outbox"

// Delivery across processes. With NodeOptions.Notifier, every Manager of
// the node is given an outbox as its notifier: a notification is
// "delivered" for the Manager once it is a row of bgtask_outbox (the
// insert is idempotent on the member and Notification.ID, so a
// notification produced again after a crash is one row; the calls of a
// node's Managers that come together are written in one statement).
//
// The node's deliverer then hands the rows to the Notifier, per parent
// session in the order they were written, one process per parent at a
// time (a claim row with an expiry, renewed as it delivers, taken over
// once it expires): exactly once without a crash, at least once across
// one, each with its stable ID. It works in rounds of one statement each
// (exchange): the statement marks what the last round delivered, for
// every parent of it at once, and releases their claims; and claims up to
// claimBatch more parents that have something to deliver, skipping those
// another process is claiming at that moment (SKIP LOCKED, on a lock per
// parent), so that processes looking at once share the parents out and
// write nothing in vain; and reads their rows. deliverWorkers goroutines
// of the deliverer's deliver them, several parents side by side, each
// parent's rows in order; the next round marks them. A round that claims
// nothing and has nothing to mark writes nothing.
//
// NotifyAllComplete is not the Managers' (each sees only its own tasks):
// bgtask_append makes it in the commit that ends a parent round's last
// live task, whichever process that commit is from, and the deliverer
// tells it once the final summary of each task of the round was delivered
// (or claimGrace after the round ended, with those that were). A summary
// is written after its round's all_complete, and may come after the next
// rounds' rows: it alone overtakes its own waiting all_complete; nothing
// else passes it. A summary delivered stays in the outbox (marked) until
// its round's all_complete is told, which takes it with it.
const (
	claimFor   = 30 * time.Second // a parent's claim, renewed as it delivers
	notifyFor  = 10 * time.Second // one Notify call's bound
	claimGrace = time.Minute      // how long an all_complete waits for its round's summaries
	markFor    = 10 * time.Second // one statement of marks, or one write of the Managers' notifications

	deliverWorkers = 8   // a node's goroutines that call the Notifier, each for one parent at a time
	claimBatch     = 32  // the parents one round claims at most
	maxActive      = 64  // the parents a node holds claims on at most
	rowsPerParent  = 100 // the rows of a parent a claim reads at most
	// straggleAfter is how long a round waits for its slowest parents
	// before it marks what the others delivered and claims again; the
	// stragglers are marked once they are done.
	straggleAfter = 100 * time.Millisecond
)

// outboxNotifier is a Manager's notifier in a node with a Notifier.
type outboxNotifier struct {
	n      *Node
	member string
	j      *Journal // the member's: while it lives, a database away is waited out
}

// noteWrite is one notification on its way to the outbox.
type noteWrite struct {
	member string
	note   bgtask.Notification
	body   []byte
	err    error
	done   chan struct{} // closed once written (or not: err)
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
	err = untilAnswered(ctx, func() bool { return o.j.failedErr() != nil }, func() error { return o.write(ctx, note, body) })
	if err != nil {
		return dbErr("writing a notification to the outbox", err)
	}
	return nil
}

// write writes note to the outbox, once (idempotent on its ID): with the
// node's other notifications of the moment, while its deliverer runs.
func (o outboxNotifier) write(ctx context.Context, note bgtask.Notification, body []byte) error {
	w := &noteWrite{member: o.member, note: note, body: body, done: make(chan struct{})}
	if nw := o.n.notes.Load(); nw != nil && nw.add(w) {
		select {
		case <-w.done:
			return w.err
		case <-ctx.Done():
			return ctx.Err() // it may still be written: a repeat is one row
		}
	}
	return o.n.writeNotes(ctx, []*noteWrite{w})
}

// writeNotes writes ws to the outbox in one statement, in their order,
// and wakes the deliverers (this node's at once).
func (n *Node) writeNotes(ctx context.Context, ws []*noteWrite) error {
	members, ids, parents, kinds, tasks, bodies := make([]string, len(ws)), make([]string, len(ws)), make([]string, len(ws)),
		make([]string, len(ws)), make([]string, len(ws)), make([]string, len(ws))
	for i, w := range ws {
		members[i], ids[i], parents[i], kinds[i], tasks[i], bodies[i] = w.member, w.note.ID, w.note.ParentSessionID, string(w.note.Kind), w.note.TaskID, string(w.body)
	}
	var sumParents, sumTasks []string // the final summaries' parents and tasks: their rounds' all_complete may now be ready
	for _, w := range ws {
		if w.note.Kind == bgtask.NotifyFinalSummary {
			sumParents, sumTasks = append(sumParents, w.note.ParentSessionID), append(sumTasks, w.note.TaskID)
		}
	}
	_, err := n.pool.Exec(ctx, writeNotesSQL, n.o.Ledger, members, ids, parents, kinds, tasks, bodies, outboxChannel,
		slices.Compact(slices.Sorted(slices.Values(sumParents))), sumTasks)
	if err == nil {
		n.wakeDeliverer()
	}
	return err
}

// writeNotesSQL is writeNotes' statement: $1 the ledger, $2–$7 the rows,
// $8 the channel to wake deliverers on, $9 the parents of the final
// summaries among the rows, $10 their tasks. It marks ready each pending
// all_complete of those parents whose round's summaries are now all
// written: those of $10 (written here, or before), and those in the
// outbox (written before: this statement does not see the rows it
// inserts). A row a deliverer holds is left as it is (SKIP LOCKED: no
// deadlock with its marks), and so is one whose last summaries two
// processes write at once, neither seeing the other's: the deliverer
// counts those rounds' summaries itself.
const writeNotesSQL = `WITH ins AS (
  INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, task_id, body)
  SELECT $1, r.member, r.id, r.parent, r.kind, r.task, r.body::jsonb
    FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[]) WITH ORDINALITY AS r(member, id, parent, kind, task, body, o)
   ORDER BY r.o
  ON CONFLICT (ledger, member, note_id) DO NOTHING RETURNING 1),
ready AS (
  UPDATE bgtask_outbox a SET ready = true
    FROM unnest($9::text[]) AS p(parent) CROSS JOIN LATERAL (
      -- A subquery with FOR UPDATE is not flattened: each parent's rows
      -- are looked up by the parent.
      SELECT w.id FROM bgtask_outbox w
       WHERE w.ledger = $1 AND w.parent_session = p.parent AND w.delivered_at IS NULL AND w.kind = 'all_complete' AND NOT w.ready
         AND NOT EXISTS (SELECT 1 FROM unnest(w.round_tasks) t(task)
                          WHERE t.task <> ALL($10::text[])
                            AND NOT EXISTS (SELECT 1 FROM bgtask_outbox s
                                             WHERE s.ledger = $1 AND s.kind = 'final_summary' AND s.task_id = t.task))
       FOR UPDATE SKIP LOCKED) r
   WHERE a.id = r.id)
SELECT pg_notify($8, $1) WHERE EXISTS (SELECT 1 FROM ins)`

// noteWriter writes the notifications of a node's Managers to the outbox:
// those that come while a write is in flight go together in the next
// (each Manager's calls for one parent come one at a time, so the order
// of a parent's rows is the order of its calls).
type noteWriter struct {
	n      *Node
	loop   context.Context // the node's: once it ended, a write is bounded by closeGrace
	mu     sync.Mutex
	queue  []*noteWrite
	closed bool          // from then on, each call writes its own
	wake   chan struct{} // something was queued
}

// add queues w, unless the writer has stopped (false).
func (q *noteWriter) add(w *noteWrite) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return false
	}
	q.queue = append(q.queue, w)
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return true
}

// run writes what is queued, a batch at a time, until stop is closed;
// then it writes what was queued before it stopped taking more.
func (q *noteWriter) run(stop <-chan struct{}) {
	for {
		q.mu.Lock()
		batch := q.queue
		q.queue = nil
		q.mu.Unlock()
		if len(batch) == 0 {
			select {
			case <-q.wake:
				continue
			case <-stop:
			}
			q.mu.Lock()
			q.closed = true // later calls write their own
			batch = q.queue
			q.queue = nil
			q.mu.Unlock()
			q.write(batch)
			return
		}
		q.write(batch)
	}
}

// write writes batch (bounded by markCtx: it is every caller's, not one
// caller's) and tells each caller how it went.
func (q *noteWriter) write(batch []*noteWrite) {
	if len(batch) == 0 {
		return
	}
	ctx, cancel := q.n.markCtx(q.loop)
	defer cancel()
	err := q.n.writeNotes(ctx, batch)
	if err != nil && !transient(err) && len(batch) > 1 {
		// Refused: each is written on its own, so that one the database
		// refuses fails alone.
		for _, w := range batch {
			w.err = q.n.writeNotes(ctx, []*noteWrite{w})
			close(w.done)
		}
		return
	}
	for _, w := range batch {
		w.err = err
		close(w.done)
	}
}

// markCtx is the context of one of the deliverer's own writes (marks, a
// batch of the Managers' notifications): markFor long, and closeGrace at
// most once loop (the node's, nil: none) ends. What was delivered as the
// node closes is still marked, but a database that does not answer holds
// Close up for closeGrace at most.
func (n *Node) markCtx(loop context.Context) (context.Context, context.CancelFunc) {
	d := markFor
	if n.o.markFor > 0 {
		d = n.o.markFor
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	if loop == nil {
		return ctx, cancel
	}
	stop := context.AfterFunc(loop, func() {
		t := time.AfterFunc(closeGrace, cancel)
		context.AfterFunc(ctx, func() { t.Stop() })
	})
	return ctx, func() { stop(); cancel() }
}

// wakeDeliverer makes the deliverer look at the outbox now.
func (n *Node) wakeDeliverer() {
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

// maxBackoff bounds the wait before a parent whose delivery failed is
// tried again.
const maxBackoff = time.Minute

// backoff is a parent's wait after a failed delivery (the deliverer's
// own: only its dispatching goroutine, deliverLoop's, uses n.backoff).
type backoff struct {
	wait time.Duration
	next time.Time
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
	sent   bool // delivered by this claim
}

// parentRun is one parent claimed by this node: its pending rows, and
// what of them was delivered and is not yet marked. A worker has it while
// it delivers, the dispatcher before and after.
type parentRun struct {
	parent  string
	rows    []outboxRow // as claimed, oldest first
	full    bool        // the claim read rowsPerParent rows: more may be pending
	renewed time.Time   // when the claim was last taken or renewed (asked): it holds claimFor from then
	sent    []int       // rows delivered and not yet marked, in the order delivered
	told    int         // rows delivered under this claim
	failed  bool        // a delivery failed: the parent waits out a backoff
	stopped bool        // the claim could not be renewed: nothing more is delivered under it
}

// deliverer is deliverLoop's state: the parents this node holds claims
// on, and those delivered and waiting for their marks.
type deliverer struct {
	n       *Node
	jobs    chan *parentRun       // to the workers
	results chan *parentRun       // from the workers
	active  map[string]*parentRun // claimed, not yet released
	done    []*parentRun          // back from the workers, not yet marked
	warned  bool                  // a statement failed, and it was logged: the next failures are not, until one succeeds
}

// trouble logs err, the first of an outage (nil: the database answered).
func (d *deliverer) trouble(what string, err error) {
	switch {
	case err == nil:
		d.warned = false
	case !d.warned:
		d.warned = true
		d.n.o.Logger.Warn("pgledger: "+what+"; tried again", "err", err)
	}
}

// deliverLoop delivers the outbox until ctx ends: at once when woken,
// and every Poll. It owns the node's note writer and the delivery
// workers, and joins them before it returns, once it has marked what
// they delivered and released its claims.
func (n *Node) deliverLoop(ctx context.Context) {
	defer n.done.Done()
	nw := &noteWriter{n: n, loop: ctx, wake: make(chan struct{}, 1)}
	stopWriter, writerDone := make(chan struct{}), make(chan struct{})
	go func() { defer close(writerDone); nw.run(stopWriter) }()
	n.notes.Store(nw)
	defer func() {
		n.notes.Store(nil)
		close(stopWriter)
		<-writerDone
	}()

	d := &deliverer{n: n, jobs: make(chan *parentRun, maxActive), results: make(chan *parentRun, maxActive), active: map[string]*parentRun{}}
	var workers sync.WaitGroup
	for range deliverWorkers {
		workers.Add(1)
		go func() {
			defer workers.Done()
			for r := range d.jobs {
				n.deliverRun(ctx, r)
				d.results <- r
			}
		}()
	}
	defer func() {
		close(d.jobs)
		workers.Wait() // ctx ended: each run they have stops at once
		for len(d.active) > len(d.done) {
			d.finished(<-d.results)
		}
		d.round(ctx) // marks, and releases every claim; claims nothing
	}()

	t := time.NewTicker(n.o.Poll)
	defer t.Stop()
	for {
		for ctx.Err() == nil && d.round(ctx) {
		}
		select {
		case <-ctx.Done():
			return
		case <-n.wake:
		case <-t.C:
		case r := <-d.results: // a straggler of an earlier round
			d.finished(r)
		}
	}
}

// round is one statement and what follows it. The statement marks what
// the finished runs delivered and releases their claims, and claims what
// there is room for (nothing once ctx ended); the workers deliver what it
// claimed, and round waits for them (straggleAfter at most: the
// stragglers are marked once they are done). It reports whether to go on
// at once: there are marks to write, claims were released, or a parent
// has more rows than its claim read. A parent with nothing to deliver yet
// is looked at again when the deliverer is woken, or at the next Poll.
func (d *deliverer) round(ctx context.Context) bool {
	n := d.n
	room := 0
	var skip []string
	if ctx.Err() == nil {
		room = min(claimBatch, maxActive-len(d.active))
		skip = make([]string, 0, len(d.active)+len(n.backoff))
		for p := range d.active {
			skip = append(skip, p)
		}
		now := time.Now()
		for p, b := range n.backoff {
			switch {
			case now.Before(b.next):
				skip = append(skip, p)
			case now.Sub(b.next) > maxBackoff:
				delete(n.backoff, p) // another process delivered it, most likely
			}
		}
	}
	if len(d.done) == 0 && room <= 0 {
		return false
	}
	c, cancel := n.markCtx(ctx)
	held, claimed, err := n.exchange(c, n.pool, d.done, true, skip, max(room, 0))
	cancel()
	d.trouble("marking notifications delivered and claiming parents", err)
	more := false
	if err != nil {
		// Kept, however long the database takes to answer: their marks
		// apply while no other process took their parents' claims over
		// (an expired claim that nobody took is still this node's), so
		// that a stall delivers nothing twice. Their parents stay active:
		// this node claims none of them again meanwhile.
		return false
	}
	for _, r := range d.done {
		delete(d.active, r.parent) // marked and released, or the claim was lost: whoever holds it goes on
		more = more || (held[r.parent] && r.full && !r.failed && !r.stopped)
	}
	d.done = d.done[:0]

	ours := make(map[*parentRun]bool, len(claimed))
	for _, r := range claimed {
		d.active[r.parent] = r
		ours[r] = true
		d.jobs <- r // room for every active run
	}
	wait := time.NewTimer(straggleAfter)
	defer wait.Stop()
	for len(ours) > 0 {
		select {
		case r := <-d.results:
			d.finished(r)
			delete(ours, r)
		case <-wait.C:
			clear(ours)
		case <-ctx.Done():
			clear(ours)
		}
	}
	// Once claims were released, one more look: rows written while this
	// node held them were not for any deliverer to claim then.
	return len(d.done) > 0 || more || len(held) > 0
}

// finished takes r back from a worker: its backoff follows how it went.
// A parent that had rows but nothing it could deliver yet (an all_complete
// whose summary is further than its claim read) is left alone until the
// next Poll, rather than claimed again at once.
func (d *deliverer) finished(r *parentRun) {
	n := d.n
	switch {
	case r.failed:
		b := n.backoff[r.parent]
		b.wait = min(max(2*b.wait, n.o.Poll), maxBackoff)
		b.next = time.Now().Add(b.wait)
		n.backoff[r.parent] = b
	case r.told == 0 && len(r.rows) > 0 && !r.stopped:
		b := n.backoff[r.parent]
		b.next = time.Now().Add(n.o.Poll)
		n.backoff[r.parent] = b
	default:
		delete(n.backoff, r.parent)
	}
	d.done = append(d.done, r)
}

// deliverRun delivers r's rows in order, and stops at a failed delivery
// (r.failed: the order is kept; it is tried again after a backoff). An
// all_complete waiting for its round's summaries lets only those
// summaries past it, wherever they are behind it: a summary may be
// written after the next round's rows (its round's all_complete comes
// first), and nothing else passes the waiting all_complete. A summary
// that passes it makes it ready, and it is told in the next pass.
func (n *Node) deliverRun(ctx context.Context, r *parentRun) {
	for progress := true; progress; {
		progress = false
		var waiting map[string]bool // the round tasks of an all_complete that waits
		for i := range r.rows {
			row := &r.rows[i]
			if row.sent {
				continue
			}
			if ctx.Err() != nil {
				return
			}
			if waiting != nil && !(row.kind == string(bgtask.NotifyFinalSummary) && waiting[row.task]) {
				continue // after the waiting all_complete: not yet
			}
			note, ok, err := n.noteOf(ctx, r, row)
			if err != nil {
				r.failed = true
				return
			}
			if !ok {
				if waiting == nil {
					waiting = map[string]bool{}
				}
				for _, id := range row.round {
					waiting[id] = true
				}
				continue
			}
			if time.Since(r.renewed) > n.claimFor()/3 && !n.renewRun(ctx, r) {
				r.stopped = true // whoever holds the claim now goes on
				return
			}
			if err := n.notify(ctx, note); err != nil {
				n.o.Logger.Warn("pgledger: delivering a notification failed; it is tried again", "parent", r.parent, "id", note.ID, "err", err)
				r.failed = true
				return
			}
			row.sent = true
			r.sent = append(r.sent, i)
			r.told++
			progress = true
		}
	}
}

// renewRun writes what r delivered so far and renews its claim; false if
// the claim is no longer this node's (or the database did not answer).
func (n *Node) renewRun(loop context.Context, r *parentRun) bool {
	ctx, cancel := n.markCtx(loop)
	defer cancel()
	held, err := n.markRuns(ctx, []*parentRun{r}, false)
	if err != nil {
		n.o.Logger.Warn("pgledger: renewing a parent's claim", "parent", r.parent, "err", err)
	}
	return err == nil && held[r.parent]
}

// noteOf is the notification row tells: its body, or for an all_complete
// the round's tasks as their final summaries show them — once each of
// those was delivered (false until then, for up to claimGrace: the
// round's last summary is written after the commit that made the
// all_complete). The summaries delivered by this claim are r's; those
// delivered before are read from the outbox, where they stay until their
// round's all_complete is told.
func (n *Node) noteOf(ctx context.Context, r *parentRun, row *outboxRow) (bgtask.Notification, bool, error) {
	var note bgtask.Notification
	if row.kind != string(bgtask.NotifyAllComplete) {
		err := json.Unmarshal(row.body, &note)
		return note, err == nil, err
	}
	round := slices.Compact(slices.Sorted(slices.Values(row.round)))
	bodies := map[string][]byte{} // task → the body of its delivered summary
	coming := false               // a summary of the round is among r's rows, not yet delivered
	for _, o := range r.rows {
		if o.kind != string(bgtask.NotifyFinalSummary) || !slices.Contains(round, o.task) {
			continue
		}
		if !o.sent {
			coming = true
		} else if _, ok := bodies[o.task]; !ok {
			bodies[o.task] = o.body
		}
	}
	if coming && row.age < claimGrace {
		return note, false, nil // it passes this all_complete first
	}
	var before []string
	for _, id := range round {
		if _, ok := bodies[id]; !ok {
			before = append(before, id)
		}
	}
	if len(before) > 0 {
		rows, err := n.pool.Query(ctx, `SELECT DISTINCT ON (task_id) task_id, body::text FROM bgtask_outbox
 WHERE ledger = $1 AND kind = 'final_summary' AND task_id = ANY($2) AND delivered_at IS NOT NULL ORDER BY task_id, id`, n.o.Ledger, before)
		if err != nil {
			return note, false, err
		}
		var task, body string
		_, err = pgx.ForEachRow(rows, []any{&task, &body}, func() error {
			bodies[task] = []byte(body)
			return nil
		})
		if err != nil {
			return note, false, err
		}
	}
	if len(bodies) < len(round) && row.age < claimGrace {
		return note, false, nil
	}
	byID := map[string]bgtask.Task{}
	for _, b := range bodies {
		var s bgtask.Notification
		if json.Unmarshal(b, &s) == nil {
			byID[s.TaskID] = s.Task
		}
	}
	tasks := make([]bgtask.Task, 0, len(row.round))
	seen := map[string]bool{}
	for _, id := range row.round { // in the order the round's tasks were launched
		if t, ok := byID[id]; ok && !seen[id] {
			seen[id] = true
			tasks = append(tasks, t)
		}
	}
	note = fleet.AllComplete(r.parent, tasks).(bgtask.Notification)
	note.ID = row.noteID
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

// querier is a pool or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// markRuns marks what runs delivered and releases their claims (with
// release) or renews them, in one statement: exchange, claiming nothing.
func (n *Node) markRuns(ctx context.Context, runs []*parentRun, release bool) (map[string]bool, error) {
	held, _, err := n.exchange(ctx, n.pool, runs, release, nil, 0)
	return held, err
}

// claimFor is how long a parent's claim holds once taken or renewed. A
// run renews it before a delivery once it is a third as old (writing
// what was delivered so far), so a Notify call (notifyFor at most)
// always ends under the claim.
func (n *Node) claimFor() time.Duration {
	if n.o.claimFor > 0 {
		return n.o.claimFor
	}
	return claimFor
}

// exchange is a round's one statement. It marks the rows each of done
// delivered and has not marked yet, and releases their parents' claims
// (with release) or renews them — each parent's only while this node
// still holds its claim: it returns those parents (held). A final summary
// stays (as delivered) until its round's all_complete is told; an
// all_complete takes its round's summaries with it; any other row goes.
// The marked rows of the held parents are no longer the runs' to mark.
//
// And it claims up to limit parents that have something to deliver —
// their oldest pending row is not an all_complete still waiting for its
// round's summaries — whose claim is free, expired or already this
// node's, and which neither skip nor done names, oldest first; and reads
// their pending rows (claimed). A parent another process is claiming at
// this moment is skipped, not waited for: the claimers take a
// transaction lock per parent with pg_try_advisory_xact_lock, which is
// SKIP LOCKED for a lock that is not a row's. So processes looking at
// once share the parents out, and none writes a claim it does not get (a
// claim row is inserted only where there is none, and updated only where
// it is expired or already this node's). A claimer locks the outbox rows
// of the parents it got only, after their claim rows, as the marks do,
// and both take the claim rows of one statement in one order (a parent's
// name): the marks of one process and the claims of another never wait
// on each other crosswise (but for a claim that expires in between).
func (n *Node) exchange(ctx context.Context, q querier, done []*parentRun, release bool, skip []string, limit int) (map[string]bool, []*parentRun, error) {
	var parents, keepParent, goneParent, sweepParent, sweepTask []string
	var keepID, goneID []int64
	for _, r := range done {
		parents = append(parents, r.parent)
		// From the last delivered back: a summary whose round's all_complete
		// was delivered after it goes with it.
		told := map[string]bool{}
		for k := len(r.sent) - 1; k >= 0; k-- {
			row := &r.rows[r.sent[k]]
			switch row.kind {
			case string(bgtask.NotifyAllComplete):
				goneID, goneParent = append(goneID, row.id), append(goneParent, r.parent)
				for _, t := range row.round {
					if !told[t] {
						told[t] = true
						sweepTask, sweepParent = append(sweepTask, t), append(sweepParent, r.parent)
					}
				}
			case string(bgtask.NotifyFinalSummary):
				if told[row.task] {
					goneID, goneParent = append(goneID, row.id), append(goneParent, r.parent)
				} else {
					keepID, keepParent = append(keepID, row.id), append(keepParent, r.parent)
				}
			default:
				goneID, goneParent = append(goneID, row.id), append(goneParent, r.parent)
			}
		}
	}
	skip = append(append([]string{}, skip...), parents...) // never nil: <> ALL(NULL) is never true
	asked := time.Now()
	rows, err := q.Query(ctx, exchangeSQL, n.o.Ledger, n.o.Member, parents, n.claimFor(), keepID, keepParent, goneID, goneParent,
		sweepParent, sweepTask, release, skip, limit, 4*limit, claimGrace, rowsPerParent)
	if err != nil {
		return nil, nil, err
	}
	defer rows.Close()
	held := map[string]bool{}
	var claimed []*parentRun
	for rows.Next() {
		var what int
		var parent string
		var id *int64
		var r outboxRow
		var noteID, kind, task, body *string
		var age *time.Duration
		if err := rows.Scan(&what, &parent, &id, &noteID, &kind, &task, &body, &r.round, &age); err != nil {
			return nil, nil, err
		}
		if what == 0 {
			held[parent] = true
			continue
		}
		if len(claimed) == 0 || claimed[len(claimed)-1].parent != parent {
			claimed = append(claimed, &parentRun{parent: parent, renewed: asked})
		}
		if id == nil { // claimed, and nothing left to deliver: released with the next marks
			continue
		}
		r.id, r.noteID, r.kind, r.task, r.body, r.age = *id, *noteID, *kind, *task, []byte(*body), *age
		run := claimed[len(claimed)-1]
		run.rows = append(run.rows, r)
		run.full = len(run.rows) == rowsPerParent
	}
	if err := rows.Err(); err != nil {
		return nil, nil, err
	}
	for _, r := range done {
		if !held[r.parent] {
			continue
		}
		if !release {
			r.renewed = asked
		}
		for _, i := range r.sent {
			if n.o.marked != nil {
				n.o.marked(r.rows[i].noteID)
			}
		}
		r.sent = r.sent[:0]
	}
	return held, claimed, nil
}

// exchangeSQL is exchange's statement: $1 ledger, $2 member; the marks:
// $3 the parents, $4 claimFor, $5/$6 the rows that stay (marked) and
// their parents, $7/$8 those that go, $9/$10 the parents and tasks of the
// rounds told, $11 release; the claim: $12 the parents to skip, $13 how
// many to claim, $14 how many oldest rows to look at for them, $15
// claimGrace, $16 rowsPerParent. Its rows are the held parents (0, the
// parent), then the claimed parents' rows (1, the parent, the row; nulls
// for a parent with none left), by parent and id.
const exchangeSQL = `WITH held AS (
  -- Expired or not: a claim is taken over only by a write of its row
  -- (which the lock here waits for, and then sees), so a row that still
  -- names this member was nobody else's meanwhile, and what this member
  -- delivered under it was delivered once.
  SELECT parent_session FROM bgtask_claims
   WHERE ledger = $1 AND member = $2 AND parent_session = ANY($3::text[])
   ORDER BY parent_session FOR UPDATE),
freed AS (
  DELETE FROM bgtask_claims c USING held h
   WHERE c.ledger = $1 AND c.parent_session = h.parent_session AND $11),
renewed AS (
  UPDATE bgtask_claims c SET until = now() + $4::interval FROM held h
   WHERE c.ledger = $1 AND c.parent_session = h.parent_session AND NOT $11),
kept AS (
  UPDATE bgtask_outbox o SET delivered_at = now() FROM unnest($5::bigint[], $6::text[]) AS k(id, parent)
   WHERE o.id = k.id AND k.parent IN (SELECT parent_session FROM held)),
gone AS (
  DELETE FROM bgtask_outbox o USING unnest($7::bigint[], $8::text[]) AS g(id, parent)
   WHERE o.id = g.id AND g.parent IN (SELECT parent_session FROM held)),
swept AS (
  DELETE FROM bgtask_outbox o USING unnest($9::text[], $10::text[]) AS s(parent, task)
   WHERE o.ledger = $1 AND o.kind = 'final_summary' AND o.task_id = s.task AND o.parent_session = s.parent
     AND o.delivered_at IS NOT NULL AND s.parent IN (SELECT parent_session FROM held)),
picked AS MATERIALIZED (
  SELECT c.parent_session FROM (
    SELECT o.parent_session FROM bgtask_outbox o
     WHERE o.ledger = $1 AND o.delivered_at IS NULL AND o.parent_session <> ALL($12::text[])
       -- the parent's oldest pending row (no older one: an ORDER BY id
       -- LIMIT 1 here let the planner walk all pending rows in id order)
       AND NOT EXISTS (SELECT 1 FROM bgtask_outbox e WHERE e.ledger = $1 AND e.parent_session = o.parent_session
                        AND e.delivered_at IS NULL AND e.id < o.id)
       -- and not an all_complete that waits for a summary not written yet
       -- (marked ready by the write of its last summary, else its tasks'
       -- summaries looked up by key, together)
       AND (o.kind <> 'all_complete' OR o.ready OR o.made <= now() - $15::interval
            OR (SELECT count(DISTINCT s.task_id) FROM bgtask_outbox s
                 WHERE s.ledger = $1 AND s.kind = 'final_summary' AND s.task_id = ANY(o.round_tasks))
               -- a task may be in its round twice (it lived again after a crash)
               >= (SELECT count(DISTINCT t) FROM unnest(o.round_tasks) t))
       AND NOT EXISTS (SELECT 1 FROM bgtask_claims k WHERE k.ledger = $1 AND k.parent_session = o.parent_session
                       AND k.until > now() AND k.member <> $2)
     ORDER BY o.id LIMIT $14) c
   -- Tried row by row, oldest first, until $13 parents are locked (the
   -- subquery's LIMIT keeps the call from being pushed down into it).
   WHERE pg_try_advisory_xact_lock(hashtextextended('bgtask claim ' || $1 || chr(31) || c.parent_session, 0))
   LIMIT $13),
ins AS (
  INSERT INTO bgtask_claims (ledger, parent_session, member, until)
  SELECT $1, p.parent_session, $2, now() + $4::interval FROM picked p
   WHERE NOT EXISTS (SELECT 1 FROM bgtask_claims c WHERE c.ledger = $1 AND c.parent_session = p.parent_session)
   ORDER BY p.parent_session
  ON CONFLICT (ledger, parent_session) DO NOTHING
  RETURNING parent_session),
upd AS (
  UPDATE bgtask_claims c SET member = $2, until = now() + $4::interval FROM picked p
   WHERE c.ledger = $1 AND c.parent_session = p.parent_session AND (c.until <= now() OR c.member = $2)
  RETURNING c.parent_session),
claimed AS (SELECT parent_session FROM ins UNION ALL SELECT parent_session FROM upd)
SELECT 0, h.parent_session, NULL::bigint, NULL::text, NULL::text, NULL::text, NULL::text, NULL::text[], NULL::interval FROM held h
UNION ALL
SELECT 1, p.parent_session, r.id, r.note_id, r.kind, r.task_id, coalesce(r.body::text, ''), coalesce(r.round_tasks, '{}'), now() - r.made
  FROM claimed p LEFT JOIN LATERAL (
    SELECT * FROM bgtask_outbox o WHERE o.ledger = $1 AND o.parent_session = p.parent_session AND o.delivered_at IS NULL
     ORDER BY o.id LIMIT $16
     -- Locked, each row is read as it is now: the claim may have been
     -- another process's, released (its marks with it) after this
     -- statement's snapshot was taken.
     FOR UPDATE) r ON true
 ORDER BY 1, 2, 3`
