package riverbench

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// riverTuning is how a River client is configured: its queue's workers,
// and its fetch cooldown and poll interval (0: River's default, 100 ms and
// 1 s).
type riverTuning struct {
	workers        int
	cooldown, poll time.Duration
}

// nothingArgs is the job of a River lifecycle: it does nothing.
type nothingArgs struct{}

func (nothingArgs) Kind() string { return "riverbench_nothing" }

// nothingWorker works a nothingArgs: it returns nil at once.
type nothingWorker struct {
	river.WorkerDefaults[nothingArgs]
}

func (nothingWorker) Work(context.Context, *river.Job[nothingArgs]) error { return nil }

// runRiver is a River system: a lifecycle is an Insert of a job (its own
// transaction, as Client.Insert makes it) and the wait until the client's
// subscription tells that the job completed, which River sends once the
// completion is written, and which costs the server nothing more.
func runRiver(t riverTuning) func(ctx context.Context, s *server, p plan) (figures, error) {
	return func(ctx context.Context, s *server, p plan) (_ figures, rerr error) {
		c := &counter{}
		pool, err := s.pool(ctx, riverDB(), p.conns, c)
		if err != nil {
			return figures{}, err
		}
		defer pool.Close()
		migrator, err := rivermigrate.New(riverpgxv5.New(pool), nil)
		if err != nil {
			return figures{}, err
		}
		if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
			return figures{}, fmt.Errorf("river's migrations: %w", err)
		}
		workers := river.NewWorkers()
		river.AddWorker(workers, nothingWorker{})
		client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
			Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: t.workers}},
			Workers:           workers,
			FetchCooldown:     t.cooldown,
			FetchPollInterval: t.poll,
			Logger:            slog.New(slog.DiscardHandler),
		})
		if err != nil {
			return figures{}, err
		}
		// The channel holds at most one event per lifecycle in flight (a
		// lifecycle ends when its event is read), so with room for more
		// than that no event is dropped.
		events, unsubscribe := client.SubscribeConfig(&river.SubscribeConfig{
			ChanSize: max(1000, 2*p.inflight),
			Kinds: []river.EventKind{river.EventKindJobCompleted, river.EventKindJobFailed, river.EventKindJobCancelled,
				river.EventKindJobSnoozed, river.EventKindJobInterrupted},
		})
		defer unsubscribe()
		ends := newJobEnds()
		quit := make(chan struct{})
		var dispatch sync.WaitGroup
		dispatch.Add(1)
		go func() { defer dispatch.Done(); ends.dispatch(events, quit) }()
		defer func() { close(quit); dispatch.Wait() }()
		if err := client.Start(ctx); err != nil {
			return figures{}, err
		}
		defer func() {
			stop, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := client.Stop(stop); err != nil && rerr == nil {
				rerr = fmt.Errorf("stopping River's client: %w", err)
			}
		}()
		life := func(ctx context.Context, _ int) error {
			res, err := client.Insert(ctx, nothingArgs{}, nil)
			if err != nil {
				return err
			}
			return ends.wait(ctx, res.Job.ID)
		}
		if _, err := drive(ctx, p.warm, p.inflight, life); err != nil {
			return figures{}, fmt.Errorf("warming up: %w", err)
		}
		var ended int
		f, err := s.measure(ctx, p.count, c, func() (err error) {
			ended, err = drive(ctx, p.count, p.inflight, life)
			return err
		})
		f.ended = ended
		return f, err
	}
}

// jobEnds hands each job's end, as the subscription tells it, to the
// lifecycle waiting for it; an end that comes before its waiter (the job
// ran before Insert returned) is kept for it.
type jobEnds struct {
	mu      sync.Mutex           // guards waiting and early
	waiting map[int64]chan error // by job: the waiter's
	early   map[int64]error      // by job: ends that came first
}

func newJobEnds() *jobEnds {
	return &jobEnds{waiting: map[int64]chan error{}, early: map[int64]error{}}
}

// dispatch hands out the ends events tells of, until quit is closed or
// events is.
func (e *jobEnds) dispatch(events <-chan *river.Event, quit <-chan struct{}) {
	for {
		select {
		case <-quit:
			return
		case ev, ok := <-events:
			if !ok {
				return
			}
			var err error
			if ev.Kind != river.EventKindJobCompleted {
				err = fmt.Errorf("river: job %d: %s", ev.Job.ID, ev.Kind)
			}
			e.end(ev.Job.ID, err)
		}
	}
}

func (e *jobEnds) end(id int64, err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ch, ok := e.waiting[id]; ok {
		delete(e.waiting, id)
		ch <- err // buffered
		return
	}
	e.early[id] = err
}

// wait waits for job id's end: nil once it completed.
func (e *jobEnds) wait(ctx context.Context, id int64) error {
	e.mu.Lock()
	if err, ok := e.early[id]; ok {
		delete(e.early, id)
		e.mu.Unlock()
		return err
	}
	ch := make(chan error, 1)
	e.waiting[id] = ch
	e.mu.Unlock()
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		return fmt.Errorf("river: job %d never ended: %w", id, ctx.Err())
	}
}
