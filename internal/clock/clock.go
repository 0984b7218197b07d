// Package clock is the time source the Manager reads: the real one, and a
// fake one that tests advance by hand, so no test sleeps to wait for a state.
package clock

import (
	"sort"
	"sync"
	"time"
)

// Clock tells the time and makes timers.
type Clock interface {
	Now() time.Time
	NewTimer(d time.Duration) Timer
}

// Timer fires once on C unless stopped first; Stop prevents that and
// reports whether it did so. It is an alias of an unnamed interface so
// that the root package can declare the same type without naming this
// package in its API: a bgtask.Clock and a Clock are then one method set.
type Timer = interface {
	C() <-chan time.Time
	Stop() bool
}

// Real is the wall clock.
type Real struct{}

// Now returns time.Now().
func (Real) Now() time.Time { return time.Now() }

// NewTimer returns a time.Timer.
func (Real) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (r realTimer) C() <-chan time.Time { return r.t.C }
func (r realTimer) Stop() bool          { return r.t.Stop() }

// Fake is a clock that moves only when Advance is called. Its zero value is
// not usable; call NewFake.
type Fake struct {
	mu      sync.Mutex // guards now, timers, added
	now     time.Time
	timers  []*fakeTimer
	added   chan struct{} // closed and replaced whenever a timer is made
	created int
}

// NewFake returns a fake clock reading start.
func NewFake(start time.Time) *Fake {
	return &Fake{now: start, added: make(chan struct{})}
}

// Now returns the fake time.
func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

// NewTimer makes a timer that fires when the fake time reaches now+d.
func (f *Fake) NewTimer(d time.Duration) Timer {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := &fakeTimer{f: f, when: f.now.Add(d), c: make(chan time.Time, 1)}
	if d <= 0 {
		t.c <- f.now
		t.fired = true
	} else {
		f.timers = append(f.timers, t)
	}
	f.created++
	close(f.added)
	f.added = make(chan struct{})
	return t
}

// Advance moves the time forward by d and fires every timer that is due, in
// order of their deadlines.
func (f *Fake) Advance(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(d)
	sort.SliceStable(f.timers, func(i, j int) bool { return f.timers[i].when.Before(f.timers[j].when) })
	kept := f.timers[:0]
	for _, t := range f.timers {
		if !t.when.After(f.now) {
			t.fired = true
			t.c <- t.when
			continue
		}
		kept = append(kept, t)
	}
	for i := len(kept); i < len(f.timers); i++ {
		f.timers[i] = nil
	}
	f.timers = kept
}

// Pending reports how many timers are waiting to fire.
func (f *Fake) Pending() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.timers)
}

// Created reports how many timers were made so far, and a channel closed
// when the next one is made: a test waits for a timer without sleeping.
func (f *Fake) Created() (int, <-chan struct{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.created, f.added
}

type fakeTimer struct {
	f     *Fake
	when  time.Time
	c     chan time.Time
	fired bool
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

func (t *fakeTimer) Stop() bool {
	t.f.mu.Lock()
	defer t.f.mu.Unlock()
	if t.fired {
		return false
	}
	for i, o := range t.f.timers {
		if o == t {
			t.f.timers = append(t.f.timers[:i], t.f.timers[i+1:]...)
			t.fired = true
			return true
		}
	}
	return false
}
