package bgtask

import (
	"context"
	"errors"

	"github.com/bgtask/bgtask/internal/fleet"
)

// Change is one applied mutation: the task as it is after it, and the
// manager-wide sequence number of the change.
type Change struct {
	// Epoch names the Manager's process life (wall-clock nanoseconds at
	// Open). It tells process lives apart but does not order them: a
	// restarted process whose clock is behind has a smaller one. Sequences
	// start again with each epoch.
	Epoch uint64 `json:"epoch,omitempty"`
	// Seq is the change's manager-wide sequence number.
	Seq uint64 `json:"seq"`
	// Task is the task as the change left it.
	Task Task `json:"task"`
}

// Snapshot is every task, complete, as of sequence Seq: what it omits is
// absent.
type Snapshot struct {
	// Epoch names the Manager's process life, as Change.Epoch does: a
	// different epoch is a different process, whether its number is larger
	// or smaller, and its sequence numbers start again.
	Epoch uint64 `json:"epoch,omitempty"`
	// Seq: every change up to it is in Tasks, none after.
	Seq uint64 `json:"seq"`
	// Tasks are the tasks in memory, in launch order.
	Tasks []Task `json:"tasks"`
	// Closures are the records of every closure that has ended, in order.
	Closures []ClosureReport `json:"closures,omitempty"`
	// Queues are the concurrency keys with attempts running or queued, by
	// key: none without WithModelLimits.
	Queues []QueueStat `json:"queues,omitempty"`
}

// Snapshot returns everything the Manager holds in memory: every task, in
// launch order, the closures that ended and the queues, and the change
// sequence it was taken at. Task reads one task, Tasks a page.
func (m *Manager) Snapshot() Snapshot {
	m.mu.Lock()
	defer m.unlock()
	out := Snapshot{Epoch: m.changes.epoch, Seq: m.changes.seq, Tasks: make([]Task, len(m.order))}
	for i, e := range m.order {
		out.Tasks[i] = e.project()
	}
	if n := len(m.led.closures); n > 0 {
		out.Closures = make([]ClosureReport, n)
		for i, r := range m.led.closures {
			out.Closures[i] = r.closure.clone()
		}
	}
	if m.calls.pool != nil {
		for _, s := range m.calls.pool.Stats() {
			out.Queues = append(out.Queues, QueueStat{Key: s.Key, Running: s.Running, Queued: s.Queued, Limit: s.Limit})
		}
	}
	return out
}

// ErrLagged ends a Subscription whose buffer overflowed: its consumer must
// resync from a Snapshot (and subscribe again).
var ErrLagged = errors.New("subscriber lagged behind; resync from a snapshot")

// Subscription is a stream of Changes. Receive from C until it is closed,
// then Err says why.
type Subscription struct {
	// C delivers every change in sequence order. It is closed when ctx
	// ends, on Close, at Shutdown, or when the buffer overflows (Err is
	// then ErrLagged).
	C <-chan Change

	done  <-chan struct{}
	err   func() error // why C was closed
	close func()       // ends it
}

// defaultSubscriptionBuffer is the buffer of Subscribe(ctx, 0).
const defaultSubscriptionBuffer = 1024

// Subscribe delivers every applied mutation from now on, with the task's
// full snapshot and a manager-wide sequence number. A slow subscriber never
// blocks the Manager: when its buffer (default defaultSubscriptionBuffer) is
// full, the subscription ends with ErrLagged and the consumer resyncs from a
// Snapshot. Subscribe before taking the Snapshot you start from; Mirror
// orders the two by sequence within an epoch.
func (m *Manager) Subscribe(ctx context.Context, buffer int) (*Subscription, error) {
	ctx = orBackground(ctx)
	if buffer <= 0 {
		buffer = defaultSubscriptionBuffer
	}
	m.mu.Lock()
	defer m.unlock()
	if m.life.closing {
		return nil, ErrShutdown
	}
	sub := m.changes.subs.Add(buffer)
	if !m.life.watchers.Go(func() {
		select {
		case <-ctx.Done():
			m.mu.Lock()
			m.changes.subs.End(sub, ctx.Err())
			m.unlock()
		case <-sub.Done():
		}
	}) {
		m.changes.subs.End(sub, ErrShutdown)
		return nil, ErrShutdown
	}
	return &Subscription{C: sub.C(), done: sub.Done(),
		err: func() error {
			m.mu.Lock()
			defer m.unlock()
			return sub.Err()
		},
		close: func() {
			m.mu.Lock()
			m.changes.subs.End(sub, nil)
			m.unlock()
		}}, nil
}

// Done is closed when the subscription has ended, as C is once what it
// holds was received: a consumer that is not reading C can wait on it, and
// Err then says why.
func (s *Subscription) Done() <-chan struct{} { return s.done }

// Err says why C was closed; nil while it is open.
func (s *Subscription) Err() error { return s.err() }

// Close ends the subscription.
func (s *Subscription) Close() { s.close() }

func init() {
	fleet.Subscription = func(c any, done <-chan struct{}, err func() error, close func()) any {
		return &Subscription{C: c.(<-chan Change), done: done, err: err, close: close}
	}
}

func (m *Manager) closeSubscriptions(err error) {
	m.mu.Lock()
	defer m.unlock()
	m.changes.subs.EndAll(err)
}

// publish sends e's new state to every subscriber, without ever blocking.
// m.mu is held.
func (m *Manager) publish(e *entry) {
	m.changes.seq++
	if m.changes.subs.Len() == 0 {
		return
	}
	m.changes.subs.Publish(Change{Epoch: m.changes.epoch, Seq: m.changes.seq, Task: e.project()})
}
