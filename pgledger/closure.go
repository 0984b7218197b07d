package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/jackc/pgx/v5"
)

// closureChannel is the channel NOTIFY asks owners to stop the runs of a
// closure on; the payload is "ledger\x1fclosure id".
const closureChannel = "bgtask_closure"

// fenceLock is the advisory lock a launch's fence check (bgtask_admit)
// takes shared and a closure's opening takes exclusive, per ledger: a
// launch either saw the fence, or its launching row is there for the
// closure to wait for. bgtask_admit spells it the same way.
func fenceLock(ledger string) string { return "bgtask fence " + ledger }

// UnstoppedRun is a run in a closure's scope that was still live in the
// database when Node.Stop returned: its run, the member that owns it and
// the process holding that member's lease, and why it did not stop.
type UnstoppedRun struct {
	bgtask.StoppedRun
	Member string `json:"member"`
	Holder string `json:"holder"`
	Reason string `json:"reason"`
}

// UnstoppedError is the error of Node.Stop of a closure (Target.Session, or
// Target.Task with Tree) when some run in scope did not stop: its abort
// failed, its owner is gone and no process has taken it over yet, or the
// caller's context ended first (Err).
type UnstoppedError struct {
	SessionID string
	Runs      []UnstoppedRun
	Err       error // the context's error, if it ended first
}

func (e *UnstoppedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "pgledger: branch %s did not stop: ", e.SessionID)
	for i, r := range e.Runs {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "task %s run %s (member %s, process %s): %s", r.TaskID, r.Token, r.Member, r.Holder, r.Reason)
	}
	if e.Err != nil {
		fmt.Fprintf(&b, " (%v)", e.Err)
	}
	return b.String()
}

func (e *UnstoppedError) Unwrap() error { return e.Err }

// admit checks a launch from parent against the fence of every open
// closure and, if no closure's branch holds parent, records the launch as
// in flight (bgtask_write clears it when its task_launched lands): under
// the fence lock, shared, in one statement with the launches that come
// with it (bgtask_admit_launches). Unless checked (its budget admitted
// it), a launch from a session of a task that spends from a budget is
// answered errBudgetFirst instead, unchecked.
func (n *Node) admit(ctx context.Context, member, id, parent string, checked bool) error {
	until, _ := ctx.Deadline()
	closure, err := n.admits.do(ctx, admission{task: id, parent: parent, member: member, until: until, checked: checked})
	if err != nil {
		return dbErr("checking the fence", err)
	}
	switch {
	case closure == nil:
		return nil
	case *closure < 0:
		return errBudgetFirst
	}
	return fmt.Errorf("%w: session %s is inside the branch closure %d is closing", bgtask.ErrBranchClosing, parent, *closure)
}

// errBudgetFirst is admit's answer for a launch whose budget must admit
// it first.
var errBudgetFirst = errors.New("pgledger: the launch's budget admits it first")

// admission is a launch's fence check: its task, the session it is
// launched from and the member it launches on, and until when its caller
// waits for it (zero: no deadline).
type admission struct {
	task, parent, member string
	until                time.Time
	checked              bool // its budget admitted it (bgtask_admit_launches)
}

// alone reports whether q must be sent alone: the database refuses text
// that is not UTF-8 or holds a NUL, and the statement that carried it
// would fail every call in it.
func (q admission) alone() bool {
	for _, s := range [...]string{q.task, q.parent, q.member} {
		if !utf8.ValidString(s) || strings.IndexByte(s, 0) >= 0 {
			return true
		}
	}
	return false
}

// admitAll is the admits' statement: a closure's id for each launch a
// fence holds, nil for each admitted.
func (n *Node) admitAll(ctx context.Context, qs []admission) ([]*int64, error) {
	task, parent, member, checked := make([]string, len(qs)), make([]string, len(qs)), make([]string, len(qs)), make([]bool, len(qs))
	// The statement may take as long as its longest-waiting caller, and
	// no longer than the batch's bound; past that, what it did is rolled
	// back, even if the server goes on with it after its connection was
	// dropped (a context that ends drops it, not the statement).
	within := batchFor
	if d, ok := ctx.Deadline(); ok {
		within = time.Until(d)
	}
	longest := time.Duration(0)
	for i, q := range qs {
		task[i], parent[i], member[i], checked[i] = q.task, q.parent, q.member, q.checked
		if q.until.IsZero() {
			longest = within
		} else {
			longest = max(longest, time.Until(q.until))
		}
	}
	within = max(min(within, longest), 0)
	var out []*int64
	if err := n.pool.QueryRow(ctx, `SELECT bgtask_admit_launches($1, $2, $3, $4, $5, $6::interval)`, n.o.Ledger, task, parent, member, checked, within).Scan(&out); err != nil {
		return nil, err
	}
	return out, nil
}

// admitDropped clears the launch of a caller that left before it was
// admitted.
func (n *Node) admitDropped(ctx context.Context, q admission, closure *int64) {
	if closure == nil {
		n.cleanUp(ctx, "launch's fence check", func(c context.Context) error { return n.admitted(c, q.task) })
	}
}

// gateStart is every Manager's start gate: a session start of a task
// inside a branch a closure is closing — a retry its owner decided before
// it heard of the closure, a launch that did not come through Node.Launch
// — is refused, so nothing new starts in the branch from the closure's
// commit on. A start that passed before is in flight at the fence, and
// the closure stops its run. The starts that come together are checked in
// one statement (bgtask_start_fenced_all).
func (n *Node) gateStart(ctx context.Context, req bgtask.SessionRequest) error {
	var closure *int64
	// A refusal is for good (the attempt ends in error): a database that
	// does not answer is asked again, until ctx ends or for startGateFor —
	// longer than any lease, so a journal that cannot reach the database
	// has failed by then and the Manager has stopped without this answer.
	deadline := time.Now().Add(startGateFor)
	err := untilAnswered(ctx, func() bool { return time.Now().After(deadline) }, func() error {
		var err error
		closure, err = n.gates.do(ctx, admission{task: req.TaskID, parent: req.ParentSessionID})
		return err
	})
	if err != nil {
		return dbErr("checking the fence", err)
	}
	if closure != nil {
		return fmt.Errorf("%w: task %s is inside the branch closure %d is closing", bgtask.ErrBranchClosing, req.TaskID, *closure)
	}
	return nil
}

// gateAll is the start gates' statement: a closure's id for each start a
// fence holds, nil for each let through.
func (n *Node) gateAll(ctx context.Context, qs []admission) ([]*int64, error) {
	task, parent := make([]string, len(qs)), make([]string, len(qs))
	for i, q := range qs {
		task[i], parent[i] = q.task, q.parent
	}
	var out []*int64
	if err := n.pool.QueryRow(ctx, `SELECT bgtask_start_fenced_all($1, $2, $3)`, n.o.Ledger, task, parent).Scan(&out); err != nil {
		return nil, err
	}
	return out, nil
}

// startGateFor bounds how long a start waits for the database to answer
// its fence check.
const startGateFor = 2 * time.Minute

// admitted clears a launch that was admitted but did not land.
func (n *Node) admitted(ctx context.Context, id string) error {
	if _, err := n.pool.Exec(ctx, `DELETE FROM bgtask_launching WHERE ledger = $1 AND task_id = $2`, n.o.Ledger, id); err != nil {
		return fmt.Errorf("clearing the launch in flight of task %s: %w", id, err)
	}
	return nil
}

// launchBegins counts a launch of task id in flight in this node.
func (n *Node) launchBegins(id string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.inflight == nil {
		n.inflight = map[string]int{}
	}
	n.inflight[id]++
}

// launchEnds counts it out; one that failed may have left its row of
// bgtask_launching behind (a fence check that committed after its caller
// left, a clearing the database did not answer): sweepLaunching looks.
func (n *Node) launchEnds(id string, failed bool) {
	n.mu.Lock()
	if n.inflight[id]--; n.inflight[id] <= 0 {
		delete(n.inflight, id)
	}
	n.mu.Unlock()
	if failed {
		n.leftover.Store(true)
	}
}

// sweepLaunchingSQL deletes the launches in flight of members $2 that no
// Node.Launch of this node has in flight ($4) and that are older than $3
// (the lease: a commit whose outcome was unknown has landed, clearing its
// row, or its journal has failed, by then), and counts those of them not
// old enough yet.
const sweepLaunchingSQL = `WITH mine AS (
  SELECT task_id, at < now() - $3::interval AS old FROM bgtask_launching
   WHERE ledger = $1 AND member = ANY($2::text[]) AND task_id <> ALL($4::text[])),
d AS (
  DELETE FROM bgtask_launching l USING mine WHERE l.ledger = $1 AND l.task_id = mine.task_id AND mine.old
  RETURNING 1)
SELECT count(*) FILTER (WHERE NOT old), (SELECT count(*) FROM d) FROM mine`

// sweepLaunching clears what launches that failed left in flight, once a
// failed one may have (and until none is left): a closure of their branch
// would wait for them while their member lives.
func (n *Node) sweepLaunching(ctx context.Context) {
	if !n.leftover.Swap(false) {
		return
	}
	n.mu.Lock()
	inflight := make([]string, 0, len(n.inflight))
	for id := range n.inflight {
		inflight = append(inflight, id)
	}
	n.mu.Unlock()
	c, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var young, swept int
	err := n.pool.QueryRow(c, sweepLaunchingSQL, n.o.Ledger, n.Members(), n.o.Lease, inflight).Scan(&young, &swept)
	if err != nil || young > 0 {
		n.leftover.Store(true) // look again at the next pass
	}
	if swept > 0 {
		n.o.Logger.Info("pgledger: cleared launches left in flight by launches that failed", "launches", swept)
	}
}

// admittedIf is admitted of a launch that was admitted (if), else
// nothing.
func (n *Node) admittedIf(ctx context.Context, admitted bool, id string) error {
	if !admitted {
		return nil
	}
	return n.admitted(ctx, id)
}

// scopeRun is a live run (or a launch in flight) in a closure's scope.
type scopeRun struct {
	ref     bgtask.RunRef
	session string
	member  string
	holder  string
	pending bool // a launch past the fence whose task is not durable yet
}

// scopeQuery lists the live runs in the branch of root $2 (and of task $3
// as a unit), of the members in $4 (all if null), and the launches in
// flight from it: the tasks whose parent is the root or any session
// (current or superseded) of a task in scope, recursively. (A launch in
// flight looks its parent session up: the launches are few, the sessions
// of the ledger many. A launch whose task landed is in flight no more: its
// row is one a late fence check left, which retention deletes.)
const scopeQuery = `
WITH RECURSIVE scope(task_id) AS (
    SELECT s.task_id FROM bgtask_sessions s WHERE s.ledger = $1 AND s.session_id = $2
  UNION
    SELECT t.task_id FROM bgtask_tasks t WHERE t.ledger = $1 AND (($2 <> '' AND t.parent_session = $2) OR t.task_id = $3)
  UNION
    SELECT t.task_id FROM scope sc
      JOIN bgtask_sessions s ON s.ledger = $1 AND s.task_id = sc.task_id
      JOIN bgtask_tasks t ON t.ledger = $1 AND t.parent_session = s.session_id
)
SELECT t.task_id, t.attempt_id, t.token,
       coalesce((SELECT s.session_id FROM bgtask_sessions s WHERE s.ledger = $1 AND s.attempt_id = t.attempt_id LIMIT 1), ''),
       t.member, coalesce(m.holder, ''), false
  FROM scope JOIN bgtask_tasks t ON t.ledger = $1 AND t.task_id = scope.task_id
  LEFT JOIN bgtask_members m ON m.ledger = $1 AND m.member = t.member
 WHERE NOT t.ended AND ($4::text[] IS NULL OR t.member = ANY($4))
UNION ALL
SELECT l.task_id, '', '', '', l.member, m.holder, true
  FROM bgtask_launching l JOIN bgtask_members m ON m.ledger = $1 AND m.member = l.member AND m.expires_at > now()
 WHERE l.ledger = $1 AND $4::text[] IS NULL
   AND NOT EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = $1 AND t.task_id = l.task_id)
   AND (($2 <> '' AND l.parent_session = $2) OR EXISTS (SELECT 1 FROM bgtask_sessions s
        WHERE s.ledger = $1 AND s.session_id = l.parent_session AND s.task_id IN (SELECT task_id FROM scope)))`

// scope lists closure k's live runs (of members, if not nil).
func (n *Node) scope(ctx context.Context, k openClosure, members []string) ([]scopeRun, error) {
	rows, err := n.pool.Query(ctx, scopeQuery, n.o.Ledger, k.root, k.task, members)
	if err != nil {
		return nil, fmt.Errorf("pgledger: the scope of closure %d: %w", k.id, err)
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (scopeRun, error) {
		var r scopeRun
		err := row.Scan(&r.ref.TaskID, &r.ref.AttemptID, &r.ref.Token, &r.session, &r.member, &r.holder, &r.pending)
		return r, err
	})
}

// openClosure is a closure row whose fence holds.
type openClosure struct {
	id         int64
	root, task string
	actor      string // who acted (Target.Actor), if named
}

// Stop stops what t names, as Manager.Stop does, and reaches across the
// fleet for a closure:
//
//   - t.Session stops the branch below that session, whichever process owns
//     each run in it. The scope is bgtask's (Manager.Stop with
//     Target.Session): the session's own task as a unit, and every task
//     launched from it or from any session of a task in scope, recursively
//     — found in the database, so a branch may span processes.
//   - t.Task with t.Tree stops that task as a unit across the fleet: its
//     live run, and what any of its sessions launched, in the same scope.
//   - t.Task, or t.Run, without Tree is stopped by the member that has the
//     task, as Manager.Stop stops it: here, or, for another process's
//     task, by its owner, asked through its inbox (it records the stop and
//     answers; this waits, unless t.NoWait, until the run has ended in the
//     ledger). A task no member of the ledger has is bgtask.ErrUnknownTask;
//     one whose owner's lease lapsed, with no process taking it over yet,
//     matches ErrOwnerGone, and nothing is asked.
//
// A closure (Session, or Task with Tree) returns once each run in its scope
// is terminal in the database. The fence is raised in the database as the
// closure's row is inserted: from that commit on, Node.Launch anywhere with
// a parent in scope returns bgtask.ErrBranchClosing (a launch already past
// its check is waited for, and stopped). Each owner is asked by NOTIFY —
// and finds out by polling every Poll if the notification is missed — and
// stops its runs exactly by token (Manager.Stop with Target.Run, whose
// Cause names the closure), so a run that was replaced meanwhile is never
// touched: the new attempt is stopped in its turn. A retry its owner
// decided before it heard of the closure may still start; it is stopped
// like any other run in scope.
//
// A closure returns a nil error only when no run in scope is live.
// Otherwise its *UnstoppedError names each run that did not stop, the
// member that owns it and the process holding that member: a failed abort,
// or a run still live when ctx ended. Either way the fence comes down and
// the closure's record — bgtask.ClosureReport, by value — is written to its
// row; if the database does not take it within ctx (or a second after ctx
// ended), the error says so and the node writes it once the database
// answers.
//
// With t.NoWait a closure returns once its fence is up; the closure goes
// on, on a goroutine the node owns (Close waits for it).
//
// A blank Session or Task, or a Target that names none of Task, Session
// and Run, is bgtask.ErrInvalidArgument; a session no member of the
// ledger knows (no task's session, no task's parent, no launch in flight
// from it) is bgtask.ErrUnknownSession, and a task with Tree that no
// member has bgtask.ErrUnknownTask. None of them writes anything.
func (n *Node) Stop(ctx context.Context, t bgtask.Target) (bgtask.ClosureReport, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if t.Actor == "" {
		t.Actor = bgtask.ActorOf(ctx)
	}
	if err := t.Validate(); err != nil {
		return bgtask.ClosureReport{}, err
	}
	switch {
	case t.Session != "":
		return n.closeBranch(ctx, t.Session, t.Actor, t.NoWait)
	case t.Tree:
		return n.closeTask(ctx, t.Task, t.Actor, t.NoWait)
	}
	id := t.Task
	if id == "" {
		id = t.Run.TaskID
	}
	for _, m := range n.Managers() {
		if _, err := m.Task(id); err == nil {
			return m.Stop(ctx, t)
		}
	}
	return n.stopElsewhere(ctx, id, t)
}

func (n *Node) closeBranch(ctx context.Context, sessionID, actor string, noWait bool) (bgtask.ClosureReport, error) {
	if strings.TrimSpace(sessionID) == "" {
		return bgtask.ClosureReport{}, fmt.Errorf("%w: Target.Session is blank", bgtask.ErrInvalidArgument)
	}
	var task string
	var known bool
	err := n.pool.QueryRow(ctx, `SELECT
  coalesce((SELECT task_id FROM bgtask_sessions WHERE ledger = $1 AND session_id = $2), ''),
  EXISTS (SELECT 1 FROM bgtask_sessions WHERE ledger = $1 AND session_id = $2)
  OR EXISTS (SELECT 1 FROM bgtask_tasks WHERE ledger = $1 AND parent_session = $2)
  OR EXISTS (SELECT 1 FROM bgtask_launching WHERE ledger = $1 AND parent_session = $2)`, n.o.Ledger, sessionID).Scan(&task, &known)
	if err != nil {
		return bgtask.ClosureReport{}, fmt.Errorf("pgledger: stop: %w", err)
	}
	if !known {
		return bgtask.ClosureReport{SessionID: sessionID}, fmt.Errorf("%w: %q is no task's session and no task's parent in ledger %s", bgtask.ErrUnknownSession, sessionID, n.o.Ledger)
	}
	return n.close(ctx, openClosure{root: sessionID, task: task, actor: actor}, noWait)
}

// closeTask closes the branch of task id as a unit — its live run, and
// what any of its sessions launched — as closeBranch does. It returns
// bgtask.ErrUnknownTask if no member of the ledger has the task.
func (n *Node) closeTask(ctx context.Context, id, actor string, noWait bool) (bgtask.ClosureReport, error) {
	if strings.TrimSpace(id) == "" {
		return bgtask.ClosureReport{}, fmt.Errorf("%w: Target.Task is blank", bgtask.ErrInvalidArgument)
	}
	var root string
	err := n.pool.QueryRow(ctx, `SELECT coalesce((SELECT s.session_id FROM bgtask_sessions s
  WHERE s.ledger = t.ledger AND s.task_id = t.task_id ORDER BY s.attempt_id = t.attempt_id DESC LIMIT 1), '')
  FROM bgtask_tasks t WHERE t.ledger = $1 AND t.task_id = $2`, n.o.Ledger, id).Scan(&root)
	if errors.Is(err, pgx.ErrNoRows) {
		return bgtask.ClosureReport{}, fmt.Errorf("%w: %q", bgtask.ErrUnknownTask, id)
	}
	if err != nil {
		return bgtask.ClosureReport{}, fmt.Errorf("pgledger: stop: %w", err)
	}
	return n.close(ctx, openClosure{root: root, task: id, actor: actor}, noWait)
}

// closeWait bounds how long a closure waits between looks at its scope.
const closeWait = 100 * time.Millisecond

// finishGrace is how long a closure whose caller's context ended has to
// take its fence down and write its record before it returns (a record
// not written by then is written later, by the node).
const finishGrace = time.Second

// stopWriteGrace is how long a closure with nothing live left waits for
// the stops its owners began to say what they came to.
const stopWriteGrace = 5 * time.Second

// close runs closure k: raise the fence, ask the owners, watch the scope
// until nothing in it is live (or ctx ends), then record it.
func (n *Node) close(ctx context.Context, k openClosure, noWait bool) (bgtask.ClosureReport, error) {
	err := pgx.BeginFunc(ctx, n.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`, fenceLock(n.o.Ledger)); err != nil {
			return err
		}
		if err := tx.QueryRow(ctx, `INSERT INTO bgtask_closures (ledger, root_session, task_id, member, actor) VALUES ($1, $2, $3, $4, $5) RETURNING id`,
			n.o.Ledger, k.root, k.task, n.o.Member, k.actor).Scan(&k.id); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_notify($1, $2)`, closureChannel, n.o.Ledger+"\x1f"+strconv.FormatInt(k.id, 10))
		return err
	})
	if err != nil {
		return bgtask.ClosureReport{SessionID: k.root}, fmt.Errorf("pgledger: raising the fence: %w", err)
	}
	rep := bgtask.ClosureReport{SessionID: k.root, TaskID: k.task, Actor: k.actor}
	if noWait {
		if !n.goOwned(func() { _, _ = n.closeFenced(n.loopCtx, k, rep) }) {
			return rep, bgtask.ErrShutdown
		}
		return rep, nil
	}
	return n.closeFenced(ctx, k, rep)
}

// closeFenced runs closure k, whose fence is up, until nothing in its
// scope is live, and ends it.
func (n *Node) closeFenced(ctx context.Context, k openClosure, rep bgtask.ClosureReport) (bgtask.ClosureReport, error) {
	var err error
	var live []scopeRun
	var quiet time.Time // since when nothing in scope is live
	wait := 2 * time.Millisecond
	for {
		rep.Passes++
		live, err = n.scope(ctx, k, nil)
		if err != nil {
			break
		}
		st, serr := n.stopsOf(ctx, k.id)
		if serr != nil {
			err = serr
			break
		}
		if !waitingFor(live, st.byToken) {
			break
		}
		if len(live) > 0 {
			quiet = time.Time{}
		} else if quiet.IsZero() {
			quiet = time.Now()
		} else if time.Since(quiet) > stopWriteGrace {
			break // a stop begun by an owner that died before it said what it came to
		}
		n.serve(ctx, k) // this node's own runs, at once
		if rep.Passes > 1 {
			n.nudge(ctx, k.id) // the owners, again: a notification may have been missed
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			err = ctx.Err()
		case <-t.C:
		}
		t.Stop()
		if err != nil {
			break
		}
		wait = min(2*wait, closeWait)
	}
	return n.finish(ctx, k, rep, live, err)
}

// waitingFor reports whether the closure must look again: a live run of
// the scope may still stop (it is a launch in flight, or no stop of its
// run failed), or a stop begun has not said what it came to.
func waitingFor(live []scopeRun, stops map[string]stopRow) bool {
	for _, r := range live {
		if s, ok := stops[r.ref.Token]; r.pending || !ok || s.err == "" {
			return true
		}
	}
	for _, s := range stops {
		if s.run.Status == "" && s.err == "" {
			return true
		}
	}
	return false
}

// nudge notifies the owners of closure id again.
func (n *Node) nudge(ctx context.Context, id int64) {
	_, _ = n.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, closureChannel, n.o.Ledger+"\x1f"+strconv.FormatInt(id, 10))
}

// stopRow is what an owner's stop of a run came to.
type stopRow struct {
	run    bgtask.StoppedRun
	member string
	err    string
}

// stops is what a closure's owners wrote of its stops: by token, and the
// runs stopped (each stop said what it came to, and no abort failed) in
// the order they were asked.
type stops struct {
	byToken map[string]stopRow
	stopped []bgtask.StoppedRun
}

// stopsOf reads closure id's stops.
func (n *Node) stopsOf(ctx context.Context, id int64) (stops, error) {
	rows, err := n.pool.Query(ctx, `SELECT task_id, attempt_id, session_id, token, status, member, err FROM bgtask_stops
 WHERE closure_id = $1 ORDER BY seq`, id)
	if err != nil {
		return stops{}, fmt.Errorf("pgledger: the stops of closure %d: %w", id, err)
	}
	out := stops{byToken: map[string]stopRow{}}
	var s stopRow
	var status string
	_, err = pgx.ForEachRow(rows, []any{&s.run.TaskID, &s.run.AttemptID, &s.run.SessionID, &s.run.Token, &status, &s.member, &s.err}, func() error {
		s.run.Status = bgtask.Status(status)
		out.byToken[s.run.Token] = s
		if s.err == "" && s.run.Status != "" {
			out.stopped = append(out.stopped, s.run)
		}
		return nil
	})
	return out, err
}

// finish takes closure k's fence down and writes its record: the runs
// stopped (in the order their stops were written), those whose abort
// failed, and those still live. A closure cut short by cause (its
// caller's context ended, the database failed) looks at its scope once
// more first: what stopped since its last look is not named as live.
//
// It keeps to the caller's context (and 30 s at most), or, once that has
// ended, to finishGrace more. A record the database did not take by then
// is written by a goroutine of the node's, which tries again until it
// lands or the node closes: the fence comes down when the database
// answers, and the caller has its report by its deadline.
func (n *Node) finish(caller context.Context, k openClosure, rep bgtask.ClosureReport, live []scopeRun, cause error) (bgtask.ClosureReport, error) {
	var ctx context.Context
	var cancel context.CancelFunc
	if caller.Err() == nil {
		ctx, cancel = context.WithTimeout(caller, 30*time.Second)
	} else {
		ctx, cancel = context.WithTimeout(context.WithoutCancel(caller), finishGrace)
	}
	defer cancel()
	if cause != nil {
		if now, err := n.scope(ctx, k, nil); err == nil {
			live = now
		}
	}
	var unstopped []UnstoppedRun
	st, err := n.stopsOf(ctx, k.id)
	if err == nil {
		rep.Stopped = st.stopped
		for _, r := range live {
			run := bgtask.StoppedRun{TaskID: r.ref.TaskID, AttemptID: r.ref.AttemptID, SessionID: r.session, Token: r.ref.Token}
			reason := "still live when the closure's context ended"
			if s, ok := st.byToken[r.ref.Token]; ok && s.err != "" {
				reason = s.err
				rep.Failed = append(rep.Failed, bgtask.StoppedRun{TaskID: run.TaskID, AttemptID: run.AttemptID, SessionID: run.SessionID, Token: run.Token, Err: s.err})
			} else {
				rep.Stopping = append(rep.Stopping, run)
			}
			if r.pending {
				reason = "a launch in flight when the closure's context ended"
			}
			unstopped = append(unstopped, UnstoppedRun{StoppedRun: run, Member: r.member, Holder: r.holder, Reason: reason})
		}
	}
	rec := bgtask.ClosureReport{SessionID: k.root, TaskID: k.task, At: time.Now(), Stopped: rep.Stopped, Failed: rep.Failed, Stopping: rep.Stopping, Passes: rep.Passes, Actor: k.actor}
	if rerr := n.record(ctx, k, rec); rerr != nil {
		err = errors.Join(err, rerr)
		if !n.goOwned(func() { _ = n.record(n.loopCtx, k, rec) }) {
			err = errors.Join(err, ErrClosed) // the fence holds until this member's lease ends
		}
	}
	switch {
	case err != nil:
		return rep, errors.Join(cause, fmt.Errorf("pgledger: ending closure %d: %w", k.id, err))
	case len(unstopped) > 0:
		return rep, &UnstoppedError{SessionID: k.root, Runs: unstopped, Err: cause}
	}
	return rep, cause
}

// record ends closure k's row with rec, by value, and — with a Notifier —
// puts its NotifyBranchClosed in the outbox for the root task's parent
// (or the root), in the same transaction; a failure is tried again while
// ctx lasts (the fence stays up until it lands, or the opener dies).
func (n *Node) record(ctx context.Context, k openClosure, rec bgtask.ClosureReport) error {
	body, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	for {
		err = pgx.BeginFunc(ctx, n.pool, func(tx pgx.Tx) error {
			tag, err := tx.Exec(ctx, `UPDATE bgtask_closures SET closed_at = now(), record = $2 WHERE id = $1 AND record IS NULL`, k.id, body)
			if err != nil || tag.RowsAffected() == 0 || n.o.Notifier == nil {
				return err // (none: a try whose outcome was lost with its connection landed)
			}
			parent := k.root
			if k.task != "" {
				if err := tx.QueryRow(ctx, `SELECT parent_session FROM bgtask_tasks WHERE ledger = $1 AND task_id = $2`, n.o.Ledger, k.task).Scan(&parent); err != nil {
					return err
				}
			}
			note := fleet.BranchClosed(parent, k.task, bgtask.Task{}, rec).(bgtask.Notification)
			note.ID = "branch_closed:" + strconv.FormatInt(k.id, 10)
			nb, err := json.Marshal(note)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body) VALUES ($1, bgtask_part($2), $2, $3, $4, $5)`,
				n.o.Ledger, parent, note.ID, string(note.Kind), string(nb))
			if err == nil {
				_, err = tx.Exec(ctx, `SELECT pg_notify($1, $2)`, outboxChannel, n.o.Ledger)
			}
			return err
		})
		if err == nil || ctx.Err() != nil {
			return err
		}
		n.o.Logger.Warn("pgledger: recording a closure failed; trying again", "closure", k.id, "err", err)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(n.o.Poll):
		}
	}
}

// stopper is this node's side of the closures: the runs it stopped.
type stopper struct {
	mu      sync.Mutex
	asked   map[int64]map[string]bool // closure → tokens this node has stopped or is stopping
	over    map[int64]string          // closure → the limit its task's spent budget reached ("": none)
	results chan stopResult           // stops done, for the writer
}

// serveAll stops this node's runs of every open closure.
func (n *Node) serveAll(ctx context.Context) {
	rows, err := n.pool.Query(ctx, `SELECT id, root_session, task_id, actor FROM bgtask_closures
 WHERE ledger = $1 AND closed_at IS NULL AND bgtask_closure_live(ledger, member)`, n.o.Ledger)
	if err != nil {
		return
	}
	open, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (openClosure, error) {
		var k openClosure
		err := row.Scan(&k.id, &k.root, &k.task, &k.actor)
		return k, err
	})
	if err != nil {
		return
	}
	ids := map[int64]bool{}
	for _, k := range open {
		ids[k.id] = true
		n.serve(ctx, k)
	}
	n.stops.mu.Lock()
	for id := range n.stops.asked {
		if !ids[id] {
			delete(n.stops.asked, id) // it ended
		}
	}
	for id := range n.stops.over {
		if !ids[id] {
			delete(n.stops.over, id)
		}
	}
	n.stops.mu.Unlock()
}

// serveFor serves the closure a notification names.
func (n *Node) serveFor(ctx context.Context, payload string) {
	ledger, id, _ := strings.Cut(payload, "\x1f")
	if ledger != n.o.Ledger {
		return
	}
	var k openClosure
	err := n.pool.QueryRow(ctx, `SELECT id, root_session, task_id, actor FROM bgtask_closures
 WHERE id = $1 AND closed_at IS NULL AND bgtask_closure_live(ledger, member)`, id).Scan(&k.id, &k.root, &k.task, &k.actor)
	if err == nil {
		n.serve(ctx, k)
	}
}

// serve asks this node's Managers to stop their live runs in closure k's
// scope, each exactly by its token and once per closure, on goroutines
// the node owns (which go on until the node closes). ctx bounds the look
// at the scope: a closure's caller's context, or the node's.
func (n *Node) serve(ctx context.Context, k openClosure) {
	members := n.Members()
	runs, err := n.scope(ctx, k, members)
	if err != nil {
		if ctx.Err() == nil { // else the caller gave up, or the node closes: the closure is served by whoever goes on
			n.o.Logger.Warn("pgledger: looking for runs to stop", "closure", k.id, "err", err)
		}
		return
	}
	type stop struct {
		mb *member
		r  scopeRun
	}
	var todo []stop
	var rows []stopResult
	for _, r := range runs {
		mb := n.live(r.member)
		if mb == nil || r.pending {
			continue
		}
		n.stops.mu.Lock()
		asked := n.stops.asked[k.id]
		if asked == nil {
			asked = map[string]bool{}
			n.stops.asked[k.id] = asked
		}
		again := asked[r.ref.Token]
		asked[r.ref.Token] = true
		n.stops.mu.Unlock()
		if !again {
			todo = append(todo, stop{mb, r})
			rows = append(rows, stopResult{closure: k.id, row: stopRow{run: bgtask.StoppedRun{TaskID: r.ref.TaskID,
				AttemptID: r.ref.AttemptID, SessionID: r.session, Token: r.ref.Token}, member: mb.name}})
		}
	}
	if len(todo) == 0 {
		return
	}
	// The stops are written as begun before any is asked: a run that ends
	// is then never seen ended by the closure without its stop row, which
	// the closure waits to see filled in (the report lists it).
	if err := n.insertStops(ctx, rows); err != nil {
		n.stops.mu.Lock()
		for _, t := range todo {
			delete(n.stops.asked[k.id], t.r.ref.Token) // asked again at the next look
		}
		n.stops.mu.Unlock()
		return
	}
	by := n.stopCauseOf(ctx, k)
	for _, t := range todo {
		if !n.goOwned(func() { n.stopRun(n.loopCtx, &by, k.id, t.mb, t.r) }) {
			return
		}
	}
}

// stopRun stops run r of member mb for closure id and hands the result to
// the writer.
func (n *Node) stopRun(ctx context.Context, by *bgtask.StopCause, id int64, mb *member, r scopeRun) {
	s := stopRow{run: bgtask.StoppedRun{TaskID: r.ref.TaskID, AttemptID: r.ref.AttemptID, SessionID: r.session, Token: r.ref.Token}, member: mb.name}
	if _, err := mb.m.Stop(ctx, bgtask.Target{Run: r.ref, Cause: by}); err != nil {
		s.err = safeText(err)
	}
	if t, err := mb.m.Task(r.ref.TaskID); err == nil {
		for _, a := range t.Attempts {
			if a.Token == r.ref.Token {
				s.run.Status, s.run.SessionID = a.Status, a.SessionID
			}
		}
	}
	if s.err == "" && !s.run.Status.Terminal() {
		s.err = "not stopped: " + string(s.run.Status)
	}
	select {
	case n.stops.results <- stopResult{closure: id, row: s}:
	case <-ctx.Done():
	}
}

// stopResult is a stop done, for the writer.
type stopResult struct {
	closure int64
	row     stopRow
}

// writeStops writes the stops this node's goroutines did, many in one
// statement when they come together, until ctx ends.
func (n *Node) writeStops(ctx context.Context) {
	defer n.done.Done()
	for {
		var batch []stopResult
		select {
		case <-ctx.Done():
			return
		case r := <-n.stops.results:
			batch = append(batch, r)
		}
	more:
		for len(batch) < 512 {
			select {
			case r := <-n.stops.results:
				batch = append(batch, r)
			default:
				break more
			}
		}
		for n.insertStops(ctx, batch) != nil && ctx.Err() == nil {
			// What a stop came to is not lost: the closure waits for it.
			select {
			case <-ctx.Done():
			case <-time.After(n.o.Poll):
			}
		}
		if n.o.stopped != nil && ctx.Err() == nil {
			for _, r := range batch {
				n.o.stopped(r.row.run.TaskID)
			}
		}
	}
}

func (n *Node) insertStops(ctx context.Context, batch []stopResult) error {
	var ids []int64
	var task, attempt, session, token, member, status, errs []string
	for _, b := range batch {
		r := b.row
		ids, task, attempt = append(ids, b.closure), append(task, r.run.TaskID), append(attempt, r.run.AttemptID)
		session, token, member = append(session, r.run.SessionID), append(token, r.run.Token), append(member, r.member)
		status, errs = append(status, string(r.run.Status)), append(errs, r.err)
	}
	// Not for a closure retention has pruned (a stop that said what it came
	// to that late would stay behind it).
	_, err := n.pool.Exec(ctx, `INSERT INTO bgtask_stops (closure_id, task_id, attempt_id, session_id, token, member, status, err)
SELECT u.* FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
       AS u(closure_id, task_id, attempt_id, session_id, token, member, status, err)
 WHERE EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.id = u.closure_id)
ON CONFLICT (closure_id, token) DO UPDATE SET status = EXCLUDED.status, err = EXCLUDED.err`,
		ids, task, attempt, session, token, member, status, errs)
	if err != nil && ctx.Err() == nil {
		n.o.Logger.Warn("pgledger: writing what the stops of a closure came to", "err", err)
	}
	return err
}

// safeText is err's text, even if its Error method panics.
func safeText(err error) (s string) {
	defer func() {
		if r := recover(); r != nil {
			s = fmt.Sprintf("an error whose Error method panicked: %v", r)
		}
	}()
	return err.Error()
}
