// Package slots hands out concurrency slots per key, first come first
// served, with waiters that can leave the queue at any time in O(1).
//
// It does no locking of its own: the Manager uses it under its lock.
package slots

import "sort"

// Waiter is one claim queued for a slot. Its zero value is not usable; New
// gives one. V is the caller's payload.
type Waiter[V any] struct {
	V          V
	key        string
	prev, next *Waiter[V]
	queued     bool
}

// Key is the key the waiter queues under.
func (w *Waiter[V]) Key() string { return w.key }

// Queued reports whether w still waits.
func (w *Waiter[V]) Queued() bool { return w.queued }

type keyState[V any] struct {
	limit      int // 0: unlimited
	running    int
	queued     int
	head, tail *Waiter[V]
}

// Pool is the set of keys. The zero value is not usable; use New.
type Pool[V any] struct {
	keys map[string]*keyState[V]
}

// New returns an empty pool.
func New[V any]() *Pool[V] { return &Pool[V]{keys: make(map[string]*keyState[V])} }

func (p *Pool[V]) state(key string, limit int) *keyState[V] {
	k := p.keys[key]
	if k == nil {
		k = &keyState[V]{}
		p.keys[key] = k
	}
	k.limit = limit
	return k
}

// Acquire takes a slot of key (limit ≤ 0: unlimited) for v and returns nil,
// or — when every slot is taken, or others already wait — queues v at the
// tail and returns its waiter.
func (p *Pool[V]) Acquire(key string, limit int, v V) *Waiter[V] {
	k := p.state(key, limit)
	if k.head == nil && (limit <= 0 || k.running < limit) {
		k.running++
		return nil
	}
	w := &Waiter[V]{V: v, key: key, prev: k.tail, queued: true}
	if k.tail != nil {
		k.tail.next = w
	} else {
		k.head = w
	}
	k.tail = w
	k.queued++
	return w
}

// Release gives back one slot of key and hands slots to the waiters at the
// head of the queue that now fit, in order, calling grant for each (they
// hold their slots). grant may call Acquire and Release.
func (p *Pool[V]) Release(key string, grant func(*Waiter[V])) {
	k := p.keys[key]
	if k == nil || k.running == 0 {
		panic("slots: release of a slot that is not held: " + key)
	}
	k.running--
	for k.head != nil && (k.limit <= 0 || k.running < k.limit) {
		w := k.head
		p.unlink(k, w)
		k.running++
		grant(w)
		if p.keys[key] != k { // grant released the last slot: k was forgotten
			return
		}
	}
	p.gc(key, k)
}

// Remove takes w out of its queue, reporting whether it was still queued.
func (p *Pool[V]) Remove(w *Waiter[V]) bool {
	if w == nil || !w.queued {
		return false
	}
	k := p.keys[w.key]
	p.unlink(k, w)
	p.gc(w.key, k)
	return true
}

// Position is w's 1-based place in its queue, 0 if it no longer waits.
func (p *Pool[V]) Position(w *Waiter[V]) int {
	if w == nil || !w.queued {
		return 0
	}
	n := 1
	for o := w.prev; o != nil; o = o.prev {
		n++
	}
	return n
}

func (p *Pool[V]) unlink(k *keyState[V], w *Waiter[V]) {
	if w.prev != nil {
		w.prev.next = w.next
	} else {
		k.head = w.next
	}
	if w.next != nil {
		w.next.prev = w.prev
	} else {
		k.tail = w.prev
	}
	w.prev, w.next, w.queued = nil, nil, false
	k.queued--
}

// gc forgets a key with nothing running or queued.
func (p *Pool[V]) gc(key string, k *keyState[V]) {
	if k.running == 0 && k.head == nil {
		delete(p.keys, key)
	}
}

// Stat is one key's state.
type Stat struct {
	Key     string
	Running int
	Queued  int
	Limit   int
}

// Queued returns how many wait for a slot of key.
func (p *Pool[V]) Queued(key string) int {
	if k := p.keys[key]; k != nil {
		return k.queued
	}
	return 0
}

// Stats returns every key with something running or queued, by key.
func (p *Pool[V]) Stats() []Stat {
	out := make([]Stat, 0, len(p.keys))
	for key, k := range p.keys {
		out = append(out, Stat{Key: key, Running: k.running, Queued: k.queued, Limit: k.limit})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}
