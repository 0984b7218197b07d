package bgtasktest

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/probe"
)

// TaskBuild describes a task for BuildTask and Load: how it was launched,
// and its attempts, in order. Its launch fields are the Spec fields of the
// same names, and reach the task as a Launch with them sets them.
type TaskBuild struct {
	// ID is the task's id (Spec.ID): at most 512 bytes of valid UTF-8,
	// with no white space or control character; a build with another is
	// refused with the *bgtask.SpecError that names the field. "": the
	// Manager's IDGenerator makes one — "task-1", "task-2", ... in the
	// order of the builds that set none, unless Load's options set
	// another generator.
	ID string
	// ParentSessionID is the task's parent ("": "chat").
	ParentSessionID string
	// Description, Agent, Prompt and Metadata are the launch's
	// (Spec.Description, Spec.Agent, Spec.Prompt, Spec.Metadata).
	Description string
	Agent       string
	Prompt      string
	Metadata    map[string]string
	// LaunchedAt is when it was launched; the attempts' times follow from
	// it and their Took. Zero: 2026-01-01 00:00 UTC for BuildTask and for
	// Load's first build; for a later build of Load, the time the build
	// before it left the clock. Load's builds share one clock, which
	// only moves forward: a later build's LaunchedAt may not be earlier.
	LaunchedAt time.Time
	// Attempts are its attempts, at least one. Every attempt but the last
	// ended in error (a failure the task retried); the last may have any
	// status.
	Attempts []AttemptBuild
}

// AttemptBuild is one attempt of a built task.
type AttemptBuild struct {
	// Model is its model (zero: ID "model-N" for attempt N).
	Model bgtask.Model
	// Status is how it stands: error for every attempt but the last; the
	// last may be pending (its session start never answered: see Load),
	// running, completed, error, cancelled or interrupt.
	Status bgtask.Status
	// Took is how long it ran before it ended (or, running, before the
	// build returned: a running task of Load keeps running while the
	// later builds move the clock on).
	Took time.Duration
	// Result is a completed attempt's answer.
	Result string
	// Err is a failed attempt's error (nil: "500 Internal Server Error").
	// It must be one the Manager retries, but for the last attempt's.
	Err error
}

// BuildTask returns the snapshot a Manager keeps of a task whose attempts
// went as b says, for tests of code that renders or maps snapshots: a
// real Manager runs it on a Clock and this package's Host, so every field
// is as bgtask sets it — the ids (b.ID or "task-1", "attempt-N",
// "ses-N"), the times, the Timeline, the Outcome and its Envelope. It is
// Load with b alone, whose Manager it shuts down once it took the
// snapshot. It returns an error for a b that no task can go through, or
// whose ID is invalid.
func BuildTask(b TaskBuild) (bgtask.Task, error) {
	r, err := load(context.Background(), "bgtasktest: BuildTask", false, []TaskBuild{b}, nil)
	if err != nil {
		return bgtask.Task{}, err
	}
	r.shutdown()
	return r.built[0], nil
}

// Load returns a Manager holding exactly the tasks builds describe, in
// their order, for tests of code that reads a *bgtask.Manager (Task,
// Tasks, Snapshot, Wait, Subscribe, an HTTP handler on it):
//
//	m, err := bgtasktest.Load(ctx, []bgtasktest.TaskBuild{done, failed, running})
//	defer m.Shutdown(ctx)
//
// The caller shuts it down. Load runs each build on that Manager, one
// after the other, as BuildTask runs one: it launches the task with the
// build's Spec fields and takes its attempts through the statuses the
// build gives, on a Clock and a Host of this package. Each task is thus
// as the Manager keeps a real one — its id, statuses, attempts, times,
// Timeline and Outcome — and the builds share the clock, the host's
// session ids ("ses-N") and the attempt ids ("attempt-N").
//
// A live task stays live, and honest. A running one runs a session of
// the host, which confirms every abort: Stop ends it cancelled, Shutdown
// interrupt, and events Observe gets for its session (Task.SessionID) end
// it as they would any. A pending one's session start never answers
// until a stop of the task is asked (Stop, Shutdown): the start then
// answers, and the session is aborted at once.
//
// opts are added after Load's own options — its Clock, its Metrics
// (which hear the stops a pending task waits for), SequentialIDs, and a
// retry policy that retries every failure at once — so a test can give
// the Manager a Notifier (told of the builds as they go), a Logger, an
// IDGenerator, a Journal that holds no task, Metrics of its own (with no
// pending build). Load checks that each build went as built, and refuses
// an option that changed one, with an error naming the build and what it
// became instead: another Clock, a failure not retried (WithRetryable, or
// a bgtask.Permanent Err), a retry delay, a stall timeout shorter than a
// Took, a limit that queues an attempt, a start gate, health cooldowns,
// retention that forgot a built task. After each step Load waits until
// the Manager is idle, so an option's code must not wait for the test: a
// step gives up after 10 seconds, and ctx bounds Load too.
//
// Load returns an error, and shuts down what it opened, for a build no
// task can go through, two builds with the same ID, an invalid ID (a
// *bgtask.SpecError naming it), a LaunchedAt earlier than the clock, a
// launch the Manager refuses, or a Journal that already holds tasks.
func Load(ctx context.Context, builds []TaskBuild, opts ...bgtask.Option) (*bgtask.Manager, error) {
	r, err := load(ctx, "bgtasktest: Load", true, builds, opts)
	if err != nil {
		return nil, err
	}
	return r.m, nil
}

// stepTimeout bounds each wait of a build: for the Manager to go idle, a
// Launch, a Stop.
const stepTimeout = 10 * time.Second

// loader runs builds on one Manager: the code BuildTask and Load share.
type loader struct {
	name  string // "bgtasktest: Load": what its errors begin with
	many  bool   // several builds may run: errors name the build
	ctx   context.Context
	clk   *Clock
	reads *countingClock // clk as the Manager was given it
	host  *Host
	watch *stopWatch // the Manager's Metrics
	m     *bgtask.Manager
	built []bgtask.Task // each build's task as it ended
}

// countingClock is the loader's Clock as the Manager gets it: it counts
// the reads, which tells whether the Manager reads it at all.
type countingClock struct {
	*Clock
	n atomic.Int64
}

// Now returns the clock's time.
func (c *countingClock) Now() time.Time {
	c.n.Add(1)
	return c.Clock.Now()
}

// stopWatch is the Metrics a loader gives its Manager: a stop asked of a
// task answers its start that hangs (a pending build's), as a session
// service answers at last. It counts the launches, which tells whether
// the Manager has it at all.
type stopWatch struct {
	bgtask.NopMetrics
	host     *Host
	launched atomic.Int64
}

// TaskLaunched counts a launch.
func (w *stopWatch) TaskLaunched(bgtask.Task) { w.launched.Add(1) }

// StopAsked answers the hanging start of t, if any.
func (w *stopWatch) StopAsked(t bgtask.Task, _ bgtask.StopCause) { w.host.stopAsked(t.ID) }

// load runs builds on a new Manager and checks that each ended as built;
// on error it shuts the Manager down. Its errors begin with name, and,
// with many, name the build.
func load(ctx context.Context, name string, many bool, builds []TaskBuild, opts []bgtask.Option) (_ *loader, err error) {
	r := &loader{name: name, many: many, ctx: ctx}
	ids := map[string]int{}
	for i := range builds {
		if err := builds[i].check(); err != nil {
			return nil, fmt.Errorf("%s: %w", r.where(i, ""), err)
		}
		if id := builds[i].ID; id != "" {
			if j, ok := ids[id]; ok {
				return nil, fmt.Errorf("%s: builds %d and %d have the same ID %q", name, j+1, i+1, id)
			}
			ids[id] = i
		}
	}
	at := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	if len(builds) > 0 && !builds[0].LaunchedAt.IsZero() {
		at = builds[0].LaunchedAt
	}
	r.clk, r.host = NewClock(at), NewHost()
	r.reads, r.watch = &countingClock{Clock: r.clk}, &stopWatch{host: r.host}
	own := []bgtask.Option{bgtask.WithClock(r.reads), bgtask.WithMetrics(r.watch), bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithRetryable(func(error, bool) bool { return true })} // every failure but the last retries: MaxAttempts ends the chain
	r.m, err = bgtask.Open(ctx, r.host, append(own, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	r.host.Attach(r.m)
	defer func() {
		if err != nil {
			r.shutdown()
		}
	}()
	if n := len(r.m.Snapshot().Tasks); n > 0 {
		return nil, fmt.Errorf("%s: the Manager holds tasks before any build (%d, its Journal's): builds need an empty one", name, n)
	}
	for i := range builds {
		t, err := r.build(i, &builds[i])
		if err != nil {
			return nil, err
		}
		r.built = append(r.built, t)
	}
	return r, r.verify()
}

// where names build i (its task id, once known) in an error.
func (r *loader) where(i int, id string) string {
	switch {
	case !r.many:
		return r.name
	case id != "":
		return fmt.Sprintf("%s: build %d (%s)", r.name, i+1, id)
	}
	return fmt.Sprintf("%s: build %d", r.name, i+1)
}

// build launches b, the i-th build, and takes it through its attempts.
func (r *loader) build(i int, b *TaskBuild) (bgtask.Task, error) {
	where := r.where(i, "") // the id, once the Manager took it
	if i > 0 && !b.LaunchedAt.IsZero() {
		now := r.clk.Now()
		if b.LaunchedAt.Before(now) {
			return bgtask.Task{}, fmt.Errorf("%s: LaunchedAt %s is before %s, where the builds before it left the clock: builds run in order, on one clock",
				where, b.LaunchedAt.Format(time.RFC3339Nano), now.Format(time.RFC3339Nano))
		}
		r.clk.Advance(b.LaunchedAt.Sub(now))
		if err := r.settle(where); err != nil {
			return bgtask.Task{}, err
		}
	}
	parent := b.ParentSessionID
	if parent == "" {
		parent = "chat"
	}
	models := make([]bgtask.Model, len(b.Attempts))
	for j, a := range b.Attempts {
		models[j] = a.Model
		if models[j] == (bgtask.Model{}) {
			models[j] = bgtask.Model{ID: fmt.Sprintf("model-%d", j+1)}
		}
	}
	last := len(b.Attempts) - 1
	pending := -1 // the attempt whose start never answers
	if b.Attempts[last].Status == bgtask.StatusPending {
		pending = last
	}
	hangStart := func() { r.host.add("start", 1, step{hang: true, untilStop: true}) }
	if pending == 0 {
		hangStart()
	}
	ctx, cancel := context.WithTimeout(r.ctx, stepTimeout)
	defer cancel()
	reads, launched := r.reads.n.Load(), r.watch.launched.Load()
	task, err := r.m.Launch(ctx, bgtask.Spec{ID: b.ID, ParentSessionID: parent, Description: b.Description, Agent: b.Agent,
		Prompt: b.Prompt, Metadata: b.Metadata, Models: models, MaxAttempts: len(models)})
	if err != nil {
		return bgtask.Task{}, fmt.Errorf("%s: %w", where, err)
	}
	where = r.where(i, task.ID)
	if r.reads.n.Load() == reads {
		return bgtask.Task{}, fmt.Errorf("%s: the Manager does not read Load's clock: an option gives it another (WithClock), and builds run on Load's own", where)
	}
	if pending >= 0 && r.watch.launched.Load() == launched {
		return bgtask.Task{}, fmt.Errorf("%s: a pending build needs Load's own Metrics, which answer its session start once a stop of it is asked: an option replaces them (WithMetrics)", where)
	}
	for j, a := range b.Attempts {
		if j == pending {
			return r.expect(where, task.ID, models[:j+1], bgtask.StatusPending, fmt.Sprintf("attempt %d should be pending (awaiting its session)", j+1))
		}
		if _, err := r.expect(where, task.ID, models[:j+1], bgtask.StatusRunning, fmt.Sprintf("attempt %d should be running", j+1)); err != nil {
			return bgtask.Task{}, err
		}
		r.clk.Advance(a.Took)
		now, err := r.expect(where, task.ID, models[:j+1], bgtask.StatusRunning, fmt.Sprintf("attempt %d should still be running after %v", j+1, a.Took))
		if err != nil {
			return bgtask.Task{}, err
		}
		if j+1 == pending {
			hangStart() // the retry's start never answers
		}
		switch a.Status {
		case bgtask.StatusRunning:
			return now, nil
		case bgtask.StatusCompleted:
			err = r.host.Idle(now.SessionID, a.Result)
		case bgtask.StatusError:
			failure := a.Err
			if failure == nil {
				failure = errors.New("500 Internal Server Error")
			}
			err = r.host.Fail(now.SessionID, failure)
		case bgtask.StatusCancelled:
			_, err = r.m.Stop(ctx, bgtask.Target{Task: task.ID})
		case bgtask.StatusInterrupt:
			err = r.host.Emit(bgtask.Event{SessionID: now.SessionID, Kind: bgtask.SessionInterrupted})
		}
		if err != nil {
			return bgtask.Task{}, fmt.Errorf("%s: attempt %d: %w", where, j+1, err)
		}
	}
	s := b.Attempts[last].Status
	return r.expect(where, task.ID, models, s, fmt.Sprintf("the task should be %s", s))
}

// expect waits until the Manager is idle, and returns task id if its
// attempts are len(models), on those models, all but the last failed,
// and the last (and the task) has status s; else an error that says what
// should be (should) and what is.
func (r *loader) expect(where, id string, models []bgtask.Model, s bgtask.Status, should string) (bgtask.Task, error) {
	if err := r.settle(where); err != nil {
		return bgtask.Task{}, err
	}
	t, err := r.m.Task(id)
	if err != nil {
		return bgtask.Task{}, fmt.Errorf("%s: %s, but the Manager says: %w", where, should, err)
	}
	ok := t.Status == s && len(t.Attempts) == len(models) && (s != bgtask.StatusPending || t.Pending == bgtask.PendingAwaitingSession)
	for k := 0; ok && k < len(t.Attempts); k++ {
		want := bgtask.StatusError // a failure retried
		if k == len(t.Attempts)-1 {
			want = s
		}
		ok = t.Attempts[k].Model == models[k] && t.Attempts[k].Status == want
	}
	if !ok {
		return bgtask.Task{}, fmt.Errorf("%s: %s, but the task is %s: an option of the Manager changed the build", where, should, describe(t))
	}
	return t, nil
}

// describe says how t stands, for an error.
func describe(t bgtask.Task) string {
	var b strings.Builder
	b.WriteString(string(t.Status))
	if t.Pending != "" {
		fmt.Fprintf(&b, " (%s)", t.Pending)
	}
	fmt.Fprintf(&b, " in attempt %d, on %s", len(t.Attempts), t.Model)
	if len(t.Skips) > 0 {
		fmt.Fprintf(&b, ", %d models skipped", len(t.Skips))
	}
	if t.Error != "" {
		fmt.Fprintf(&b, ": %s", t.Error)
	}
	return b.String()
}

// verify checks, once every build ran, that the Manager holds each built
// task, in order, as it was when its build ended: a later build's clock
// moves may not have changed a live one (a stall timeout, say), nor
// retention forgotten an ended one.
func (r *loader) verify() error {
	if err := r.settle(r.name); err != nil {
		return err
	}
	tasks := r.m.Snapshot().Tasks
	ids := func(ts []bgtask.Task) []string {
		out := make([]string, len(ts))
		for i, t := range ts {
			out[i] = t.ID
		}
		return out
	}
	if got, want := ids(tasks), ids(r.built); !slices.Equal(got, want) {
		return fmt.Errorf("%s: the Manager holds tasks %q once every build ran, not the %q built: an option of the Manager forgot some (WithRetention)", r.name, got, want)
	}
	for i, t := range tasks {
		b := r.built[i]
		if t.Status != b.Status || t.Pending != b.Pending || len(t.Attempts) != len(b.Attempts) {
			return fmt.Errorf("%s: the task was %s when built, and is %s once every build ran: an option of the Manager changed it as the later builds moved the clock",
				r.where(i, t.ID), describe(b), describe(t))
		}
	}
	return nil
}

// settle waits until the Manager is idle: each of its goroutines has
// ended, waits for a timer of the clock, hangs in the host, or is parked
// on a wait of its own (internal/probe), and it stays so while the
// goroutines that could run had their turn. where begins its error.
func (r *loader) settle(where string) error {
	ctx, cancel := context.WithTimeout(r.ctx, stepTimeout)
	defer cancel()
	for idle := 0; ; {
		running, ran := probe.Running(r.m)
		parked, unparked := probe.Parked(r.m)
		blocked, hosted := r.host.blocked()
		_, timed := r.clk.Timers()
		timers := r.clk.Pending()
		if running <= parked+blocked+timers {
			// A goroutine just woken may not have counted itself yet: let
			// it run, and look again.
			if idle++; idle >= 8 {
				return nil
			}
			runtime.Gosched()
			continue
		}
		idle = 0
		select {
		case <-ran:
		case <-unparked:
		case <-hosted:
		case <-timed:
		case <-ctx.Done():
			return fmt.Errorf("%s: the Manager did not go idle (%d goroutines running: %d parked, %d in the host, %d on timers): %w",
				where, running, parked, blocked, timers, ctx.Err())
		}
	}
}

// shutdown shuts the Manager down, for BuildTask and for a Load that
// failed: what hangs in the host returns, and nothing hangs any more.
func (r *loader) shutdown() {
	r.host.releaseAll()
	ctx, cancel := context.WithTimeout(context.Background(), stepTimeout)
	defer cancel()
	_ = r.m.Shutdown(ctx)
}

func (b *TaskBuild) check() error {
	if len(b.Attempts) == 0 {
		return errors.New("no attempt")
	}
	for i, a := range b.Attempts {
		switch {
		case i < len(b.Attempts)-1 && a.Status != bgtask.StatusError:
			return fmt.Errorf("attempt %d is %q: only a failed attempt is followed by another", i+1, a.Status)
		case a.Took < 0:
			return fmt.Errorf("attempt %d took %v", i+1, a.Took)
		}
		switch a.Status {
		case bgtask.StatusPending, bgtask.StatusRunning, bgtask.StatusCompleted, bgtask.StatusError, bgtask.StatusCancelled, bgtask.StatusInterrupt:
		default:
			return fmt.Errorf("attempt %d has no status bgtask knows (%q)", i+1, a.Status)
		}
	}
	return nil
}
