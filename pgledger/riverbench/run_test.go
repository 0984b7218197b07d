package riverbench

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// plan is how a system is run: count lifecycles measured (commits, for
// the floor), after warm unmeasured ones, inflight at a time, on pools of
// conns connections at most.
type plan struct {
	count, warm, inflight int
	conns                 int32
}

// system is one of the systems compared: run sets it up on the server,
// warms it, measures p.count lifecycles, and takes it down.
type system struct {
	name string
	run  func(ctx context.Context, s *server, p plan) (figures, error)
}

// figures is what one system's measured lifecycles (the floor's commits)
// cost: time, the server's CPU time, WAL, statements, and this process's
// CPU time.
type figures struct {
	name  string
	count int
	took  time.Duration
	db    time.Duration // the server's CPU time; -1 if it is not on this machine
	self  time.Duration // this process's
	wal   int64         // bytes
	stmts int64
	// ended is how many lifecycles ended as they should (a job completed,
	// a task completed and both its notifications delivered); dups how
	// many notifications came twice (pgledger).
	ended, dups int
	// tail (pgledger) is how long the deliveries went on after the last
	// task ended: part of took.
	tail time.Duration
}

func (f figures) rate() float64      { return float64(f.count) / f.took.Seconds() }
func (f figures) dbPer() float64     { return micros(f.db) / float64(f.count) }
func (f figures) selfPer() float64   { return micros(f.self) / float64(f.count) }
func (f figures) walPer() float64    { return float64(f.wal) / float64(f.count) }
func (f figures) stmtsPer() float64  { return float64(f.stmts) / float64(f.count) }
func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// measure runs one measured section: run must return once every one of
// count lifecycles has ended.
func (s *server) measure(ctx context.Context, count int, c *counter, run func() error) (figures, error) {
	from, err := s.mark(ctx, c, true)
	if err != nil {
		return figures{}, err
	}
	if err := run(); err != nil {
		return figures{}, err
	}
	to, err := s.mark(ctx, c, false)
	if err != nil {
		return figures{}, err
	}
	return s.figures(ctx, count, from, to)
}

// drive runs count lifecycles, life(ctx, i) for each i in [0, count),
// inflight at a time, and returns how many ended without error, and the
// first error: after it no lifecycle starts, and the others' contexts are
// cancelled.
func drive(ctx context.Context, count, inflight int, life func(ctx context.Context, i int) error) (int, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var next, ended atomic.Int64
	var wg sync.WaitGroup
	for range min(inflight, count) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := next.Add(1) - 1; i < int64(count) && ctx.Err() == nil; i = next.Add(1) - 1 {
				if err := life(ctx, int(i)); err != nil {
					cancel(err)
					return
				}
				ended.Add(1)
			}
		}()
	}
	wg.Wait()
	return int(ended.Load()), context.Cause(ctx)
}
