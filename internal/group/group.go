// Package group tracks the goroutines a Manager owns.
//
// A Group is a counter kept under a mutex rather than a sync.WaitGroup: the
// Manager starts goroutines (aborts, deliveries) while it is already shutting
// down, and WaitGroup forbids an Add that races a Wait. Here Go may be called
// at any time until Close, and Wait returns when the count reaches zero.
package group

import (
	"context"
	"sync"
	"time"
)

// Group counts running goroutines. The zero value is ready to use.
//
// A goroutine that ran reserved work (Start) does not exit at once: it
// waits up to IdleTimeout for the next Start to hand it a job, so a stream
// of short jobs reuses goroutines whose stacks have already grown. A
// waiting goroutine is not counted as running; Close ends the waiting ones
// and returns once they are gone.
type Group struct {
	mu      sync.Mutex // guards n, closed, idle, changed, parked, quit
	n       int
	closed  bool
	idle    chan struct{}  // closed when n drops to zero; nil while nobody waits
	changed chan struct{}  // closed when n changes; nil while nobody waits
	parked  []chan Job     // goroutines waiting for a job, newest last
	quit    chan struct{}  // closed by Close: waiting goroutines exit
	waiting sync.WaitGroup // goroutines in the waiting state (parked, or leaving it)
}

// IdleTimeout is how long a goroutine that finished its work waits for
// more before it exits; MaxIdle bounds how many wait at once. MaxIdle is
// sized for a harness's burst of concurrent tasks (dozens of chats, each
// with starts and aborts in flight): with 4, most effects of 32
// concurrent lifecycles started a goroutine of their own and grew its
// stack again (a quarter of the journaled lifecycle's throughput went to
// it). 64 idle goroutines cost at most a few MiB of stack, for 250 ms.
const (
	IdleTimeout = 250 * time.Millisecond
	MaxIdle     = 64
)

// Changed returns the number running now and a channel closed the next time
// it changes.
func (g *Group) Changed() (int, <-chan struct{}) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.changed == nil {
		g.changed = make(chan struct{})
	}
	return g.n, g.changed
}

func (g *Group) bump() {
	if g.changed != nil {
		close(g.changed)
		g.changed = nil
	}
}

// Go runs f on a new goroutine and reports true, or reports false without
// running f once the group is closed.
func (g *Group) Go(f func()) bool {
	if !g.Reserve() {
		return false
	}
	go func() {
		defer g.done()
		f()
	}()
	return true
}

// Reserve counts one goroutine that Start will run, and reports true; or,
// once the group is closed, reports false and counts nothing. A goroutine
// reserved counts as running (Wait waits for it) from Reserve on, so an
// owner can decide under its own lock what to start and start it once the
// lock is released, without a Wait that sees zero in between.
func (g *Group) Reserve() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return false
	}
	g.n++
	g.bump()
	return true
}

// Release gives back a reservation that will not be started.
func (g *Group) Release() { g.done() }

// Worker is a goroutine of the group running reserved work. While it runs
// a function, it may take one more to run when that function returns
// (Start with it): a chain of calls that each set off the next runs on one
// goroutine, one after the other, with no new goroutine and no recursion.
type Worker struct {
	next Job
}

// Job is work a Worker runs; w is the worker running it.
type Job interface{ Run(w *Worker) }

// Start runs job, which was reserved. With w (the worker the caller runs
// on) free, job runs on w once its current job returns; otherwise on a
// waiting goroutine of the group, or a new one.
func (g *Group) Start(w *Worker, job Job) {
	if w != nil && w.next == nil {
		w.next = job
		g.done() // w itself is counted while it runs
		return
	}
	g.mu.Lock()
	if k := len(g.parked); k > 0 {
		jobs := g.parked[k-1]
		g.parked[k-1] = nil
		g.parked = g.parked[:k-1]
		g.mu.Unlock()
		jobs <- job // it waits for exactly this send
		return
	}
	if g.quit == nil {
		g.quit = make(chan struct{})
	}
	g.mu.Unlock()
	go g.work(job)
}

// work runs job and what follows it on one goroutine, then waits for the
// next job (see IdleTimeout).
func (g *Group) work(job Job) {
	jobs := make(chan Job)
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	w := new(Worker) // one per goroutine, for all its jobs
	for {
		w.next = job
		for w.next != nil {
			job := w.next
			w.next = nil
			job.Run(w)
		}
		g.done()
		g.mu.Lock()
		if g.closed || len(g.parked) >= MaxIdle {
			g.mu.Unlock()
			return
		}
		g.parked = append(g.parked, jobs)
		g.waiting.Add(1) // under g.mu, before Close can see closed
		quit := g.quit
		g.mu.Unlock()
		if t == nil {
			t = time.NewTimer(IdleTimeout)
		} else {
			t.Reset(IdleTimeout)
		}
		select {
		case job = <-jobs:
			t.Stop()
			g.waiting.Done()
			continue
		case <-t.C:
		case <-quit:
		}
		if !g.unpark(jobs) {
			job = <-jobs // a Start took it meanwhile: the job is on its way
			g.waiting.Done()
			continue
		}
		g.waiting.Done()
		return
	}
}

// unpark takes jobs out of the waiting list; false if a Start took it
// first.
func (g *Group) unpark(jobs chan Job) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for i, c := range g.parked {
		if c == jobs {
			g.parked = append(g.parked[:i], g.parked[i+1:]...)
			return true
		}
	}
	return false
}

func (g *Group) done() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.n--
	g.bump()
	if g.n == 0 && g.idle != nil {
		close(g.idle)
		g.idle = nil
	}
}

// Running reports how many goroutines are running now.
func (g *Group) Running() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
}

// Wait blocks until no goroutine of the group is running, or ctx ends.
// Goroutines started by goroutines of the group are waited for too.
func (g *Group) Wait(ctx context.Context) error {
	for {
		g.mu.Lock()
		if g.n == 0 {
			g.mu.Unlock()
			return nil
		}
		if g.idle == nil {
			g.idle = make(chan struct{})
		}
		idle := g.idle
		g.mu.Unlock()
		select {
		case <-idle:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Close makes every later Go, Reserve and Start refuse, and ends the
// goroutines waiting for work; it returns once they have exited.
// Goroutines already running go on (their work then ends them).
func (g *Group) Close() {
	g.mu.Lock()
	g.closed = true
	if g.quit != nil {
		select {
		case <-g.quit:
		default:
			close(g.quit)
		}
	}
	g.mu.Unlock()
	g.waiting.Wait() // each waiting goroutine leaves: it exits, or has a job
}
