// Package signal keeps the wake-up channels of one task's waiters: the
// next change, the end of the task, and the end of one run. A channel is
// made only when someone waits on it, and closed exactly once.
//
// A Set is not safe for concurrent use: the Manager guards it with its
// lock; the channels it hands out are read without it.
package signal

// Closed is a channel closed from the start, returned to a waiter of
// something that already happened.
var Closed = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// Set is one task's signals. The zero value is ready to use.
type Set struct {
	changed chan struct{} // closed and cleared at every change; nil while nobody waits
	done    chan struct{} // closed when the task ends
	run     chan struct{} // closed when the run named runKey ends or is replaced
	runKey  string
}

// Changed returns a channel closed at the next change (Change).
func (s *Set) Changed() <-chan struct{} {
	if s.changed == nil {
		s.changed = make(chan struct{})
	}
	return s.changed
}

// Change wakes the waiters of Changed.
func (s *Set) Change() {
	if s.changed != nil {
		close(s.changed)
		s.changed = nil
	}
}

// Done returns a channel closed when the task ends (End); ended says it
// has already.
func (s *Set) Done(ended bool) <-chan struct{} {
	if ended {
		return Closed
	}
	if s.done == nil {
		s.done = make(chan struct{})
	}
	return s.done
}

// End wakes the waiters of Done. Call it once, as the task ends.
func (s *Set) End() {
	if s.done != nil && s.done != Closed {
		close(s.done)
		s.done = Closed // the task's own channel goes; Done returns Closed from now on
	}
}

// Run returns a channel closed when run key ends or is replaced (RunOver);
// over says it has already.
func (s *Set) Run(key string, over bool) <-chan struct{} {
	if over {
		return Closed
	}
	if s.run == nil || s.runKey != key {
		if s.run != nil {
			close(s.run) // another run is asked for: the one it was made for is replaced
		}
		s.run, s.runKey = make(chan struct{}), key
	}
	return s.run
}

// RunOver wakes the waiters of Run for the run it was made for, if over
// says that run has ended or been replaced.
func (s *Set) RunOver(over func(key string) bool) {
	if s.run != nil && over(s.runKey) {
		close(s.run)
		s.run, s.runKey = nil, ""
	}
}

// Made returns the channel Done made for a waiter (Closed once End let it
// go), or nil if none waited: for checks that a waiter made before the
// end was released.
func (s *Set) Made() <-chan struct{} { return s.done }
