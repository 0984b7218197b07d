package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// Run tokens and exact cancellation.
//
// Every attempt is one run and carries a token (Attempt.Token) that is never
// reused. Anything that acts on a run it observed earlier — a cancel, a
// retry timer, a session start in flight, an abort — carries that token and
// does nothing if the run was replaced or ended meanwhile. Aborts are shared:
// Cancel and Shutdown asking to stop the same run join one host call.

// RunRef names one run: a task's attempt and its token.
type RunRef struct {
	TaskID    string
	AttemptID string
	Token     string
}

// ErrStopPending is returned by Cancel and Shutdown when they are called
// with the context a callback was given and would have to wait for that very
// callback to return: Cancel from a Host call (or a FuncHost function)
// serving the run it would stop, Shutdown from any Host, Notifier or
// FuncHost function. The stop is recorded and goes on
// (a session being started is aborted on arrival; an abort in flight is
// joined); Wait, or a later call from outside the callback, sees the end.
var ErrStopPending = errors.New("bgtask: stop requested from a callback it would wait for; it completes after the callback returns")

// callKind says which callback a context was made for.
type callKind uint8

const (
	callStart callKind = iota + 1
	callAbort
	callNotify
	callRun // a FuncHost's function
)

type runKey struct{}

type runValue struct {
	ref  RunRef
	kind callKind
}

func withRun(ctx context.Context, ref RunRef, kind callKind) context.Context {
	return context.WithValue(ctx, runKey{}, runValue{ref: ref, kind: kind})
}

// RunFromContext returns the run a Host or Notifier call serves, from the
// context the Manager gave that call.
func RunFromContext(ctx context.Context) (RunRef, bool) {
	v, ok := ctx.Value(runKey{}).(runValue)
	return v.ref, ok
}

// servesRun reports whether ctx belongs to a host call (start or abort) or
// a FuncHost function serving the run with token: a wait on that run from
// it waits on itself.
func servesRun(ctx context.Context, token string) bool {
	v, ok := ctx.Value(runKey{}).(runValue)
	return ok && v.ref.Token == token && v.kind != callNotify
}

// abortOp is one in-flight AbortSession, shared by everyone who asked for it.
type abortOp struct {
	run     RunRef
	session string
	done    chan struct{} // closed when the host answered
	err     error         // the host's answer; read after done
}

// abortRun starts the abort of run a of e, or joins the one in flight. When
// the host confirms it, the attempt ends with e's wanted stop status unless
// it already ended on its own evidence. m.mu is held.
func (m *Manager) abortRun(e *entry, a Attempt) *abortOp {
	if op := m.aborts[a.Token]; op != nil {
		return op
	}
	op := &abortOp{
		run:     RunRef{TaskID: e.info.id, AttemptID: a.ID, Token: a.Token},
		session: a.SessionID,
		done:    make(chan struct{}),
	}
	m.aborts[a.Token] = op
	ok := m.group.Go(func() {
		err := m.callAbort(withRun(m.life, op.run, callAbort), op.session)
		m.mu.Lock()
		defer m.unlock()
		m.aborted(e, op, err)
	})
	if !ok {
		m.aborted(e, op, ErrShutdown)
	}
	return op
}

// aborted records the host's answer to op. m.mu is held.
func (m *Manager) aborted(e *entry, op *abortOp, err error) {
	delete(m.aborts, op.run.Token)
	op.err = err
	close(op.done)
	ref := m.led.byAttempt[op.run.AttemptID]
	live := ref.isCurrent() && !ref.attempt().Status.Terminal() && ref.attempt().Token == op.run.Token
	switch {
	case err != nil:
		if live {
			m.logLocked(slog.LevelWarn, "bgtask: abort failed; the child is still running",
				slog.String("task", op.run.TaskID), slog.String("attempt", op.run.AttemptID),
				slog.String("session", op.session), slog.String("err", err.Error()))
		}
		m.changed(e, e.terminal())
	case live:
		status := e.rt.stopWanted
		if status == "" {
			status = StatusCancelled
		}
		m.finalize(e, op.run.AttemptID, status, "", "", m.now())
	default:
		m.changed(e, e.terminal())
	}
}

// abortOrphan aborts a session that was created for attempt a after a
// stopped being current. The session is never adopted; a failed abort is
// logged.
func (m *Manager) abortOrphan(e *entry, a Attempt, sessionID string) {
	run := RunRef{TaskID: e.info.id, AttemptID: a.ID, Token: a.Token}
	m.group.Go(func() {
		if err := m.callAbort(withRun(m.life, run, callAbort), sessionID); err != nil {
			m.cfg.logger.Warn("bgtask: abort of a session created for a superseded attempt failed",
				"task", run.TaskID, "attempt", run.AttemptID, "session", sessionID, "err", err)
		}
	})
}

func (m *Manager) callAbort(ctx context.Context, sessionID string) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("bgtask: Host.AbortSession panicked: %v", r)
		}
	}()
	return m.host.AbortSession(ctx, sessionID)
}

// stopRun acts on e's wanted stop for its current run: a run with no child
// ends at once; a running child is aborted; a start in flight is aborted on
// arrival (started sees stopWanted). m.mu is held.
func (m *Manager) stopRun(e *entry, now time.Time) *abortOp {
	a := *e.cur()
	switch {
	case a.Status == StatusPending && !e.rt.starting():
		m.finalize(e, a.ID, e.rt.stopWanted, "", "", now)
	case a.Status == StatusRunning:
		return m.abortRun(e, a)
	}
	return nil
}

// Cancel stops the task with id and returns once its child has stopped: the
// host confirmed the abort, or no child existed yet. It acts on the run it
// observes when called (by token): it never stops a later run, and no retry
// follows it.
//
// Cancel returns nil, changing nothing, when the task is already terminal
// (also when the child finished before the abort landed: the task keeps that
// outcome). It returns ErrUnknownTask for an unknown id; the host's error if
// the abort failed (the task stays in its live state, and Cancel may be
// called again); ctx's error if ctx ends first (the abort goes on and its
// outcome is recorded when it lands); and ErrStopPending when called with a
// Host callback's context for the run that callback serves.
func (m *Manager) Cancel(ctx context.Context, id string) error {
	var token string
	for {
		m.mu.Lock()
		e := m.led.tasks[id]
		if e == nil {
			m.unlock()
			return fmt.Errorf("%w: %q", ErrUnknownTask, id)
		}
		a := *e.cur()
		if e.terminal() || (token != "" && a.Token != token) {
			m.unlock()
			return nil
		}
		token = a.Token
		if e.rt.stopWanted == "" {
			e.rt.stopWanted = StatusCancelled
		}
		op := m.stopRun(e, m.now())
		if e.terminal() {
			m.unlock()
			return nil
		}
		wait := e.waitChange()
		if op != nil {
			wait = op.done
		}
		m.unlock()

		if servesRun(ctx, token) {
			return ErrStopPending
		}
		if m.testHookWaiting != nil {
			m.testHookWaiting(id)
		}
		select {
		case <-wait:
		case <-ctx.Done():
			return ctx.Err()
		}
		if op != nil && op.err != nil {
			m.mu.Lock()
			live := !e.terminal() && e.cur().Token == token
			m.unlock()
			if live {
				return fmt.Errorf("bgtask: cancel task %s: abort session %s: %w", id, op.session, op.err)
			}
		}
	}
}
