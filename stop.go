package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/bgtask/bgtask/internal/callq"
)

// newAbort registers the abort of run a of e, or returns the one in flight
// (fresh false). A fresh op must be handed to runAbort or addAbort. store,
// if not nil, is where a fresh op is kept (closures allocate ops in slabs).
// m.mu is held.
func (m *Manager) newAbort(e *entry, a *Attempt, store *abortOp) (op *abortOp, fresh bool) {
	if op := e.rt.abort; op != nil && op.run().Token == a.Token {
		return op, false
	}
	if store == nil {
		store = new(abortOp)
	}
	op = store
	m.intend(recAbortRequested, e, *a)
	*op = abortOp{
		ref:     attemptRef{e: e, index: e.current},
		session: a.SessionID,
		ctx: runCtx{Context: m.life.ctx, v: runValue{
			ref:  RunRef{TaskID: e.id, AttemptID: a.ID, Token: a.Token},
			kind: callAbort,
		}},
	}
	e.rt.abort = op
	m.calls.abortsN++
	return op, true
}

// abortRun starts the abort of run a of e, or joins the one in flight. When
// the host confirms it, the attempt ends with e's wanted stop status unless
// it already ended on its own evidence. m.mu is held.
func (m *Manager) abortRun(e *entry, a Attempt) *abortOp {
	op, fresh := m.newAbort(e, &a, nil)
	if fresh {
		m.runAbort(op)
	}
	return op
}

// maxAbortWorkers bounds the goroutines one batch of aborts (a closure
// pass) calls the host on. A host that answers at once keeps one or two
// busy; a slow or hung one grows the set to the bound (see internal/callq).
const maxAbortWorkers = 32

// abortBatch is a set of aborts in flight. The host calls run on a callq
// Queue's workers; each answer is recorded under m.mu, as it lands, by the
// queue's recorder — or by the closure pass that set the batch off, which
// takes the answers that landed while it went on scanning.
type abortBatch struct {
	q      *callq.Queue[*abortOp]
	left   int           // ops added and not recorded yet
	sealed bool          // no op will be added
	done   chan struct{} // made by seal; closed once sealed and left is 0
	failed []*abortOp    // ops whose abort failed, in the order recorded
	buf    []*abortOp    // scratch for take
	pend   []*abortOp    // fresh ops not handed to the queue yet
}

func (m *Manager) newBatch() *abortBatch {
	b := &abortBatch{}
	b.q = callq.New(maxAbortWorkers, m.goLater, m.life.group.Go,
		func(op *abortOp) { op.err = m.callAbort(&op.ctx, op.ref.e, op.session) },
		func(ops []*abortOp) {
			m.step(&abortedIn{b: b, ops: ops})
		})
	return b
}

// runAbort calls the host for one fresh op on an owned goroutine. m.mu is
// held.
func (m *Manager) runAbort(op *abortOp) {
	b := m.newBatch()
	m.addAbort(b, op)
	m.flushAborts(b)
}

// addAbort adds a fresh op to b; flushAborts hands it to the workers.
// m.mu is held.
func (m *Manager) addAbort(b *abortBatch, op *abortOp) {
	b.left++
	b.pend = append(b.pend, op)
}

// flushAborts hands b's added ops to its workers, all at once. m.mu is
// held.
func (m *Manager) flushAborts(b *abortBatch) {
	if !b.q.Add(b.pend...) { // the group is closed (after Shutdown): the ops fail
		for _, op := range b.pend {
			op.err = ErrShutdown
		}
		m.recordAborts(b, b.pend, m.now())
	}
	clear(b.pend)
	b.pend = b.pend[:0]
}

// takeAborts hands b's added ops to its workers and records the answers
// they landed that no recorder took yet. m.mu is held.
func (m *Manager) takeAborts(b *abortBatch) {
	m.flushAborts(b)
	b.buf = b.q.Take(b.buf[:0])
	if len(b.buf) > 0 {
		m.recordAborts(b, b.buf, m.now())
		clear(b.buf)
	}
}

// sealAborts says b gets no more ops and returns a channel closed once
// every answer is recorded. m.mu is held.
func (m *Manager) sealAborts(b *abortBatch) <-chan struct{} {
	m.flushAborts(b)
	b.sealed = true
	b.done = make(chan struct{})
	done := b.done
	b.closeIfDone()
	return done
}

// closeIfDone closes b's done channel once it is sealed and every answer
// is recorded. m.mu is held.
func (b *abortBatch) closeIfDone() {
	if b.sealed && b.left == 0 && b.done != nil {
		close(b.done)
		b.done = nil
	}
}

// recordAborts records the host's answers to ops, all of which had landed
// by now. m.mu is held.
func (m *Manager) recordAborts(b *abortBatch, ops []*abortOp, now time.Time) {
	for _, op := range ops {
		m.aborted(op, op.err, now)
		if op.err != nil {
			b.failed = append(b.failed, op)
		}
	}
	b.left -= len(ops)
	b.closeIfDone()
}

// aborted records the host's answer to op, which had landed by now. m.mu
// is held.
func (m *Manager) aborted(op *abortOp, err error, now time.Time) {
	e := op.ref.e
	if e.rt.abort == op {
		e.rt.abort = nil
	}
	m.calls.abortsN--
	op.err = err
	op.finished = true
	if op.done != nil {
		close(op.done)
	}
	a := op.ref.attempt()
	live := op.ref.isCurrent() && !a.Status.Terminal()
	if out := e.seen.out; err != nil && live && out.token == a.Token && out.returned {
		err = nil // the abort gave up on a run that has returned since: it stopped
		op.err = nil
	}
	switch {
	case err != nil:
		if live {
			// The stop it served is withdrawn: the run goes on (a stop that
			// was asked still forbids a retry).
			m.logLocked(slog.LevelWarn, "abort failed; the child is still running",
				slog.String("task", op.run().TaskID), slog.String("attempt", op.run().AttemptID),
				slog.String("session", op.session), slog.String("err", safeText(err)))
			if !m.commit(e, record{kind: recStopWithdrawn, at: now, attempt: *a, recordExt: &recordExt{note: err.Error()}}) {
				m.touched(e)
			}
		} else {
			m.touched(e) // the stop's waiters learn the answer
		}
	case live && op.failWith != nil && e.stop != StatusError && !m.fence(e):
		e.seen.stopped = op.run().Token // the retry need not abort it again
		m.fail(e, *op.failWith, now)
	case live:
		var errText string // what the run returned as it stopped, if anything
		if out := e.seen.out; out.token == a.Token {
			errText = out.stopErr
		}
		m.endStopped(op.ref, errText, now)
	default:
		m.touched(e)
	}
	op.status = op.ref.attempt().Status
}

// endStopped ends the run ref names, which a stop asked of it (e.stop,
// or a cancel) found stopped: the task's deadline fails it, reason
// deadline, whoever's abort stopped it; any other stop gives its status,
// with errText, what the run returned as it stopped. m.mu is held.
func (m *Manager) endStopped(ref attemptRef, errText string, now time.Time) {
	e := ref.e
	if e.stop == StatusError {
		m.fail(e, *deadlineFailure(e, false), now)
		return
	}
	m.finalizeRef(ref, e.stopStatus(), errText, "", now)
}

// abortOrphan aborts a session that was created for attempt a after a
// stopped being current. The session is never adopted; a failed abort is
// logged.
func (m *Manager) abortOrphan(e *entry, a Attempt, sessionID string) {
	orphan := a
	orphan.SessionID = sessionID
	m.intend(recAbortRequested, e, orphan)
	if !m.effect(effect{kind: fxAbortOrphan, e: e, run: runOfAttempt(a), session: sessionID}) {
		m.logLocked(slog.LevelError, "a session created for a superseded attempt was left running: the manager is shut down",
			slog.String("task", e.id), slog.String("attempt", a.ID), slog.String("session", sessionID))
	}
}

// abortOrphanNow aborts sessionID, created for run a of e after a stopped
// being current; a failed abort is logged.
func (m *Manager) abortOrphanNow(e *entry, a Attempt, sessionID string) {
	run := RunRef{TaskID: e.id, AttemptID: a.ID, Token: a.Token}
	if err := m.callAbort(withRun(m.life.ctx, run, callAbort), e, sessionID); err != nil {
		m.logAttrs(slog.LevelWarn, "abort of a session created for a superseded attempt failed",
			slog.String("task", run.TaskID), slog.String("attempt", run.AttemptID),
			slog.String("session", sessionID), slog.String("err", safeText(err)))
	}
}

// callAbort calls the host of e's run — the in-process host for a task
// with its own function (Spec.Run: e.info never changes, so no lock is
// needed). A panic is an abort that failed; the host's
// error is guarded, so rendering it later never calls user code.
func (m *Manager) callAbort(ctx context.Context, e *entry, sessionID string) (err error) {
	if err := m.poisoned(); err != nil {
		return err
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("Host.AbortSession panicked: %s", panicText(r))
		}
	}()
	host := m.hosts.main
	if e.info.inProcess {
		host = m.hosts.funcs
	}
	return guardError(host.AbortSession(ctx, sessionID))
}

// stopRun acts on e's wanted stop for its current run: a run with no child
// ends at once; a running child is aborted; a start in flight is aborted on
// arrival (started sees the stop recorded). m.mu is held.
func (m *Manager) stopRun(e *entry, now time.Time) *abortOp {
	a := *e.cur()
	if op := e.rt.abort; op != nil && op.run().Token == a.Token {
		return op // joined: an arriving session, a stall, another stop
	}
	switch {
	case a.Status == StatusPending && !e.rt.starting() && e.stop == StatusError:
		m.fail(e, *deadlineFailure(e, false), now) // no child: the task's deadline ends it now
	case a.Status == StatusPending && !e.rt.starting():
		m.finalize(e, a.ID, e.stop, "", "", now)
	case a.Status == StatusRunning:
		return m.abortRun(e, a)
	}
	return nil
}

// Target names what Stop stops. Exactly one of Task, Session and Run is
// set; the zero Target is refused (ErrInvalidArgument).
type Target struct {
	// Task stops the task with this id: the run current when Stop looks,
	// by its token (never a later run), and no retry follows. With Tree,
	// everything launched from any of its sessions (current and
	// superseded) is stopped too, recursively, as a closure: a fence goes
	// up, the closure is recorded (ClosureReport, Snapshot.Closures) and
	// the parent is told (NotifyBranchClosed). A task that has ended is
	// no obstacle to Tree: what it launched is still stopped.
	Task string
	// Tree: see Task.
	Tree bool
	// Session stops everything launched from this session, recursively,
	// as a closure (see Task and Tree): the branch beneath a chat, or
	// beneath one task's session.
	Session string
	// Run stops exactly this run (RunFromContext, Run's fields). If that
	// run was already replaced or ended, Stop does nothing and returns
	// nil: it never touches another run of the task.
	Run RunRef
	// NoWait returns once the stop is recorded (durably, with a journal)
	// and, for a closure, its fence is up, with the first pass's report;
	// the stop goes on in the background. Without it, Stop returns once
	// everything it stopped has really stopped. Either way a task reads
	// as it is until its child really stopped, then ends cancelled (Wait
	// or Subscribe tell).
	NoWait bool
	// Cause, when set, is recorded as who asked a stop of a task or a run
	// (Task.Stop), instead of a cancel: for code that stops runs on
	// another's behalf, as pgledger's fleet closure stops, in each
	// process, the runs of a branch closed from another. The task still
	// ends cancelled, whatever its kind. A closure (Tree, Session) records
	// its own cause: Cause is refused with them.
	Cause *StopCause
	// Actor, when set, names who acted (an operator's identity); "": the
	// actor Stop's context names (WithActor: bgtaskhttp names the one its
	// Authorize accepted so), if any. It is recorded with the stop:
	// StopCause.Actor of each task it stops, and ClosureReport.Actor of a
	// closure. One line of printable text, at most 200 bytes.
	Actor string
}

// maxActor bounds Target.Actor.
const maxActor = 200

type actorKey struct{}

// WithActor returns ctx naming who acts — an operator's identity — for
// the calls made with it: Extend records the actor (Invocation.Actor),
// and Stop when its Target names none (Target.Actor). bgtaskhttp names so
// the actor its Authorize accepted. An actor that is not one line of
// printable text of at most 200 bytes is made one: its other characters
// dropped, cut at a character's boundary.
func WithActor(ctx context.Context, actor string) context.Context {
	actor = strings.TrimSpace(strings.Map(func(r rune) rune {
		if !unicode.IsPrint(r) {
			return -1
		}
		return r
	}, actor))
	for len(actor) > maxActor {
		_, n := utf8.DecodeLastRuneInString(actor)
		actor = actor[:len(actor)-n]
	}
	return context.WithValue(orBackground(ctx), actorKey{}, strings.TrimSpace(actor))
}

// ActorOf is the actor ctx names (WithActor), or "".
func ActorOf(ctx context.Context) string {
	if ctx == nil {
		return ""
	}
	a, _ := ctx.Value(actorKey{}).(string)
	return a
}

// Validate says what is wrong with t, if anything (ErrInvalidArgument):
// the rules Manager.Stop, pgledger's Node.Stop and bgtaskhttp's
// Client.Stop all apply before they act.
func (t Target) Validate() error {
	set := 0
	for _, s := range [...]bool{t.Task != "", t.Session != "", t.Run != (RunRef{})} {
		if s {
			set++
		}
	}
	switch {
	case set == 0:
		return fmt.Errorf("%w: Stop needs a Target with Task, Session or Run", ErrInvalidArgument)
	case set > 1:
		return fmt.Errorf("%w: a Target names one of Task, Session and Run, not several", ErrInvalidArgument)
	case t.Tree && t.Task == "":
		return fmt.Errorf("%w: Target.Tree goes with Target.Task", ErrInvalidArgument)
	case t.Cause != nil && (t.Tree || t.Session != ""):
		return fmt.Errorf("%w: Target.Cause goes with a stop of a task or a run; a closure records its own", ErrInvalidArgument)
	case t.Session != "" && blank(t.Session):
		return fmt.Errorf("%w: Target.Session is blank", ErrInvalidArgument)
	case t.Task != "" && blank(t.Task):
		return fmt.Errorf("%w: Target.Task is blank", ErrInvalidArgument)
	case t.Run != (RunRef{}) && (blank(t.Run.TaskID) || blank(t.Run.Token)):
		return fmt.Errorf("%w: Target.Run needs its TaskID and Token", ErrInvalidArgument)
	case len(t.Actor) > maxActor:
		return fmt.Errorf("%w: Target.Actor is %d bytes long; at most %d", ErrInvalidArgument, len(t.Actor), maxActor)
	case strings.IndexFunc(t.Actor, func(r rune) bool { return !unicode.IsPrint(r) }) >= 0 || (t.Actor != "" && blank(t.Actor)):
		return fmt.Errorf("%w: Target.Actor %q is not one line of printable text", ErrInvalidArgument, t.Actor)
	case t.Cause != nil && (strings.Contains(t.Cause.Note, noteActor) || strings.Contains(t.Cause.Actor, noteActor)):
		return fmt.Errorf("%w: Target.Cause holds the byte 0x1f, which separates a stop's note from its actor", ErrInvalidArgument)
	case t.Cause != nil && t.Cause.Actor != "" && (Target{Task: "t", Actor: t.Cause.Actor}).Validate() != nil:
		return fmt.Errorf("%w: Target.Cause.Actor %q is not one line of printable text of 200 bytes at most", ErrInvalidArgument, t.Cause.Actor)
	}
	return nil
}

// Stop stops what t names and, unless t.NoWait, returns once all of it has
// really stopped: the host confirmed each abort, or no child existed yet.
// The report lists each run it stopped; for a closure (Tree, Session) it
// is the closure's, with its passes.
//
// A task that is already terminal (also one whose child finished before
// the abort landed, and keeps that outcome) changes nothing, and Stop
// returns nil. Stop returns ErrInvalidArgument for a bad Target;
// ErrUnknownTask or ErrForgotten for a task id it does not have;
// ErrUnknownSession for a session no task has or launched from; the
// host's error if an abort failed (the run keeps its live state, and Stop
// may be asked again; a closure's is a *ClosureError naming every run that
// did not stop); ctx's error if ctx ends first (the stop goes on, and its
// outcome is recorded when it lands); a *DurabilityUnknownError when ctx
// ended before the stop was durable; ErrShutdown after Shutdown.
//
// Called with the context of a Host call or a FuncHost function serving a
// run it would stop, Stop would wait on its own caller: it records the
// stop, sets it off, and returns ErrStopPending (for a closure, with the
// first pass's report); the rest goes on in the background. A Notifier's
// context is no such case.
func (m *Manager) Stop(ctx context.Context, t Target) (ClosureReport, error) {
	ctx = orBackground(ctx)
	if t.Actor == "" {
		t.Actor = ActorOf(ctx)
	}
	if err := t.Validate(); err != nil {
		return ClosureReport{}, err
	}
	if t.Actor != "" && t.Session == "" && !t.Tree {
		c := StopCause{Kind: StopCancel}
		if t.Cause != nil {
			c = *t.Cause
		}
		c.Actor, t.Cause = t.Actor, &c
	}
	switch {
	case t.Session != "":
		return m.closeBranch(ctx, t.Session, closedByStopSession, t.Actor, t.NoWait)
	case t.Tree:
		return m.closeTask(ctx, t.Task, closedByStopTree, t.Actor, t.NoWait)
	case t.NoWait:
		id, token := t.Task, ""
		if id == "" {
			id, token = t.Run.TaskID, t.Run.Token
		}
		return m.stopNoWait(ctx, id, token, t.Cause)
	case t.Task != "":
		return m.cancel(ctx, t.Task, "", t.Cause)
	}
	ref := t.Run
	m.mu.Lock()
	e := m.led.tasks[ref.TaskID]
	if e == nil {
		err := m.missing(ref.TaskID)
		m.unlock()
		return ClosureReport{}, err
	}
	live := !e.terminal() && e.cur().Token == ref.Token
	m.unlock()
	if !live {
		return ClosureReport{}, nil
	}
	return m.cancel(ctx, ref.TaskID, ref.Token, t.Cause)
}

// stopNoWait records the stop of task id's run with token ("": its
// current one), sets off its abort, and returns.
func (m *Manager) stopNoWait(ctx context.Context, id, token string, cause *StopCause) (ClosureReport, error) {
	in := stopIn{id: id, token: token, by: stopAskedBy(cause)}
	if err := m.stepCtx(ctx, &in); err != nil {
		return ClosureReport{}, durabilityUnknown(err, "Stop", id)
	}
	if in.out.err == nil && !in.out.done && in.out.token != "" {
		return m.reportRun(id, in.out.token, false), nil
	}
	return ClosureReport{}, in.out.err
}

// reportRun is the report of a stop of task id's run with token: the run,
// with its status now; when ended, only if the stop ended it (cancelled).
func (m *Manager) reportRun(id, token string, ended bool) ClosureReport {
	m.mu.Lock()
	defer m.unlock()
	e := m.led.tasks[id]
	if e == nil {
		return ClosureReport{}
	}
	for i := len(e.attempts) - 1; i >= 0; i-- {
		if a := e.attempts[i]; a.Token == token {
			if ended && a.Status != StatusCancelled {
				break
			}
			return ClosureReport{Stopped: []StoppedRun{{TaskID: id, AttemptID: a.ID, SessionID: a.SessionID, Token: a.Token, Status: a.Status}}}
		}
	}
	return ClosureReport{}
}

// cancel stops the run of task id with token, or (token "") the run current
// at the first look, and waits until it stopped.
func (m *Manager) cancel(ctx context.Context, id, token string, cause *StopCause) (ClosureReport, error) {
	for {
		in := stopIn{id: id, token: token, by: stopAskedBy(cause)}
		if err := m.stepCtx(ctx, &in); err != nil {
			return ClosureReport{}, durabilityUnknown(err, "Stop", id)
		}
		r := in.out
		if r.err != nil {
			return ClosureReport{}, r.err
		}
		if r.done {
			if r.token != "" {
				token = r.token
			}
			if token == "" {
				return ClosureReport{}, nil
			}
			return m.reportRun(id, token, true), nil
		}
		op, wait := r.op, r.wait
		token = r.token // the run the stop acts on
		if servesRun(ctx, token) {
			return m.reportRun(id, token, false), ErrStopPending
		}
		if m.hooks.waiting != nil {
			m.hooks.waiting(id)
		}
		if err := m.parkOn(ctx, wait); err != nil {
			return ClosureReport{}, err
		}
		if op != nil && op.err != nil {
			e := op.ref.e
			m.mu.Lock()
			live := !e.terminal() && e.cur().Token == token
			m.unlock()
			if live {
				return m.reportRun(id, token, false), fmt.Errorf("stop task %s: abort session %s: %w", id, op.session, op.err)
			}
		}
	}
}

// onStop decides a Stop of task id's run (token, or "" for the current
// one): the stop is recorded and acted on; the reply says what to wait for
// (the abort, or the next change), or done when the task is terminal or
// another run is current. m.mu is held.
func (m *Manager) onStop(in *stopIn) reply {
	e := m.led.tasks[in.id]
	if e == nil {
		return reply{err: m.missing(in.id)}
	}
	a := *e.cur()
	if e.terminal() || (in.token != "" && a.Token != in.token) {
		return reply{done: true}
	}
	by := in.by
	if by == nil {
		by = stopByCancel
	}
	m.wantStop(e, by, m.now())
	op := m.stopRun(e, m.now())
	if e.terminal() {
		return reply{done: true, token: a.Token}
	}
	r := reply{op: op, wait: e.waitChange(), token: a.Token}
	if op != nil {
		r.wait = op.waitDone()
	}
	return r
}

// cascadeDelete closes the branch beneath a deleted session: the fence goes
// up at once, and the passes run on a goroutine the Manager owns, so
// Observe never waits for them. Its record is kept; the parent hears of it
// only if anything was running below. m.mu is held.
func (m *Manager) cascadeDelete(sessionID string) {
	c := m.openClosure(sessionID, nil, closedBySessionDeleted, "")
	c.quiet = true
	if !m.effect(effect{kind: fxCascade, closure: c, session: sessionID}) {
		// After Shutdown nothing runs its passes: the fence comes down
		// at once, and the closure that began ends, cut short.
		delete(m.closures.active, c)
		m.signal()
		m.closureEnded(c, ClosureReport{SessionID: sessionID}, false, ErrShutdown)
	}
}

// cascadeNow runs the passes of closure c, which its opener does not wait
// for: a deleted session's branch, a spent budget's.
func (m *Manager) cascadeNow(c *closure, sessionID string) {
	if _, err := m.runClosure(m.life.ctx, c); err != nil && !errors.Is(err, context.Canceled) {
		m.logAttrs(slog.LevelWarn, "closing a branch failed", slog.String("by", c.by),
			slog.String("session", sessionID), slog.String("err", safeText(err)))
	}
}
