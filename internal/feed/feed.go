// Package feed fans values out to subscribers without ever blocking the
// publisher: each subscriber has a buffer, and one whose buffer is full
// when a value comes is ended with the error the owner gives for lagging
// (its consumer resyncs from a snapshot), never waited for.
//
// A Feed is not safe for concurrent use: its owner guards it (the Manager,
// with its lock). A Sub's channel is read without it.
package feed

// Feed is a set of subscribers. The zero value is not usable; call New.
type Feed[T any] struct {
	subs   map[*Sub[T]]struct{}
	lagged error
}

// Sub is one subscriber.
type Sub[T any] struct {
	ch   chan T
	done chan struct{} // closed with ch
	err  error
}

// New returns a Feed that ends a lagging subscriber with lagged.
func New[T any](lagged error) *Feed[T] {
	return &Feed[T]{subs: make(map[*Sub[T]]struct{}), lagged: lagged}
}

// Add subscribes with a buffer of n values (n ≥ 1).
func (f *Feed[T]) Add(n int) *Sub[T] {
	s := &Sub[T]{ch: make(chan T, max(n, 1)), done: make(chan struct{})}
	f.subs[s] = struct{}{}
	return s
}

// Len reports how many subscribers there are.
func (f *Feed[T]) Len() int { return len(f.subs) }

// Publish hands v to every subscriber; one whose buffer is full is ended
// with the lagged error.
func (f *Feed[T]) Publish(v T) {
	for s := range f.subs {
		select {
		case s.ch <- v:
		default:
			f.End(s, f.lagged)
		}
	}
}

// End ends s with err (nil: closed by its consumer), once: its channel is
// closed after the values already in its buffer.
func (f *Feed[T]) End(s *Sub[T], err error) {
	if _, ok := f.subs[s]; !ok {
		return
	}
	delete(f.subs, s)
	s.err = err
	close(s.ch)
	close(s.done)
}

// EndAll ends every subscriber with err.
func (f *Feed[T]) EndAll(err error) {
	for s := range f.subs {
		f.End(s, err)
	}
}

// C is the channel the subscriber receives from.
func (s *Sub[T]) C() <-chan T { return s.ch }

// Done is closed when the subscription ends.
func (s *Sub[T]) Done() <-chan struct{} { return s.done }

// Err says why it ended (read under the owner's guard); nil while open or
// when closed by its consumer.
func (s *Sub[T]) Err() error { return s.err }
