package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/fleet"
)

// outboxChannel is the channel NOTIFY wakes the deliverers on; the
// payload is the ledger.
const outboxChannel = "bgtask_outbox"

// Delivery across processes. With NodeOptions.Notifier, every Manager of
// the node is given an outboxNotifier, which takes the notifications with
// the commits that produce them (fleet.AtCommit): bgtask_write writes
// each to bgtask_notes in its commit, and makes each parent round's
// all_complete there too, in the commit that ends the round's last task,
// whichever process that commit is from (migration 10, write.go).
//
// The node's deliverer hands the rows to the Notifier: per parent session
// in the order they were written, one process per part at a time (a claim
// on the part, with an expiry), exactly once without a crash, at least
// once across one, each with its stable ID. It works in rounds of one
// statement each (roundSQL): the statement deletes what the last round
// delivered (a row this node delivered goes whoever holds its part now:
// the sooner it goes, the likelier a process that took the part over
// after a stall does not deliver it again); renews the claims that are
// due, or releases them all as the node closes; claims the parts that
// have rows and whose claim is free, expired or this node's already,
// skipping those another process is claiming at that moment; and reads
// up to rowsPerPart rows of each part held, but for the parents still
// being delivered or waiting out a failure. deliverWorkers goroutines
// deliver them, several parents side by side, each parent's rows in
// order; the next round deletes them.
const (
	noteParts     = 16               // the outbox's parts (bgtask_part): a part is delivered by one process at a time
	claimFor      = 30 * time.Second // a part's claim, renewed once a third as old
	notifyFor     = 10 * time.Second // one Notify call's bound
	markFor       = 10 * time.Second // one statement of the deliverer's
	rowsPerPart   = 256              // the rows of a part a round reads at most
	bellEvery     = 5 * time.Millisecond
	straggleAfter = 100 * time.Millisecond // a round waits this long for its slowest parents; what they deliver is deleted once they are done

	deliverWorkers = 8 // a node's goroutines that call the Notifier, each for one parent at a time
)

// outboxNotifier is a Manager's notifier in a node with a Notifier: it
// takes the Manager's notifications with their commits (NotesAtCommit),
// so the Manager never calls Notify.
type outboxNotifier struct{}

// NotesAtCommit makes outboxNotifier a fleet.AtCommit.
func (outboxNotifier) NotesAtCommit() {}

// errNotAtCommit is what Notify answers: a Manager with a journal never
// calls it.
var errNotAtCommit = errors.New("pgledger: a notification came to the outbox outside its commit")

func (outboxNotifier) Notify(context.Context, bgtask.Notification) error { return errNotAtCommit }

// outboxNotes are the notifications one commit carries (fleet.NoteOf),
// as bgtask_write takes them: each one's parent session, ID, kind, task
// and JSON. A Manager's own all_complete is not among them: the ledger
// makes each round's, from all of its members' tasks.
type outboxNotes struct{ parent, id, kind, task, body []string }

// add takes rec's notification, if it carries one.
func (o *outboxNotes) add(rec *bgtask.Record) error {
	if rec.Kind != "notification_produced" {
		return nil
	}
	note, ok := fleet.NoteOf(rec).(*bgtask.Notification)
	if !ok || note.Kind == bgtask.NotifyAllComplete {
		return nil
	}
	body, err := json.Marshal(note)
	if err != nil {
		return fmt.Errorf("pgledger: encoding notification %s: %w", note.ID, err)
	}
	o.parent, o.id, o.kind = append(o.parent, note.ParentSessionID), append(o.id, note.ID), append(o.kind, string(note.Kind))
	o.task, o.body = append(o.task, note.TaskID), append(o.body, string(body))
	return nil
}

// noteWritten is what a member's journal tells the node once a commit
// wrote notes to parts (a bit each): its deliverer looks at once, and if
// it does not hold them all, the other nodes' are rung for.
func (n *Node) noteWritten(parts uint32) {
	n.wakeDeliverer()
	if parts&^n.heldParts.Load() != 0 {
		select {
		case n.rang <- struct{}{}:
		default:
		}
	}
}

// bell wakes the ledger's deliverers (NOTIFY) when rung, bellEvery at
// most, until ctx ends: one statement for the commits of that while.
func (n *Node) bell(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.rang:
		}
		c, cancel := context.WithTimeout(ctx, markFor)
		_, err := n.pool.Exec(c, `SELECT pg_notify($1, $2)`, outboxChannel, n.o.Ledger)
		cancel()
		if err != nil && ctx.Err() == nil {
			n.o.Logger.Debug("pgledger: waking the deliverers", "err", err) // they poll
		}
		t.Reset(bellEvery)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// markCtx is the context of one of the deliverer's statements: markFor
// long, and closeGrace at most once loop (the node's, nil: none) ends.
// What was delivered as the node closes is still deleted, but a database
// that does not answer holds Close up for closeGrace at most.
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
// own: only deliverLoop's goroutine uses n.backoff).
type backoff struct {
	wait time.Duration
	next time.Time
}

// noteRow is one row of the outbox.
type noteRow struct {
	id                 int64
	noteID, kind, body string
}

// parentRun is one parent's rows of one round, delivered in order by a
// worker: sent are those delivered (to be deleted by the next round).
type parentRun struct {
	parent  string
	part    int
	until   time.Time // deliver nothing past this: the claim may need renewing first
	rows    []noteRow
	sent    []int64
	failed  bool // a delivery failed: the parent waits out a backoff
	stopped bool // until came: the rest is delivered after the next round renews the claim
}

// heldPart is a part this node holds a claim on.
type heldPart struct {
	renewed time.Time // when the claim was taken or last renewed (asked): it holds claimFor from then
}

// sentRow is a row delivered, not deleted yet.
type sentRow struct {
	part int
	id   int64
	note string // its notification's ID (the marked hook)
}

// deliverer is deliverLoop's state.
type deliverer struct {
	n       *Node
	jobs    chan *parentRun // to the workers
	results chan *parentRun // from the workers
	parts   map[int]*heldPart
	busy    map[string]*parentRun // parents a worker has
	done    []sentRow             // delivered, not yet deleted
	warned  bool                  // a statement failed, and it was logged: the next failures are not, until one succeeds
	made    bool                  // the ledger's rows of bgtask_parts are there
	failed  bool                  // the last round's statement failed: the next waits for a wake-up or Poll
}

// trouble logs err, the first of an outage (nil: the database answered).
func (d *deliverer) trouble(what string, err error) {
	d.failed = err != nil
	switch {
	case err == nil:
		d.warned = false
	case !d.warned:
		d.warned = true
		d.n.o.Logger.Warn("pgledger: "+what+"; tried again", "err", err)
	}
}

func newDeliverer(n *Node) *deliverer {
	return &deliverer{n: n, jobs: make(chan *parentRun, deliverWorkers), results: make(chan *parentRun, deliverWorkers),
		parts: map[int]*heldPart{}, busy: map[string]*parentRun{}}
}

// deliverLoop delivers the outbox until ctx ends: at once when woken,
// and every Poll. It owns the bell and the delivery workers, and joins
// them before it returns, once it has deleted what they delivered and
// released its claims.
func (n *Node) deliverLoop(ctx context.Context) {
	defer n.done.Done()
	rung := make(chan struct{})
	go func() { defer close(rung); n.bell(ctx) }()
	defer func() { <-rung }()

	d := newDeliverer(n)
	workers := make(chan struct{})
	for range deliverWorkers {
		go func() {
			defer func() { workers <- struct{}{} }()
			for r := range d.jobs {
				n.deliverRun(ctx, r)
				d.results <- r
			}
		}()
	}
	queue := []*parentRun{} // runs waiting for a worker
	defer func() {
		close(d.jobs)
		for left := deliverWorkers; left > 0; { // ctx ended: each run they have stops at once
			select {
			case <-workers:
				left--
			case r := <-d.results:
				d.finished(r)
			}
		}
		for len(d.results) > 0 {
			d.finished(<-d.results)
		}
		for _, r := range queue {
			delete(d.busy, r.parent)
		}
		d.round(ctx, nil) // deletes what was delivered, and releases every claim; claims nothing
	}()

	t := time.NewTicker(n.o.Poll)
	defer t.Stop()
	for {
		for ctx.Err() == nil {
			more, runs := d.round(ctx, queue)
			queue = d.dispatch(ctx, runs)
			if d.idle(more) {
				break
			}
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

// idle reports whether the deliverer waits for a wake-up or Poll after a
// round that found no more (more): what was delivered meanwhile is
// deleted at once — unless the database did not answer that round, which
// must not be asked again at once, round after round, for as long as it
// is away.
func (d *deliverer) idle(more bool) bool {
	return !more && (len(d.done) == 0 || d.failed)
}

// dispatch hands runs to the workers and waits for them, straggleAfter
// at most (what the stragglers deliver is deleted once they are done); it returns
// the runs no worker took yet (none: the workers' queue holds a run per
// worker, and a round reads no parent a worker has).
func (d *deliverer) dispatch(ctx context.Context, runs []*parentRun) []*parentRun {
	if len(runs) == 0 {
		return nil
	}
	wait := time.NewTimer(straggleAfter)
	defer wait.Stop()
	out := len(runs)
	for len(runs) > 0 || out > 0 {
		var jobs chan *parentRun
		var next *parentRun
		if len(runs) > 0 {
			jobs, next = d.jobs, runs[0]
		}
		select {
		case jobs <- next:
			runs = runs[1:]
		case r := <-d.results:
			d.finished(r)
			out--
		case <-wait.C:
			if len(runs) == 0 {
				return nil
			}
			wait.Reset(straggleAfter) // the rest still goes out, each in turn
		case <-ctx.Done():
			return runs
		}
	}
	return nil
}

// finished takes r back from a worker: what it delivered waits for its
// delete, and its parent's backoff follows how it went.
func (d *deliverer) finished(r *parentRun) {
	n := d.n
	delete(d.busy, r.parent)
	for _, id := range r.sent {
		note := ""
		for _, row := range r.rows {
			if row.id == id {
				note = row.noteID
				break
			}
		}
		d.done = append(d.done, sentRow{part: r.part, id: id, note: note})
	}
	if r.stopped {
		n.wakeDeliverer() // the next round renews its claim, and reads the rest
	}
	if r.failed {
		b := n.backoff[r.parent]
		b.wait = min(max(2*b.wait, n.o.Poll), maxBackoff)
		b.next = time.Now().Add(b.wait)
		n.backoff[r.parent] = b
	} else {
		delete(n.backoff, r.parent)
	}
}

// round is one statement (roundSQL): it deletes what was delivered,
// renews the claims that are due (or, once ctx ended, releases them all
// and claims nothing), and reads the rows of the parts held, but for the
// parents of queue and of the runs still out. It returns the runs to
// deliver, a parent each, and whether to go again at once (deletes were
// written, a part had more rows than it read, a run stopped for its
// claim's renewal).
func (d *deliverer) round(ctx context.Context, queue []*parentRun) (bool, []*parentRun) {
	n := d.n
	closing := ctx.Err() != nil
	if closing && len(d.done) == 0 && len(d.parts) == 0 {
		return false, nil
	}
	heldParts := []int32{}
	var renew []int32
	now := time.Now()
	for p, h := range d.parts {
		heldParts = append(heldParts, int32(p))
		if now.Sub(h.renewed) > n.claimFor()/3 {
			renew = append(renew, int32(p))
		}
	}
	delParts, delIDs := []int32{}, []int64{}
	for _, s := range d.done {
		delParts, delIDs = append(delParts, int32(s.part)), append(delIDs, s.id)
	}
	skip := []string{}
	for p := range d.busy {
		skip = append(skip, p)
	}
	for _, r := range queue {
		skip = append(skip, r.parent)
	}
	for p, b := range n.backoff {
		switch {
		case now.Before(b.next):
			skip = append(skip, p)
		case now.Sub(b.next) > maxBackoff:
			delete(n.backoff, p) // another process delivered it, most likely
		}
	}
	limit := noteParts - len(d.parts)
	if closing {
		limit = 0
	}
	c, cancel := n.markCtx(ctx)
	defer cancel()
	if !d.made {
		// The outbox's parts, each a row its claims are written to.
		if _, err := n.pool.Exec(c, `INSERT INTO bgtask_parts (ledger, part) SELECT $1, g FROM generate_series(0, $2::int - 1) g
ON CONFLICT (ledger, part) DO NOTHING`, n.o.Ledger, noteParts); err != nil {
			d.trouble("making the outbox's parts", err)
			return false, nil
		}
		d.made = true
	}
	asked := time.Now()
	rows, err := n.pool.Query(c, roundSQL, n.o.Ledger, n.o.Member, heldParts, delParts, delIDs, renew, n.claimFor(),
		closing, limit, skip, rowsPerPart)
	if err != nil {
		d.trouble("delivering notifications", err)
		// What was delivered is kept, however long the database takes to
		// answer, and deleted once it does: an expired claim that nobody
		// took over is still this node's, so that a stall delivers nothing
		// twice.
		return false, nil
	}
	held := map[int]bool{}
	var runs []*parentRun
	full := map[int]int{}
	for rows.Next() {
		var what, part int32
		var num int64
		var parent, noteID, kind, body *string
		if err := rows.Scan(&what, &part, &num, &parent, &noteID, &kind, &body); err != nil {
			rows.Close()
			d.trouble("delivering notifications", err)
			return false, nil
		}
		if what == 0 {
			held[int(part)] = true
			continue
		}
		full[int(part)]++
		if len(runs) == 0 || runs[len(runs)-1].parent != *parent || runs[len(runs)-1].part != int(part) {
			// A parent's rows come together: ordered by part, parent, id.
			runs = append(runs, &parentRun{parent: *parent, part: int(part)})
		}
		r := runs[len(runs)-1]
		r.rows = append(r.rows, noteRow{id: num, noteID: *noteID, kind: *kind, body: *body})
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		d.trouble("delivering notifications", err)
		return false, nil
	}
	d.trouble("", nil)
	for _, s := range d.done {
		if n.o.marked != nil {
			n.o.marked(s.note)
		}
	}
	wrote := len(d.done) > 0
	d.done = d.done[:0]
	renewed := map[int32]bool{}
	for _, p := range renew {
		renewed[p] = true
	}
	var mask uint32
	for p := range d.parts {
		if !held[p] {
			delete(d.parts, p) // lost: whoever holds it goes on
		}
	}
	for p := range held {
		h := d.parts[p]
		if h == nil {
			h = &heldPart{renewed: asked} // claimed by this round
			d.parts[p] = h
		} else if renewed[int32(p)] {
			h.renewed = asked
		}
		mask |= 1 << p
	}
	n.heldParts.Store(mask)
	more := wrote
	for _, k := range full {
		more = more || k >= rowsPerPart
	}
	for _, r := range runs {
		r.until = d.parts[r.part].renewed.Add(n.claimFor() / 3)
		d.busy[r.parent] = r
	}
	return more, runs
}

// roundSQL is round's statement: $1 ledger, $2 member; $3 the parts
// this node holds; $4/$5 the rows delivered (part, id); $6 the held parts
// whose claims are due for renewal, $7 claimFor; $8 closing (release
// every claim: nobody need wait for it to expire); $9 how many parts to
// claim at most; $10 the parents not to read; $11 rowsPerPart. Its rows
// are the parts held (0, part), then their rows (1, part, id, parent,
// note id, kind, body), by part, parent and id.
//
// A part's claim is this node's while its row names this member, expired
// or not: it is taken over only by a write of its row, once expired,
// which the lock here waits for and then sees. Claimers skip a part row
// another process has locked (SKIP LOCKED): processes looking at once
// share the parts out.
const roundSQL = `WITH mine AS (
  SELECT p.part FROM bgtask_parts p
   WHERE p.ledger = $1 AND p.member = $2 AND p.part = ANY($3::int[])
   ORDER BY p.part FOR UPDATE),
gone AS (
  DELETE FROM bgtask_notes n USING unnest($4::int[], $5::bigint[]) AS d(part, id)
   WHERE n.ledger = $1 AND n.part = d.part AND n.id = d.id),
kept AS (
  UPDATE bgtask_parts p SET until = CASE WHEN $8 THEN '-infinity'::timestamptz ELSE now() + $7::interval END
    FROM mine m WHERE p.ledger = $1 AND p.part = m.part AND ($8 OR p.part = ANY($6::int[]))),
free AS (
  SELECT p.part FROM bgtask_parts p
   WHERE p.ledger = $1 AND p.part <> ALL($3::int[]) AND (p.until < now() OR p.member = $2)
     AND EXISTS (SELECT 1 FROM bgtask_notes n WHERE n.ledger = $1 AND n.part = p.part)
   ORDER BY p.part LIMIT $9 FOR UPDATE SKIP LOCKED),
took AS (
  UPDATE bgtask_parts p SET member = $2, until = now() + $7::interval
    FROM free f WHERE p.ledger = $1 AND p.part = f.part
  RETURNING p.part),
kept_parts AS (SELECT part FROM mine WHERE NOT $8)
SELECT 0, h.part, 0::bigint, NULL::text, NULL::text, NULL::text, NULL::text FROM (SELECT part FROM kept_parts UNION ALL SELECT part FROM took) h
UNION ALL
SELECT 1, r.part, r.id, r.parent_session, r.note_id, r.kind, r.body
  FROM kept_parts h CROSS JOIN LATERAL (
    SELECT n.part, n.id, n.parent_session, n.note_id, n.kind, n.body FROM bgtask_notes n
     WHERE n.ledger = $1 AND n.part = h.part AND n.id <> ALL($5::bigint[]) AND n.parent_session <> ALL($10::text[])
     ORDER BY n.id LIMIT $11) r
UNION ALL
-- A part just taken over is read locked, each row as it is now: the
-- process that held it may have deleted rows (and released it) after
-- this statement's snapshot was taken.
SELECT 1, r.part, r.id, r.parent_session, r.note_id, r.kind, r.body
  FROM took h CROSS JOIN LATERAL (
    SELECT n.part, n.id, n.parent_session, n.note_id, n.kind, n.body FROM bgtask_notes n
     WHERE n.ledger = $1 AND n.part = h.part AND n.parent_session <> ALL($10::text[])
     ORDER BY n.id LIMIT $11 FOR UPDATE) r
 ORDER BY 1, 2, 4, 3`

// deliverRun delivers r's rows in order, and stops at a failed delivery
// (r.failed: the order is kept; it is tried again after a backoff), or
// once the claim needs renewing before another Notify call (r.stopped),
// so that a call always ends under the claim.
func (n *Node) deliverRun(ctx context.Context, r *parentRun) {
	for _, row := range r.rows {
		if ctx.Err() != nil {
			return
		}
		if time.Now().After(r.until) {
			r.stopped = true
			return
		}
		note, err := noteOf(r.parent, row)
		if err != nil {
			// Not a notification this package wrote: it cannot be told, and
			// it must not hold its parent's later ones up for good.
			n.o.Logger.Error("pgledger: a notification in the outbox cannot be read; it is dropped", "parent", r.parent, "id", row.noteID, "err", err)
			r.sent = append(r.sent, row.id)
			continue
		}
		if err := n.notify(ctx, note); err != nil {
			if ctx.Err() == nil { // else the node closes: the row stays, for whoever delivers it next
				n.o.Logger.Warn("pgledger: delivering a notification failed; it is tried again", "parent", r.parent, "id", note.ID, "err", err)
			}
			r.failed = true
			return
		}
		r.sent = append(r.sent, row.id)
	}
}

// noteOf is the notification row tells: its JSON, or for an all_complete
// one made of its round's final summaries (a JSON array of them, in the
// order the round's tasks were launched).
func noteOf(parent string, row noteRow) (bgtask.Notification, error) {
	var note bgtask.Notification
	if row.kind != string(bgtask.NotifyAllComplete) {
		err := json.Unmarshal([]byte(row.body), &note)
		return note, err
	}
	var sums []bgtask.Notification
	if err := json.Unmarshal([]byte(row.body), &sums); err != nil {
		return note, err
	}
	tasks := make([]bgtask.Task, 0, len(sums))
	for _, s := range sums {
		if !slices.ContainsFunc(tasks, func(t bgtask.Task) bool { return t.ID == s.Task.ID }) {
			tasks = append(tasks, s.Task)
		}
	}
	note = fleet.AllComplete(parent, tasks).(bgtask.Notification)
	note.ID = row.noteID
	return note, nil
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

// claimFor is how long a part's claim holds once taken or renewed. A run
// delivers nothing once its claim is a third as old, until a round
// renewed it, so a Notify call (notifyFor at most) always ends under the
// claim.
func (n *Node) claimFor() time.Duration {
	if n.o.claimFor > 0 {
		return n.o.claimFor
	}
	return claimFor
}
