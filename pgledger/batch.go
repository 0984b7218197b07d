package pgledger

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// batch sends the calls of one kind that come while a statement of that
// kind is in flight together, in the next statement: one round trip (and
// one commit) for many calls, as the journal's group commit does for
// appends. The statements run on a goroutine of the batch's, under its
// context, not under a caller's: each caller waits for its answer only as
// long as its own context lasts, and a caller that left is not sent (if
// its statement has not gone yet) or has what was done for it undone
// (drop). A statement none of whose callers waits any more is cancelled,
// so that a stalled one holds no later call up for long.
type batch[Q, A any] struct {
	// run is one statement for qs: an answer each, in order, or an error
	// for them all.
	run func(ctx context.Context, qs []Q) ([]A, error)
	// drop undoes what run did for a call whose caller left before its
	// answer came (nil: nothing to undo).
	drop func(ctx context.Context, q Q, a A)
	// alone reports a call that must go in a statement of its own (nil:
	// none), one whose failure must not be the others'.
	alone func(q Q) bool

	ctx    context.Context // the statements'; ends at close
	cancel context.CancelFunc

	mu     sync.Mutex
	queue  []*batchCall[Q, A]
	busy   bool // a goroutine is sending
	closed bool
	wg     sync.WaitGroup

	enqueued func() // tests: called once a call is queued
}

// batchFor bounds one batch's statement.
const batchFor = 10 * time.Second

// A batchCall is one caller's call: pending, then answered or left,
// whichever comes first.
type batchCall[Q, A any] struct {
	q     Q
	a     A
	err   error
	state atomic.Int32 // callPending, callAnswered, callLeft
	done  chan struct{}
	// sent is the statement the call went in, once it went; counted, once
	// the call's leaving was counted there.
	sent    atomic.Pointer[sending]
	counted atomic.Bool
}

// sending is one statement in flight: the callers still waiting for it,
// and its cancel, called once none is (what it did for them is then
// undone, or it is rolled back).
type sending struct {
	waiting atomic.Int32
	cancel  context.CancelFunc
}

// left counts c's leaving in its statement, once, if it was sent.
func (c *batchCall[Q, A]) left() {
	if s := c.sent.Load(); s != nil && c.counted.CompareAndSwap(false, true) && s.waiting.Add(-1) == 0 {
		s.cancel()
	}
}

const (
	callPending int32 = iota
	callAnswered
	callLeft
)

func newBatch[Q, A any](run func(context.Context, []Q) ([]A, error), drop func(context.Context, Q, A)) *batch[Q, A] {
	ctx, cancel := context.WithCancel(context.Background())
	return &batch[Q, A]{run: run, drop: drop, ctx: ctx, cancel: cancel}
}

// do sends q with the calls around it and returns its answer, or ctx's
// error once ctx ends first. Once the batch is closed, or if alone says
// so, q is sent alone, under ctx.
func (b *batch[Q, A]) do(ctx context.Context, q Q) (A, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	c := &batchCall[Q, A]{q: q, done: make(chan struct{})}
	b.mu.Lock()
	if b.closed || (b.alone != nil && b.alone(q)) {
		b.mu.Unlock()
		as, err := b.run(ctx, []Q{q})
		if err == nil && len(as) != 1 {
			err = fmt.Errorf("pgledger: %d answers to 1 call", len(as))
		}
		if err != nil {
			var zero A
			return zero, err
		}
		return as[0], nil
	}
	b.queue = append(b.queue, c)
	if !b.busy {
		b.busy = true
		b.wg.Add(1)
		go b.send()
	}
	b.mu.Unlock()
	if b.enqueued != nil {
		b.enqueued()
	}
	select {
	case <-c.done:
		return c.a, c.err
	case <-ctx.Done():
		if c.state.CompareAndSwap(callPending, callLeft) {
			c.left()
			var zero A
			return zero, ctx.Err()
		}
		<-c.done // answered meanwhile
		return c.a, c.err
	}
}

// send sends what is queued, a batch at a time, until the queue is empty.
func (b *batch[Q, A]) send() {
	defer b.wg.Done()
	for {
		b.mu.Lock()
		calls := b.queue
		b.queue = nil
		if len(calls) == 0 {
			b.busy = false
			b.mu.Unlock()
			return
		}
		b.mu.Unlock()
		// Those whose callers left already are not sent.
		live := calls[:0]
		for _, c := range calls {
			if c.state.Load() == callPending {
				live = append(live, c)
			}
		}
		if len(live) == 0 {
			continue
		}
		qs := make([]Q, len(live))
		for i, c := range live {
			qs[i] = c.q
		}
		ctx, cancel := context.WithTimeout(b.ctx, batchFor)
		s := &sending{cancel: cancel}
		s.waiting.Store(int32(len(live)))
		for _, c := range live {
			c.sent.Store(s)
			if c.state.Load() == callLeft {
				c.left() // it left before it knew where it went
			}
		}
		as, err := b.run(ctx, qs)
		cancel()
		if err == nil && len(as) != len(qs) {
			err = fmt.Errorf("pgledger: %d answers to %d calls", len(as), len(qs))
		}
		for i, c := range live {
			if err != nil {
				c.err = err
			} else {
				c.a = as[i]
			}
			if c.state.CompareAndSwap(callPending, callAnswered) {
				close(c.done)
			} else if err == nil && b.drop != nil {
				ctx, cancel := context.WithTimeout(b.ctx, batchFor)
				b.drop(ctx, c.q, c.a)
				cancel()
			}
		}
	}
}

// close ends the batch: the statement in flight is cancelled, its callers
// get the error, and later calls are sent alone, each under its caller's
// context.
func (b *batch[Q, A]) close() {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	b.cancel()
	b.wg.Wait()
}
