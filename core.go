package bgtask

import (
	"context"
	"time"

	"github.com/bgtask/bgtask/internal/slots"
)

// Inputs. Everything that can change a task enters the core as one of the
// values below, and decide is the one place that routes each to the code
// that decides it, under m.mu. Deciding does no I/O: it commits records
// (commit, which derives every follow-up), queues effects (m.effect: host
// calls, timers, goroutines of the machinery) and log lines, and returns a
// reply; unlock then runs what was queued, outside the lock, and what an
// effect learns comes back as another input. User code that must run
// before a decision (an error's methods and the retry classifier, the
// retry delay) runs in the shell, and its answer is part of the input.
// The closure passes are the one other way in (closurePass, closure.go).
type input interface{ input() }

type (
	// launchIn: Launch, with the spec resolved and validated. (By value:
	// an input that is one pointer would make every input escape.)
	launchIn struct {
		info   taskInfo
		ticket *fanWaiter // its place in its parent's queue (TreeLimits.MaxPerParent), once it waits
		loc    *local     // what the new task keeps only in this process, if anything
		out    reply
	}
	// eventIn: Observe, a child session's event; its failure classified
	// when it needs to be (errNeedsClass asks for that first).
	eventIn struct {
		obs observation
		who resolved // the attempt a refused event resolved to
		err error    // why it was refused
	}
	// startedIn: a StartSession call returned (start seq, for attempt a).
	startedIn struct {
		e   *entry
		a   Attempt
		seq uint64
		sid string
		err error   // a *StartError, or nil
		f   failure // err, classified
	}
	// abortedIn: AbortSession calls of a batch returned (each op's err).
	abortedIn struct {
		b   *abortBatch
		ops []*abortOp
	}
	// retryReadyIn: a retry's old session was aborted and its delay (if
	// any) asked; afterDelay, the delay was also waited out.
	retryReadyIn struct {
		e          *entry
		next       Attempt
		delay      time.Duration
		delayErr   string // the retry delay function panicked
		afterDelay bool
		out        reply
	}
	// queueTimeoutIn: the queue timeout of queued run a fired.
	queueTimeoutIn struct {
		e *entry
		a Attempt
		w *slots.Waiter[queued]
	}
	// gateCheckIn: the children gate's release watch of candidate g fired.
	gateCheckIn struct {
		e *entry
		g *gateHold
	}
	// extendIn: Extend, before the host call (admit: check and reserve),
	// and after it (done: hostErr is its answer).
	extendIn struct {
		e       *entry
		prompt  string
		notice  string // rides the invocation's answer
		actor   string // who asked (WithActor)
		done    bool
		hostErr error
		req     PromptRequest      // admit: what to send
		cancel  context.CancelFunc // ends the host call (when the run prompted ends)
		values  context.Context    // admit: the Launch context whose values the call carries
		n       int
		err     error
	}
	// stallCheckIn: the stall watch of run a is due to look (retryAt: no
	// new stall abort before then).
	stallCheckIn struct {
		e       *entry
		a       Attempt
		retryAt time.Time
		out     reply
	}
	// deadlineIn: the deadline of run a of e (a.ID "": the task's) is due.
	deadlineIn struct {
		e    *entry
		a    Attempt
		wait <-chan struct{} // the abort to wait for before looking again
	}
	// stopIn: Stop asked to stop task id (token: the run it saw, or "");
	// by says who asked (Target.Cause), nil for a cancel.
	stopIn struct {
		id, token string
		by        *recordExt
		out       reply
	}
	// shutdownIn: Shutdown began.
	shutdownIn struct{}
	// runReturnedIn: a FuncHost function returned after it was asked to
	// stop, with its error text; ended: no abort in flight will confirm it.
	runReturnedIn struct {
		attemptID, token, text string
		ended                  bool
	}
	// recoveredIn: a StatusHost said, after a restart, what became of run
	// a of e (sid: its session, found by attempt id if it was not bound).
	recoveredIn struct {
		e      *entry
		a      Attempt
		sid    string
		report SessionReport
		err    error
		text   string  // err's text, worked out outside the lock
		f      failure // an ended run's error, classified outside the lock
		// stopAsked: a stop was asked of the run before the question was
		// (before the restart); one asked since is this life's own.
		stopAsked bool
		// seq is the start sequence the question stands for, when the run
		// was pending (its start's answer lost); 0 for a bound run.
		seq uint64
		rv  *recovery // the recovery asking: it counts the answers
	}
	// cooledIn: the timer of run a of e's wait for a cooldown fired (the
	// wait stop names): it may be admitted now.
	cooledIn struct {
		e    *entry
		a    Attempt
		stop chan struct{}
	}
)

func (*cooledIn) input() {}

func (*launchIn) input() {}

func (*eventIn) input() {}

func (*startedIn) input() {}

func (*abortedIn) input() {}

func (*retryReadyIn) input() {}

func (*queueTimeoutIn) input() {}

func (*gateCheckIn) input() {}

func (*extendIn) input() {}

func (*stallCheckIn) input() {}

func (*stopIn) input() {}

func (*deadlineIn) input() {}

func (*shutdownIn) input() {}

func (*runReturnedIn) input() {}

func (*recoveredIn) input() {}

// reply is what deciding an input tells its caller (the out field of the
// inputs that have one).
type reply struct {
	e     *entry          // launchIn: the new task
	err   error           // launchIn, eventIn, stopIn: the input was refused
	wait  <-chan struct{} // stopIn, stallCheckIn: what to wait for next
	op    *abortOp        // stopIn: the abort the stop waits for
	token string          // stopIn: the run the stop acts on
	due   time.Time       // stallCheckIn: no new stall abort before then
	after time.Duration   // stallCheckIn: look again after that long
	done  bool            // stopIn: nothing to wait for; stallCheckIn: the watch ends
}

// decide decides one input; what it answers is left in the input's own
// result fields. m.mu is held.
func (m *Manager) decide(in input) {
	switch in := in.(type) {
	case *launchIn:
		in.out = m.onLaunch(in)
	case *eventIn:
		in.who, in.err = m.observeLocked(&in.obs)
	case *startedIn:
		m.onStarted(in)
	case *abortedIn:
		m.recordAborts(in.b, in.ops, m.now())
	case *retryReadyIn:
		in.out = m.onRetryReady(in)
	case *cooledIn:
		m.onCooled(in)
	case *queueTimeoutIn:
		m.onQueueTimeout(in)
	case *gateCheckIn:
		m.onGateCheck(in)
	case *extendIn:
		in.n, in.err = m.onExtend(in)
	case *stallCheckIn:
		in.out = m.onStallCheck(in)
	case *stopIn:
		in.out = m.onStop(in)
	case *deadlineIn:
		m.onDeadline(in)
	case *shutdownIn:
		m.onShutdown()
	case *runReturnedIn:
		m.onRunReturned(in)
	case *recoveredIn:
		m.onRecovered(in)
	}
}

// step decides one input under m.mu and runs what it queued once the lock
// is released: the façade of every input that needs nothing between the
// two.
func (m *Manager) step(in input) error {
	if err := m.poisoned(); err != nil {
		return err
	}
	m.mu.Lock()
	m.decide(in)
	return m.unlock()
}

// stepCtx is step for a caller whose wait for durability keeps to ctx
// (see unlockCtx).
func (m *Manager) stepCtx(ctx context.Context, in input) error {
	if err := m.poisoned(); err != nil {
		return err
	}
	m.mu.Lock()
	m.decide(in)
	return m.unlockCtx(ctx)
}
