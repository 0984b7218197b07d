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
)

// Group counts running goroutines. The zero value is ready to use.
type Group struct {
	mu      sync.Mutex // guards n, closed, idle, changed
	n       int
	closed  bool
	idle    chan struct{} // closed when n drops to zero; nil while nobody waits
	changed chan struct{} // closed when n changes; nil while nobody waits
}

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
// on) free, job runs on w once its current job returns; otherwise on a new
// goroutine.
func (g *Group) Start(w *Worker, job Job) {
	if w != nil && w.next == nil {
		w.next = job
		g.done() // w itself is counted while it runs
		return
	}
	go func() {
		defer g.done()
		w := &Worker{next: job}
		for w.next != nil {
			job := w.next
			w.next = nil
			job.Run(w)
		}
	}()
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

// Close makes every later Go refuse. Goroutines already running go on.
func (g *Group) Close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}
