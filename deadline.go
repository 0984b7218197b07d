package bgtask

import (
	"fmt"
	"time"
)

// Deadlines (Spec.Timeout, Spec.AttemptTimeout).

// armDeadline arms the task's deadline (a.ID ""), from its launch, or run
// a's, from its start: a timer on the Manager's clock whose watch ends
// with the task, or the run. m.mu is held.
func (m *Manager) armDeadline(e *entry, a Attempt) {
	due, done := e.info.launchedAt.Add(e.info.opt().timeout), e.waitDone()
	if a.ID != "" {
		due, done = a.StartedAt.Add(e.info.opt().attemptTimeout), m.runDone(e)
	}
	t := m.cfg.clock.NewTimer(max(due.Sub(m.now()), 0))
	if !m.effect(effect{kind: fxDeadline, e: e, run: runOfAttempt(a), timer: t, done: done}) {
		t.Stop()
	}
}

// deadlineRetry is how long a deadline waits, after an abort that did not
// stop the run, before it asks for another.
const deadlineRetry = 30 * time.Second

// watchDeadlineNow waits for the deadline fx arms, and has the core act on
// it unless the task (or run) ended first; while the abort it set off (or
// found in flight) leaves the run alive, it asks again every
// deadlineRetry.
func (m *Manager) watchDeadlineNow(fx *effect) {
	t := fx.timer
	for {
		select {
		case <-t.C():
		case <-fx.done:
			t.Stop()
			return
		case <-m.life.ctx.Done():
			t.Stop()
			return
		}
		in := deadlineIn{e: fx.e, a: fx.run.attempt()}
		m.step(&in)
		if in.wait == nil {
			return
		}
		unpark := m.life.parked.park(in.wait, fx.done, m.life.ctx.Done())
		select { // the abort's answer: stopped (then done closes), or still alive
		case <-in.wait:
		case <-fx.done:
		case <-m.life.ctx.Done():
		}
		unpark()
		t = m.cfg.clock.NewTimer(deadlineRetry)
	}
}

// onDeadline decides a deadline that came due. The task's: a stop is
// recorded (no retry follows) and the run fails, reason deadline — at
// once with no child, else once the host confirms the abort, whoever
// asked for it. A run's: it is aborted and fails, reason deadline,
// falling back to the next model only with Spec.RetryOnTimeout; an abort
// already in flight is waited for instead. in.wait is the abort to wait
// for before looking again. m.mu is held.
func (m *Manager) onDeadline(in *deadlineIn) {
	e, a := in.e, in.a
	if m.hooks.deadline != nil {
		defer m.hooks.deadline(e.id)
	}
	cur := e.cur()
	switch {
	case e.terminal():
		return
	case a.ID == "":
		m.wantStop(e, stopByDeadline, m.now())
		switch op := m.stopRun(e, m.now()); {
		case e.terminal():
		case op != nil:
			in.wait = op.waitDone()
		default: // a start in flight: its session is aborted as it arrives, then looked at again
			in.wait = e.waitChange()
		}
		return
	case cur.Token != a.Token || cur.Status != StatusRunning:
		return
	case e.rt.abort != nil:
		in.wait = e.rt.abort.waitDone()
		return
	}
	op, _ := m.newAbort(e, cur, nil)
	op.failWith = deadlineFailure(e, true)
	m.runAbort(op)
	in.wait = op.waitDone()
}

// deadlineFailure is how a run stopped at a deadline fails: the task's
// (Spec.Timeout), never retried, or its own (Spec.AttemptTimeout),
// retried with Spec.RetryOnTimeout.
func deadlineFailure(e *entry, attempt bool) *failure {
	err := fmt.Errorf("%w: the task ran longer than its timeout of %s", ReasonDeadline, e.info.opt().timeout)
	if attempt {
		err = fmt.Errorf("%w: the attempt ran longer than its timeout of %s", ReasonDeadline, e.info.opt().attemptTimeout)
	}
	return &failure{err: err, text: err.Error(), reason: ReasonDeadline, retry: attempt && e.info.opt().retryOnTimeout}
}
