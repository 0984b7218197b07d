// Package dispatch delivers items one at a time per key, in the order they
// were pushed, with different keys proceeding independently.
//
// The Manager pushes under its own lock (so the push order is the order in
// which changes were applied) and a lane's worker delivers with no lock held.
package dispatch

import (
	"context"
	"slices"
	"sync"
)

// Lanes holds one FIFO lane per key. A lane has at most one worker; the
// worker exits when its lane is empty, and the next Push starts a new one.
type Lanes[T any] struct {
	spawn   func(func()) bool
	deliver func(key string, item T)
	limit   int                 // items a lane may hold waiting; 0: no bound
	victim  func(items []T) int // which waiting item a full lane gives up

	mu      sync.Mutex // guards lanes, working, idle
	lanes   map[string]*lane[T]
	working int           // lanes with a worker
	idle    chan struct{} // closed when working drops to zero; nil while nobody waits
}

type lane[T any] struct {
	items   []T
	working bool
}

// New returns Lanes that start workers with spawn (which reports false when
// no goroutine may be started any more) and hand each item to deliver.
func New[T any](spawn func(func()) bool, deliver func(key string, item T)) *Lanes[T] {
	return &Lanes[T]{spawn: spawn, deliver: deliver, lanes: make(map[string]*lane[T])}
}

// SetLimit bounds how many items one lane holds waiting (the one being
// delivered not counted); 0 means no bound. When a full lane takes a new
// item, victim picks the index of the waiting item it gives up (nil: the
// oldest). Call it before the first Push.
func (l *Lanes[T]) SetLimit(n int, victim func(items []T) int) {
	l.limit, l.victim = max(n, 0), victim
}

// Push appends item to key's lane. It never calls deliver itself, so it is
// safe to call while holding a lock that deliver's callee may take. When
// the lane is full (SetLimit), its oldest waiting item is taken out to make
// room and returned as old, with evicted true: the caller decides what
// becomes of it. ok is false when no worker could be started (spawn
// refused): the item stays pending and is counted by Pending.
func (l *Lanes[T]) Push(key string, item T) (old T, evicted, ok bool) {
	l.mu.Lock()
	ln := l.lanes[key]
	if ln == nil {
		ln = &lane[T]{}
		l.lanes[key] = ln
	}
	if l.limit > 0 && len(ln.items) >= l.limit {
		i := 0
		if l.victim != nil {
			i = min(max(l.victim(ln.items), 0), len(ln.items)-1)
		}
		old, evicted = ln.items[i], true
		ln.items = slices.Delete(ln.items, i, i+1)
	}
	ln.items = append(ln.items, item)
	if ln.working {
		l.mu.Unlock()
		return old, evicted, true
	}
	ln.working = true
	l.working++
	l.mu.Unlock()
	if !l.spawn(func() { l.work(key, ln) }) {
		l.mu.Lock()
		ln.working = false
		l.stopped()
		l.mu.Unlock()
		return old, evicted, false
	}
	return old, evicted, true
}

// stopped counts a worker out. l.mu is held.
func (l *Lanes[T]) stopped() {
	l.working--
	if l.working == 0 && l.idle != nil {
		close(l.idle)
		l.idle = nil
	}
}

// Wait blocks until no lane has a worker — everything pushed was handed to
// deliver — or ctx ends.
func (l *Lanes[T]) Wait(ctx context.Context) error {
	for {
		l.mu.Lock()
		if l.working == 0 {
			l.mu.Unlock()
			return nil
		}
		if l.idle == nil {
			l.idle = make(chan struct{})
		}
		idle := l.idle
		l.mu.Unlock()
		select {
		case <-idle:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (l *Lanes[T]) work(key string, ln *lane[T]) {
	for {
		l.mu.Lock()
		if len(ln.items) == 0 {
			ln.working = false
			if l.lanes[key] == ln {
				delete(l.lanes, key)
			}
			l.stopped()
			l.mu.Unlock()
			return
		}
		item := ln.items[0]
		var zero T
		ln.items[0] = zero
		ln.items = ln.items[1:]
		l.mu.Unlock()
		l.deliver(key, item)
	}
}

// Pending reports how many items are pushed and not yet handed to deliver.
func (l *Lanes[T]) Pending() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, ln := range l.lanes {
		n += len(ln.items)
	}
	return n
}
