package bgtask

import (
	"context"
	"errors"
	"fmt"

	"github.com/bgtask/bgtask/internal/signal"
)

// Run tokens and exact cancellation.
//
// Every attempt is one run and carries a token (Attempt.Token) that is never
// reused. Anything that acts on a run it observed earlier — a cancel, a
// retry timer, a session start in flight, an abort — carries that token and
// does nothing if the run was replaced or ended meanwhile. Aborts are shared:
// Stop and Shutdown asking to stop the same run join one host call.

// RunRef names one run: a task's attempt and its token.
type RunRef struct {
	// TaskID is the task the run belongs to.
	TaskID string
	// AttemptID is the attempt the run is.
	AttemptID string
	// Token is the run's token (Attempt.Token).
	Token string
}

// ErrStopPending is returned by Stop and Shutdown when they are called with
// the context a callback was given and would have to wait for that very
// callback to return: Stop from a Host call (or a FuncHost function) serving
// a run it would stop, Shutdown from any Host, Notifier or FuncHost
// function. The stop is recorded and goes on (a session being started is
// aborted on arrival; an abort in flight is joined); Wait, or a later call
// from outside the callback, sees the end.
var ErrStopPending = errors.New("stop requested from a callback it would wait for; it completes after the callback returns")

// callKind says which callback a context was made for.
type callKind uint8

const (
	callStart callKind = iota + 1
	callAbort
	callNotify
	callRun    // a FuncHost's function
	callPrompt // a Prompter's PromptSession (Extend)
)

type runKey struct{}

type runValue struct {
	ref       RunRef
	kind      callKind
	e         *entry // the task, when known: Fence reads its live run without a lock
	delivered func() // a Notify's: records its notification delivered (Delivered)
}

// runCtx is a context carrying the run a callback serves: one allocation,
// or none when embedded in an abortOp.
type runCtx struct {
	context.Context
	v runValue
	// values, if set, is the Launch context whose values the call sees
	// (Spec.InheritValues): only its values, never its Done or Err.
	values context.Context
}

// Value returns the run for runKey, then a value of the Launch context
// (Spec.InheritValues), and defers to the parent otherwise.
func (c *runCtx) Value(key any) any {
	if key == (runKey{}) {
		return &c.v
	}
	if c.values != nil {
		if v := c.values.Value(key); v != nil {
			return v
		}
	}
	return c.Context.Value(key)
}

func withRun(ctx context.Context, ref RunRef, kind callKind) context.Context {
	return &runCtx{Context: ctx, v: runValue{ref: ref, kind: kind}}
}

// withRunOf is withRun for the run req names, with its task known (Fence).
func withRunOf(ctx context.Context, e *entry, req PromptRequest, values context.Context) context.Context {
	return &runCtx{Context: ctx, v: runValue{ref: RunRef{TaskID: req.TaskID, AttemptID: req.AttemptID, Token: req.Token}, kind: callPrompt, e: e}, values: values}
}

// Fence returns nil while the run ctx carries (a Host call's context, or a
// FuncHost function's) is still its task's current live run, and
// ErrSuperseded once it is not: it was replaced by a retry, a stop was
// asked for it (a cancel, a closure, Shutdown), or it ended. A tool about
// to make a side effect calls it first, so that a superseded run refuses
// its own effect. It is one atomic read, with no lock. A context that
// carries no run gets ErrInvalidArgument.
func Fence(ctx context.Context) error {
	if ctx == nil {
		return fmt.Errorf("%w: Fence with a nil context", ErrInvalidArgument)
	}
	v, ok := ctx.Value(runKey{}).(*runValue)
	if !ok {
		return fmt.Errorf("%w: the context carries no run", ErrInvalidArgument)
	}
	if v.e == nil {
		return fmt.Errorf("%w: the context's run cannot be checked (not a start, prompt or FuncHost context)", ErrInvalidArgument)
	}
	if live := v.e.live.Load(); live == nil || *live != v.ref.Token {
		return fmt.Errorf("%w: run %s of task %s", ErrSuperseded, v.ref.Token, v.ref.TaskID)
	}
	return nil
}

// Delivered is what a Notifier calls, inside Notify, at the moment the
// notification reached its session, when that comes before Notify returns:
// it is recorded delivered from then on (and Notify's error, if any, is
// ignored). It matters to the children gate: a session that answers at
// once on reading a child's result (an in-process function) could
// otherwise end its turn before the delivery is recorded, and its turn
// would wait as a candidate. Outside a Notify call it does nothing.
func Delivered(ctx context.Context) {
	if ctx == nil {
		return
	}
	if v, ok := ctx.Value(runKey{}).(*runValue); ok && v.delivered != nil {
		v.delivered()
	}
}

// RunFromContext returns the run a Host or Notifier call serves, from the
// context the Manager gave that call.
func RunFromContext(ctx context.Context) (RunRef, bool) {
	v, ok := ctx.Value(runKey{}).(*runValue)
	if !ok {
		return RunRef{}, false
	}
	return v.ref, true
}

// servesRun reports whether ctx belongs to a host call (start or abort) or
// a FuncHost function serving the run with token: a wait on that run from
// it waits on itself.
func servesRun(ctx context.Context, token string) bool {
	v, ok := ctx.Value(runKey{}).(*runValue)
	return ok && v.ref.Token == token && v.kind != callNotify
}

// abortOp is one in-flight AbortSession, shared by everyone who asked for it.
type abortOp struct {
	ref      attemptRef // the attempt whose run it stops
	session  string
	ctx      runCtx        // the host call's context
	err      error         // the host's answer, once finished
	failWith *failure      // when confirmed, the run fails with this (a stall, a start error)
	finished bool          // the host answered
	status   Status        // the attempt's status once the answer was recorded
	done     chan struct{} // closed when finished; made only for a waiter
}

// run names the run op stops (kept once, in its host call's context).
func (op *abortOp) run() *RunRef { return &op.ctx.v.ref }

// waitDone returns a channel closed when the host answered op. m.mu is held.
func (op *abortOp) waitDone() <-chan struct{} {
	if op.finished {
		return signal.Closed
	}
	if op.done == nil {
		op.done = make(chan struct{})
	}
	return op.done
}
