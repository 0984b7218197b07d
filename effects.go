package bgtask

import (
	"github.com/bgtask/bgtask/internal/group"
	"github.com/bgtask/bgtask/internal/slots"
)

// effect is one thing the core decided to do to the world: a host call, a
// timer to wait on, a goroutine of the machinery. The core never does it
// itself: it queues the effect (m.effect) under m.mu, and unlock runs it,
// on a goroutine of the Manager, once the lock is released. What the
// effect learns comes back into the core as an input (a start returned,
// an abort returned, a timer fired).
type effect struct {
	m    *Manager
	kind effectKind
	e    *entry
	run  runOf // the run it serves
	// fxStart: the start's sequence. fxRetry: the failed run (prev),
	// whose session is aborted first when abortOld, and its failure
	// (cause), for the retry delay.
	seq      uint64
	prev     runOf
	abortOld bool
	cause    error
	session  string                // fxAbortOrphan, fxCascade: the session
	closure  *closure              // fxCascade: the closure of its branch
	rv       *recovery             // fxRecover: the restart it serves
	stopped  bool                  // fxRecover: a stop was asked before the question
	timer    Timer                 // fxQueueTimeout: made as the run queued; fxDeadline: made as it was armed; fxCooldown: until the earliest end
	done     <-chan struct{}       // fxStallWatch, fxCooldown: closed when the run ends or is replaced
	wake     chan struct{}         // fxCooldown: closed when the core ended the wait itself (healthWake)
	waiter   *slots.Waiter[queued] // fxQueueTimeout: the run's place in the queue
	fn       func()                // fxGo: a goroutine of the machinery (a lane, abort workers)
	ctx      runCtx                // fxStart, fxRetry: the host call's context, made as it runs
}

// runOf is what identifies a run, copied from its attempt: immutable, so
// an effect reads it without the lock.
type runOf struct {
	id, token, session string
	number             int
	model              Model
}

func runOfAttempt(a Attempt) runOf {
	return runOf{id: a.ID, token: a.Token, session: a.SessionID, number: a.Number, model: a.Model}
}

// attempt is the run's identity as an Attempt (its status fields empty).
func (r runOf) attempt() Attempt {
	return Attempt{ID: r.id, Number: r.number, Token: r.token, Model: r.model, SessionID: r.session}
}

type effectKind uint8

const (
	fxStart        effectKind = iota + 1 // call StartSession for run a (start seq)
	fxRetry                              // abort the failed run's session, wait out the retry delay, admit run a
	fxAbortOrphan                        // abort a session created for a run no longer current
	fxStallWatch                         // watch run a for a stall
	fxQueueTimeout                       // end queued run a when the queue timeout fires first
	fxCascade                            // close the branch beneath a deleted session
	fxRecover                            // ask a StatusHost what became of run a after a restart
	fxDeadline                           // stop run a (or, with no run, the task) at its deadline: due
	fxGo                                 // run fn
	fxCooldown                           // wait for the cooldown pending run a waits on to end, then admit it
)

// effect queues fx to run once m.mu is released, and reports true; or,
// once the Manager's goroutines are closed (after Shutdown), reports false
// and queues nothing: the caller settles what fx would have done. The
// goroutine it will run on is reserved now, under m.mu, so Shutdown's join
// never sees zero goroutines while an effect waits to run. m.mu is held.
func (m *Manager) effect(fx effect) bool {
	if !m.life.group.Reserve() {
		return false
	}
	fx.m = m
	m.out.fx = append(m.out.fx, fx)
	return true
}

// goLater runs f on a goroutine of the Manager once m.mu is released: the
// spawn of the machinery the core feeds under its lock (notification
// lanes, abort workers). m.mu is held.
func (m *Manager) goLater(f func()) bool { return m.effect(effect{kind: fxGo, fn: f}) }

// Run executes the effect, without m.mu, on worker w of the Manager's
// group: the goroutine reserved for it, or one that took it on after its
// own work (group.Worker).
func (fx *effect) Run(w *group.Worker) {
	m := fx.m
	switch fx.kind {
	case fxStart:
		m.startSession(fx, w)
	case fxRetry:
		m.retry(fx, w)
	case fxAbortOrphan:
		m.abortOrphanNow(fx.e, fx.run.attempt(), fx.session)
	case fxStallWatch:
		m.watchStallNow(fx.e, fx.run.attempt(), fx.done)
	case fxQueueTimeout:
		m.watchQueueNow(fx.e, fx.run.attempt(), fx.waiter, fx.timer)
	case fxCascade:
		m.cascadeNow(fx.closure, fx.session)
	case fxRecover:
		m.recoverRun(fx)
	case fxDeadline:
		m.watchDeadlineNow(fx)
	case fxGo:
		fx.fn()
	case fxCooldown:
		m.waitCooldownNow(fx)
	}
}
