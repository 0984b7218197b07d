package bgtask

import (
	"fmt"
	"maps"
	"time"

	"github.com/bgtask/bgtask/internal/slots"
)

// TreeLimits are the limits a tree of subagents needs (WithTreeLimits).
// A task launched from a task's session is one level deeper than that
// task (Task.Depth); the root of a tree is the session at its top
// (Task.Root). Every limit is off at 0, the default.
type TreeLimits struct {
	// MaxDepth refuses a Launch whose task would be deeper than MaxDepth
	// (ErrDepthLimit).
	MaxDepth int
	// MaxPerParent caps the live (pending or running) tasks launched from
	// one session. A Launch past it waits, first come first served, for
	// one of them to end — at most ParentWait, then it is refused
	// (ErrFanOutLimit); with ParentWait 0 it is refused at once. A waiting
	// Launch also gives up when its context ends (its error) or at
	// Shutdown (ErrShutdown).
	MaxPerParent int
	// ParentWait: see MaxPerParent.
	ParentWait time.Duration
	// MaxPerRoot caps the live tasks of one tree, at any depth: a Launch
	// past it is refused (ErrTreeLimit).
	MaxPerRoot int
}

func (t *TreeLimits) validate() error {
	if t.MaxDepth < 0 || t.MaxPerParent < 0 || t.MaxPerRoot < 0 || t.ParentWait < 0 {
		return fmt.Errorf("%w: TreeLimits %+v: every limit is ≥ 0", ErrInvalidArgument, *t)
	}
	return nil
}

// WithTreeLimits limits the depth and breadth of subagent trees; see
// TreeLimits. The limits are checked by the core as each task is
// launched, from what the ledger holds. Default: no limits.
func WithTreeLimits(t TreeLimits) Option { return optionFunc(func(c *config) { c.tree = t }) }

// ModelLimits caps how many attempts run at once. An attempt holds a slot from
// the moment its session start is requested until its run ends, whatever
// ends it; an attempt that finds no free slot waits pending (PendingQueued)
// and slots are handed over first come, first served, per key. A retry
// gives its slot back and queues under its own model's key.
//
// A model's key and limit are, in order of precedence: its entry in Models
// (that model alone), its provider's entry in Providers (every model of the
// provider together), or Default (that model alone). A limit of 0 means no
// limit; a negative one is invalid (Launch reports it).
type ModelLimits struct {
	// Models caps single models, keyed "provider/id" (no variant), or by
	// the ID alone for a model with no provider (an ID "a/b" with no
	// provider and the model b of provider a share the key "a/b").
	Models map[string]int
	// Providers caps all models of a provider together, keyed by provider.
	// A model with no provider is never under one: its entry in Models or
	// Default caps it.
	Providers map[string]int
	// Default caps every other model on its own. 0: no limit.
	Default int
	// QueueTimeout ends a task in error ("timed out while queued", with
	// its queue position and key) when one of its attempts waits for a
	// slot longer than it. It leaves the queue at once. 0: no timeout.
	QueueTimeout time.Duration
}

func (l *ModelLimits) validate() error {
	for k, n := range l.Models {
		if n < 0 {
			return fmt.Errorf("%w: ModelLimits: Models[%q] is negative (%d)", ErrInvalidArgument, k, n)
		}
	}
	for k, n := range l.Providers {
		if n < 0 {
			return fmt.Errorf("%w: ModelLimits: Providers[%q] is negative (%d)", ErrInvalidArgument, k, n)
		}
	}
	if l.QueueTimeout < 0 {
		return fmt.Errorf("%w: ModelLimits: QueueTimeout is negative (%s)", ErrInvalidArgument, l.QueueTimeout)
	}
	if l.Default < 0 {
		return fmt.Errorf("%w: ModelLimits: Default is negative (%d)", ErrInvalidArgument, l.Default)
	}
	return nil
}

// key returns the concurrency key of model and its limit: "model:p/id"
// ("model:id" with no provider) or "provider:p".
func (l *ModelLimits) key(model Model) (string, int) {
	id := Model{Provider: model.Provider, ID: model.ID}.String()
	if n, ok := l.Models[id]; ok {
		return "model:" + id, n
	}
	if n, ok := l.Providers[model.Provider]; ok && model.Provider != "" {
		return "provider:" + model.Provider, n
	}
	return "model:" + id, l.Default
}

// WithModelLimits caps concurrent attempts per model or provider; see
// ModelLimits. Default: no limits.
func WithModelLimits(l ModelLimits) Option {
	return optionFunc(func(c *config) {
		l.Models = maps.Clone(l.Models)
		l.Providers = maps.Clone(l.Providers)
		c.limits = &l
	})
}

// WithGateTimeout bounds how long the children gate holds a child's turn
// end once the tasks its session launched have all settled: if no further
// turn comes within d, the held turn is released as the answer, marked
// degraded with a notice. d <= 0, the default: the stall timeout if set,
// else defaultGateTimeout.
func WithGateTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.gateTimeout = d })
}

// WithStallTimeout aborts, through the host, a running attempt that reported
// no event for d, and fails it with "stalled: no activity for d" — a
// retryable failure, so the task moves to its next model. Default: 0, no
// stall detection.
func WithStallTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.stallTimeout = d })
}

// watchQueueNow waits for queued run a of e to leave the queue, or for the
// queue timeout t to fire first (queueTimeoutIn).
func (m *Manager) watchQueueNow(e *entry, a Attempt, w *slots.Waiter[queued], t Timer) {
	select {
	case <-t.C():
	case <-w.V.stop:
		t.Stop()
		return
	case <-m.life.ctx.Done():
		t.Stop()
		return
	}
	m.step(&queueTimeoutIn{e: e, a: a, w: w})
}

// watchStallNow is the stall watch of run a of e; done closes when the run
// ends or is replaced. It asks the core (stallCheckIn) what to do, and
// waits for what it says: a timer until the run is due to be looked at
// again, or the answer to the abort a stall set off.
func (m *Manager) watchStallNow(e *entry, a Attempt, done <-chan struct{}) {
	in := stallCheckIn{e: e, a: a}
	for {
		m.step(&in)
		r := in.out
		switch {
		case r.done:
			return
		case r.wait != nil:
			if !r.due.IsZero() {
				in.retryAt = r.due // after a failed stall abort, wait before the next
			}
			unpark := m.life.parked.park(r.wait, done, m.life.ctx.Done())
			select { // the abort's answer: stopped (failed over) or still alive
			case <-r.wait:
				unpark()
				continue
			case <-done:
			case <-m.life.ctx.Done():
			}
			unpark()
			return
		}
		t := m.cfg.clock.NewTimer(r.after)
		select {
		case <-t.C():
		case <-done:
			t.Stop()
			return
		case <-m.life.ctx.Done():
			t.Stop()
			return
		}
	}
}

// QueueStat is the state of one concurrency key.
type QueueStat struct {
	Key string `json:"key"` // "model:provider/id" or "provider:name"
	// Running counts the attempts holding a slot of the key.
	Running int `json:"running"`
	// Queued counts those waiting for one.
	Queued int `json:"queued"`
	Limit  int `json:"limit"` // 0: no limit
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
	if m.calls.health != nil {
		var ok bool
		if a, ok = m.healthAdmit(e, a); !ok {
			return
		}
	}
	if m.calls.pool == nil {
		m.spawnStart(e, a)
		return
	}
	key, limit := m.cfg.limits.key(a.Model)
	q := queued{e: e, token: a.Token}
	if m.queueTimeout() > 0 {
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
	if m.queueTimeout() > 0 {
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
	if h := m.calls.health; h != nil && h.admits(cur.Model, m.now()).on {
		// Its model began to cool (or is probed) while it queued: the slot
		// goes on to the next in line, and the attempt chooses again.
		m.calls.pool.Release(w.Key(), m.granted)
		m.admit(e, cur)
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
	d := m.queueTimeout()
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
	m.finalize(e, in.a.ID, StatusError, fmt.Sprintf("timed out while queued: waited %s at position %d for a slot of %s", m.queueTimeout(), pos, w.Key()), "", m.now())
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

// queueTimeout is ModelLimits.QueueTimeout (0 without WithModelLimits).
func (m *Manager) queueTimeout() time.Duration {
	if m.cfg.limits == nil {
		return 0
	}
	return m.cfg.limits.QueueTimeout
}
