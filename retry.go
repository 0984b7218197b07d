package bgtask

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"math/rand/v2"
	"time"

	"github.com/bgtask/bgtask/internal/errclass"
	"github.com/bgtask/bgtask/internal/group"
)

// WithRetryable decides which failures move a task to its next model: f
// sees each failure and what DefaultRetryable answers for it, and its
// answer decides. To replace the default, ignore the second argument; to
// extend it, combine them:
//
//	bgtask.WithRetryable(func(err error, retryable bool) bool {
//		var q *QuotaError
//		return retryable || errors.As(err, &q)
//	})
//
// DefaultRetryable is always asked first (it reads the error's own
// methods: a status, IsRetryable, Temporary, Timeout). A Permanent error
// is never retried, whatever f says. A failed session start reaches f as a
// *StartError. f is user code, run outside the Manager's lock; a panic in
// it (or in the error's methods) makes the failure non-retryable, named in
// its text. Default: DefaultRetryable alone.
func WithRetryable(f func(err error, retryable bool) bool) Option {
	return optionFunc(func(c *config) { c.retryable = f })
}

// WithRetryDelay waits f(n, cause) before starting attempt n (n ≥ 2) of a
// retry. cause is the error the failed attempt reported (a *StartError
// for a failed session start), so f can honour what the provider asked
// for; Backoff returns a ready-made f that does not look at it:
//
//	bgtask.WithRetryDelay(func(n int, cause error) time.Duration {
//		if d, ok := bgtask.RetryAfter(cause); ok {
//			return d
//		}
//		return time.Second
//	})
//
// The attempt is pending with PendingRetryDelay meanwhile, and a Stop ends
// the wait. f runs on a goroutine of the Manager, never under its lock. A
// panic in f ends the attempt it would delay in error, naming the panic.
// Default: no delay.
func WithRetryDelay(f func(attempt int, cause error) time.Duration) Option {
	return optionFunc(func(c *config) { c.retryDelay = f })
}

// RetryAfter reports the delay a failure asks for before it is tried again:
// a RetryAfter() time.Duration method anywhere in err's chain, a RetryAfter
// field, or a Retry-After (or retry-after-ms) header carried by the error's
// HTTP response, as provider SDK errors carry it.
func RetryAfter(err error) (time.Duration, bool) {
	return errclass.RetryAfter(err)
}

// classify works out a failure. It calls user code (the error's methods,
// the classifier): never with m.mu held. A panic in any of it makes the
// failure non-retryable, named in its text.
func (m *Manager) classify(err error) (f failure) {
	f = failure{err: err, text: safeText(err)}
	defer func() {
		if r := recover(); r != nil {
			f.reason, f.retry = ReasonUnknown, false
			f.text += " (classifying this error panicked: " + panicText(r) + ")"
		}
	}()
	f.reason = reasonOf(err)
	f.retry = m.retryable(err)
	if m.cfg.health != nil {
		f.health = healthClassOf(err)
		f.after, _ = errclass.RetryAfter(err)
	}
	return f
}

// retryable applies the classifier; Permanent always wins. It runs user
// code: never call it with m.mu held.
func (m *Manager) retryable(err error) bool {
	if IsPermanent(err) {
		return false
	}
	retry := DefaultRetryable(err)
	if f := m.cfg.retryable; f != nil {
		retry = f(err, retry)
	}
	return retry
}

// retry runs a retry effect on worker w: abort the failed run's session,
// ask the retry delay, wait it out, then have the next run (fx.run)
// admitted if it is still the task's current, pending run.
func (m *Manager) retry(fx *effect, w *group.Worker) {
	e, next := fx.e, fx.run.attempt()
	if fx.abortOld {
		failed := fx.prev.attempt()
		fx.ctx = runCtx{Context: m.life.ctx, v: runValue{ref: RunRef{TaskID: e.info.id, AttemptID: failed.ID, Token: failed.Token}, kind: callAbort}}
		if err := m.callAbort(&fx.ctx, e, failed.SessionID); err != nil {
			m.logAttrs(slog.LevelWarn, "abort of failed attempt's session failed",
				slog.String("task", e.info.id), slog.String("attempt", failed.ID),
				slog.String("session", failed.SessionID), slog.String("err", safeText(err)))
		}
	}
	in := retryReadyIn{e: e, next: next}
	in.delay, in.delayErr = m.retryDelay(next.Number, fx.cause)
	m.mu.Lock()
	m.decide(&in)
	r := in.out
	if r.wait == nil {
		m.unlockOn(w)
		return
	}
	m.unlock()
	t := m.cfg.clock.NewTimer(in.delay)
	select {
	case <-t.C():
	case <-r.wait:
		t.Stop()
	case <-m.life.ctx.Done():
		t.Stop()
	}
	in.afterDelay = true
	m.mu.Lock()
	m.decide(&in)
	m.unlockOn(w)
}

// retryDelay asks the user's retry delay function (user code: never under
// m.mu). A panic is reported as the error text that ends the attempt.
func (m *Manager) retryDelay(attempt int, cause error) (d time.Duration, panicked string) {
	if m.cfg.retryDelay == nil {
		return 0, ""
	}
	defer func() {
		if r := recover(); r != nil {
			d, panicked = 0, "the retry delay function panicked: "+panicText(r)
		}
	}()
	return m.cfg.retryDelay(attempt, cause), ""
}

// StartError is a failed session start: StartSession returned an error
// before a child session existed. DefaultRetryable retries it unless its
// cause is permanent or not worth retrying (context overflow, validation,
// aborted).
type StartError struct {
	// Model is the attempt's model.
	Model Model
	// Err is the host's error.
	Err error
}

// Error says the start failed, with its cause.
func (e *StartError) Error() string {
	return "session start failed on " + e.Model.String() + ": " + safeText(e.Err)
}

// Unwrap returns the Host's error.
func (e *StartError) Unwrap() error { return e.Err }

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }

func (e *permanentError) Unwrap() error { return e.err }

// causeOf is err as Task.Cause keeps it: the error a function or host
// gave, as it gave it (a Permanent mark of its own included), but without
// the mark the Manager put on errors of its own making: a panic's Cause is
// the *PanicError itself, a nil result's ErrNilResult itself.
func causeOf(err error) error {
	if p, ok := err.(*permanentError); ok {
		if _, panicked := p.err.(*PanicError); panicked || p.err == ErrNilResult {
			return p.err
		}
	}
	return err
}

// Permanent marks err as not retryable: a task whose attempt fails with it
// ends in error instead of moving to its next model, whatever WithRetryable
// says. The mark survives wrapping. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err or anything it wraps was marked Permanent.
func IsPermanent(err error) bool {
	_, ok := inChain[*permanentError](err)
	return ok
}

// DefaultRetryable is the retry classifier: its answer decides unless
// WithRetryable decides otherwise.
// It retries rate limits (429), overload (503, 529, "overloaded"), other
// 5xx, a forbidden or unauthorized provider (403, 401), a model not found
// (404) and timeouts. The status is read from the first error in the chain
// that has one: a StatusCode() or HTTPStatus() int method, an int field
// such as StatusCode or HTTPStatusCode, or a Response *http.Response field
// (the provider SDKs' shapes); else from the message, where a written-out
// status ("404 Not Found") and a provider's error code (model_not_found,
// invalid_api_key, not_found_error, RESOURCE_EXHAUSTED, …) win over a
// generic type such as invalid_request_error; and a
// failed session start (*StartError) unless its cause is known not to be
// worth retrying. Context-length, validation and aborted errors, and
// anything unrecognised, are not retried.
//
// Before all of that (but after Permanent and those three sentinels), an
// error that says so itself decides: the first
// error in the chain with an IsRetryable() bool method is retried exactly
// when it returns true, and one whose Temporary() bool or Timeout() bool
// returns true is retried. To add rules of your own without losing these,
// use WithRetryable and combine your answer with the one it is given.
func DefaultRetryable(err error) bool {
	if err == nil || IsPermanent(err) {
		return false
	}
	if errors.Is(err, ReasonContextOverflow) || errors.Is(err, ReasonOutputLimit) || errors.Is(err, ReasonContentFilter) {
		return false
	}
	if retry, ok := errclass.Stated(err); ok {
		return retry
	}
	if se := startErrorIn(err); se != nil {
		switch errclass.Classify(se.Err) {
		case errclass.ContextOverflow, errclass.Validation, errclass.Aborted:
			return false
		}
		return true
	}
	return errclass.Classify(err).Retryable()
}

// startErrorIn returns the first *StartError in err's chain, or nil.
func startErrorIn(err error) *StartError {
	se, _ := inChain[*StartError](err)
	return se
}

// inChain returns the first error of type T in err's chain (Unwrap, and
// every branch of an Unwrap() []error in order): errors.As without its
// allocation. A link with an As method is left to errors.As.
func inChain[T error](err error) (T, bool) {
	for err != nil {
		switch e := err.(type) {
		case T:
			return e, true
		case interface{ As(any) bool }:
			var t T
			ok := errors.As(err, &t)
			return t, ok
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				if t, ok := inChain[T](inner); ok {
					return t, true
				}
			}
			var zero T
			return zero, false
		case interface{ Unwrap() error }:
			err = e.Unwrap()
		default:
			var zero T
			return zero, false
		}
	}
	var zero T
	return zero, false
}

// Backoff returns a delay for WithRetryDelay and WithNotifyRetry: base
// before attempt 2, doubling for each later attempt, never more than max.
// jitter in [0, 1] takes up to that fraction off each delay at random, so
// tasks that failed together do not retry together; 0 means none. A
// base ≤ 0 means no delay. It does not look at the cause.
func Backoff(base, max time.Duration, jitter float64) func(attempt int, cause error) time.Duration {
	jitter = math.Min(math.Max(jitter, 0), 1)
	return func(attempt int, _ error) time.Duration {
		if base <= 0 {
			return 0
		}
		d := base
		for i := 2; i < attempt && d < max; i++ {
			d *= 2
		}
		if max > 0 && d > max {
			d = max
		}
		if jitter > 0 {
			d -= time.Duration(jitter * rand.Float64() * float64(d))
		}
		return d
	}
}

// fail ends the current attempt of e with f: a retry on the next model
// when f is retryable and nothing forbids it, else the task's error.
func (m *Manager) fail(e *entry, f failure, at time.Time) {
	m.fence(e)
	a := e.cur()
	if e.stop != "" && (errors.Is(f.err, ErrSuperseded) || errors.Is(f.err, context.Canceled)) {
		// The run heard the stop — from Fence, or as its context's end —
		// and ended for it: the stop is what ended it (a budget's stops
		// are asked before any abort; Shutdown cancels the contexts of
		// the runs it stops), and Task.Cause says so (a *StopError).
		e.output().reason = f.reason
		m.finalize(e, a.ID, e.stop, f.text, "", at)
		return
	}
	if f.err != nil { // the value itself, for Task.Cause
		l := e.keep()
		l.err, l.errTok = causeOf(f.err), a.Token
	}
	text := f.text
	e.output().reason = f.reason
	if m.calls.health != nil {
		m.healthFailed(e, *a, f, at)
	}
	if !f.retry || a.Number >= e.info.maxAttempts || e.stop != "" {
		// The child's run ended on its own failure: that is what the
		// status says, also when a stop (Stop, a closure, Shutdown) was
		// asked for, whose only say is that no new child starts.
		m.finalize(e, a.ID, StatusError, text, "", at)
		return
	}
	recs, lerr := m.led.retryRecords(e, text, at)
	batch := recs[:]
	if lerr == nil && m.calls.health != nil { // the next attempt past what cools, so the retry names the model it runs on
		batch = append(batch, m.skipsFor(e, recs[2].attempt, at)...)
	}
	if lerr != nil || !m.commit(e, batch...) {
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
	m.prepareRetry(e, recs[1].attempt, *e.cur(), f.err)
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
