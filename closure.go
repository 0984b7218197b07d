package bgtask

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/bgtask/bgtask/internal/probe"
	"github.com/bgtask/bgtask/internal/signal"
	"github.com/bgtask/bgtask/internal/slab"
)

// Branch closure.
//
// A branch is a session and everything proven to descend from it: every
// task whose parent session is in the branch, and — recursively — every
// task launched from any attempt session of those tasks, historical ones
// included. Edges come only from the ledger: a task's parent as recorded at
// launch, a task's sessions as recorded at bind (or when a session was
// created for an attempt that was no longer current).

// NotifyBranchClosed tells the parent of a closed branch's root what the
// closure stopped. Its Text starts with "[Branch closure]".
const NotifyBranchClosed NotificationKind = "branch_closed"

// StoppedRun is one run a stop stopped (or found ending on its own while
// it stopped it), with the status the run ended in; in a report's Failed,
// one it could not stop, and why (Err).
type StoppedRun struct {
	// TaskID, AttemptID, SessionID and Token name the run.
	TaskID    string `json:"taskID"`
	AttemptID string `json:"attemptID"`
	SessionID string `json:"sessionID,omitempty"`
	Token     string `json:"token"`
	// Status is the attempt's status once the stop was recorded.
	Status Status `json:"status,omitempty"`
	// Err, for a run a stop could not stop (ClosureReport.Failed), is the
	// text of the host's abort error: the run keeps its live state.
	Err string `json:"error,omitempty"`
}

// ClosureReport is what a stop did: for a closure (Stop with Tree or
// Session), the runs it stopped, could not stop, and was still stopping
// when it returned; it is also the closure's durable record (Snapshot.Closures,
// JournalView.Closures), with the time it ended.
type ClosureReport struct {
	SessionID string `json:"sessionID"` // the root that was closed
	// TaskID is the task closed as a unit: the one a Stop with Tree named,
	// or the task the root session belongs to; empty if it is no task's
	// session.
	TaskID string `json:"taskID,omitempty"`
	// At is when a closure ended (its record's time); zero for a report
	// of a stop that was no closure.
	At      time.Time    `json:"at,omitzero"`
	Stopped []StoppedRun `json:"stopped"` // each run stopped, in the order it was asked to stop
	// Failed lists the runs whose abort failed: they are still live.
	Failed []StoppedRun `json:"failed,omitempty"`
	// Stopping lists runs asked to stop whose stop was not confirmed when
	// Stop returned early (its context ended, or ErrStopPending).
	Stopping []StoppedRun `json:"stopping,omitempty"`
	Passes   int          `json:"passes"` // scans until a scan found nothing runnable
	// Actor is who acted, when the stop's caller named them
	// (Target.Actor).
	Actor string `json:"actor,omitempty"`
}

// clone copies r, its slices included.
func (r *ClosureReport) clone() ClosureReport {
	c := *r
	c.Stopped = slices.Clone(r.Stopped)
	c.Failed = slices.Clone(r.Failed)
	c.Stopping = slices.Clone(r.Stopping)
	return c
}

// ErrBranchNotStopped matches a *ClosureError.
var ErrBranchNotStopped = errors.New("branch did not stop")

// ClosureError names every run a closure could not stop. It matches
// ErrBranchNotStopped; errors.As gives the list.
type ClosureError struct {
	// SessionID is the root of the closure.
	SessionID string
	// Failed names every run the closure could not stop.
	Failed []StoppedRun
}

// Error names the runs that did not stop and why.
func (e *ClosureError) Error() string {
	var b strings.Builder
	b.WriteString("branch ")
	b.WriteString(e.SessionID)
	b.WriteString(" did not stop: ")
	for i, f := range e.Failed {
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString("task " + f.TaskID + " (session " + f.SessionID + "): " + f.Err)
	}
	return b.String()
}

// Is reports whether target is ErrBranchNotStopped.
func (e *ClosureError) Is(target error) bool { return target == ErrBranchNotStopped }

// branchClosures is the machinery of the closures in progress. passMu is
// its own lock; active is guarded by m.mu; scanGen and walkQueue belong to
// the walk, which holds both passMu and m.mu.
type branchClosures struct {
	// passMu serializes closure passes, so that one may release m.mu
	// midway (its walk marks and scratch stay its own). Taken before m.mu,
	// never while holding it.
	passMu    sync.Mutex
	active    map[*closure]struct{} // active branch closures: their fences
	scanGen   uint64                // closure walks made
	walkQueue []*entry              // a closure walk's scratch
}

// testHooks let tests see the Manager at points where it is about to wait
// or has let others in. Tests set them before the Manager is used and
// never change them after, so they are read without a lock; outside tests
// they are nil.
type testHooks struct {
	// waiting, when set, is called when a Stop of a task or a run is
	// about to block.
	waiting func(taskID string)
	// yield, when set, is called while a closure walk has released m.mu
	// to let others in.
	yield func()
	// queued, when set, is called (m.mu held) when a Launch starts waiting
	// for a slot of its parent session (TreeLimits.MaxPerParent), once
	// its ParentWait timer runs.
	queued func(parent string)
	// deadline, when set, is called (m.mu held) once a deadline that came
	// due was decided.
	deadline func(taskID string)
}

// closure is one branch closure in progress (a Stop with Target.Session or
// with Tree, or one the Manager began: see by): while it is in
// m.closures.active, its fence refuses new work in its branch.
type closure struct {
	root     string             // the session closed; for a task closed as a unit (Stop with Tree), its session ("" if none)
	task     *entry             // the task closed as a unit (Stop with Tree), or nil
	stop     *recordExt         // the stop it asks of every run in its branch
	touched  slab.List[touch]   // runs asked to stop, in order
	ops      slab.List[abortOp] // the aborts it set off
	starting map[string]bool    // tokens touched while their start was in flight, or stopped by the fence
	failed   map[string]StoppedRun
	self     string    // the run token of the callback Stop was called from
	detached bool      // Target.NoWait: its caller does not wait past the first pass
	quiet    bool      // notify the parent only if something was in the branch
	by       string    // what began it (ClosureSummary.By: closedBy...)
	actor    string    // who acted (Target.Actor; ClosureReport.Actor), if named
	began    time.Time // when its fence went up
	horizon  uint64    // the last session start issued when the closure opened
	opened   uint64    // the sequence of its opening record (0: not recorded)
	// settled: the last pass started no start it must wait for, and
	// its scan saw the ledger at widened; every run it found was then
	// stopped, ended, or failed to stop, and has been waited for.
	settled bool
	widened uint64
	// ctx is its caller's (the Manager's life for a closure that goes on
	// without one): the waits of its commits for durability keep to it.
	ctx context.Context
}

// unlockFor is unlock for c's commits: their wait for durability keeps to
// c's caller's context (see unlockCtx). m.mu is held, and released.
func (m *Manager) unlockFor(c *closure) error { return m.unlockCtx(c.ctx) }

// touch is a run a closure asked to stop, with the abort that stopped it
// (nil if the run had no child to abort when it was touched).
type touch struct {
	ref attemptRef
	op  *abortOp
}

// stopped says what became of t: the run as the report lists it, and
// whether it has ended. It reads the abort's own copy of the answer when it
// can, so a large report does not revisit every task. m.mu is held.
func (t touch) stopped() (StoppedRun, bool) {
	if op := t.op; op != nil && op.finished && op.status.Terminal() {
		// A terminal attempt never changes: the abort's copy is exact.
		return StoppedRun{TaskID: op.run().TaskID, AttemptID: op.run().AttemptID, SessionID: op.session, Token: op.run().Token, Status: op.status}, true
	}
	run := stoppedRun(t.ref)
	return run, run.Status.Terminal()
}

// stoppedRun is the run of attempt r as a closure lists it. m.mu is held.
func stoppedRun(r attemptRef) StoppedRun {
	a := r.attempt()
	return StoppedRun{TaskID: r.e.id, AttemptID: a.ID, SessionID: a.SessionID, Token: a.Token, Status: a.Status}
}

// rootTask returns the task c closes as a unit: the task named (Stop with
// Tree), or the task one of whose sessions (current or superseded) is c's
// root session; nil while the root is no task's session. m.mu is held.
func (m *Manager) rootTask(c *closure) *entry {
	if c.task != nil {
		return c.task
	}
	if ref, ok := m.led.bySession[c.root]; ok {
		return ref.e
	}
	return nil
}

// sessionInBranch reports whether session lies in c's branch: it is the
// root, or a session of the root's task, or it belongs to a task whose
// parent session is in the branch. The walk goes up the ledger's recorded
// edges, so it holds from the first instant for every task, found by a scan
// yet or not. m.mu is held.
func (m *Manager) sessionInBranch(session string, c *closure) bool {
	owner := m.rootTask(c)
	for range maxBranchDepth {
		if session == c.root && session != "" {
			return true
		}
		ref, ok := m.led.bySession[session]
		if !ok {
			return false
		}
		if ref.e == owner {
			return true
		}
		session = ref.e.info.parent
	}
	return false // an edge cycle or an absurd depth: not proven
}

// maxBranchDepth bounds the upward walk: deeper trees are not proven in
// scope (a safety net against a cycle of recorded edges).
const maxBranchDepth = 10_000

// taskInBranch reports whether e's current run is in c's branch: e is the
// root's task, or e's parent session is in the branch.
func (m *Manager) taskInBranch(e *entry, c *closure) bool {
	return e == m.rootTask(c) || m.sessionInBranch(e.info.parent, c)
}

// closingParent reports whether a Launch from parent must be refused.
// m.mu is held.
func (m *Manager) closingParent(parent string) bool {
	for c := range m.closures.active {
		if m.sessionInBranch(parent, c) {
			return true
		}
	}
	return false
}

// fence marks e to stop if its run is inside a branch being closed: no retry
// is scheduled and a session that arrives is aborted, not adopted. It
// reports whether e is fenced. m.mu is held.
func (m *Manager) fence(e *entry) bool {
	if e.stop != "" {
		return true
	}
	for c := range m.closures.active {
		if m.taskInBranch(e, c) {
			m.wantStop(e, c.stop, m.now())
			return true
		}
	}
	return false
}

// fenceStop is fence for a run the fence itself stops (a start that
// arrives, a retry or a queued attempt that will not start): each closure
// whose branch holds it lists it, although a pass may never see it live.
// m.mu is held.
func (m *Manager) fenceStop(e *entry) bool {
	if !m.fence(e) {
		return false
	}
	for c := range m.closures.active {
		if m.taskInBranch(e, c) {
			c.touch(e, true)
		}
	}
	return true
}

// touch lists e's current run among the runs c asked to stop, once, and
// returns it (nil if it was listed already). keep says the run may be seen
// again in a later pass (its start is in flight, or the fence stopped it):
// it is remembered so, and not listed twice. m.mu is held.
func (c *closure) touch(e *entry, keep bool) *touch {
	tok := e.cur().Token
	if c.starting[tok] {
		return nil
	}
	if keep {
		c.starting[tok] = true
	}
	return c.touched.Push(touch{ref: attemptRef{e: e, index: e.current}})
}

// wantStop records that a stop of e was asked for — by a cancel, a
// closure, Shutdown: stop says which, with the status it gives — and from
// then on no retry starts. The first stop asked is the one recorded. m.mu
// is held.
func (m *Manager) wantStop(e *entry, stop *recordExt, at time.Time) {
	if e.stop != "" {
		return
	}
	if m.commit(e, record{kind: recStopRequested, at: at, attempt: *e.cur(), recordExt: stop}) {
		m.stopAsked(e, stop)
	}
}

// The stops a record can name: immutable, so every stop record of one
// asker shares its extension (a closure makes its own, see stopBy).
var (
	stopByCancel   = &recordExt{stop: StatusCancelled, note: noteCancel}
	stopByShutdown = &recordExt{stop: StatusInterrupt, note: noteShutdown}
	// stopByDeadline is the task's deadline (Spec.Timeout): the only stop
	// that ends a run error (deadlineFailure says how).
	stopByDeadline = &recordExt{stop: StatusError, note: noteDeadline}
	// stopBySessionDeleted is a SessionDeleted event's: the run has
	// already stopped, and ends cancelled at once.
	stopBySessionDeleted = &recordExt{stop: StatusCancelled, note: noteSessionDeleted}
)

// stopBy is the stop a closure of root (or of task, closed as a unit)
// asks, for actor ("": none named).
func stopBy(root string, task *entry, actor string) *recordExt {
	c := StopCause{Kind: StopClosure, Root: root, Actor: actor}
	if task != nil { // a task closed as a unit: the cause names the task
		c.Root, c.TaskID = "", task.id
	}
	return &recordExt{stop: StatusCancelled, note: c.note()}
}

// walk visits the branch's tasks, found from the ledger's edges: the task
// whose current session is the root, then, breadth first, every task
// launched from the root or from any session of a task found (its kids,
// in launch order). Breadth first is launch order when parents launch
// before their children, which is allocation order: the walk reads memory
// mostly in sequence. m.mu and m.closures.passMu are held; visit may
// release m.mu for a moment, never m.closures.passMu.
func (m *Manager) walk(c *closure, visit func(*entry)) {
	m.closures.scanGen++
	gen := m.closures.scanGen
	queue := m.closures.walkQueue[:0]
	if owner := m.rootTask(c); owner != nil {
		// The task is the unit: its own live run, and what any of its
		// sessions launched (its kids cover the root's).
		owner.rt.scanGen = gen
		visit(owner)
		queue = append(queue, owner.kids...)
	} else if c.root != "" {
		queue = append(queue, m.led.byParent[c.root]...)
	}
	for i := 0; i < len(queue); i++ {
		e := queue[i]
		if e.rt.scanGen == gen {
			continue
		}
		e.rt.scanGen = gen
		visit(e)
		queue = append(queue, e.kids...)
	}
	clear(queue)
	m.closures.walkQueue = queue[:0]
}

// closeBranch closes the branch beneath sessionID (Stop with
// Target.Session), begun by by (closedBy...); with noWait its caller does
// not wait past the fence and the first pass.
func (m *Manager) closeBranch(ctx context.Context, sessionID, by, actor string, noWait bool) (ClosureReport, error) {
	m.mu.Lock()
	if !m.sessionKnown(sessionID) && len(m.calls.inflight) == 0 {
		m.unlock()
		return ClosureReport{SessionID: sessionID}, fmt.Errorf("%w: %q is no task's session and no task's parent", ErrUnknownSession, sessionID)
	}
	return m.closeOpened(ctx, m.openClosure(sessionID, nil, by, actor), noWait)
}

// closeTask closes the branch of the task with id as a unit (Stop with
// Target.Tree): its own live run, and everything launched from any of
// its sessions, recursively. by is who began it (closedBy...):
// closedByCaller asks its stops as the caller of task id
// (Spec.CancelWithCaller), not as a closure.
func (m *Manager) closeTask(ctx context.Context, id, by, actor string, noWait bool) (ClosureReport, error) {
	m.mu.Lock()
	e := m.led.tasks[id]
	if e == nil {
		err := m.missing(id)
		m.unlock()
		return ClosureReport{}, err
	}
	return m.closeOpened(ctx, m.openClosure(sessionOf(e), e, by, actor), noWait)
}

// closeOpened runs closure c, just opened with m.mu held, which it
// releases, for a caller with ctx.
func (m *Manager) closeOpened(ctx context.Context, c *closure, noWait bool) (ClosureReport, error) {
	c.ctx, c.detached = ctx, noWait
	if err := m.unlockFor(c); err != nil && noWait {
		c.ctx = m.life.ctx // the closure goes on; only the wait for durability ended
		rep, _ := m.closeFrom(ctx, c)
		return rep, durabilityUnknown(err, "Stop", "")
	}
	// Without noWait its fence is up: the closure goes on (and ends) with
	// or without the caller.
	rep, err := m.closeFrom(ctx, c)
	if noWait && errors.Is(err, ErrStopPending) {
		return rep, nil
	}
	return rep, err
}

// sessionOf is the session a closure of task e as a unit names: its
// current one, else its latest ("" if it never had one).
func sessionOf(e *entry) string {
	root := e.cur().SessionID
	if ss := e.sessionList(); root == "" && len(ss) > 0 {
		root = ss[len(ss)-1]
	}
	return root
}

// closeFrom runs closure c for a caller with ctx: a caller that is a
// callback serving a run may be in scope, and must not wait on itself.
func (m *Manager) closeFrom(ctx context.Context, c *closure) (ClosureReport, error) {
	if v, ok := ctx.Value(runKey{}).(*runValue); ok && v.kind != callNotify {
		c.self = v.ref.Token
	}
	return m.runClosure(ctx, c)
}

// sessionKnown reports whether the ledger has seen session: a task's
// session, or a task's parent. m.mu is held.
func (m *Manager) sessionKnown(session string) bool {
	if _, ok := m.led.bySession[session]; ok {
		return true
	}
	return len(m.led.byParent[session]) > 0
}

// What begins a closure (ClosureSummary.By).
const (
	closedByStopSession    = "stop_session"
	closedByStopTree       = "stop_tree"
	closedByCaller         = "caller"
	closedBySessionDeleted = "session_deleted"
	closedByRestart        = "restart"
	closedByBudget         = "budget"
)

// openClosure raises the fence of a closure of root (and, when task is
// not nil, of task as a unit: Stop with Tree), begun by by, for actor
// (Target.Actor; "" if none was named). m.mu is held.
func (m *Manager) openClosure(root string, task *entry, by, actor string) *closure {
	stop := stopBy(root, task, actor)
	switch by {
	case closedByCaller:
		stop = &recordExt{stop: StatusCancelled, note: noteCallerOf + task.id}
	case closedByBudget:
		stop = budgetNote(task)
	}
	c := &closure{root: root, task: task, stop: stop, by: by, actor: actor, began: m.now(), starting: map[string]bool{}, failed: map[string]StoppedRun{}, horizon: m.calls.startSeq, ctx: m.life.ctx}
	taskID := ""
	if task != nil {
		taskID = task.id
	}
	// Recorded, so that a closure a crash interrupts is finished at restart.
	c.opened = m.led.emit(record{kind: recClosureOpened, task: taskID, at: m.now(), recordExt: &recordExt{session: root, note: taskID}})
	m.closures.active[c] = struct{}{}
	m.signal()
	m.closureBegun(c)
	return c
}

// runClosure makes passes until one finds nothing runnable, then takes the
// fence down. When the caller is a callback serving a run in scope, it
// hands the rest to an owned goroutine and answers at once.
func (m *Manager) runClosure(ctx context.Context, c *closure) (ClosureReport, error) {
	passes := 0
	for {
		passes++
		p := m.closurePass(c)
		if p.selfWait || (c.detached && !p.done()) {
			rep := m.report(c, passes)
			c.ctx = m.life.ctx // it goes on without its caller
			if !m.life.group.Go(func() { _, _ = m.finishPasses(m.life.ctx, c, passes, p) }) {
				_, _ = m.finishClosure(c, passes, ErrShutdown)
			}
			return rep, ErrStopPending
		}
		if p.done() {
			return m.finishClosure(c, passes, nil)
		}
		if err := m.awaitClosurePass(ctx, c, p); err != nil {
			return m.finishClosure(c, passes, err)
		}
	}
}

// finishPasses goes on with a closure whose caller could not wait.
func (m *Manager) finishPasses(ctx context.Context, c *closure, passes int, p pass) (ClosureReport, error) {
	for !p.done() {
		if err := m.awaitClosurePass(ctx, c, p); err != nil {
			return m.finishClosure(c, passes, err)
		}
		passes++
		p = m.closurePass(c)
	}
	return m.finishClosure(c, passes, nil)
}

// pass is what one closure scan set off.
type pass struct {
	batch    *abortBatch       // the aborts it set off
	joined   []*abortOp        // aborts in flight it joined
	waits    []<-chan struct{} // what to wait for: the batch and joined aborts
	busy     bool              // a start in flight: wait for the next change
	change   <-chan struct{}
	selfWait bool
}

func (p pass) done() bool { return p.batch == nil && len(p.joined) == 0 && !p.busy }

// takeEvery is how many tasks a closure pass visits between takes of the
// answers its batch's workers landed meanwhile.
const takeEvery = 64

// yieldEvery is how many tasks a closure pass visits before it releases
// m.mu for a moment.
const yieldEvery = 1024

// closurePass walks the branch and asks every live run in it to stop. The
// host calls start while the walk goes on; the answers that land meanwhile
// are recorded by the pass itself, while the tasks they touch are hot.
func (m *Manager) closurePass(c *closure) pass {
	m.closures.passMu.Lock()
	defer m.closures.passMu.Unlock()
	m.mu.Lock()
	defer m.unlockFor(c)
	if c.settled && c.widened == m.led.widened {
		// Nothing that could add a run to the branch was recorded since
		// the last walk, and every run that walk found has been dealt
		// with: this walk is proven to find nothing runnable.
		return pass{}
	}
	c.widened = m.led.widened
	w := passWalk{c: c, now: m.now()}
	m.walk(c, func(e *entry) { m.passVisit(&w, e) })
	return m.passEnd(&w)
}

// passWalk is a closure pass's walk in progress: the pass it is making and
// what it learnt on the way. It lives on closurePass's stack.
type passWalk struct {
	c       *closure
	p       pass
	now     time.Time
	visited int
	asked   bool // a stop was asked for a run that had none
	// changedMeanwhile: a change was made while the walk let others in.
	changedMeanwhile bool
}

// passVisit is the pass's visit of e: it takes the answers its batch's
// workers landed every takeEvery tasks and lets others in every
// yieldEvery, then asks e's live run to stop — joining the abort in flight,
// adding an abort to the pass's batch for a running child, or stopping a
// run with no child yet. m.mu and m.closures.passMu are held.
func (m *Manager) passVisit(w *passWalk, e *entry) {
	c, p := w.c, &w.p
	if w.visited++; p.batch != nil && w.visited%takeEvery == 0 {
		m.takeAborts(p.batch)
	}
	if w.visited%yieldEvery == 0 {
		m.passYield(w)
	}
	if e.terminal() {
		return
	}
	a := e.cur() // no attempt is added while the visit runs
	if _, failed := c.failed[a.Token]; failed {
		return
	}
	if e.stop == "" {
		m.wantStop(e, c.stop, w.now)
		w.asked = true
	}
	// A run is touched once: only a run whose start was in flight can
	// still be live in a later pass (an abort that was waited for
	// either stopped it or failed, and failed runs are skipped).
	t := c.touch(e, e.rt.starting())
	if c.self != "" && c.self == a.Token {
		p.selfWait = true
	}
	switch {
	case e.rt.abort != nil && e.rt.abort.run().Token == a.Token:
		p.joined = append(p.joined, e.rt.abort)
		p.waits = append(p.waits, e.rt.abort.waitDone())
		if t != nil {
			t.op = e.rt.abort
		}
	case a.Status == StatusRunning:
		op, _ := m.newAbort(e, a, c.ops.Push(abortOp{}))
		if t != nil {
			t.op = op
		}
		if p.batch == nil {
			p.batch = m.newBatch()
		}
		m.addAbort(p.batch, op)
	default:
		m.stopRun(e, w.now) // no child yet: ends now, or on arrival
		if !e.terminal() {
			p.busy = true // a start in flight: its session is aborted on arrival
		}
	}
}

// passYield releases m.mu for a moment: a long walk lets others in
// (events, launches, cancels). Whatever they change is seen: each task is
// judged when visited, a widened ledger makes the next pass walk, and a
// change made meanwhile wakes a pass that ends waiting for one (a start
// seen in flight may have ended meanwhile). m.closures.passMu stays held.
func (m *Manager) passYield(w *passWalk) {
	change := m.waitAny()
	_ = m.unlockFor(w.c)
	if m.hooks.yield != nil {
		m.hooks.yield()
	}
	m.mu.Lock()
	w.now = m.now()
	select {
	case <-change:
		w.changedMeanwhile = true
	default:
	}
}

// passEnd completes the pass once its walk is over: it waits for the starts
// that may create the root, hands the batch's last aborts to the workers
// and seals it, and says what to wait for. m.mu and m.closures.passMu are
// held.
func (m *Manager) passEnd(w *passWalk) pass {
	c, p := w.c, w.p
	if m.rootTask(c) == nil {
		// The root may be a session a start in flight is creating: wait
		// for the starts that were in flight when the closure opened.
		for seq := range m.calls.inflight {
			if seq <= c.horizon {
				p.busy = true
				break
			}
		}
	}
	if p.batch != nil {
		m.takeAborts(p.batch)
		p.waits = append(p.waits, m.sealAborts(p.batch))
	}
	if w.asked {
		m.signal() // stops were asked for: waiters may look again
	}
	c.settled = !p.busy
	p.change = m.waitAny()
	if w.changedMeanwhile {
		p.change = signal.Closed
	}
	return p
}

// awaitClosurePass waits for a pass's aborts (and, when a start was in
// flight, for the next change), recording the aborts that failed.
func (m *Manager) awaitClosurePass(ctx context.Context, c *closure, p pass) error {
	for _, done := range p.waits {
		if err := m.parkOn(ctx, done); err != nil {
			return err
		}
	}
	if p.busy && len(p.waits) == 0 {
		if err := m.parkOn(ctx, p.change); err != nil {
			return err
		}
	}
	m.mu.Lock()
	defer m.unlock()
	failed := p.joined
	if p.batch != nil {
		failed = slices.Concat(failed, p.batch.failed)
	}
	for _, op := range failed {
		if op.err == nil {
			continue
		}
		if op.ref.isCurrent() && !op.ref.attempt().Status.Terminal() {
			c.failed[op.run().Token] = StoppedRun{TaskID: op.run().TaskID, AttemptID: op.run().AttemptID, SessionID: op.session, Token: op.run().Token, Err: op.err.Error()}
		}
	}
	return nil
}

// report says what became of each run c asked to stop. m.mu must not be
// held.
func (m *Manager) report(c *closure, passes int) ClosureReport {
	m.mu.Lock()
	defer m.unlock()
	return m.reportLocked(c, passes)
}

// reportLocked also returns the attempts of the runs that stopped: terminal,
// so they never change, and the closure record keeps them instead of a copy
// of the report. m.mu is held.
func (m *Manager) reportLocked(c *closure, passes int) (rep ClosureReport) {
	rep = ClosureReport{SessionID: c.root, Actor: c.actor, Passes: passes}
	if owner := m.rootTask(c); owner != nil {
		rep.TaskID = owner.id
	}
	if c.touched.Len() > 0 {
		rep.Stopped = make([]StoppedRun, 0, c.touched.Len())
	}
	defer func() {
		if len(rep.Stopped) == 0 {
			rep.Stopped = nil // as with nothing touched: JSON null
		}
	}()
	for t := range c.touched.All {
		run, ended := t.stopped()
		switch f, failed := c.failed[run.Token]; {
		case ended:
			rep.Stopped = append(rep.Stopped, run)
		case failed:
			rep.Failed = append(rep.Failed, f)
		default:
			rep.Stopping = append(rep.Stopping, run)
		}
	}
	return rep
}

// finishClosure takes the fence down, records the closure and notifies the
// root's parent.
func (m *Manager) finishClosure(c *closure, passes int, cause error) (rep ClosureReport, err error) {
	err = cause
	m.mu.Lock()
	defer func() {
		if uerr := m.unlockFor(c); uerr != nil && err == nil {
			task := ""
			if c.task != nil {
				task = c.task.id
			}
			err = durabilityUnknown(uerr, "Stop", task)
		}
	}()
	delete(m.closures.active, c)
	m.signal()
	owner := m.rootTask(c)
	if owner == nil && c.touched.Len() == 0 && !m.sessionKnown(c.root) {
		// The root was a session no start in flight turned out to create:
		// nothing to record, nobody to tell.
		m.led.emit(record{kind: recClosureDropped, at: m.now(), recordExt: &recordExt{opened: c.opened}})
		rep = ClosureReport{SessionID: c.root, Actor: c.actor, Passes: passes}
		err = fmt.Errorf("%w: %q is no task's session and no task's parent", ErrUnknownSession, c.root)
		m.closureEnded(c, rep, true, err)
		return rep, err
	}
	rep = m.reportLocked(c, passes)
	rep.At = m.now()
	rec := rep.clone()
	rec.Passes = passes
	m.led.recordClosure(rec, rep.TaskID, c.opened) // by value: the record owns its copy

	parent, taskID := c.root, ""
	var snap Task
	if owner != nil {
		parent, taskID, snap = owner.info.parent, owner.id, owner.project()
	}
	if m.cfg.notifier != nil && !(c.quiet && c.touched.Len() == 0) {
		m.push(branchClosed(parent, taskID, snap, rec))
	}
	m.closureEnded(c, rep, false, err) // err: the caller's context, or Shutdown; the failures are counted
	if err == nil && len(rep.Failed) > 0 {
		err = &ClosureError{SessionID: c.root, Failed: rep.Failed}
	}
	return rep, err
}

// branchClosed is the NotifyBranchClosed a Manager sends parent when a
// closure of the branch of task taskID (snap, as it was; "" and a zero
// Task when the root was no task's session) ended as rec says. It has no
// ID or Seq: those are the producer's. A journal shared by several
// processes (pgledger, through internal/fleet) uses it for a closure that
// spanned them.
func branchClosed(parent, taskID string, snap Task, rec ClosureReport) Notification {
	return Notification{Kind: NotifyBranchClosed, ParentSessionID: parent, TaskID: taskID, Task: snap, Text: branchClosedText(rec)}
}

func init() {
	fleet.AllComplete = func(parent string, tasks any) any { return allComplete(parent, tasks.([]Task)) }
	fleet.BranchClosed = func(parent, taskID string, snap, rec any) any {
		return branchClosed(parent, taskID, snap.(Task), rec.(ClosureReport))
	}
	fleet.NoteOf = func(rec any) any {
		if n := rec.(*Record).note; n != nil {
			return n
		}
		return nil // not a typed nil in an interface
	}
	probe.Running = func(m any) (int, <-chan struct{}) { return m.(*Manager).life.group.Changed() }
	probe.Parked = func(m any) (int, <-chan struct{}) { return m.(*Manager).life.parked.state() }
	probe.Record = func(m any) { m.(*Manager).recordAll() }
	probe.Replay = func(m any) error { return m.(*Manager).checkReplay() }
}

// parkOn waits for ch, ctx or the journal's failure (await). The
// simulation harness counts goroutines parked here as idle while none of
// what they wait for is ready.
func (m *Manager) parkOn(ctx context.Context, ch <-chan struct{}) error {
	done := m.life.parked.park(ch, ctx.Done())
	defer done()
	return m.await(ctx, ch)
}

// parking is the waits parked now (parkOn, the stall watch), for the
// simulation harness (probe.Parked). It is guarded by its own mu.
type parking struct {
	mu    sync.Mutex                   // guards seq, waits, ch
	seq   uint64                       // ids of parked waits
	waits map[uint64][]<-chan struct{} // what each parked goroutine waits on
	ch    chan struct{}                // closed when waits changes; nil while nobody waits
}

// park registers a goroutine as waiting on chans until the returned func is
// called. They must be close signals: state tells whether one is ready by
// receiving from it, which would steal a value sent on it.
func (pk *parking) park(chans ...<-chan struct{}) func() {
	pk.mu.Lock()
	pk.seq++
	id := pk.seq
	if pk.waits == nil {
		pk.waits = map[uint64][]<-chan struct{}{}
	}
	pk.waits[id] = chans
	pk.bump()
	pk.mu.Unlock()
	return func() {
		pk.mu.Lock()
		delete(pk.waits, id)
		pk.bump()
		pk.mu.Unlock()
	}
}

func (pk *parking) bump() {
	if pk.ch != nil {
		close(pk.ch)
		pk.ch = nil
	}
}

func (pk *parking) state() (int, <-chan struct{}) {
	pk.mu.Lock()
	defer pk.mu.Unlock()
	if pk.ch == nil {
		pk.ch = make(chan struct{})
	}
	n := 0
	for _, chans := range pk.waits {
		ready := false
		for _, c := range chans {
			select {
			case <-c:
				ready = true
			default:
			}
		}
		if !ready {
			n++
		}
	}
	return n, pk.ch
}
