package bgtask

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/bgtask/bgtask/internal/held"
)

// Observe applies a child session's lifecycle event. It returns nil when the
// event was applied, or held until the session a start in flight creates is
// bound; ErrStaleEvent when it belongs to a superseded or terminal attempt,
// names an old run token, or names an attempt no child can be running for;
// ErrUnknownSession when no task knows the session (or too many events are
// held already); ErrInvalidArgument for an event with neither session nor
// attempt, or an unknown kind. Rejected events change nothing and are logged
// at debug level with the task, attempt and session ids. With a journal,
// Observe returns once what the event decided is durable, or ErrJournal if
// it could not be made so (the Manager then stops acting on the world).
func (m *Manager) Observe(ev Event) error {
	if !ev.Kind.valid() {
		return fmt.Errorf("%w: unknown kind %q", ErrInvalidArgument, ev.Kind)
	}
	if ev.SessionID == "" && ev.AttemptID == "" {
		return fmt.Errorf("%w: no SessionID or AttemptID", ErrInvalidArgument)
	}
	if err := ev.Usage.validate(); err != nil {
		return err
	}
	in := eventIn{obs: observation{ev: ev, classified: ev.Kind != SessionError}}
	durable := m.step(&in)
	if in.err == errNeedsClass {
		// An error that will be applied: classify it without the lock (the
		// classifier is user code), then resolve again from scratch.
		o := &in.obs
		if o.ev.Err == nil {
			o.ev.Err = errors.New("session error with no detail")
		}
		o.fail, o.classified = m.classify(o.ev.Err), true
		durable = m.step(&in)
	}
	if in.err != nil {
		m.logRejected(ev, in.who, in.err)
		return in.err
	}
	return durable // ErrJournal: what the event decided is not durable, and has not happened
}

// resolved names the attempt an event resolved to, for logging.
type resolved struct{ taskID, attemptID string }

// observeLocked resolves an event to an attempt identity and, if it is the
// current live run, applies it. m.mu is held.
func (m *Manager) observeLocked(o *observation) (resolved, error) {
	ev := o.ev
	var ref attemptRef
	var ok bool
	if ev.AttemptID != "" {
		ref, ok = m.led.attemptOf(ev.AttemptID)
	} else {
		ref, ok = m.led.bySession[ev.SessionID]
	}
	if !ok {
		if ev.AttemptID == "" && len(m.calls.inflight) > 0 {
			if !o.classified {
				return resolved{}, errNeedsClass
			}
			if !m.hold(o, "") {
				return resolved{}, fmt.Errorf("%w: %d events already held for sessions being started", ErrUnknownSession, m.calls.held.BySession())
			}
			return resolved{}, nil
		}
		return resolved{}, ErrUnknownSession
	}
	// The entry's first cache line decides most events: whether the
	// attempt is current, and its status. The attempt itself is read only
	// for a token to compare, or a session when the event was resolved by
	// its attempt (bySession names the session's attempt by construction).
	e := ref.e
	stale := !ref.isCurrent() || e.state.Terminal()
	if stale && ev.Usage.IsZero() {
		return m.who(ref), ErrStaleEvent
	}
	if ev.Token != "" || ev.AttemptID != "" {
		a := ref.attempt()
		if (ev.Token != "" && ev.Token != a.Token) ||
			(ev.SessionID != "" && a.SessionID != "" && ev.SessionID != a.SessionID) {
			return m.who(ref), ErrStaleEvent // it contradicts its attempt: its usage counts nowhere
		}
	}
	if stale || ev.Kind == SessionUsage {
		// The work was done: its usage counts for the attempt that did
		// it, and nothing else of the event applies.
		m.spend(ref, ev.Usage, ev.At)
		if ev.Kind == SessionUsage {
			return resolved{}, nil
		}
		return m.who(ref), ErrStaleEvent
	}
	if !o.classified && (e.state == StatusRunning || e.rt.starting()) {
		return resolved{}, errNeedsClass
	}
	if e.state == StatusPending {
		a := ref.attempt()
		if !e.rt.starting() {
			m.spend(ref, ev.Usage, ev.At)
			return m.who(ref), ErrStaleEvent // no child can be running for it
		}
		if !m.hold(o, a.ID) {
			return m.who(ref), fmt.Errorf("%w: %d events already held for attempt %s", ErrUnknownSession, m.calls.held.ForAttempt(a.ID), a.ID)
		}
		return resolved{}, nil
	}
	m.spend(ref, ev.Usage, ev.At)
	m.apply(ref.e, o)
	return resolved{}, nil
}

// hold keeps o until the attempt it names (attemptID), or the session it
// names (attemptID ""), is bound, within the WithHoldLimit bound (see
// internal/held). A liveness event given up to make room is logged as
// refused. m.mu is held.
func (m *Manager) hold(o *observation, attemptID string) bool {
	dropped, gaveUp, ok := m.calls.held.Hold(held.Event[observation]{
		V: *o, Attempt: attemptID, Session: o.ev.SessionID, Ends: o.ev.Kind.ends(), Horizon: m.calls.startSeq,
	})
	if ok && m.cfg.logDebug {
		m.logLocked(slog.LevelDebug, "event held until its session is bound", slog.String("kind", string(o.ev.Kind)),
			slog.String("session", o.ev.SessionID), slog.String("attempt", attemptID))
	}
	if gaveUp {
		m.rejectedLocked(dropped.ev, resolved{}, fmt.Errorf("%w: dropped to hold an event that ends a run", ErrUnknownSession))
	}
	return ok
}

// who names the attempt for a log line; a Manager that logs nothing does
// not read them. m.mu is held.
func (m *Manager) who(r attemptRef) resolved {
	if m.cfg.silent {
		return resolved{}
	}
	return resolved{taskID: r.e.id, attemptID: r.attempt().ID}
}

// expireHeld drops the session events that no start still in flight can
// claim: every start issued before they arrived has returned.
func (m *Manager) expireHeld() {
	if m.calls.held.BySession() == 0 {
		return
	}
	oldest := m.calls.startSeq + 1
	for seq := range m.calls.inflight {
		oldest = min(oldest, seq)
	}
	m.calls.held.Expire(oldest, func(o observation) { m.rejectedLocked(o.ev, resolved{}, ErrUnknownSession) })
}

// apply applies an event to the current running attempt of e. m.mu is held.
func (m *Manager) apply(e *entry, o *observation) {
	ev, a := o.ev, e.cur()
	var at time.Time
	if ev.Kind.ends() || m.cfg.stallTimeout > 0 {
		// Only a run's end and the stall watch need the time: liveness
		// without a stall watch reads no clock and not the attempt.
		if at = ev.At; at.IsZero() {
			at = m.now()
		}
		if at.Before(a.StartedAt) { // an early event, replayed at the bind
			at = a.StartedAt
		}
		e.seen.lastEvent = at
	}
	if ev.Text != "" {
		e.output().output = ev.Text
	}
	switch ev.Kind {
	case SessionBusy, SessionCompacted:
		// Liveness only: the run goes on.
		m.setProgress(e, ev.Progress)
		m.setActivity(e, ActivityGenerating)
	case SessionWaiting:
		m.setProgress(e, ev.Progress)
		m.setActivity(e, ActivityWaiting)
	case SessionIdle:
		if ev.Value != nil { // the turn's structured result, for Task.Value
			l := e.keep()
			l.value, l.valueTok = ev.Value, a.Token
		}
		if t := (turnEnd{token: a.Token, text: ev.Text, finish: string(ev.Reason), noText: ev.NoFinalText, upTo: ev.Invocation, at: at, last: ev.last}); !m.atGate(e, t) {
			m.turnEnded(e, t, "")
		}
	case SessionError:
		m.fail(e, o.fail, at)
	case SessionInterrupted:
		m.finalize(e, a.ID, StatusInterrupt, "", "", at)
	case SessionDeleted:
		m.wantStop(e, stopBySessionDeleted, at) // who stopped it, unless a stop was asked first
		m.finalize(e, a.ID, StatusCancelled, "session deleted", "", at)
		m.cascadeDelete(a.SessionID)
	}
}
