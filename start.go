package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/bgtask/bgtask/internal/group"
)

// startSession calls StartSession for run a of e (start seq) and feeds its
// answer back (started), on worker w.
func (m *Manager) startSession(fx *effect, w *group.Worker) {
	e, a := fx.e, fx.run.attempt()
	req := SessionRequest{
		TaskID:          e.info.id,
		AttemptID:       a.ID,
		AttemptNumber:   a.Number,
		Token:           a.Token,
		ParentSessionID: e.info.parent,
		Model:           a.Model,
		Agent:           e.info.agent,
		Prompt:          e.info.prompt,
		Description:     e.info.description,
		Metadata:        maps.Clone(e.info.metadata),
	}
	fx.ctx = runCtx{Context: m.life.ctx, v: runValue{ref: RunRef{TaskID: req.TaskID, AttemptID: a.ID, Token: a.Token}, kind: callStart, e: e}, values: fx.ctx.values}
	var sid string
	err := m.gateStart(&fx.ctx, req)
	switch {
	case err != nil:
	case a.Number == 1 && e.info.opt().resume != "":
		sid, err = m.callResume(&fx.ctx, e.info.opt().resume, req)
	case e.info.inProcess:
		sid, err = m.callStartOn(&fx.ctx, m.hosts.funcs, req)
	default:
		sid, err = m.callStart(&fx.ctx, req)
	}
	var f failure
	if err != nil {
		err = &StartError{Model: a.Model, Err: err}
		f = m.classify(err)
	}
	m.mu.Lock()
	m.decide(&startedIn{e: e, a: a, seq: fx.seq, sid: sid, err: err, f: f})
	m.unlockOn(w)
}

// gateStart asks the start gate (WithStartGate) whether req may start: a
// refusal, or a gate that panics, fails the start for good.
func (m *Manager) gateStart(ctx context.Context, req SessionRequest) (err error) {
	g := m.cfg.startGate
	if g == nil {
		return nil
	}
	defer func() {
		if r := recover(); r != nil {
			err = Permanent(fmt.Errorf("the start gate panicked: %s", panicText(r)))
		}
	}()
	if err := guardError(g(ctx, req)); err != nil {
		return Permanent(fmt.Errorf("the start was refused: %w", err))
	}
	return nil
}

// callResume resumes session sid for req (Spec.ContinueFrom) and returns
// it; the host is user code.
func (m *Manager) callResume(ctx context.Context, sid string, req SessionRequest) (_ string, err error) {
	if err := m.poisoned(); err != nil {
		return "", Permanent(err)
	}
	defer func() {
		if r := recover(); r != nil {
			err = Permanent(fmt.Errorf("Host.ResumeSession panicked: %s", panicText(r)))
		}
	}()
	r, _ := m.hosts.main.(Resumer) // Launch checked
	if err := guardError(r.ResumeSession(ctx, sid, req)); err != nil {
		return "", err
	}
	return sid, nil
}

func (m *Manager) callStart(ctx context.Context, req SessionRequest) (sid string, err error) {
	return m.callStartOn(ctx, m.hosts.main, req)
}

// callStartOn calls host's StartSession: the Manager's Host, or its
// in-process host for a task with its own function.
func (m *Manager) callStartOn(ctx context.Context, host Host, req SessionRequest) (sid string, err error) {
	if err := m.poisoned(); err != nil {
		return "", Permanent(err)
	}
	defer func() {
		if r := recover(); r != nil {
			sid, err = "", Permanent(fmt.Errorf("Host.StartSession panicked: %s", panicText(r)))
		}
	}()
	sid, err = host.StartSession(ctx, req)
	return sid, guardError(err)
}

// signal wakes everyone waiting on a manager-wide change.
func (m *Manager) signal() {
	if m.changes.anyChange != nil {
		close(m.changes.anyChange)
		m.changes.anyChange = nil
	}
}

// spawnStart has StartSession called for attempt a of e (an effect).
// m.mu is held.
func (m *Manager) spawnStart(e *entry, a Attempt) {
	if m.calls.health != nil {
		m.healthTake(e, a.Model, a.Token, m.now())
	}
	m.calls.startSeq++
	seq := m.calls.startSeq
	if !m.effect(effect{kind: fxStart, e: e, run: runOfAttempt(a), seq: seq, ctx: runCtx{values: e.values()}}) {
		m.finalize(e, a.ID, StatusInterrupt, "", "", m.now())
		return
	}
	m.calls.inflight[seq] = struct{}{}
	e.rt.startSeq = seq
	m.intend(recStartRequested, e, a)
}

// intend records that a host call for run a of e is about to be made
// (kind: recStartRequested, recAbortRequested): durable, with a journal,
// before the call, so that after a crash recovery knows which calls may
// have happened. m.mu is held.
func (m *Manager) intend(kind recordKind, e *entry, a Attempt) {
	if m.led.recording() {
		m.led.emit(record{kind: kind, task: e.id, at: m.now(), attempt: a})
	}
}

// onStarted decides StartSession's answer for attempt a of e (start seq).
// err, when set, is a *StartError, and f its classification, made before
// the lock. m.mu is held.
func (m *Manager) onStarted(in *startedIn) {
	e, a, seq, sid, err, f := in.e, in.a, in.seq, in.sid, in.err, in.f
	delete(m.calls.inflight, seq)
	if e.rt.startSeq == seq {
		e.rt.startSeq = 0
	}
	defer m.signal() // Shutdown and closures wait for starts to return
	defer m.expireHeld()

	ref, ok := m.led.attemptOf(a.ID)
	live := ok && ref.e == e && ref.isCurrent() && ref.attempt().Token == a.Token && ref.attempt().Status == StatusPending
	if err == nil && sid == "" {
		err = Permanent(&StartError{Model: a.Model, Err: errors.New("Host.StartSession returned no session id")})
		f = failure{err: err, text: err.Error(), reason: ReasonUnknown}
	}
	if sid != "" {
		if owner, taken := m.led.bySession[sid]; taken && !(a.Number == 1 && continues(e, owner, sid)) {
			// A host bug: never touch a session that belongs to another run.
			m.logLocked(slog.LevelError, "Host.StartSession returned a session that belongs to another attempt",
				slog.String("task", e.info.id), slog.String("attempt", a.ID), slog.String("session", sid),
				slog.String("owner", owner.attempt().ID))
			err = Permanent(&StartError{Model: a.Model, Err: fmt.Errorf("Host.StartSession returned session %s, which belongs to attempt %s", sid, owner.attempt().ID)})
			f = failure{err: err, text: err.Error(), reason: ReasonUnknown}
			sid = ""
		}
	}
	if live {
		m.fenceStop(e) // a run inside a closing branch is aborted on arrival
	}
	switch {
	case live && sid != "":
		// Adopt it: the session exists, so the attempt runs — also when a
		// stop was asked for meanwhile, or the host reported the start
		// failed although it made a session. Bind, then apply what the
		// child already said (a child that already ended keeps its own
		// outcome); then, for a stop or a failed start, abort it. It ends
		// (cancelled, or failed with the start's error) only once the host
		// confirms; if the abort fails, it is alive and runs on.
		if !m.bindRun(e, a.ID, sid, m.now()) {
			return
		}
		m.replayHeld(a.ID, sid)
		if cur := e.cur(); cur.ID == a.ID && !cur.Status.Terminal() && (e.stop != "" || err != nil) {
			op, fresh := m.newAbort(e, cur, nil)
			if err != nil {
				fw := f // only this path pays for keeping it
				op.failWith = &fw
			}
			if fresh {
				m.runAbort(op)
			}
		}
	case sid != "":
		// Created for an attempt that is no longer current: index it so its
		// events resolve (as stale), abort it, never adopt it.
		rec, err := m.led.orphanRecord(e, a.ID, sid, m.now())
		m.commitBuilt(e, rec, err)
		m.abortOrphan(e, a, sid)
		m.replayHeld(a.ID, sid)
	case live:
		m.replayHeld(a.ID, sid) // held events for an attempt that never ran: stale
		m.startFailed(e, a, f)
	default:
		m.replayHeld(a.ID, sid)
	}
}

// replayHeld applies, in arrival order, the events held for the attempt or
// its session (sid, "" if none): as they would have been applied had they
// come now. m.mu is held.
func (m *Manager) replayHeld(attemptID, sid string) {
	evs := m.calls.held.Take(attemptID, sid) // the Set's buffer: nothing below takes again
	for i := range evs {
		if who, rerr := m.observeLocked(&evs[i]); rerr != nil {
			m.rejectedLocked(evs[i].ev, who, rerr)
		}
	}
}

// bindRun binds sid to attempt attemptID of e, which runs from now, and
// does what every bind does: the parent hears of a retry's session, and the
// stall watch starts. It reports false if the ledger refused the bind.
// m.mu is held.
func (m *Manager) bindRun(e *entry, attemptID, sid string, now time.Time) bool {
	rec, err := m.led.bindRecord(e, attemptID, sid, now)
	return m.commitBuilt(e, rec, err)
}

// startFailed records a failed session start of the current attempt a.
func (m *Manager) startFailed(e *entry, a Attempt, f failure) {
	now := m.now()
	if !m.setPending(e, a.ID, PendingSessionFailed, now) {
		return
	}
	if e.stop != "" {
		// No child exists: the stop asked for is already true. The start's
		// failure is kept as the attempt's error.
		e.output().reason = f.reason
		m.finalize(e, a.ID, e.stop, f.text, "", now)
		return
	}
	m.fail(e, f, now)
}

// finalize ends attempt id of e with status. m.mu is held.
func (m *Manager) finalize(e *entry, id string, status Status, errText, result string, at time.Time) {
	ref, ok := m.led.attemptOf(id)
	if !ok || ref.e != e {
		m.ledgerBug(e, fmt.Errorf("ledger: unknown attempt %q", id))
		return
	}
	m.finalizeRef(ref, status, errText, result, at)
}

// finalizeRef ends the attempt ref names with status. m.mu is held.
func (m *Manager) finalizeRef(ref attemptRef, status Status, errText, result string, at time.Time) {
	rec, err := m.led.finalRecord(ref.e, ref.attempt().ID, status, errText, result, at)
	rec.evidence.budget = budgetNotice(ref.e.budgetState()) // the figures as the task ends: its envelope's notice
	m.commitBuilt(ref.e, rec, err)
}

// setPending records why e's pending attempt id waits now, and runs what
// follows every applied change. A refused write is logged as the bug it is
// and reported false. m.mu is held.
func (m *Manager) setPending(e *entry, id string, reason PendingReason, at time.Time) bool {
	rec, err := m.led.pendingRecord(e, id, reason, at)
	return m.commitBuilt(e, rec, err)
}

// stopStatus is the status a stop of e's run gives: the one asked for,
// cancelled by default. m.mu is held.
func (e *entry) stopStatus() Status {
	if e.stop != "" {
		return e.stop
	}
	return StatusCancelled
}

// onRunReturned decides a FuncHost function's return after a stop was
// asked (see stoppedWith). m.mu is held.
func (m *Manager) onRunReturned(in *runReturnedIn) {
	attemptID, token, text, ended := in.attemptID, in.token, in.text, in.ended
	ref, ok := m.led.attemptOf(attemptID)
	if !ok || !ref.isCurrent() || ref.attempt().Token != token || ref.attempt().Status.Terminal() {
		return
	}
	e := ref.e
	out := e.output()
	if text != "" {
		out.stopErr = text
		if out.output == "" {
			out.output = text
		}
	}
	if !ended {
		return
	}
	out.returned = true // an abort in flight that gave up on it still ends it (aborted)
	if e.rt.abort == nil || e.rt.abort.run().Token != token {
		m.finalizeRef(ref, e.stopStatus(), out.stopErr, "", m.now())
	}
}
