package bgtask

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask/internal/held"
	"github.com/bgtask/bgtask/internal/signal"
	"github.com/bgtask/bgtask/internal/slots"
	"github.com/bgtask/bgtask/internal/textbound"
)

// Model names a provider's model, with an optional variant. Provider may
// be empty: a harness's own name for a model (an alias such as
// "gpt-primary", a router's name) is a Model with only an ID, rendered as
// the ID alone.
type Model struct {
	// Provider names the provider ("openai"); empty for a harness's own alias.
	Provider string `json:"providerID"`
	// ID is the model's id at the provider, or the alias.
	ID string `json:"modelID"`
	// Variant is an optional variant ("thinking"), rendered in parentheses.
	Variant string `json:"variant,omitempty"`
}

// String returns "provider/id" ("id" with no provider), and a variant in
// parentheses after it: "provider/id (variant)".
func (m Model) String() string {
	s := m.ID
	if m.Provider != "" {
		s = m.Provider + "/" + m.ID
	}
	if m.Variant != "" {
		s += " (" + m.Variant + ")"
	}
	return s
}

// ParseModel splits s at its first "/" into provider and model ID; a
// string with no "/" is a model with no provider (its ID is s). An empty
// side, or an empty s, is an error.
func ParseModel(s string) (Model, error) {
	provider, id, ok := strings.Cut(s, "/")
	if !ok {
		if blank(s) {
			return Model{}, fmt.Errorf("bgtask: model %q is empty", s)
		}
		return Model{ID: s}, nil
	}
	if provider == "" || id == "" {
		return Model{}, fmt.Errorf("bgtask: model %q has an empty provider or ID", s)
	}
	return Model{Provider: provider, ID: id}, nil
}

// Status is the state of an attempt; a task's status is its current
// attempt's.
type Status string

const (
	// StatusPending: the attempt exists but its child session is not
	// running yet. Entered when the attempt is created (launch or retry);
	// left for running when StartSession returns a session bound to it, or
	// for a terminal state. Attempt.Pending says why it waits.
	StatusPending Status = "pending"
	// StatusRunning: the child session exists and was bound to this attempt.
	// Left only on evidence that the run ended (an event, or an abort the
	// host confirmed).
	StatusRunning Status = "running"
	// StatusCompleted: the child's turn ended (SessionIdle). Terminal.
	StatusCompleted Status = "completed"
	// StatusError: the child's turn failed, or its session could not be
	// started, and the task did not (or could not) retry it. Terminal.
	StatusError Status = "error"
	// StatusCancelled: the child was stopped on request (the host confirmed
	// the abort), its session was deleted, or it never started before the
	// request. Terminal.
	StatusCancelled Status = "cancelled"
	// StatusInterrupt: the child's run was interrupted (SessionInterrupted)
	// or stopped by Shutdown. Terminal.
	StatusInterrupt Status = "interrupt"
)

// Terminal reports whether s is a final state: completed, error, cancelled
// or interrupt.
func (s Status) Terminal() bool {
	switch s {
	case StatusCompleted, StatusError, StatusCancelled, StatusInterrupt:
		return true
	}
	return false
}

// PendingReason says why a pending attempt waits. It is empty for an
// attempt that is not pending.
type PendingReason string

const (
	// PendingQueued: waiting for a concurrency slot.
	PendingQueued PendingReason = "queued"
	// PendingAwaitingSession: the attempt was created (launch, or a retry
	// was chosen) and its child session is being created.
	PendingAwaitingSession PendingReason = "awaiting_session"
	// PendingSessionFailed: creating the child session failed before a
	// session existed. The attempt stays here until it is finalized.
	PendingSessionFailed PendingReason = "session_failed"
	// PendingRetryDelay: a retry was scheduled and waits out its delay
	// (WithRetryDelay) before its session is created.
	PendingRetryDelay PendingReason = "retry_delay"
)

// Attempt is one run of a task on one model in one child session. It is a
// value: the ledger never changes an Attempt you hold, and once an attempt
// is terminal no later version of it is ever recorded.
type Attempt struct {
	// ID is the attempt's immutable identity.
	ID string `json:"attemptID"`
	// Number is 1-based, in the order attempts were made.
	Number int `json:"attemptNumber"`
	// Token names this attempt's run; it is never reused, also not across
	// Managers. Operations that act on a run they observed carry it.
	Token string `json:"token"`
	// SessionID is the child session, "" until StartSession's session is
	// bound to this attempt.
	SessionID string `json:"sessionID,omitempty"`
	// Model is the model this attempt runs on.
	Model Model `json:"model"`
	// Status is the attempt's state; see Status.
	Status Status `json:"status"`
	// Pending says why a pending attempt waits.
	Pending PendingReason `json:"pendingReason,omitempty"`
	// Error is the failure text of an attempt that ended in error.
	Error string `json:"error,omitempty"`
	// Result is the child's final answer text of a completed attempt.
	Result string `json:"result,omitempty"`
	// StartedAt is when its session was bound (zero while pending).
	StartedAt time.Time `json:"startedAt,omitzero"`
	// CompletedAt is when it became terminal (zero until then).
	CompletedAt time.Time `json:"completedAt,omitzero"`
}

// transitions is the attempt state machine: transitions[from][to] is true
// when an attempt may move from one status to the other. pending→pending is
// a change of PendingReason. Terminal states have no row: nothing leaves
// them.
var transitions = map[Status]map[Status]bool{
	StatusPending: {
		StatusPending:   true,
		StatusRunning:   true,
		StatusError:     true,
		StatusCancelled: true,
		StatusInterrupt: true,
	},
	StatusRunning: {
		StatusCompleted: true,
		StatusError:     true,
		StatusCancelled: true,
		StatusInterrupt: true,
	},
}

// canTransition reports whether the state machine allows from → to. It
// reads transitions through a dense copy: it runs on every ledger write.
func canTransition(from, to Status) bool {
	i, j := statusIndex(from), statusIndex(to)
	return i >= 0 && j >= 0 && allowed[i][j]
}

// statusList lists every Status; allowed is transitions indexed by position.
var (
	statusList = [...]Status{StatusPending, StatusRunning, StatusCompleted, StatusError, StatusCancelled, StatusInterrupt}
	allowed    = func() (t [len(statusList)][len(statusList)]bool) {
		for i, from := range statusList {
			for j, to := range statusList {
				t[i][j] = transitions[from][to]
			}
		}
		return t
	}()
)

// statusIndex is s's position in statusList, or -1.
func statusIndex(s Status) int { return slices.Index(statusList[:], s) }

// UnmarshalJSON reads an attempt as MarshalJSON writes it (its model
// nested under "model", as a task's is), and also the flat form of earlier
// versions (providerID, modelID, variant on the attempt itself).
func (a *Attempt) UnmarshalJSON(data []byte) error {
	type plain Attempt // no methods: no recursion
	var j struct {
		plain
		ProviderID string `json:"providerID"`
		ModelID    string `json:"modelID"`
		Variant    string `json:"variant"`
	}
	if err := json.Unmarshal(data, &j); err != nil {
		return err
	}
	if j.Model == (Model{}) {
		j.Model = Model{Provider: j.ProviderID, ID: j.ModelID, Variant: j.Variant}
	}
	*a = Attempt(j.plain)
	return nil
}

// runSeen is what the current run reported: process-local, never in the
// ledger, and kept apart from runtime because a closure never reads it.
type runSeen struct {
	lastEvent time.Time // when the current run last reported anything
	stopped   string    // a run whose session the host confirmed stopped (a stall)
	out       runOutput // what the current run said last
}

func (rt *runtime) starting() bool { return rt.startSeq != 0 }

// observation is an event with what was decided about it before the lock
// was taken: whether its error is retryable (the classifier is user code
// and never runs under the lock).
type observation struct {
	ev         Event
	fail       failure // SessionError: the failure, classified before the lock
	classified bool    // fail was filled in (only SessionError needs it)
}

// failure is an attempt's failure with everything that calls user code — the
// error's own methods, the retry classifier — worked out before the lock.
type failure struct {
	err    error // the failure itself, for a retry delay that reads it
	text   string
	reason Reason
	retry  bool
}

// errNeedsClass is observeLocked asking Observe to classify the event's
// error outside the lock and come back.
var errNeedsClass = errors.New("bgtask: classify first")

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
	if !ref.isCurrent() || e.state.Terminal() {
		return m.who(ref), ErrStaleEvent
	}
	if ev.Token != "" || ev.AttemptID != "" {
		a := ref.attempt()
		if (ev.Token != "" && ev.Token != a.Token) ||
			(ev.SessionID != "" && a.SessionID != "" && ev.SessionID != a.SessionID) {
			return m.who(ref), ErrStaleEvent
		}
	}
	if !o.classified && (e.state == StatusRunning || e.rt.starting()) {
		return resolved{}, errNeedsClass
	}
	if e.state == StatusPending {
		a := ref.attempt()
		if !e.rt.starting() {
			return m.who(ref), ErrStaleEvent // no child can be running for it
		}
		if !m.hold(o, a.ID) {
			return m.who(ref), fmt.Errorf("%w: %d events already held for attempt %s", ErrUnknownSession, m.calls.held.ForAttempt(a.ID), a.ID)
		}
		return resolved{}, nil
	}
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
		m.logLocked(slog.LevelDebug, "bgtask: event held until its session is bound", slog.String("kind", string(o.ev.Kind)),
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
		if t := (turnEnd{token: a.Token, text: ev.Text, finish: ev.Finish, noText: ev.NoFinalText, upTo: ev.Invocation, at: at, last: ev.last}); !m.atGate(e, t) {
			m.turnEnded(e, t, "")
		}
	case SessionError:
		m.fail(e, o.fail, at)
	case SessionInterrupted:
		m.finalize(e, a.ID, StatusInterrupt, "", "", at)
	case SessionDeleted:
		m.finalize(e, a.ID, StatusCancelled, "session deleted", "", at)
		m.cascadeDelete(a.SessionID)
	}
}

// fail ends the current attempt of e with f: a retry on the next model
// when f is retryable and nothing forbids it, else the task's error.
func (m *Manager) fail(e *entry, f failure, at time.Time) {
	m.fence(e)
	a := e.cur()
	if f.err != nil { // the value itself, for Task.Err
		l := e.keep()
		l.err, l.errTok = f.err, a.Token
	}
	text := f.text
	e.output().reason = f.reason
	if !f.retry || a.Number >= e.info.maxAttempts || e.stop != "" {
		// The child's run ended on its own failure: that is what the
		// status says, also when a stop (Cancel, a closure, Shutdown) was
		// asked for, whose only say is that no new child starts.
		m.finalize(e, a.ID, StatusError, text, "", at)
		return
	}
	recs, lerr := m.led.retryRecords(e, text, at)
	if lerr != nil || !m.commit(e, recs[:]...) {
		if lerr != nil {
			m.ledgerBug(e, lerr)
		}
		if !e.terminal() { // the next attempt could not be made: end here
			why := "the ledger refused it"
			if lerr != nil {
				why = lerr.Error()
			}
			m.finalize(e, a.ID, StatusError, text+" (no retry: "+why+")", "", at)
		}
		return
	}
	e.gate = nil // a candidate of the failed run answers nothing
	m.answerAtRetry(e, recs[1].attempt, text, at)
	m.prepareRetry(e, recs[1].attempt, recs[2].attempt, f.err)
}

// prepareRetry starts next: at once, or — when the failed attempt has a
// session to abort or a retry delay may apply — as an effect that aborts
// the old session, waits out the delay, and gives up if next stopped being
// current meanwhile (retry). cause is the failure, for the retry delay.
// m.mu is held.
func (m *Manager) prepareRetry(e *entry, failed, next Attempt, cause error) {
	abortOld := failed.SessionID != "" && e.seen.stopped != failed.Token
	if !abortOld && m.cfg.retryDelay == nil {
		m.admit(e, next)
		return
	}
	if abortOld {
		m.intend(recAbortRequested, e, failed)
	}
	if !m.effect(effect{kind: fxRetry, e: e, run: runOfAttempt(next), prev: runOfAttempt(failed), abortOld: abortOld, cause: cause}) {
		m.finalize(e, next.ID, StatusInterrupt, "", "", m.now())
	}
}

// onRetryReady decides what follows a retry's abort of the old session
// and its delay: nothing if the next run was replaced or ended meanwhile;
// its end in error if the delay function panicked; a wait (reply.wait: the
// run's end) before a delay; then, unless a stop was asked, its admission.
// m.mu is held.
func (m *Manager) onRetryReady(in *retryReadyIn) reply {
	e, next := in.e, in.next
	ref, ok := m.led.attemptOf(next.ID)
	if !ok || ref.e != e || !ref.isCurrent() || ref.attempt().Status != StatusPending || ref.attempt().Token != next.Token {
		return reply{} // the run was replaced or ended meanwhile (the task may be forgotten since: retention)
	}
	switch {
	case in.delayErr != "":
		m.finalize(e, next.ID, StatusError, in.delayErr, "", m.now())
		return reply{}
	case in.delay > 0 && !in.afterDelay:
		m.setPending(e, next.ID, PendingRetryDelay, m.now())
		return reply{wait: m.runDone(e)}
	}
	if m.fenceStop(e) {
		m.finalize(e, next.ID, e.stop, "", "", m.now())
		return reply{}
	}
	if in.delay > 0 {
		m.setPending(e, next.ID, PendingAwaitingSession, m.now())
	}
	m.admit(e, next)
	return reply{}
}

// spawnStart has StartSession called for attempt a of e (an effect).
// m.mu is held.
func (m *Manager) spawnStart(e *entry, a Attempt) {
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
			m.logLocked(slog.LevelError, "bgtask: Host.StartSession returned a session that belongs to another attempt",
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
		m.ledgerBug(e, fmt.Errorf("bgtask: ledger: unknown attempt %q", id))
		return
	}
	m.finalizeRef(ref, status, errText, result, at)
}

// finalizeRef ends the attempt ref names with status. m.mu is held.
func (m *Manager) finalizeRef(ref attemptRef, status Status, errText, result string, at time.Time) {
	rec, err := m.led.finalRecord(ref.e, ref.attempt().ID, status, errText, result, at)
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
	if ended && (e.rt.abort == nil || e.rt.abort.run().Token != token) {
		m.finalizeRef(ref, e.stopStatus(), out.stopErr, "", m.now())
	}
}

// queued is a run waiting for a slot.
type queued struct {
	e     *entry
	token string
	stop  chan struct{} // closed when it leaves the queue
	since time.Time     // when it queued (WithMetrics: the queue wait)
}

// admit starts attempt a of e when a slot is free, or queues it. m.mu is
// held.
func (m *Manager) admit(e *entry, a Attempt) {
	if m.calls.pool == nil {
		m.spawnStart(e, a)
		return
	}
	key, limit := m.cfg.limits.key(a.Model)
	q := queued{e: e, token: a.Token}
	if m.cfg.queueTimeout > 0 {
		q.stop = make(chan struct{})
	}
	if m.cfg.metrics != nil {
		q.since = m.now()
	}
	w := m.calls.pool.Acquire(key, limit, q)
	if w == nil {
		e.slot.key, e.slot.token = key, a.Token
		m.spawnStart(e, a)
		return
	}
	m.queueDepth(key)
	e.slot.waiter = w
	m.setPending(e, a.ID, PendingQueued, m.now())
	if m.cfg.queueTimeout > 0 {
		m.watchQueue(e, a, w)
	}
}

// settleRun runs at every change of e: when the run that holds a slot, waits
// in a queue, or has waiters on runDone has ended or been replaced, it gives
// the slot back (handing it to the next in line), leaves the queue, and
// closes runDone — exactly once per run.
func (m *Manager) settleRun(e *entry) {
	cur := e.cur()
	over := func(token string) bool { return cur.Token != token || cur.Status.Terminal() }
	e.rt.sig.RunOver(over)
	if e.hot == nil {
		return // frozen: it holds no slot and waits in no queue
	}
	if w := e.slot.waiter; w != nil && over(w.V.token) {
		e.slot.waiter = nil
		m.calls.pool.Remove(w)
		m.queueDepth(w.Key())
		if w.V.stop != nil {
			close(w.V.stop)
		}
	}
	if e.slot.token != "" && over(e.slot.token) {
		key := e.slot.key
		e.slot.key, e.slot.token = "", ""
		m.calls.pool.Release(key, m.granted)
	}
}

// granted starts a run that was handed a slot. m.mu is held.
func (m *Manager) granted(w *slots.Waiter[queued]) {
	e := w.V.e
	if m.cfg.metrics != nil {
		key, waited := w.Key(), m.now().Sub(w.V.since)
		m.measure(func(mt Metrics) { mt.QueueWaited(key, waited) })
		m.queueDepth(key)
	}
	if w.V.stop != nil {
		close(w.V.stop)
	}
	if e.slot.waiter == w {
		e.slot.waiter = nil
	}
	cur := *e.cur()
	if cur.Token == w.V.token && cur.Status == StatusPending && m.fenceStop(e) {
		e.slot.key, e.slot.token = w.Key(), cur.Token // given back as it ends
		m.finalize(e, cur.ID, e.stop, "", "", m.now())
		return
	}
	if cur.Token != w.V.token || cur.Status != StatusPending {
		// Cannot happen (a run leaves the queue as it ends), but a slot
		// must never leak.
		m.calls.pool.Release(w.Key(), m.granted)
		return
	}
	e.slot.key, e.slot.token = w.Key(), cur.Token
	m.setPending(e, cur.ID, PendingAwaitingSession, m.now())
	m.spawnStart(e, cur)
}

// runDone returns a channel closed when e's current run ends or is
// replaced. m.mu is held.
func (m *Manager) runDone(e *entry) <-chan struct{} {
	cur := e.cur()
	return e.rt.sig.Run(cur.Token, cur.Status.Terminal())
}

// watchQueue ends run a of e in error if it is still queued after the
// queue timeout. m.mu is held.
func (m *Manager) watchQueue(e *entry, a Attempt, w *slots.Waiter[queued]) {
	d := m.cfg.queueTimeout
	// The timer is made now, as the attempt queues (the clock may be
	// called under m.mu): however late the watcher runs, the timeout is
	// measured from the moment it queued.
	t := m.cfg.clock.NewTimer(d)
	if !m.effect(effect{kind: fxQueueTimeout, e: e, run: runOfAttempt(a), waiter: w, timer: t}) {
		t.Stop()
	}
}

// onQueueTimeout decides a queue timeout: run a ends in error, with its
// queue position and key, unless it left the queue as the timer fired.
// m.mu is held.
func (m *Manager) onQueueTimeout(in *queueTimeoutIn) {
	e, w := in.e, in.w
	if !w.Queued() || e.hot == nil || e.slot.waiter != w {
		return // dequeued as the timer fired
	}
	pos := m.calls.pool.Position(w)
	e.output().reason = ReasonUnknown // no provider was involved
	m.finalize(e, in.a.ID, StatusError, fmt.Sprintf("timed out while queued: waited %s at position %d for a slot of %s", m.cfg.queueTimeout, pos, w.Key()), "", m.now())
}

// watchStall aborts run a of e once it reported nothing for the stall
// timeout, and fails it (retryably) when the host confirms. Its timer is
// tied to the run's token: it stops when the run ends and cannot touch a
// later run. m.mu is held.
func (m *Manager) watchStall(e *entry, a Attempt) {
	m.effect(effect{kind: fxStallWatch, e: e, run: runOfAttempt(a), done: m.runDone(e)})
}

// onStallCheck decides a stall watch's look at run a: the watch ends with
// the run; an abort in flight is waited for; a run silent for the stall
// timeout (and past retryAt) is aborted, to fail over retryably once the
// host confirms; else the watch sleeps until it is due. m.mu is held.
func (m *Manager) onStallCheck(in *stallCheckIn) reply {
	e, a, d := in.e, in.a, m.cfg.stallTimeout
	if cur := e.cur(); cur.Token != a.Token || cur.Status != StatusRunning {
		return reply{done: true}
	}
	now := m.now()
	due := e.seen.lastEvent.Add(d)
	if due.Before(in.retryAt) {
		due = in.retryAt
	}
	switch {
	case e.rt.abort != nil: // someone is stopping it already
		return reply{wait: e.rt.abort.waitDone()}
	case !now.Before(due):
		op, _ := m.newAbort(e, &a, nil)
		stalled := fmt.Errorf("stalled: no activity for %s", d)
		op.failWith = &failure{err: stalled, text: stalled.Error(), reason: ReasonUnknown, retry: true}
		m.runAbort(op)
		return reply{wait: op.waitDone(), due: now.Add(d)}
	}
	return reply{after: due.Sub(now)}
}

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
	err := fmt.Errorf("%w: the task ran longer than its timeout of %s", ErrDeadline, e.info.opt().timeout)
	if attempt {
		err = fmt.Errorf("%w: the attempt ran longer than its timeout of %s", ErrDeadline, e.info.opt().attemptTimeout)
	}
	return &failure{err: err, text: err.Error(), reason: ReasonDeadline, retry: attempt && e.info.opt().retryOnTimeout}
}

// output returns what e's current run reported, started afresh when the
// run is new. m.mu is held.
func (e *entry) output() *runOutput {
	if e.hot == nil {
		return new(runOutput) // frozen: its run is over, and nothing reads what is written here
	}
	if tok := e.cur().Token; e.seen.out.token != tok {
		e.seen.out = runOutput{token: tok}
	}
	return &e.seen.out
}

// runOutput is what a run reported last, kept to compute its outcome.
type runOutput struct {
	token    string // the run it belongs to
	output   string // latest output text
	finish   FinishReason
	noText   bool
	reason   Reason // of the failure that ended it, worked out outside the lock
	stopErr  string // the error the run returned after it was asked to stop
	notice   string // a fact that rides its answer (a degraded children gate)
	progress string // its latest line of progress (Task.Progress)
}

// setProgress keeps p, bounded, as e's run's latest progress; a change
// is published. m.mu is held.
func (m *Manager) setProgress(e *entry, p string) {
	if p == "" {
		return
	}
	if p = textbound.OneLine(p, MaxProgressRunes); e.output().progress != p {
		e.output().progress = p
		m.publish(e)
	}
}

// setActivity records what the current run is doing; a change is published.
func (m *Manager) setActivity(e *entry, a Activity) {
	if e.activity != a {
		e.activity = a
		m.publish(e)
	}
}

// runtime is the process-local state of a task's current run. It is not in
// the ledger and is never persisted.
type runtime struct {
	// What a closure pass and the end of a run touch comes first: these
	// share the entry's first cache lines.
	scanGen  uint64     // the last closure walk that visited this task
	abort    *abortOp   // the abort in flight for the current run, shared by all who ask
	startSeq uint64     // the StartSession in flight for the current attempt; 0: none
	sig      signal.Set // the waiters' channels: next change, task end, run end
	round    *round     // the parent's round the task counts in
}

// slotHold is a run's claim on a concurrency slot (WithConcurrency): its
// place in the queue while it waits, then the slot it holds.
type slotHold struct {
	waiter *slots.Waiter[queued]
	token  string // the run holding the slot
	key    string // the concurrency key whose slot it holds
}

// Restart recovery.

// LostAcrossRestart is the error of a run the host reported gone after a
// restart, or that no host could report on (StatusHost missing, FuncHost).
const LostAcrossRestart = "lost across restart"

// StartOutcomeUnknown is the error of a run whose StartSession was asked
// for before a restart and whose session no host could find.
const StartOutcomeUnknown = "start outcome unknown after restart"

// reconcile decides what each task that was live at the crash becomes,
// after restore: a run that may have a child is asked about (a recovery
// effect, with a StatusHost) or ends interrupt; a run that never asked
// for a child is admitted again; the notifications produced and not
// delivered are queued again, in their order. m.mu is held.
func (m *Manager) reconcile(rv *recovery) {
	now := m.now()
	_, asks := m.host.(StatusHost)
	m.retryOwed(rv, now)
	m.roundsOwed(rv)
	for _, e := range slices.Clone(m.order) { // an end here may forget an ended task (retention)
		if e.terminal() {
			continue
		}
		a := *e.cur()
		switch {
		case a.Status == StatusRunning || rv.started[a.ID]:
			// It may have a child: only the host can say.
			if !asks {
				why := LostAcrossRestart
				if a.Status != StatusRunning {
					why = StartOutcomeUnknown
				}
				m.finalize(e, a.ID, StatusInterrupt, why, "", now)
				continue
			}
			fx := effect{kind: fxRecover, e: e, run: runOfAttempt(a), rv: rv, stopped: e.stop != ""}
			if a.Status == StatusPending {
				// The question stands for the start whose answer was lost: a
				// stop asked meanwhile (a deadline that passed while nobody
				// ran) waits for it as for a start in flight, so that a
				// session the host finds is stopped through it, never left
				// running unknown.
				m.calls.startSeq++
				fx.seq = m.calls.startSeq
			}
			if m.effect(fx) {
				rv.left++
				if fx.seq != 0 {
					m.calls.inflight[fx.seq] = struct{}{}
					e.rt.startSeq = fx.seq
				}
			} else {
				m.finalize(e, a.ID, StatusInterrupt, LostAcrossRestart, "", now)
			}
		case e.stop != "":
			m.stopRun(e, now) // no child was ever asked for: it ends now
		default:
			m.admit(e, a) // it never asked for a child: ask now
		}
		if !e.terminal() && (e.stop == "" || e.stop == StatusError) && e.info.opt().timeout > 0 {
			m.armDeadline(e, Attempt{}) // due from the launch: at once if it passed meanwhile, or it was asked already
		}
	}
	rv.pending = make(chan struct{}, rv.left)
	for _, n := range rv.lost {
		if len(m.notes.lost) < m.cfg.undeliveredLimit {
			m.notes.lost = append(m.notes.lost, m.noticeNotification(n))
		}
	}
	seqs := slices.Sorted(maps.Keys(rv.notes))
	for _, seq := range seqs {
		n := rv.notes[seq]
		m.redeliver(n)
	}
}

// retryOwed starts the next attempt of each task whose retry was durable
// (retry_scheduled) while the attempt it chose was not: the retry was
// decided, so it goes on, and its parent is told as a live retry tells it.
// A task that cannot go on (no attempt left) ends as its records say.
// m.mu is held.
func (m *Manager) retryOwed(rv *recovery, now time.Time) {
	l := m.led
	for _, e := range m.order {
		if !rv.retry[e] {
			continue
		}
		failed, n := *e.cur(), e.count()+1
		if e.terminal() && failed.Status == StatusError && n <= e.info.maxAttempts {
			next, err := l.newAttempt(n, e.info.modelFor(n))
			if err == nil && m.commit(e, record{kind: recAttemptCreated, task: e.id, at: now, attempt: next}) {
				if m.cfg.notifier != nil {
					m.notify(e, NotifyRetryScheduled, retryScheduledText(failed, *e.cur()))
				}
				continue
			}
		}
		if e.terminal() { // counted ended as afterReplay counts the others
			l.liveEnded(e)
			l.ended = append(l.ended, e)
		}
	}
}

// roundsOwed rebuilds each parent's rounds from the records (a round: its
// tasks from a launch while the parent had none live until the last of
// them ended) and, with a Notifier, tells what is owed: each ended task
// whose final summary was never produced gets one, then each round whose
// tasks all ended and whose all_complete was never produced gets it. A
// round still live counts its ended tasks too, as it did before the
// restart. m.mu is held.
func (m *Manager) roundsOwed(rv *recovery) {
	if m.cfg.notifier == nil {
		return
	}
	for _, e := range m.order {
		if e.terminal() && !rv.finals[e.id] && rv.owed(e.seq) {
			m.answerAtEnd(e)
			m.notify(e, NotifyFinalSummary, finalSummaryText(e.project()))
		}
	}
	type group struct {
		tasks []*entry
		live  int
		end   uint64 // the last end of its ended tasks
	}
	byParent := make(map[string][]*group)
	var parents []string
	for _, e := range m.order {
		p := e.info.parent
		gs := byParent[p]
		if len(gs) == 0 {
			parents = append(parents, p)
		}
		if len(gs) == 0 || (gs[len(gs)-1].live == 0 && rv.launchSeq[e] > gs[len(gs)-1].end) {
			gs = append(gs, &group{})
			byParent[p] = gs
		}
		g := gs[len(gs)-1]
		g.tasks = append(g.tasks, e)
		if e.terminal() {
			g.end = max(g.end, e.seq)
		} else {
			g.live++
		}
	}
	for _, p := range parents {
		for _, g := range byParent[p] {
			if g.live > 0 {
				r := &round{parent: p, live: g.live, tasks: g.tasks}
				m.notes.rounds[p] = r
				for _, e := range g.tasks {
					if !e.terminal() {
						e.rt.round = r
					}
				}
				continue
			}
			told := false
			for _, e := range g.tasks {
				told = told || rv.roundTold[e.id]
			}
			if !told && rv.owed(g.end) {
				tasks := make([]Task, 0, len(g.tasks))
				for _, e := range g.tasks {
					tasks = append(tasks, e.project())
				}
				m.push(AllComplete(p, tasks))
			}
		}
	}
}

// redeliver queues again a notification produced before a restart and
// not delivered, with its ID, sequence and text. m.mu is held.
func (m *Manager) redeliver(n *notice) {
	if m.cfg.notifier == nil {
		return
	}
	m.queueNote(m.noticeNotification(n))
}

// noticeNotification is the notification a recorded notice was, its task
// snapshots taken now. m.mu is held.
func (m *Manager) noticeNotification(n *notice) Notification {
	out := Notification{ID: n.id, Seq: n.seq, Kind: n.kind, ParentSessionID: n.parent, Text: n.text, Invocation: n.invocation}
	if ref, ok := m.led.attemptOf(n.attempt); ok {
		out.TaskID, out.Task = ref.e.id, ref.e.project()
	}
	for _, id := range n.tasks {
		if e := m.led.tasks[id]; e != nil {
			out.Tasks = append(out.Tasks, e.project())
		}
	}
	return out
}

// recoverRun asks the host what became of run a of e after a restart (a
// recovery effect): the session it may have created (by attempt id, when
// it was never bound), and that session's state. The answer comes back as
// recoveredIn.
func (m *Manager) recoverRun(fx *effect) {
	e, a := fx.e, fx.run.attempt()
	defer func() { fx.rv.pending <- struct{}{} }()
	sh := m.host.(StatusHost)
	in := recoveredIn{e: e, a: a, sid: a.SessionID, stopAsked: fx.stopped, seq: fx.seq}
	ctx := withRun(m.life.ctx, RunRef{TaskID: e.id, AttemptID: a.ID, Token: a.Token}, callStart)
	func() {
		defer func() {
			if r := recover(); r != nil {
				in.err = fmt.Errorf("bgtask: StatusHost panicked: %s", panicText(r))
			}
		}()
		if in.sid == "" {
			req := SessionRequest{TaskID: e.id, AttemptID: a.ID, AttemptNumber: a.Number, Token: a.Token,
				ParentSessionID: e.info.parent, Model: a.Model, Agent: e.info.agent, Prompt: e.info.prompt}
			in.sid, in.err = sh.FindSession(ctx, req)
			if in.err != nil || in.sid == "" {
				return
			}
		}
		in.report, in.err = sh.SessionStatus(ctx, in.sid)
	}()
	if in.err != nil {
		in.text = safeText(in.err) // user code: before the lock
	}
	if in.report.State == SessionEnded && in.report.End.Kind == SessionError {
		err := in.report.End.Err
		if err == nil {
			err = errors.New("session error with no detail")
		}
		in.f = m.classify(err)
	}
	_ = m.step(&in)
}

// onRecovered decides what the host said of a run after a restart: alive,
// it runs on (re-adopted: bound if it was not, its stall watch armed, and
// stopped if a stop was asked); ended, it ends with that evidence; gone or
// unknown, it is interrupt — never cancelled, never completed without
// evidence. m.mu is held.
func (m *Manager) onRecovered(in *recoveredIn) {
	e, a := in.e, in.a
	if in.seq != 0 { // the start whose answer was lost has its answer now
		delete(m.calls.inflight, in.seq)
		if e.rt.startSeq == in.seq {
			e.rt.startSeq = 0
		}
		defer m.signal() // Shutdown and closures wait for starts to return
	}
	cur := e.cur()
	if cur.ID != a.ID || cur.Token != a.Token || cur.Status.Terminal() {
		if _, taken := m.led.bySession[in.sid]; in.sid != "" && in.report.State == SessionAlive && a.SessionID == "" && !taken {
			// Found for a run that ended meanwhile: indexed (its events are
			// stale) and stopped, never left running unknown.
			rec, err := m.led.orphanRecord(e, a.ID, in.sid, m.now())
			m.commitBuilt(e, rec, err)
			m.abortOrphan(e, a, in.sid)
		}
		return
	}
	now := m.now()
	switch {
	case in.err != nil:
		why := LostAcrossRestart + ": the host could not say what became of it: " + in.text
		m.finalize(e, a.ID, StatusInterrupt, why, "", now)
		return
	case in.sid == "" && e.stop != "":
		m.stopRun(e, now) // no child was ever made: the stop ends it now, as it ends a run that never started
		return
	case in.sid == "":
		m.finalize(e, a.ID, StatusInterrupt, StartOutcomeUnknown, "", now)
		return
	case in.report.State == SessionGone && e.stop != "" && !in.stopAsked:
		// A stop asked since the question (a deadline that passed while
		// nobody ran, a cancel) had its abort sent: that abort may be what
		// ended the session before the host was asked. The run is not
		// running, and it ends as the stop's confirmed abort ends it.
		if ref, ok := m.led.attemptOf(a.ID); ok {
			m.endStopped(ref, "", now)
		}
		return
	case in.report.State == SessionGone || (in.report.State != SessionAlive && in.report.State != SessionEnded):
		m.finalize(e, a.ID, StatusInterrupt, LostAcrossRestart, "", now)
		return
	}
	if cur.Status == StatusPending {
		if owner, taken := m.led.bySession[in.sid]; taken && owner.e != e {
			m.finalize(e, a.ID, StatusInterrupt, StartOutcomeUnknown, "", now)
			return
		}
		if !m.bindRun(e, a.ID, in.sid, now) {
			return
		}
	} else {
		if m.cfg.stallTimeout > 0 {
			e.seen.lastEvent = now // it was silent while nobody listened
			m.watchStall(e, *e.cur())
		}
		if e.info.opt().attemptTimeout > 0 {
			m.armDeadline(e, *e.cur())
		}
	}
	if in.report.State == SessionEnded {
		ev := in.report.End
		if !ev.Kind.ends() {
			ev.Kind = SessionInterrupted // ended, but not said how: an interruption, not an answer
		}
		ev.SessionID, ev.AttemptID, ev.Token = in.sid, a.ID, a.Token
		o := observation{ev: ev, fail: in.f, classified: true}
		if who, err := m.observeLocked(&o); err != nil {
			m.rejectedLocked(ev, who, err)
		}
		return
	}
	if e.stop != "" {
		m.stopRun(e, now) // a stop was asked before the restart: it goes on
	}
}

// Invocations and the children gate.
//
// Every prompt sent into a task's child conversation is an invocation: the
// launch prompt is 1, Extend admits the next. A turn end answers every
// invocation up to the last it had seen that has no answer yet; answers are
// released in invocation order, each once (to WaitAnswer, and as a parent
// notification: NotifyAnswer, or the final summary for the last); the task
// ends only once its last admitted invocation is answered. A task that is
// never extended carries no invocation state: its turn end is its end.

// invocations is a task's invocations, once it was extended.
type invocations struct {
	list []Invocation // list[i] is invocation i+1; list[0] the launch prompt
	// answered is how many invocations from the first have their answers:
	// those are released. The ledger's writer keeps it, so neither a
	// release nor a turn end walks the list.
	answered int
}

// file records ans as the answer of invocation n (the ledger's writer).
// ans is the record's, immutable: it is shared, never written.
func (iv *invocations) file(n int, ans *Answer) {
	iv.list[n-1].Answer = ans
	for iv.answered < len(iv.list) && iv.list[iv.answered].Answer != nil {
		iv.answered++
	}
}

// turnEnd is one turn end of a run (a SessionIdle), as the gate holds it
// and as an Extend in flight keeps it until the prompt's fate is known.
type turnEnd struct {
	token  string // the run that ended the turn
	text   string
	finish FinishReason
	noText bool
	upTo   int // the last invocation the turn had seen; 0: the latest admitted
	at     time.Time
	last   bool   // the run is over (a FuncHost function returned): no turn follows
	notice string // the gate's, on a turn it released degraded, kept while the turn waits (replayEarly)
}

// released reports whether invocation n and every one before it has its
// answer: answers are released in order.
func (iv *invocations) released(n int) bool { return n >= 1 && n <= iv.answered }

// records are the records that rebuild iv: its admissions, then its
// answers (compaction).
func (iv *invocations) records(task string) []record {
	var out []record
	for _, in := range iv.list[1:] {
		adm := in
		adm.Answer = nil
		out = append(out, record{kind: recInvocationAdmitted, task: task, at: in.AdmittedAt, inv: &adm})
	}
	for _, in := range iv.list {
		if in.Answer != nil {
			filed := Invocation{N: in.N, Answer: in.Answer}
			out = append(out, record{kind: recAnswerFiled, task: task, at: in.Answer.At, inv: &filed})
		}
	}
	return out
}

// clone is the projection of iv onto a snapshot: an answer shows once it
// is released (every invocation before it has its own).
func (iv *invocations) clone() []Invocation {
	out := slices.Clone(iv.list)
	for i := range out {
		if i >= iv.answered {
			out[i].Answer = nil // filed (at a retry), not yet released
		} else if a := out[i].Answer; a != nil {
			c := *a
			c.Notices = slices.Clone(a.Notices)
			out[i].Answer = &c
		}
	}
	return out
}

// turnEnded files turn end t of e's current run and ends the task if that
// answered everything admitted. notice, when set, rides the answer (a
// degraded gate). A turn end that arrives while a prompt is in flight is
// kept until that prompt is admitted or refused (replayEarly). m.mu is
// held.
func (m *Manager) turnEnded(e *entry, t turnEnd, notice string) {
	admitted := 1
	if e.inv != nil {
		admitted = len(e.inv.list)
	}
	if t.upTo <= 0 {
		t.upTo = admitted
	}
	if lane := m.calls.prompts[e]; lane != nil && lane.inflight > 0 {
		t.notice = notice // a degraded release stays degraded when it is filed
		lane.early = append(lane.early, t)
		return
	}
	out := e.output()
	out.finish, out.noText, out.notice = t.finish, t.noText, notice
	if iv := e.inv; iv != nil {
		lastOpen := iv.list[len(iv.list)-1].Answer == nil
		o := answerOutcome(e.id, StatusCompleted, t.text, "", evidence{output: t.text, finish: t.finish, noText: t.noText, notice: notice})
		from, to := m.fileAnswers(e, min(t.upTo, admitted), o, notice != "", t.at)
		ending := m.settled(e)
		// Ending with this turn as the last invocation's answer: the final
		// summary carries it. (One filed earlier, at a retry, is told.)
		m.releaseAnswers(e, from, to, ending && lastOpen)
		if !ending {
			out.notice = "" // it rode the answers filed now, not what ends the run later
			return          // an invocation is still open: the run goes on
		}
	}
	m.finalize(e, e.cur().ID, StatusCompleted, "", t.text, t.at)
}

// fileAnswers answers every invocation of e up to upTo that has none yet
// with o, and returns the invocations whose answers that released (from,
// to: indexes into e.inv.list), since answers are released in order.
// m.mu is held.
func (m *Manager) fileAnswers(e *entry, upTo int, o *Outcome, degraded bool, at time.Time) (from, to int) {
	iv := e.inv
	from = iv.answered
	for n := from + 1; n <= upTo && n <= len(iv.list); n++ {
		if iv.list[n-1].Answer == nil && !m.fileAnswer(e, n, o, degraded, at) {
			break
		}
	}
	return from, iv.answered
}

// releaseAnswers tells the parent the answers of invocations from..to-1
// (indexes), in order, each once; with skipLast the last invocation's is
// left to the final summary, which carries it. m.mu is held.
func (m *Manager) releaseAnswers(e *entry, from, to int, skipLast bool) {
	if m.cfg.notifier == nil {
		return
	}
	iv := e.inv
	for i := from; i < to; i++ {
		if skipLast && i == len(iv.list)-1 {
			break
		}
		m.notifyOf(e, NotifyAnswer, i+1, answerText(e.id, e.info.description, *iv.list[i].Answer))
	}
}

// answerAtEnd answers every open invocation of e, which has just ended,
// with its outcome: none is left waiting. m.mu is held.
func (m *Manager) answerAtEnd(e *entry) {
	iv := e.inv
	if iv == nil || iv.released(len(iv.list)) {
		return
	}
	lastOpen := iv.list[len(iv.list)-1].Answer == nil
	t := e.project()
	from, to := m.fileAnswers(e, len(iv.list), t.Outcome, false, t.CompletedAt)
	m.releaseAnswers(e, from, to, lastOpen)
}

// answerAtRetry answers the supplemental invocations still open when e's
// run failed over to a new attempt: they were sent to the failed session,
// and the retry, which starts from the launch prompt, never receives them.
// They are released once invocation 1 is answered. m.mu is held.
func (m *Manager) answerAtRetry(e *entry, failed Attempt, why string, at time.Time) {
	iv := e.inv
	if iv == nil || len(iv.list) < 2 {
		return
	}
	text := "the run this prompt was sent to (attempt " + strconv.Itoa(failed.Number) + " on " + failed.Model.String() + ") failed: " + why + "; the retry starts from the launch prompt and never received it"
	o := answerOutcome(e.id, StatusError, "", text, evidence{reason: ReasonUnknown})
	for n := 2; n <= len(iv.list); n++ {
		if iv.list[n-1].Answer == nil && !m.fileAnswer(e, n, o, false, at) {
			return
		}
	}
}

// fileAnswer records o as the answer of invocation n of e. m.mu is held.
func (m *Manager) fileAnswer(e *entry, n int, o *Outcome, degraded bool, at time.Time) bool {
	if note := e.inv.list[n-1].Notice; note != "" { // a fact of its admission rides its answer
		c := *o
		c.Notices = append(slices.Clone(o.Notices), note)
		o = &c
	}
	// The record's invocation and its answer are made as one: the ledger
	// keeps the answer, the record only passes through.
	filed := &struct {
		inv Invocation
		ans Answer
	}{}
	ans := &filed.ans
	*ans = Answer{Invocation: n, Status: o.State, Degraded: degraded, Notices: o.Notices, At: at, Envelope: renderAnswerEnvelope(e.id, n, o)}
	if o.HasAnswer {
		ans.Text = o.Answer
	} else {
		ans.Text = o.Error
	}
	filed.inv = Invocation{N: n, Answer: ans}
	return m.commit(e, record{kind: recAnswerFiled, task: e.id, at: at, inv: &filed.inv})
}

// childrenOutstanding reports whether a task launched from e's current
// session is still live, or has notifications not yet delivered to that
// session. m.mu is held.
func (m *Manager) childrenOutstanding(e *entry) bool {
	sid := e.cur().SessionID
	for _, k := range e.kids {
		if k.info.parent == sid && (!k.terminal() || k.notesOut > 0) {
			return true
		}
	}
	return false
}

// childrenLive reports whether a task launched from e's current session
// is still live. m.mu is held.
func (m *Manager) childrenLive(e *entry) bool {
	sid := e.cur().SessionID
	for _, k := range e.kids {
		if k.info.parent == sid && !k.terminal() {
			return true
		}
	}
	return false
}

// gateHold is a turn end the children gate holds back: the candidate
// answer while tasks the child's session launched are outstanding.
type gateHold struct {
	turnEnd
	armed bool // the release watch runs: the children settled
}

// atGate decides a turn end of e's run at the children gate: while tasks
// its session launched are outstanding, the turn is held as the candidate
// (a turn that stopped at a tool call is not even that), and true says so.
// The gate is inert for a task whose sessions launched nothing. m.mu is
// held.
func (m *Manager) atGate(e *entry, t turnEnd) bool {
	if len(e.kids) == 0 {
		return false
	}
	// A run's last turn (a FuncHost function returned) is held only while
	// a task it launched is live: one that ended was the function's to
	// wait for (Wait, OnDone), not its notification's to reach it, and no
	// further turn can come.
	if !m.childrenOutstanding(e) || (t.last && !m.childrenLive(e)) {
		if e.gate != nil { // this turn, after they settled, is the answer
			e.gate = nil
			m.setActivity(e, ActivityNone)
		}
		return false
	}
	if t.finish == FinishToolCalls {
		return true // a pause at a tool call is never an answer
	}
	e.gate = &gateHold{turnEnd: t}
	m.setActivity(e, ActivityAwaitingChildren)
	return true
}

// taskSettled follows a task k that has ended and has no notification
// out (its final summary was delivered or given up): its parent's gate
// may open, and its Spec.OnDone is called. m.mu is held.
func (m *Manager) taskSettled(k *entry) {
	m.kidSettled(k)
	if l := k.loc; l != nil && len(l.onDone) > 0 {
		m.callOnDone(l.onDone, k.project())
		l.onDone = nil
	}
	m.led.warm = append(m.led.warm, k) // frozen at the unlock, once nothing reads it (freezeSome)
}

// callOnDone has each of hooks called with t once m.mu is released, on a
// goroutine of the Manager; a panic in one is logged. m.mu is held.
func (m *Manager) callOnDone(hooks []*func(Task), t Task) {
	for _, hook := range hooks {
		done := *hook
		m.out.later = append(m.out.later, func() {
			defer func() {
				if r := recover(); r != nil {
					m.logAttrs(slog.LevelError, "bgtask: Spec.OnDone panicked", slog.String("task", t.ID), slog.String("panic", panicText(r)))
				}
			}()
			done(t)
		})
	}
}

// kidSettled follows a task k that has ended and has no notification out:
// if it was the last outstanding task of the session that launched it, and
// that session's task holds a candidate, the candidate's release watch
// starts. m.mu is held.
func (m *Manager) kidSettled(k *entry) {
	ref, ok := m.led.bySession[k.info.parent]
	if !ok || !ref.isCurrent() {
		return
	}
	e := ref.e
	g := e.gate
	if g == nil || g.armed || e.terminal() || e.cur().Token != g.token || m.childrenOutstanding(e) {
		return
	}
	g.armed = true
	if g.last { // no turn can follow the run's last: it is the answer now
		m.releaseGate(e, g, degradedNotice+"the child's run ended while tasks it launched were still running; its last turn was released once they had ended")
		return
	}
	d := m.gateTimeout()
	t := m.cfg.clock.NewTimer(d)
	done := m.runDone(e)
	m.goLater(func() {
		select {
		case <-t.C():
			m.step(&gateCheckIn{e: e, g: g})
		case <-done:
			t.Stop()
		case <-m.life.ctx.Done():
			t.Stop()
		}
	})
}

// gateTimeout is how long a candidate waits for a further turn once the
// children settled: WithGateTimeout, else the stall timeout, else 10
// minutes.
func (m *Manager) gateTimeout() time.Duration {
	switch {
	case m.cfg.gateTimeout > 0:
		return m.cfg.gateTimeout
	case m.cfg.stallTimeout > 0:
		return m.cfg.stallTimeout
	}
	return DefaultGateTimeout
}

// DefaultGateTimeout is how long the children gate waits, by default, for
// a turn after the tasks a child launched settled, before it releases the
// turn it held, degraded.
const DefaultGateTimeout = 10 * time.Minute

// onGateCheck releases the candidate g of e, degraded, if no turn came
// since the children settled. m.mu is held.
func (m *Manager) onGateCheck(in *gateCheckIn) {
	e, g := in.e, in.g
	if e.gate != g || e.terminal() || e.cur().Token != g.token || e.state != StatusRunning {
		return
	}
	if m.childrenOutstanding(e) {
		g.armed = false // launched another meanwhile: its settling arms the watch again
		return
	}
	m.releaseGate(e, g, degradedNotice+"the children gate released the child's last turn; no further turn came within "+m.gateTimeout().String()+" after the tasks it launched had ended")
}

// degradedNotice starts the notice of every answer the children gate
// released without a turn (Answer.Degraded): an outcome's notices say by it
// whether its answer was.
const degradedNotice = "degraded: "

// isDegradedNotice reports whether notice is the children gate's, on an
// answer it released degraded.
func isDegradedNotice(notice string) bool { return strings.HasPrefix(notice, degradedNotice) }

// releaseGate files g, the turn the children gate held, as the answer,
// with notice. m.mu is held.
func (m *Manager) releaseGate(e *entry, g *gateHold, notice string) {
	e.gate = nil
	m.setActivity(e, ActivityNone)
	t := g.turnEnd
	t.at = m.now()
	m.turnEnded(e, t, notice)
}

// onExtend decides an Extend of in.e: before the host call, whether the
// prompt may be sent and as which invocation (the task's run is running,
// no stop was asked, no closure fences it); after it, the admission
// record, or nothing when the host refused (the task may then end, if it
// waited only for this). m.mu is held.
func (m *Manager) onExtend(in *extendIn) (int, error) {
	e := in.e
	lane := m.calls.prompts[e]
	if !in.done {
		switch {
		case e.terminal():
			return 0, fmt.Errorf("%w: task %s is %s", ErrNotRunning, e.id, e.state)
		case e.state != StatusRunning:
			return 0, fmt.Errorf("%w: task %s has no session yet (%s)", ErrNotRunning, e.id, e.state)
		case e.stop != "":
			return 0, fmt.Errorf("%w: task %s is being stopped", ErrNotRunning, e.id)
		case m.life.closing:
			return 0, ErrShutdown
		case m.inClosingBranch(e):
			return 0, fmt.Errorf("%w: task %s is inside a branch being closed", ErrBranchClosing, e.id)
		}
		n := 2
		if e.inv != nil {
			n = len(e.inv.list) + 1
		}
		a := e.cur()
		in.req = PromptRequest{TaskID: e.id, AttemptID: a.ID, Token: a.Token, SessionID: a.SessionID, Invocation: n, Prompt: in.prompt}
		in.values = e.values()
		lane.stopCall = in.cancel
		lane.inflight++
		return n, nil
	}
	lane.inflight--
	lane.stopCall = nil
	early := lane.early
	lane.early = nil
	defer m.replayEarly(e, early) // whatever became of the prompt
	a, now := e.cur(), m.now()
	switch {
	case in.hostErr != nil:
		return 0, fmt.Errorf("%w: %w", ErrPromptRefused, in.hostErr)
	case e.terminal() || a.Token != in.req.Token:
		return 0, fmt.Errorf("%w: the run of task %s ended before the prompt was admitted", ErrNotRunning, e.id)
	}
	inv := Invocation{N: in.req.Invocation, Prompt: in.prompt, AdmittedAt: now, Notice: in.notice}
	if !m.commit(e, record{kind: recInvocationAdmitted, task: e.id, at: now, attempt: *a, inv: &inv}) {
		return 0, fmt.Errorf("%w: the ledger refused the invocation", ErrNotRunning)
	}
	return inv.N, nil
}

// replayEarly files, in order, the turn ends that arrived while a prompt
// was in flight, now that the prompt's fate is known. m.mu is held.
func (m *Manager) replayEarly(e *entry, early []turnEnd) {
	for _, t := range early {
		if !e.terminal() && e.cur().Token == t.token {
			m.turnEnded(e, t, t.notice)
		}
	}
}

// settled reports whether every admitted invocation of e is answered and
// no prompt is in flight: the task may end. m.mu is held.
func (m *Manager) settled(e *entry) bool {
	if lane := m.calls.prompts[e]; lane != nil && lane.inflight > 0 {
		return false
	}
	return e.inv == nil || e.inv.released(len(e.inv.list))
}

// inClosingBranch reports whether a closure in progress covers e, without
// recording a stop. m.mu is held.
func (m *Manager) inClosingBranch(e *entry) bool {
	for c := range m.closures.active {
		if m.taskInBranch(e, c) {
			return true
		}
	}
	return false
}
