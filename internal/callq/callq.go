// Package callq runs a stream of blocking calls on a bounded set of worker
// goroutines and hands their answers back for recording in batches.
//
// The Manager uses it for host aborts. Three needs decide its shape:
//
//   - A host that answers at once should not pay for many goroutines
//     fighting over the Manager's lock, so a worker is added only when every
//     worker is inside a call while items wait: a quick host keeps one or
//     two, and a slow or hung one grows the set to the bound.
//   - An answer never waits behind an unrelated call. Workers only call;
//     answers are recorded by a recorder goroutine, started when an answer
//     lands and none runs, which records everything landed until nothing
//     is left. It makes no call, so a hung call delays no answer.
//   - The owner may Take answers itself, under its own lock, while it is
//     still adding work: what it just touched is recorded while hot in
//     cache, and a recorder waiting for that lock is not needed.
package callq

import "sync"

// Queue runs call for each added item. The zero value is not usable; call
// New.
type Queue[T any] struct {
	max    int
	add    func(func()) bool // starts a worker from Add (the owner's side)
	spawn  func(func()) bool // starts a worker or recorder from a worker
	call   func(T)
	record func([]T)

	mu        sync.Mutex // guards everything below; never held across call or record
	items     []T        // added, not yet taken by a worker
	next      int        // index of the next item to call
	landed    []T        // answered, not yet recorded
	spare     []T        // a recorded batch's storage, reused for landed
	workers   int        // running workers
	inCall    int        // workers inside call
	recording bool       // a recorder runs
}

// New returns a queue running at most max workers. A worker Add needs is
// started with add, one a worker needs (another worker, a recorder) with
// spawn; each reports false when it can start no goroutine. (The owner
// calls Add under its own lock: add may queue the start for when it is
// released.) call makes one call; record is given answered items, by one
// goroutine at a time.
func New[T any](max int, add, spawn func(func()) bool, call func(T), record func([]T)) *Queue[T] {
	if max < 1 {
		max = 1
	}
	return &Queue[T]{max: max, add: add, spawn: spawn, call: call, record: record}
}

// Add queues every item of vs, with one hand-over for all of them. It
// reports false, queuing nothing, when no worker runs and none could be
// started: the caller must settle them itself. The owner serializes its
// calls to Add.
func (q *Queue[T]) Add(vs ...T) bool {
	if len(vs) == 0 {
		return true
	}
	q.mu.Lock()
	q.items = append(q.items, vs...)
	idle := q.workers == 0
	start := idle || (q.inCall == q.workers && q.workers < q.max)
	if start {
		q.workers++
	}
	q.mu.Unlock()
	if !start || q.add(q.work) {
		return true
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.workers--
	if !idle {
		// A worker ran when vs was queued: it takes vs before it can find
		// the queue empty and leave (it may have done both meanwhile).
		return true
	}
	// No worker ran and none started: vs is still at the tail (the owner
	// serializes its adds).
	clear(q.items[len(q.items)-len(vs):])
	q.items = q.items[:len(q.items)-len(vs)]
	return false
}

// Take appends to buf, and returns, the answered items no recorder has
// taken yet. The caller records them.
func (q *Queue[T]) Take(buf []T) []T {
	q.mu.Lock()
	defer q.mu.Unlock()
	buf = append(buf, q.landed...)
	clear(q.landed)
	q.landed = q.landed[:0]
	return buf
}

// Workers reports how many workers run now.
func (q *Queue[T]) Workers() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.workers
}

func (q *Queue[T]) work() {
	q.mu.Lock()
	for {
		v, ok := q.takeLocked()
		if !ok {
			return
		}
		q.call(v)
		q.mu.Lock()
		q.landLocked(v)
	}
}

// takeLocked hands a worker the next item, growing the set of workers when
// every worker is inside a call and items still wait. It reports false,
// counting the worker out, when nothing is left. q.mu is held on entry
// and released on return.
func (q *Queue[T]) takeLocked() (T, bool) {
	var zero T
	if q.next == len(q.items) {
		q.workers--
		q.items, q.next = q.items[:0], 0
		q.mu.Unlock()
		return zero, false
	}
	v := q.items[q.next]
	q.items[q.next] = zero
	q.next++
	q.inCall++
	grow := q.inCall == q.workers && q.next < len(q.items) && q.workers < q.max
	if grow {
		q.workers++
	}
	q.mu.Unlock()
	if grow && !q.spawn(q.work) {
		q.mu.Lock()
		q.workers--
		q.mu.Unlock()
	}
	return v, true
}

// landLocked queues v's answer and starts a recorder if none runs; if
// none can be started, the worker records itself. q.mu is held on entry
// and on return.
func (q *Queue[T]) landLocked(v T) {
	q.inCall--
	q.landed = append(q.landed, v)
	if q.recording {
		return
	}
	q.recording = true
	q.mu.Unlock()
	if !q.spawn(q.recordAll) {
		q.recordAll()
	}
	q.mu.Lock()
}

// recordAll records every landed answer until none is left.
func (q *Queue[T]) recordAll() {
	q.mu.Lock()
	for len(q.landed) > 0 {
		batch := q.landed
		q.landed = q.spare[:0]
		q.spare = nil
		q.mu.Unlock()
		q.record(batch)
		clear(batch)
		q.mu.Lock()
		q.spare = batch[:0]
	}
	q.recording = false
	q.mu.Unlock()
}
