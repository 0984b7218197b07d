package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/bgtask/bgtask/internal/group"
	"github.com/bgtask/bgtask/internal/wal"
)

// Lifecycle milestones: a line at info level and a measurement each.

// durableMark is the sequence of the last record known durable, and a
// channel closed when it moves on: what a wait that returns what the
// ledger holds waits on, so that what it returns survives a crash.
type durableMark struct {
	mu  sync.Mutex
	seq uint64
	ch  chan struct{}
}

// advance notes that the records up to seq are durable.
func (d *durableMark) advance(seq uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if seq > d.seq {
		d.seq = seq
		if d.ch != nil {
			close(d.ch)
			d.ch = nil
		}
	}
}

// reached reports whether the records up to seq are durable, and if not
// a channel closed when the mark next moves.
func (d *durableMark) reached(seq uint64) (bool, <-chan struct{}) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.seq >= seq {
		return true, nil
	}
	if d.ch == nil {
		d.ch = make(chan struct{})
	}
	return false, d.ch
}

// errNotDurable wraps ctx's error when a call's wait for its records to be
// durable ended with ctx: they may or may not be.
type errNotDurable struct{ err error }

func (e errNotDurable) Error() string {
	return "the context ended before the records were durable: " + e.err.Error()
}

func (e errNotDurable) Unwrap() error { return e.err }

func (m *Manager) unlockUntil(ctx context.Context, w *group.Worker) error {
	if h := m.calls.health; h != nil && h.roused {
		m.healthWake() // the attempts a cooldown's early end lets go, in this critical section
	}
	if len(m.led.warm) > 0 {
		m.freezeSome(freezeBudget)
	}
	if len(m.out.lines) == 0 && len(m.out.fx) == 0 && len(m.out.recs) == 0 && len(m.out.later) == 0 && len(m.out.measures) == 0 {
		m.mu.Unlock()
		return nil
	}
	r := released{lines: m.out.lines, fx: m.out.fx, later: m.out.later, measures: m.out.measures}
	recs := m.out.recs
	m.out.lines, m.out.fx, m.out.recs, m.out.later, m.out.measures = nil, nil, nil, nil, nil
	r.ordered = len(r.lines) > 0 || len(r.measures) > 0
	if r.ordered {
		r.turn = m.out.turns.take() // under m.mu: the turns follow its releases
	}
	var durable Commit
	if len(recs) > 0 {
		// Batches reach the journal in commit order: the order lock is
		// taken before m.mu is released, and the batch is encoded and
		// appended under it alone, so the encoding holds up no input.
		m.out.order.Lock()
		m.out.recs, m.out.spare = m.out.spare, nil // both locks held: the next commit's buffer
		m.mu.Unlock()
		r.last = recs[len(recs)-1].seq
		durable = m.appendBatch(recs)
		m.out.recycle(recs) // encoded: the records are done with
		m.out.order.Unlock()
	} else {
		m.mu.Unlock()
	}
	var err error
	if durable != nil {
		done, rest, werr := m.waitDurable(ctx, durable)
		if !done {
			// ctx ended first: the wait and all that follows it go on
			// without the caller (effects run only once the records are
			// durable, as ever).
			q := new(released)
			*q = r
			if !m.life.group.Go(func() { _ = m.finishRelease(q, rest(), nil) }) {
				_ = m.finishRelease(q, rest(), nil)
			}
			return errNotDurable{ctx.Err()}
		}
		err = werr
	}
	return m.finishRelease(&r, err, w)
}

// waitDurable waits for c to be durable until ctx ends (nil: without
// end). done is false when ctx ended first; rest then waits for what is
// left of the wait. A Journal's own Commit has only a blocking Wait: with
// a ctx that can end, it waits on a goroutine of the Manager.
func (m *Manager) waitDurable(ctx context.Context, c Commit) (done bool, rest func() error, err error) {
	if ctx == nil || ctx.Done() == nil {
		return true, nil, c.Wait()
	}
	switch c := c.(type) {
	case *wal.Batch:
		done, err = c.WaitContext(ctx)
		return done, c.Wait, err
	case failedCommit:
		return true, nil, c.err
	}
	ch := make(chan error, 1)
	if !m.life.group.Go(func() { ch <- c.Wait() }) {
		return true, nil, c.Wait()
	}
	select {
	case err := <-ch:
		return true, nil, err
	case <-ctx.Done():
		select {
		case err := <-ch:
			return true, nil, err
		default:
		}
		return false, func() error { return <-ch }, nil
	}
}

// finishRelease is the rest of an unlock once its records are durable
// (werr nil) or are known not to be: the Manager stops then (poison).
func (m *Manager) finishRelease(r *released, werr error, w *group.Worker) error {
	var err error
	if r.last > 0 {
		if werr != nil {
			err = m.poison(werr)
		} else {
			m.out.durable.advance(r.last)
		}
	}
	fx := r.fx
	for i := range fx {
		// fx is this call's own: &fx[i] stays valid. Worker w, if any, goes
		// on with the first host call (a start, a retry) of the chain.
		on := w
		if fx[i].kind != fxStart && fx[i].kind != fxRetry {
			on = nil
		} else {
			w = nil
		}
		m.life.group.Start(on, &fx[i])
	}
	if r.ordered { // the logger and Metrics are user code, and may be slow: after the effects start
		m.out.turns.wait(r.turn)
		for _, l := range r.lines {
			m.logAttrs(l.level, l.msg, l.attrs...)
		}
		for _, f := range r.measures {
			f()
		}
		m.out.turns.done()
	}
	for _, f := range r.later { // user callbacks: on a goroutine of their own, or here once none starts
		if err != nil {
			break // not durable: what they would be told did not happen
		}
		if !m.life.group.Go(f) {
			f()
		}
	}
	return err
}

// turns hands out turns in order and lets their holders go one at a time,
// in that order: what an unlock emits (log lines, measurements) comes out
// in the order m.mu was released, without m.mu held while an earlier
// unlock waits for its records to be durable. A turn's holder always takes
// it and gives it back: nothing between can block on a later turn.
type turns struct {
	issued uint64 // guarded by the Manager's m.mu
	mu     sync.Mutex
	next   uint64
	cond   sync.Cond
}

// take hands out the next turn. m.mu is held.
func (t *turns) take() uint64 {
	t.issued++
	return t.issued - 1
}

// wait returns once it is turn n's turn.
func (t *turns) wait(n uint64) {
	t.mu.Lock()
	if t.cond.L == nil {
		t.cond.L = &t.mu
	}
	for t.next != n {
		t.cond.Wait()
	}
	t.mu.Unlock()
}

// done ends the current turn.
func (t *turns) done() {
	t.mu.Lock()
	t.next++
	if t.cond.L != nil {
		t.cond.Broadcast()
	}
	t.mu.Unlock()
}

// appendBatch hands recs to the journal, encoded. m.out.order is held.
func (m *Manager) appendBatch(recs []record) (c Commit) {
	if fj, ok := m.cfg.journal.(*fileJournal); ok { // encoded straight into its payloads
		return fj.appendRecs(recs)
	}
	batch, err := encodeAll(recs)
	if err != nil {
		return failedCommit{err}
	}
	err = guardJournal("Append", func() error {
		c = m.cfg.journal.Append(batch)
		return nil
	})
	if err != nil || c == nil {
		if err == nil {
			err = errors.New("Journal.Append returned no Commit")
		}
		return failedCommit{err}
	}
	return guardedCommit{c}
}

// guardedCommit is a Journal's Commit (user code) whose Wait cannot panic
// through the Manager.
type guardedCommit struct{ c Commit }

func (g guardedCommit) Wait() error {
	return guardJournal("Commit.Wait", g.c.Wait)
}

type failedCommit struct{ err error }

func (c failedCommit) Wait() error { return c.err }

// poison stops the Manager from acting on the world after its journal
// failed: what it has in memory is no longer what is durable, so no host
// call and no notification is made from then on (each fails with the
// journal's error), and every input is refused with it. A restart recovers
// from what the journal holds.
func (m *Manager) poison(err error) error {
	err = fmt.Errorf("%w: %w", ErrJournal, err)
	if m.life.jerr.CompareAndSwap(nil, &err) {
		close(m.life.dead) // whoever waits for what can no longer be recorded (await)
		m.logAttrs(slog.LevelError, "the journal failed; the manager stops acting on the world", slog.String("err", safeText(err)))
	}
	return m.poisoned()
}

// await waits until ch is closed (nil), ctx ends (its error) or the
// journal failed (its error: what is waited for will never be recorded).
// A ch already closed wins.
func (m *Manager) await(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-m.life.dead:
		select {
		case <-ch:
			return nil
		default:
			return m.poisoned()
		}
	}
}

// poisoned returns the journal's error once it failed, else nil.
func (m *Manager) poisoned() error {
	if p := m.life.jerr.Load(); p != nil {
		return *p
	}
	return nil
}

// recordAll makes m keep every record it commits (tests: checkReplay).
func (m *Manager) recordAll() {
	m.mu.Lock()
	defer m.unlock()
	m.led.recordAll()
}

// checkReplay is checkReplay on m's ledger, under its lock.
func (m *Manager) checkReplay() error {
	m.mu.Lock()
	defer m.unlock()
	return checkReplay(m.led)
}

// commit is the one way a change enters the ledger. It writes recs to e,
// in order (a refused record is logged as the bug it is, and ends the
// batch: the records before it stand), and derives from what was written —
// never from the caller — everything that follows: waiters wake, the run's
// slot and queue place are settled, the change is published, a retry's
// notifications are produced, a bound run's stall watch starts, and, when
// the task has just become terminal, its final summary, its done signal and
// the end of its parent's round. It reports whether every record was
// written. m.mu is held.
func (m *Manager) commit(e *entry, recs ...record) bool {
	was := e.current >= 0 && e.terminal()
	n := 0
	for i := range recs {
		if err := m.led.put(e, &recs[i]); err != nil {
			m.ledgerBug(e, err)
			break
		}
		n++
	}
	m.follow(e, was, recs[:n], n == len(recs))
	if len(m.led.crossings) > 0 {
		m.budgetCrossed()
	}
	return n == len(recs)
}

// commitBuilt commits what a record builder made, unless it refused (a bug,
// logged). m.mu is held.
func (m *Manager) commitBuilt(e *entry, rec record, err error) bool {
	if err != nil {
		m.ledgerBug(e, err)
		return false
	}
	return m.commit(e, rec)
}

// follow derives what follows the records just written to e (wasTerminal:
// whether e was terminal before them; whole: the batch was written whole —
// a retry is announced only then, when its new attempt exists). m.mu is
// held.
func (m *Manager) follow(e *entry, wasTerminal bool, recs []record, whole bool) {
	visible := false
	for i := range recs {
		switch recs[i].kind {
		case recStopRequested, recSessionOrphan: // no change a subscriber is sent (a stop shows with the end it brings)
		default:
			visible = true
		}
	}
	if !visible {
		return
	}
	if len(recs) == 1 && recs[0].kind == recUsage { // no run changed: its watchers and subscribers hear, nothing else follows
		e.rt.sig.Change()
		m.signal()
		m.publish(e)
		return
	}
	m.touched(e)
	for i := range recs {
		switch rec := &recs[i]; rec.kind {
		case recRetryScheduled:
			if whole && m.cfg.notifier != nil { // the new attempt is current by now
				m.notify(e, NotifyRetryScheduled, retryScheduledText(rec.attempt, *e.cur()))
			}
			m.retried(e, rec.attempt)
		case recAttemptFinal:
			if m.calls.health != nil {
				m.healthEnded(e, rec.attempt)
			}
			if m.cfg.metrics != nil && !rec.attempt.StartedAt.IsZero() {
				t, a := e.project(), rec.attempt
				m.measure(func(mt Metrics) { mt.AttemptEnded(t, a, a.CompletedAt.Sub(a.StartedAt)) })
			}
		case recSessionBound:
			m.started(e, rec.attempt)
			e.seen.lastEvent = rec.attempt.StartedAt
			if rec.attempt.Number > 1 && m.cfg.notifier != nil {
				m.notify(e, NotifyRetrySessionReady, retrySessionReadyText(rec.attempt))
			}
			if m.cfg.stallTimeout > 0 {
				m.watchStall(e, rec.attempt)
			}
			if e.info.opt().attemptTimeout > 0 {
				m.armDeadline(e, rec.attempt)
			}
		}
	}
	for i := range recs {
		if recs[i].kind == recAttemptFinal { // the run a prompt call in flight serves has ended
			if lane := m.calls.prompts[e]; lane != nil && lane.stopCall != nil {
				lane.stopCall()
			}
		}
	}
	if !wasTerminal && e.terminal() {
		m.ended(e)
	}
}

// touched wakes everyone waiting on a change of e, settles its run's slot
// and queue place, and publishes its state. m.mu is held.
func (m *Manager) touched(e *entry) {
	e.rt.sig.Change()
	m.signal()
	m.settleRun(e)
	m.publish(e)
}

// ended follows e becoming terminal: its final summary, its done signal,
// and the end of its parent's round. m.mu is held.
func (m *Manager) ended(e *entry) {
	m.endedLine(e)
	m.answerAtEnd(e)
	if lane := m.calls.prompts[e]; lane != nil && lane.users == 0 {
		delete(m.calls.prompts, e) // else the last Extend waiting on it does
	}
	if m.cfg.notifier != nil {
		m.notify(e, NotifyFinalSummary, finalSummaryText(e.project()))
	}
	e.rt.sig.End()
	m.roundEnded(e)
	l := m.led
	l.liveEnded(e)
	m.wakeFanout(e.info.parent)
	if loc := e.loc; loc != nil {
		if loc.stopWait != nil {
			loc.stopWait() // Spec.CancelWithCaller: nothing left to cancel
			loc.stopWait = nil
		}
		loc.values = nil // no call of the task is made any more: let the caller's context go
	}
	l.ended = append(l.ended, e)
	if e.notesOut == 0 {
		m.taskSettled(e)
	}
	m.sweep()
}

// launched tells of new task e. m.mu is held.
func (m *Manager) launched(e *entry) {
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "task launched", slog.String("task", e.id), slog.String("attempt", e.cur().ID), slog.String("parent", e.info.parent),
			slog.String("models", fmt.Sprint(e.info.models)), slog.Int("depth", e.info.depth))
	}
	if m.cfg.metrics != nil {
		t, live := e.project(), m.liveTasks()
		m.measure(func(mt Metrics) { mt.TaskLaunched(t); mt.LiveTasks(live) })
	}
}

// started tells of attempt a of e, whose session now runs. m.mu is held.
func (m *Manager) started(e *entry, a Attempt) {
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "attempt started", slog.String("task", e.id), slog.String("attempt", a.ID),
			slog.String("session", a.SessionID), slog.Int("number", a.Number), slog.String("model", a.Model.String()))
	}
	if m.cfg.metrics != nil {
		t := e.project()
		m.measure(func(mt Metrics) { mt.AttemptStarted(t, a) })
	}
}

// retried tells of failed attempt a of e failing over. m.mu is held.
func (m *Manager) retried(e *entry, a Attempt) {
	if !m.cfg.logInfo && m.cfg.metrics == nil {
		return
	}
	reason := reasonOf(errors.New(a.Error)) // our own error: no user code runs
	if out := e.seen.out; out.token == a.Token && out.reason != "" {
		reason = out.reason
	}
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "retry scheduled", slog.String("task", e.id), slog.String("attempt", a.ID),
			slog.String("session", a.SessionID), slog.String("model", a.Model.String()), slog.String("next_model", e.cur().Model.String()),
			slog.String("reason", string(reason)), slog.String("err", a.Error))
	}
	if m.cfg.metrics != nil {
		t := e.project()
		m.measure(func(mt Metrics) { mt.RetryScheduled(t, a, reason) })
	}
}

// endedLine tells of e's end, with its outcome. m.mu is held.
func (m *Manager) endedLine(e *entry) {
	if !m.cfg.logInfo && m.cfg.metrics == nil {
		return
	}
	t := e.project()
	o, cur := t.Outcome, t.Current()
	if m.cfg.logInfo {
		attrs := []slog.Attr{slog.String("task", e.id), slog.String("attempt", cur.ID),
			slog.String("session", cur.SessionID), slog.String("status", string(t.Status)), slog.String("outcome", string(o.State)),
			slog.String("reason", string(o.Reason)), slog.Int("attempts", len(t.Attempts))}
		m.logLocked(slog.LevelInfo, "task ended", append(attrs, stopAttrs(t.Stop)...)...)
	}
	if m.cfg.metrics != nil {
		live := m.liveTasks() - 1 // e counts as ended from here on
		m.measure(func(mt Metrics) {
			mt.TaskEnded(t, o.State, o.Reason, t.CompletedAt.Sub(t.LaunchedAt))
			mt.LiveTasks(live)
		})
	}
}

// liveTasks counts the live tasks. m.mu is held.
func (m *Manager) liveTasks() int { return len(m.led.tasks) - len(m.led.ended) }

// queueDepth reports key's queue, after it changed. m.mu is held.
func (m *Manager) queueDepth(key string) {
	if m.cfg.metrics != nil {
		n := m.calls.pool.Queued(key)
		m.measure(func(mt Metrics) { mt.QueueDepth(key, n) })
	}
}

// Who stopped what: the lines and measurements of a stop asked, a branch
// closure and a restart's recovery.

// stopAsked tells of the stop just recorded for e's current run: who
// asked (stop's note, read back as the StopCause the ledger keeps). m.mu
// is held.
func (m *Manager) stopAsked(e *entry, stop *recordExt) {
	if !m.cfg.logInfo && m.cfg.metrics == nil {
		return
	}
	c := stopCauseOf(stop.note)
	if m.cfg.logInfo {
		a := e.cur()
		attrs := []slog.Attr{slog.String("task", e.id), slog.String("attempt", a.ID), slog.String("session", a.SessionID),
			slog.String("status", string(a.Status)), slog.String("stop.status", string(stop.stop))}
		m.logLocked(slog.LevelInfo, "stop asked", append(attrs, stopAttrs(&c)...)...)
	}
	if m.cfg.metrics != nil {
		t := e.project()
		m.measure(func(mt Metrics) { mt.StopAsked(t, c) })
	}
}

// stopAttrs says who asked a stop, for a log line: stop (in words),
// stop.kind, and what the kind names — stop.root, stop.task, stop.note —
// when it names it. None for no stop.
func stopAttrs(c *StopCause) []slog.Attr {
	if c == nil {
		return nil
	}
	return []slog.Attr{slog.String("stop", c.String()), slog.String("stop.kind", string(c.Kind)),
		slog.String("stop.root", c.Root), slog.String("stop.task", c.TaskID), slog.String("stop.note", c.Note)}
}

// closureSummary is c as Metrics sees it, with no counts yet. m.mu is
// held.
func (m *Manager) closureSummary(c *closure) ClosureSummary {
	s := ClosureSummary{SessionID: c.root, By: c.by, Stop: stopCauseOf(c.stop.note)}
	if owner := m.rootTask(c); owner != nil {
		s.TaskID = owner.id
	}
	return s
}

// closureAttrs are the attributes a closure's lines share.
func closureAttrs(s *ClosureSummary) []slog.Attr {
	return append([]slog.Attr{slog.String("session", s.SessionID), slog.String("task", s.TaskID), slog.String("by", s.By)},
		stopAttrs(&s.Stop)...)
}

// closureBegun tells of closure c, whose fence just went up. m.mu is held.
func (m *Manager) closureBegun(c *closure) {
	if !m.cfg.logInfo && m.cfg.metrics == nil {
		return
	}
	s := m.closureSummary(c)
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "branch closure begun", closureAttrs(&s)...)
	}
	if m.cfg.metrics != nil {
		m.measure(func(mt Metrics) { mt.ClosureBegun(s) })
	}
}

// closureEnded tells of closure c, whose fence just came down, with what
// its report says; dropped: its root turned out to be no task's session;
// cause: why it returned early (its caller's context, Shutdown), if it
// did. m.mu is held.
func (m *Manager) closureEnded(c *closure, rep ClosureReport, dropped bool, cause error) {
	if !m.cfg.logInfo && m.cfg.metrics == nil {
		return
	}
	s := m.closureSummary(c)
	s.Stopped, s.Failed, s.Stopping, s.Passes, s.Dropped = len(rep.Stopped), len(rep.Failed), len(rep.Stopping), rep.Passes, dropped
	if !dropped {
		s.Ended = m.closureEndedEarly(cause)
	}
	d := m.now().Sub(c.began)
	if m.cfg.logInfo {
		attrs := append(closureAttrs(&s), slog.Int("stopped", s.Stopped), slog.Int("failed", s.Failed), slog.Int("stopping", s.Stopping),
			slog.Int("passes", s.Passes), slog.Duration("duration", d), slog.String("ended", s.Ended))
		if dropped {
			attrs = append(attrs, slog.Bool("dropped", true))
		}
		if cause != nil {
			attrs = append(attrs, slog.String("err", safeText(cause)))
		}
		m.logLocked(slog.LevelInfo, "branch closure ended", attrs...)
	}
	if m.cfg.metrics != nil {
		m.measure(func(mt Metrics) { mt.ClosureEnded(s, d) })
	}
}

// closureEndedEarly says why a closure ended before its end
// (ClosureSummary.Ended), from the error it ended with: "" for none.
// Its context ends with Shutdown when it is the Manager's own (a deleted
// session's closure, one gone on without its caller), so a context's end
// once Shutdown began is Shutdown's. m.mu is held.
func (m *Manager) closureEndedEarly(cause error) string {
	switch {
	case cause == nil:
		return ""
	case errors.Is(cause, ErrShutdown):
		return closureShutdown
	case errors.Is(cause, context.Canceled) || errors.Is(cause, context.DeadlineExceeded):
		if m.life.closing {
			return closureShutdown
		}
		return closureCancelled
	}
	return closureJournalFailed
}

// recovered tells of a restart's recovery, over after d, with what it
// counted. m.mu is held.
func (m *Manager) recovered(rv *recovery, d time.Duration) {
	n := rv.counts
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "recovered from the journal", slog.Int("tasks", n.Tasks), slog.Int("live", n.Live),
			slog.Int("readopted", n.Readopted), slog.Int("ended", n.Ended), slog.Int("interrupted", n.Interrupted),
			slog.Int("stopped", n.Stopped), slog.Int("started", n.Started), slog.Int("retried", n.Retried),
			slog.Int("redelivered", n.Redelivered), slog.Int("owed", n.Owed), slog.Int("undelivered", n.Undelivered),
			slog.Int("closures", n.Closures), slog.Duration("duration", d))
	}
	if m.cfg.metrics != nil {
		m.measure(func(mt Metrics) { mt.Recovered(n, d) })
	}
}
