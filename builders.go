package bgtask

import (
	"errors"
	"fmt"
	"time"
)

// The record builders make the record of one change from the attempt's
// latest version, without writing it: Manager.commit writes what they
// make, and derives what follows. The write helpers below (setPending,
// bindSession, orphanSession, finalize, scheduleRetry) build and write in
// one step, for the ledger's own tests and for a replay.

// open records a new task and returns it with the record of its first
// attempt, pending, which the caller commits at once. Ids are checked
// before anything is recorded, so a refused launch leaves no trace, and
// the first attempt's record cannot be refused.
func (l *ledger) open(info *taskInfo) (*entry, record, error) {
	if _, dup := l.tasks[info.id]; dup || info.id == "" {
		return nil, record{}, fmt.Errorf("IDGenerator returned task id %q, which is empty or in use", info.id)
	}
	first, err := l.newAttempt(1, info.modelFor(1))
	if err != nil {
		return nil, record{}, err
	}
	e, err := l.apply(record{kind: recTaskLaunched, task: info.id, at: info.launchedAt, recordExt: &recordExt{spec: info}})
	if err != nil {
		return nil, record{}, err
	}
	return e, record{kind: recAttemptCreated, at: info.launchedAt, attempt: first}, nil
}

// launch is open with the first attempt written.
func (l *ledger) launch(info *taskInfo) (*entry, error) {
	e, first, err := l.open(info)
	if err != nil {
		return nil, err
	}
	return e, l.put(e, &first)
}

// newAttempt makes attempt number n, pending (awaiting session), with fresh
// ids that no attempt uses yet.
func (l *ledger) newAttempt(n int, model Model) (Attempt, error) {
	id, token, err := attemptIDs(l.ids)
	if err != nil {
		return Attempt{}, err
	}
	a := Attempt{
		ID:      id,
		Number:  n,
		Token:   token,
		Model:   model,
		Status:  StatusPending,
		Pending: PendingAwaitingSession,
	}
	if _, dup := l.byAttempt[a.ID]; dup || a.ID == "" {
		return Attempt{}, fmt.Errorf("IDGenerator returned attempt id %q, which is empty or in use", a.ID)
	}
	if a.Token == "" {
		return Attempt{}, errors.New("IDGenerator returned an empty run token")
	}
	return a, nil
}

// attemptIDs makes a new attempt's id and run token.
func attemptIDs(g IDGenerator) (id, token string, err error) {
	if u, ok := g.(*uuidIDs); ok {
		id, token = u.attemptIDs()
		return id, token, nil
	}
	if id, err = newID(g, idAttempt); err == nil {
		token, err = newID(g, idToken)
	}
	return id, token, err
}

// newID asks g (user code) for an id; a panic is an error that names it.
func newID(g IDGenerator, kind string) (id string, err error) {
	defer func() {
		if r := recover(); r != nil {
			id, err = "", fmt.Errorf("IDGenerator panicked making a %s id: %s", kind, panicText(r))
		}
	}()
	return g.NewID(kind), nil
}

// pendingRecord says why the current pending attempt waits now.
func (l *ledger) pendingRecord(e *entry, attemptID string, reason PendingReason, at time.Time) (record, error) {
	_, a, err := l.version(e, attemptID)
	a.Status = StatusPending
	a.Pending = reason
	return record{kind: recAttemptPending, at: at, attempt: a}, err
}

// bindRecord binds sessionID to exactly attemptID, which must be the
// current attempt and pending; the attempt runs from at.
func (l *ledger) bindRecord(e *entry, attemptID, sessionID string, at time.Time) (record, error) {
	_, a, err := l.version(e, attemptID)
	a.SessionID = sessionID
	a.Status = StatusRunning
	a.Pending = ""
	a.StartedAt = at
	return record{kind: recSessionBound, at: at, attempt: a}, err
}

// orphanRecord indexes a session that was created for attemptID after that
// attempt stopped being current, so its events resolve (and are stale).
func (l *ledger) orphanRecord(e *entry, attemptID, sessionID string, at time.Time) (record, error) {
	_, a, err := l.version(e, attemptID)
	return record{kind: recSessionOrphan, at: at, attempt: a, recordExt: &recordExt{session: sessionID}}, err
}

// finalRecord moves attemptID to a terminal status, with the evidence its
// run reported. errText is recorded for error, result for completed.
func (l *ledger) finalRecord(e *entry, attemptID string, status Status, errText, result string, at time.Time) (record, error) {
	if !status.Terminal() {
		return record{}, fmt.Errorf("%w: finalize to %s", errBadTransition, status)
	}
	_, a, err := l.version(e, attemptID)
	a.Status = status
	a.Pending = ""
	a.Error = errText
	a.Result = result
	a.CompletedAt = at
	rec := record{kind: recAttemptFinal, at: at, attempt: a}
	rec.evidence, _ = e.reported(a.Token)
	return rec, err
}

// retryRecords end the current attempt as error with errText and create
// the next attempt, pending on the next model, which becomes current: the
// final record, the retry record (carrying the failed attempt's final
// version) and the new attempt's, in the order the timeline relies on. The
// next attempt's ids are made first, so a refusal leaves nothing to write.
func (l *ledger) retryRecords(e *entry, errText string, at time.Time) ([3]record, error) {
	n := e.count() + 1
	next, err := l.newAttempt(n, e.modelFor(n))
	if err != nil {
		return [3]record{}, err
	}
	final, err := l.finalRecord(e, e.cur().ID, StatusError, errText, "", at) // no budget figures: a retry follows
	if err != nil {
		return [3]record{}, err
	}
	return [3]record{
		final,
		{kind: recRetryScheduled, at: at, attempt: final.attempt}, // its Error says why
		{kind: recAttemptCreated, at: at, attempt: next},
	}, nil
}

// put writes rec, which names an attempt of e (or a new one), resolving
// the attempt it rewrites.
func (l *ledger) put(e *entry, rec *record) error {
	var ref attemptRef
	switch rec.kind {
	case recAttemptPending, recSessionBound, recAttemptFinal, recSessionOrphan, recStopRequested, recStopWithdrawn, recModelSkipped:
		if e.current >= 0 && e.cur().ID == rec.attempt.ID {
			ref = attemptRef{e: e, index: e.current} // the usual case: no lookup
			break
		}
		var ok bool
		if ref, ok = l.attemptOf(rec.attempt.ID); !ok || ref.e != e {
			return fmt.Errorf("ledger: unknown attempt %q", rec.attempt.ID)
		}
	}
	return l.write(e, ref, rec)
}

// build writes what a builder made, unless it refused.
func (l *ledger) build(e *entry) func(record, error) error {
	return func(rec record, err error) error {
		if err != nil {
			return err
		}
		return l.put(e, &rec)
	}
}

func (l *ledger) setPending(e *entry, attemptID string, reason PendingReason, at time.Time) error {
	return l.build(e)(l.pendingRecord(e, attemptID, reason, at))
}

func (l *ledger) bindSession(e *entry, attemptID, sessionID string, at time.Time) error {
	return l.build(e)(l.bindRecord(e, attemptID, sessionID, at))
}

func (l *ledger) finalize(e *entry, attemptID string, status Status, errText, result string, at time.Time) error {
	rec, err := l.finalRecord(e, attemptID, status, errText, result, at)
	rec.evidence.budget = budgetNotice(e.budgetState())
	return l.build(e)(rec, err)
}

// scheduleRetry writes retryRecords and returns the failed and the next
// attempt.
func (l *ledger) scheduleRetry(e *entry, errText string, at time.Time) (failed, next Attempt, err error) {
	recs, err := l.retryRecords(e, errText, at)
	if err != nil {
		return Attempt{}, Attempt{}, err
	}
	for i := range recs {
		if err := l.put(e, &recs[i]); err != nil {
			return Attempt{}, Attempt{}, err
		}
	}
	return recs[1].attempt, recs[2].attempt, nil
}

// version resolves attemptID of e and returns a copy of its latest version
// for a helper to modify; write checks the result.
func (l *ledger) version(e *entry, attemptID string) (attemptRef, Attempt, error) {
	ref, ok := l.attemptOf(attemptID)
	if !ok || ref.e != e {
		return attemptRef{}, Attempt{}, fmt.Errorf("ledger: unknown attempt %q", attemptID)
	}
	return ref, *ref.attempt(), nil
}
