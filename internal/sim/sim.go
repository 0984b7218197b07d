// Package sim is a deterministic simulation harness for bgtask: one seed
// drives a Manager through a random workload — nested launches, fallback
// chains, failing and slow session starts, failing and hanging aborts,
// early, late, duplicated and stale events, compaction, cancels, nested and
// overlapping branch closures, concurrency limits, stall and queue
// timeouts, notifier failures and a Shutdown — on simulated time, and checks
// the invariants after every step.
//
// Reproducibility: the driver's choices come from the seed, the host's
// decisions are a hash of the seed and deterministic ids, and time is a
// fake clock; after every step the driver waits until the Manager is idle
// (every goroutine finished, blocked in the scripted host, waiting on a
// timer, or parked on an internal wait). The order of the host calls that
// one step sets off concurrently can still vary; the steps, decisions and
// invariants do not.
package sim

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/clock"
	"github.com/bgtask/bgtask/internal/probe"
)

// Options configures one run.
type Options struct {
	Seed  uint64
	Steps int
	// Wrap, if set, is put between the Manager and the simulated session
	// service: a host adapter under test, given the service as a Host
	// (which also implements Prompter and StatusHost).
	Wrap func(bgtask.Host) bgtask.Host
	// Check, if set, is an invariant of the caller's, asked after every
	// step with the Manager and its tasks; an error is a failure.
	Check func(m *bgtask.Manager, tasks []bgtask.Task) error
	// Journal, if set, opens the journal every process life runs on
	// (every run then has restarts): at the start, and after each crash,
	// once the journal of the crashed life was closed. Unset, a journal
	// in memory is used in a third of the runs.
	Journal func() (bgtask.Journal, error)
	// Health turns health on (WithHealth, with throttling providers) in
	// every run; unset, a run's own stream turns it on in half of them.
	Health bool
	// Budget turns budgets and usage-reporting runs on in every run;
	// unset, a run's own stream turns them on in half of them.
	Budget bool
}

// prompts reports whether the Host the Manager was given can prompt.
func (w *world) prompts() bool {
	_, ok := w.hostFor(w.gate).(bgtask.Prompter)
	return ok
}

// hostFor is the Host the Manager is given: the gate, or the caller's
// wrapper around it.
func (w *world) hostFor(g *gate) bgtask.Host {
	if w.opts.Wrap != nil {
		return w.opts.Wrap(g)
	}
	return g
}

// Failure is a broken invariant, with the seed and the trace that led to it.
type Failure struct {
	Seed  uint64
	Step  int
	What  string
	Trace []string
}

func (f *Failure) Error() string {
	return fmt.Sprintf("sim seed %d, step %d: %s\ntrace:\n  %s\nreplay: go test ./internal/sim -run Sim -sim.seed=%d",
		f.Seed, f.Step, f.What, strings.Join(f.Trace, "\n  "), f.Seed)
}

type notes struct {
	mu   sync.Mutex
	got  []bgtask.Notification
	fail atomic.Bool
}

func (n *notes) Notify(ctx context.Context, x bgtask.Notification) error {
	if n.fail.Load() {
		return errors.New("parent session unavailable")
	}
	n.mu.Lock()
	n.got = append(n.got, x)
	n.mu.Unlock()
	return nil
}

func (n *notes) all() []bgtask.Notification {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]bgtask.Notification(nil), n.got...)
}

type world struct {
	opts   Options
	rng    *rand.Rand
	clock  *clock.Fake
	host   *host
	notes  *notes
	m      *bgtask.Manager
	trace  []string
	step   int
	fail   *Failure
	frozen map[string]bgtask.Attempt
	revs   map[string]uint64
	// answers are the invocations' answers as first seen ("task/n"): an
	// answer, once given, never changes; ended are the tasks seen ended.
	answers map[string]bgtask.Answer
	ended   map[string]bool

	calls     atomic.Int64 // driver API calls (Stop of a task or a branch) not yet returned
	callsDone sync.WaitGroup
	callMu    sync.Mutex
	callCh    chan struct{} // closed when a call returns

	mu       sync.Mutex // guards closures, results
	closures map[int]*closureCall
	nextCall int

	cfg       []bgtask.Option
	tree      bgtask.TreeLimits      // with "tree": the limits every check holds to
	deadlines bool                   // with "deadlines": launches may carry timeouts
	specs     map[string]bgtask.Spec // each task's spec, by id (its timeouts)
	gate      *gate                  // the live process's connection to the world
	journal   *memJournal            // with "restarts": what outlives a process
	// With "health": the policy, its own random stream (a run without
	// health draws from rng exactly as before health was simulated), this
	// process life's HealthChanged log, the skips checked, and when each
	// run waiting for a cooldown was first seen waiting.
	hrng      *rand.Rand
	health    *bgtask.HealthPolicy
	hlog      *healthLog
	skipsSeen map[string]bool
	waitSince map[string]time.Time
	restarted bool
	// With "budget": its own random stream, the world's account of usage,
	// and the tasks as they were before the step (budget.go).
	brng   *rand.Rand
	bud    *budgetState
	before []bgtask.Task
}

type closureCall struct {
	root     string // the session closed; "" for a Stop with Tree
	task     string // a Stop with Tree: the task closed as a unit
	known    bool   // the root was a known session when the closure was called
	returned bool
	err      error
	checked  bool
}

var models = []bgtask.Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}, {Provider: "c", ID: "3"}}

// Run drives one simulated workload and returns its trace and the first
// broken invariant (a *Failure).
func Run(opts Options) (trace []string, err error) {
	if opts.Steps <= 0 {
		opts.Steps = 150
	}
	w := &world{
		opts:     opts,
		rng:      rand.New(rand.NewPCG(opts.Seed, 0x9e3779b97f4a7c15)),
		clock:    clock.NewFake(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)),
		host:     newHost(int64(opts.Seed)),
		notes:    &notes{},
		frozen:   map[string]bgtask.Attempt{},
		revs:     map[string]uint64{},
		answers:  map[string]bgtask.Answer{},
		ended:    map[string]bool{},
		closures: map[int]*closureCall{},
		specs:    map[string]bgtask.Spec{},
		hrng:     rand.New(rand.NewPCG(opts.Seed, 0x6a09e667f3bcc908)),
		brng:     rand.New(rand.NewPCG(opts.Seed, 0xbb67ae8584caa73b)),
	}
	w.host.now = w.clock.Now
	cfg := []bgtask.Option{
		bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithClock(w.clock),
		bgtask.WithNotifyRetry(2, func(int, error) time.Duration { return time.Second }),
	}
	var features []string
	var limits *bgtask.ModelLimits // drawn in the order the seeds were made with
	if w.rng.IntN(2) == 0 {
		limits = &bgtask.ModelLimits{Default: 1 + w.rng.IntN(3), Providers: map[string]int{"c": 1}}
		features = append(features, "limits")
	}
	if w.rng.IntN(2) == 0 {
		cfg = append(cfg, bgtask.WithStallTimeout(time.Duration(30+w.rng.IntN(60))*time.Second))
		features = append(features, "stall")
	}
	if w.rng.IntN(2) == 0 {
		d := time.Duration(60+w.rng.IntN(60)) * time.Second
		if limits != nil { // a queue exists only with limits
			limits.QueueTimeout = d
			features = append(features, "queue-timeout")
		}
	}
	if limits != nil {
		cfg = append(cfg, bgtask.WithModelLimits(*limits))
	}
	if w.rng.IntN(3) == 0 {
		cfg = append(cfg, bgtask.WithRetryDelay(bgtask.Backoff(time.Second, 8*time.Second, 0)))
		features = append(features, "retry-delay")
	}
	if w.rng.IntN(3) == 0 {
		w.tree = bgtask.TreeLimits{MaxDepth: 2 + w.rng.IntN(2), MaxPerParent: 2 + w.rng.IntN(2), MaxPerRoot: 4 + w.rng.IntN(4)}
		cfg = append(cfg, bgtask.WithTreeLimits(w.tree))
		features = append(features, "tree")
	}
	if w.rng.IntN(3) == 0 {
		w.deadlines = true
		features = append(features, "deadlines")
	}
	if w.rng.IntN(3) == 0 || opts.Journal != nil {
		w.journal = &memJournal{open: opts.Journal}
		if err := w.journal.reopen(); err != nil {
			return nil, err
		}
		defer func() {
			if cerr := w.journal.close(); cerr != nil && err == nil {
				err = fmt.Errorf("closing the journal: %w", cerr)
			}
		}()
		cfg = append(cfg, bgtask.WithJournal(w.journal))
		features = append(features, "restarts")
	}
	if w.hrng.IntN(2) == 0 || opts.Health {
		p := w.healthPolicy()
		w.health = &p
		w.skipsSeen, w.waitSince = map[string]bool{}, map[string]time.Time{}
		cfg = append(cfg, bgtask.WithHealth(p))
		features = append(features, "health")
	}
	if w.brng.IntN(2) == 0 || opts.Budget {
		w.bud = newBudgetState()
		features = append(features, "budget")
	}
	w.cfg = cfg
	w.gate = &gate{h: w.host, n: w.notes}
	m, err := bgtask.Open(context.Background(), w.hostFor(w.gate), w.lifeOptions()...)
	if err != nil {
		return nil, err
	}
	w.m = m
	probe.Record(w.m) // replay must reproduce the run, checked at the end
	w.host.m.Store(w.m)
	w.log("start: %v", features)

	for w.step = 1; w.step <= opts.Steps && w.fail == nil; w.step++ {
		if w.health != nil {
			w.weather()
			w.quiesce() // what a reset set off has settled before the act
		}
		w.act()
		w.quiesce()
		w.check()
	}
	w.finish()
	if w.fail != nil {
		return w.trace, w.fail
	}
	return w.trace, nil
}

func (w *world) log(format string, args ...any) {
	w.trace = append(w.trace, fmt.Sprintf("%3d ", w.step)+fmt.Sprintf(format, args...))
}

func (w *world) failf(format string, args ...any) {
	if w.fail == nil {
		w.fail = &Failure{Seed: w.opts.Seed, Step: w.step, What: fmt.Sprintf(format, args...), Trace: w.trace}
	}
}

// sessions lists every session bound to any attempt, in a stable order.
func (w *world) sessions(tasks []bgtask.Task) []string {
	var out []string
	for _, t := range tasks {
		for _, a := range t.Attempts {
			if a.SessionID != "" {
				out = append(out, a.SessionID)
			}
		}
	}
	return out
}

func (w *world) act() {
	tasks := w.m.Snapshot().Tasks
	w.before = tasks
	switch op := w.rng.IntN(100); {
	case op < 22 || len(tasks) == 0:
		w.launch(tasks)
	case op < 50:
		w.event(tasks)
	case op < 55:
		w.extend(tasks)
	case op < 62:
		w.cancel(tasks)
	case op < 68:
		w.closeBranch(tasks)
	case op < 78:
		d := time.Duration(1+w.rng.IntN(40)) * time.Second
		w.clock.Advance(d)
		w.log("advance clock %s", d)
	case op < 90:
		if k := w.host.release(w.rng.IntN(1000)); k != "" {
			w.log("release %s", k)
		} else {
			w.log("release: nothing blocked")
		}
	case op < 93:
		on := !w.notes.fail.Load()
		w.notes.fail.Store(on)
		w.log("notifier failing=%v", on)
	case op < 93+2 && w.journal != nil && w.calls.Load() == 0 && w.rng.IntN(3) == 0:
		w.restart()
	case op < 95:
		w.host.mu.Lock()
		w.host.abortsFail = !w.host.abortsFail
		on := w.host.abortsFail
		w.host.mu.Unlock()
		w.log("aborts failing=%v", on)
	default:
		w.deleteSession(tasks)
	}
}

func (w *world) launch(tasks []bgtask.Task) {
	parent := fmt.Sprintf("root-%d", w.rng.IntN(3))
	if s := w.sessions(tasks); len(s) > 0 && w.rng.IntN(2) == 0 {
		parent = s[w.rng.IntN(len(s))]
	}
	n := 1 + w.rng.IntN(3)
	start := w.rng.IntN(len(models))
	var chain []bgtask.Model
	for i := range n {
		chain = append(chain, models[(start+i)%len(models)])
	}
	spec := bgtask.Spec{ParentSessionID: parent, Prompt: "work", Models: chain, MaxAttempts: w.rng.IntN(4), Budget: w.budgetFor(parent)}
	if w.rng.IntN(4) == 0 {
		spec.Key = fmt.Sprintf("key-%d", w.rng.IntN(3))
	}
	if w.deadlines && w.rng.IntN(2) == 0 {
		spec.Timeout = time.Duration(60+w.rng.IntN(120)) * time.Second
	}
	if w.deadlines && w.rng.IntN(2) == 0 {
		spec.AttemptTimeout = time.Duration(20+w.rng.IntN(60)) * time.Second
		spec.RetryOnTimeout = w.rng.IntN(2) == 0
	}
	limited := w.treeRefusal(tasks, parent)
	spent := w.bud != nil && budgetRefusal(tasks, parent)
	closing := w.activeClosureCovers(tasks, parent)
	holder := ""
	for _, t := range tasks {
		if spec.Key != "" && t.Key == spec.Key && !t.Status.Terminal() {
			holder = t.ID
		}
	}
	task, err := w.m.Launch(context.Background(), spec)
	var held *bgtask.KeyHeldError
	var limit *bgtask.LimitError
	switch {
	case errors.Is(err, bgtask.ErrBudget):
		if !spent {
			w.failf("launch under %s refused by %v, which its tree does not say", parent, err)
		}
		w.log("launch under %s refused: %v", parent, err)
	case spent:
		w.failf("launch under %s not refused by its spent budget: %v", parent, err)
	case errors.As(err, &limit):
		if limited == nil || !errors.Is(err, limited) {
			w.failf("launch under %s refused by %v; the tasks say %v", parent, err, limited)
		}
		w.log("launch under %s refused: %v", parent, err)
	case err == nil && limited != nil && closing == "" && holder == "":
		w.failf("launch under %s admitted past a limit: %v", parent, limited)
	case err == nil && closing != "":
		w.failf("launch under %s was admitted while closure of %s was running", parent, closing)
	case err == nil && holder != "":
		w.failf("launch with key %s started a second run beside %s", spec.Key, holder)
	case errors.As(err, &held):
		if held.TaskID != holder && holder != "" {
			w.failf("key %s: refused naming %s, held by %s", spec.Key, held.TaskID, holder)
		}
		w.log("launch with key %s refused: held by %s", spec.Key, held.TaskID)
	case err != nil && !errors.Is(err, bgtask.ErrBranchClosing):
		w.failf("launch: %v", err)
	case err != nil:
		w.log("launch under %s refused: branch closing", parent)
	default:
		w.specs[task.ID] = spec
		w.log("launch %s under %s on %v max=%d timeout=%s attempt-timeout=%s retry=%v", task.ID, parent, chain, spec.MaxAttempts,
			spec.Timeout, spec.AttemptTimeout, spec.RetryOnTimeout)
	}
}

// treeRefusal is the tree limit a launch under parent must be refused by,
// worked out from the tasks alone (nil: none applies).
func (w *world) treeRefusal(tasks []bgtask.Task, parent string) error {
	t := w.tree
	root, depth := parent, 1
	liveUnder, liveRoot := 0, map[string]int{}
	for _, task := range tasks {
		for _, a := range task.Attempts {
			if a.SessionID == parent {
				root, depth = task.Root, task.Depth+1
			}
		}
	}
	for _, task := range tasks {
		if task.Status.Terminal() {
			continue
		}
		liveRoot[task.Root]++
		if task.ParentSessionID == parent {
			liveUnder++
		}
	}
	switch {
	case t.MaxDepth > 0 && depth > t.MaxDepth:
		return bgtask.ErrDepthLimit
	case t.MaxPerRoot > 0 && liveRoot[root] >= t.MaxPerRoot:
		return bgtask.ErrTreeLimit
	case t.MaxPerParent > 0 && liveUnder >= t.MaxPerParent:
		return bgtask.ErrFanOutLimit
	}
	return nil
}

// checkTree: no task is deeper than the limit, and no parent session or
// tree has more live tasks than its limit; a task that ended at a deadline
// had one, and ended no earlier than it was due.
func (w *world) checkTree(tasks []bgtask.Task) {
	t := w.tree
	parents, roots := map[string]int{}, map[string]int{}
	for _, task := range tasks {
		if t.MaxDepth > 0 && task.Depth > t.MaxDepth {
			w.failf("%s is at depth %d, past the limit %d", task.ID, task.Depth, t.MaxDepth)
		}
		if !task.Status.Terminal() {
			parents[task.ParentSessionID]++
			roots[task.Root]++
		}
		if task.Outcome == nil || task.Outcome.Reason != bgtask.ReasonDeadline {
			continue
		}
		spec, ok := w.specs[task.ID]
		due := time.Time{}
		switch cur := task.Current(); {
		case !ok:
			continue // launched before a restart this world does not track
		case strings.Contains(cur.Error, "the task ran longer"):
			due = task.LaunchedAt.Add(spec.Timeout)
		case strings.Contains(cur.Error, "the attempt ran longer"):
			due = cur.StartedAt.Add(spec.AttemptTimeout)
		default:
			w.failf("%s ended at a deadline with error %q", task.ID, cur.Error)
			continue
		}
		if spec.Timeout == 0 && spec.AttemptTimeout == 0 {
			w.failf("%s ended at a deadline it did not have", task.ID)
		}
		if task.CompletedAt.Before(due) {
			w.failf("%s ended at a deadline at %s, before it was due at %s", task.ID, task.CompletedAt, due)
		}
	}
	for p, n := range parents {
		if t.MaxPerParent > 0 && n > t.MaxPerParent {
			w.failf("parent %s has %d live tasks, past the limit %d", p, n, t.MaxPerParent)
		}
	}
	for r, n := range roots {
		if t.MaxPerRoot > 0 && n > t.MaxPerRoot {
			w.failf("tree %s has %d live tasks, past the limit %d", r, n, t.MaxPerRoot)
		}
	}
}

func (w *world) event(tasks []bgtask.Task) {
	t := tasks[w.rng.IntN(len(tasks))]
	a := t.Attempts[w.rng.IntN(len(t.Attempts))]
	kinds := []bgtask.EventKind{bgtask.SessionBusy, bgtask.SessionIdle, bgtask.SessionError, bgtask.SessionInterrupted,
		bgtask.SessionCompacted, bgtask.SessionWaiting, bgtask.SessionBusy, bgtask.SessionError}
	ev := bgtask.Event{Kind: kinds[w.rng.IntN(len(kinds))], Text: "out"}
	switch w.rng.IntN(10) {
	case 0:
		ev.Err = errors.New("context_length_exceeded")
	case 1:
		ev.Err = bgtask.Permanent(errors.New("bad tool schema"))
	default:
		ev.Err = errors.New("429 Too Many Requests")
	}
	switch w.rng.IntN(6) {
	case 0:
		ev.AttemptID = a.ID
	case 1:
		ev.SessionID, ev.Token = a.SessionID, "run-stale"
	case 2:
		ev.SessionID = fmt.Sprintf("s-unknown-%d", w.rng.IntN(5))
	default:
		ev.SessionID = a.SessionID
	}
	if ev.SessionID == "" && ev.AttemptID == "" {
		ev.AttemptID = a.ID
	}
	if ev.SessionID == a.SessionID || ev.AttemptID == a.ID { // an unknown session's event may be held, and dropped
		ev.Usage = w.usageFor(tasks, t, a)
	}
	if ev.Kind == bgtask.SessionIdle && w.rng.IntN(2) == 0 {
		ev.Invocation = w.rng.IntN(len(t.Invocations) + 2) // 0 (the latest), one admitted, or one past them
	}
	if ev.Kind == bgtask.SessionIdle && w.rng.IntN(6) == 0 {
		ev.Reason = bgtask.ReasonUnconsumedToolCall
	}
	times := 1
	if w.rng.IntN(8) == 0 {
		times = 2 // duplicated
	}
	for i := range times {
		if i > 0 {
			w.quiesce()               // what the first copy set off has settled
			ev.Usage = bgtask.Usage{} // a host reports usage once: a report twice counts twice
		}
		before, _ := w.m.Task(t.ID)
		err := w.m.Observe(ev)
		after, _ := w.m.Task(t.ID)
		if err != nil && !errors.Is(err, bgtask.ErrStaleEvent) && !errors.Is(err, bgtask.ErrUnknownSession) {
			w.failf("observe %+v: %v", ev, err)
		}
		w.counted(ev, a, err)
		rejected := errors.Is(err, bgtask.ErrStaleEvent) || errors.Is(err, bgtask.ErrUnknownSession)
		if rejected && ev.Usage.IsZero() && after.Revision != before.Revision {
			w.failf("a rejected event changed %s: revision %d → %d", t.ID, before.Revision, after.Revision)
		}
		if rejected && (after.Status != before.Status || after.CurrentAttemptID != before.CurrentAttemptID || after.Result != before.Result) {
			w.failf("a rejected event carrying usage moved %s: %s %s → %s %s", t.ID, before.Status, before.CurrentAttemptID, after.Status, after.CurrentAttemptID)
		}
		w.log("event %s session=%q attempt=%q token=%q usage=%d on %s/%d: %v", ev.Kind, ev.SessionID, ev.AttemptID, ev.Token, ev.Usage.Tokens(), t.ID, a.Number, err)
	}
}

// extend sends a supplemental prompt to a task, on a driver goroutine (the
// host may hang it): admitted or refused with a typed error, never anything
// else.
func (w *world) extend(tasks []bgtask.Task) {
	t := tasks[w.rng.IntN(len(tasks))]
	w.log("extend %s (%s)", t.ID, t.Status)
	w.call(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // past quiesce's: a hang is reported with its stacks
		defer cancel()
		_, err := w.m.Extend(ctx, t.ID, "more")
		switch {
		case errors.Is(err, errors.ErrUnsupported) && !w.prompts():
			w.log("extend %s refused: the host under test prompts no session", t.ID)
		case err == nil, errors.Is(err, bgtask.ErrNotRunning), errors.Is(err, bgtask.ErrPromptRefused),
			errors.Is(err, bgtask.ErrBranchClosing), errors.Is(err, bgtask.ErrShutdown), errors.Is(err, bgtask.ErrForgotten),
			errors.Is(err, bgtask.ErrJournal):
		case errors.Is(err, context.DeadlineExceeded):
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			w.mu.Lock()
			w.failf("extend of %s hung; goroutines:\n%s", t.ID, buf)
			w.mu.Unlock()
		default:
			w.mu.Lock()
			w.failf("extend of %s: %v", t.ID, err)
			w.mu.Unlock()
		}
	})
}

// call runs a blocking API call on a driver goroutine, counted until it
// returns.
func (w *world) call(f func()) {
	w.calls.Add(1)
	w.callsDone.Add(1)
	go func() {
		defer w.callsDone.Done()
		defer func() {
			w.calls.Add(-1)
			w.callMu.Lock()
			if w.callCh != nil {
				close(w.callCh)
				w.callCh = nil
			}
			w.callMu.Unlock()
		}()
		f()
	}()
}

func (w *world) callState() <-chan struct{} {
	w.callMu.Lock()
	defer w.callMu.Unlock()
	if w.callCh == nil {
		w.callCh = make(chan struct{})
	}
	return w.callCh
}

func (w *world) cancel(tasks []bgtask.Task) {
	t := tasks[w.rng.IntN(len(tasks))]
	w.log("cancel %s (%s)", t.ID, t.Status)
	w.call(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a lost wakeup shows up as a failure, not a hang
		defer cancel()
		if _, err := w.m.Stop(ctx, bgtask.Target{Task: t.ID}); errors.Is(err, context.DeadlineExceeded) {
			w.mu.Lock()
			w.failf("cancel of %s hung", t.ID)
			w.mu.Unlock()
		}
	})
}

func (w *world) closeBranch(tasks []bgtask.Task) {
	if len(tasks) > 0 && w.rng.IntN(4) == 0 {
		w.closeTask(tasks[w.rng.IntN(len(tasks))].ID)
		return
	}
	root := fmt.Sprintf("root-%d", w.rng.IntN(3))
	if s := w.sessions(tasks); len(s) > 0 && w.rng.IntN(2) == 0 {
		root = s[w.rng.IntN(len(s))]
	}
	w.runClosure(&closureCall{root: root, known: edges(tasks).known(root)}, "branch "+root,
		func(ctx context.Context) error { _, err := w.m.Stop(ctx, bgtask.Target{Session: root}); return err })
}

// closeTask closes a task as a unit (Stop with Target.Tree).
func (w *world) closeTask(taskID string) {
	w.runClosure(&closureCall{task: taskID, known: true}, "task "+taskID,
		func(ctx context.Context) error {
			_, err := w.m.Stop(ctx, bgtask.Target{Task: taskID, Tree: true})
			return err
		})
}

// runClosure registers c and runs close as a driver call, recording what
// it returned for checkClosures.
func (w *world) runClosure(c *closureCall, what string, close func(context.Context) error) {
	w.mu.Lock()
	id := w.nextCall
	w.nextCall++
	w.closures[id] = c
	w.mu.Unlock()
	w.log("close %s (#%d)", what, id)
	w.call(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err := close(ctx)
		w.mu.Lock()
		c.returned, c.err = true, err
		w.mu.Unlock()
	})
}

func (w *world) deleteSession(tasks []bgtask.Task) {
	t := tasks[w.rng.IntN(len(tasks))]
	if t.SessionID == "" {
		w.log("delete: %s has no session", t.ID)
		return
	}
	err := w.m.Observe(bgtask.Event{SessionID: t.SessionID, Kind: bgtask.SessionDeleted})
	w.log("delete session %s of %s: %v", t.SessionID, t.ID, err)
}

// quiesce waits until the Manager is idle: each of its goroutines has
// finished, is blocked in the scripted host, waits on a fake timer, or is
// parked; and each driver API call has returned or is parked.
func (w *world) quiesce() {
	deadline := time.After(time.Minute) // a stuck run is reported, not hung
	stable := 0
	for {
		cch := w.callState()
		running, ch := probe.Running(w.m)
		blocked, hch := w.host.state()
		parked, pch := probe.Parked(w.m)
		_, tch := w.clock.Created()
		if running+int(w.calls.Load()) <= blocked+w.clock.Pending()+parked {
			// A goroutine whose wait just ended still counts as parked
			// until it runs: let the woken run, then look again.
			if stable++; stable >= 8 {
				return
			}
			runtime.Gosched()
			continue
		}
		stable = 0
		select {
		case <-ch:
		case <-hch:
		case <-pch:
		case <-cch:
		case <-tch:
		case <-deadline:
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			w.failf("the manager never went idle: %d running, %d blocked in the host, %d timers, %d parked, %d calls; goroutines:\n%s",
				running, blocked, w.clock.Pending(), parked, w.calls.Load(), buf)
			return
		}
	}
}

func (w *world) check() {
	tasks := w.m.Snapshot().Tasks
	for _, t := range tasks {
		live := 0
		var cur bgtask.Attempt
		for i, a := range t.Attempts {
			if a.Number != i+1 {
				w.failf("%s: attempt %d numbered %d", t.ID, i+1, a.Number)
			}
			if a.ID == t.CurrentAttemptID {
				cur = a
			}
			if !a.Status.Terminal() {
				live++
				if a.ID != t.CurrentAttemptID {
					w.failf("%s: live attempt %s is not current", t.ID, a.ID)
				}
			}
			if old, ok := w.frozen[a.ID]; ok && old != a {
				w.failf("terminal attempt %s changed:\n%+v\n%+v", a.ID, old, a)
			}
			if a.Status.Terminal() {
				w.frozen[a.ID] = a
			}
		}
		if live > 1 {
			w.failf("%s has %d live attempts", t.ID, live)
		}
		// seed 004: a run stopped by us (cancelled/interrupt) whose session
		// the host created must have had its abort confirmed.
		for _, a := range t.Attempts {
			if a.Status != bgtask.StatusCancelled {
				continue
			}
			if a.Error == "session deleted" {
				continue
			}
			sid := "s-" + a.ID
			w.host.mu.Lock()
			created, confirmed := w.host.created[sid], w.host.confirmed[sid]
			w.host.mu.Unlock()
			if created && !confirmed {
				w.failf("seed 004: %s attempt %s is %s but its session %s was never confirmed stopped (bound %q)", t.ID, a.ID, a.Status, sid, a.SessionID)
			}
		}
		if t.Status != cur.Status || t.SessionID != cur.SessionID || t.Model != cur.Model || t.Error != cur.Error ||
			!t.StartedAt.Equal(cur.StartedAt) || !t.CompletedAt.Equal(cur.CompletedAt) || t.Result != cur.Result {
			w.failf("%s: task fields differ from its current attempt", t.ID)
		}
		if t.Revision < w.revs[t.ID] {
			w.failf("%s: revision went back %d → %d", t.ID, w.revs[t.ID], t.Revision)
		}
		w.revs[t.ID] = t.Revision
		if t.Status.Terminal() != (t.Outcome != nil) {
			w.failf("%s is %s with outcome %v", t.ID, t.Status, t.Outcome)
		}
	}
	w.checkInvocations(tasks)
	for _, s := range w.m.Snapshot().Queues {
		if s.Limit > 0 && s.Running > s.Limit {
			w.failf("key %s runs %d over its limit %d", s.Key, s.Running, s.Limit)
		}
	}
	w.checkNotifications(tasks, false)
	w.checkClosures(tasks)
	w.checkTree(tasks)
	if w.health != nil {
		w.checkHealth(tasks)
	}
	if w.bud != nil {
		w.checkBudgets(tasks, w.before)
	}
	if w.opts.Check != nil {
		if err := w.opts.Check(w.m, tasks); err != nil {
			w.failf("the caller's invariant: %v", err)
		}
	}
}

// checkInvocations: every answer is given once and never changes; answers
// are given in invocation order; no task ends with an open invocation; a
// task that completes has no live task launched from its session (the
// children gate); at most one live task holds a key.
func (w *world) checkInvocations(tasks []bgtask.Task) {
	live := map[string]int{} // parent session → its live tasks
	keys := map[string]string{}
	for _, t := range tasks {
		if !t.Status.Terminal() {
			live[t.ParentSessionID]++
			if t.Key != "" {
				if o, ok := keys[t.Key]; ok {
					w.failf("key %s is held by %s and %s", t.Key, o, t.ID)
				}
				keys[t.Key] = t.ID
			}
		}
	}
	for _, t := range tasks {
		open := false
		for _, in := range t.Invocations {
			k := t.ID + "/" + strconv.Itoa(in.N)
			if in.Answer == nil {
				open = true
				if _, had := w.answers[k]; had {
					w.failf("%s: invocation %d lost its answer", t.ID, in.N)
				}
				continue
			}
			if open {
				w.failf("%s: invocation %d answered before an earlier one", t.ID, in.N)
			}
			if old, had := w.answers[k]; had && (old.Text != in.Answer.Text || old.Status != in.Answer.Status || old.Envelope != in.Answer.Envelope) {
				w.failf("%s: the answer of invocation %d changed: %+v → %+v", t.ID, in.N, old, *in.Answer)
			}
			w.answers[k] = *in.Answer
		}
		if t.Status.Terminal() && open {
			w.failf("%s is %s with an open invocation", t.ID, t.Status)
		}
		if t.Status == bgtask.StatusCompleted && !w.ended[t.ID] && t.SessionID != "" && live[t.SessionID] > 0 {
			w.failf("%s completed while %d tasks its session launched run", t.ID, live[t.SessionID])
		}
		if t.Status.Terminal() {
			w.ended[t.ID] = true
		}
	}
}

// checkNotifications: per parent, delivery order is production order; per
// task at most one final summary, last among its own notifications (and, at
// the end, exactly one for every terminal task).
func (w *world) checkNotifications(tasks []bgtask.Task, final bool) {
	last := map[string]uint64{}
	answered := map[string]int{} // task → the last invocation whose answer was told
	finals := map[string]int{}
	after := map[string]bool{}
	ids := map[string]bool{}
	for _, n := range w.notes.all() {
		if ids[n.ID] {
			continue // delivered again after a crash: the same ID, dropped by its receiver
		}
		ids[n.ID] = true
		if n.Seq <= last[n.ParentSessionID] {
			w.failf("parent %s: notification %d delivered after %d", n.ParentSessionID, n.Seq, last[n.ParentSessionID])
		}
		last[n.ParentSessionID] = n.Seq
		switch n.Kind {
		case bgtask.NotifyAnswer:
			inv := n.Invocation
			if inv <= answered[n.TaskID] {
				w.failf("%s: the answer of invocation %d told after that of %d", n.TaskID, inv, answered[n.TaskID])
			}
			answered[n.TaskID] = inv
			if finals[n.TaskID] > 0 {
				after[n.TaskID] = true
			}
		case bgtask.NotifyFinalSummary:
			finals[n.TaskID]++
		case bgtask.NotifyRetryScheduled, bgtask.NotifyRetrySessionReady:
			if finals[n.TaskID] > 0 {
				after[n.TaskID] = true
			}
		}
	}
	lost := map[string]int{}
	for _, n := range w.m.Dropped().Undelivered {
		if n.Kind == bgtask.NotifyFinalSummary {
			lost[n.TaskID]++
		}
	}
	for _, t := range tasks {
		if finals[t.ID]+lost[t.ID] > 1 {
			w.failf("%s has %d final summaries", t.ID, finals[t.ID]+lost[t.ID])
		}
		if after[t.ID] {
			w.failf("%s: a notification came after its final summary", t.ID)
		}
		if final && t.Status.Terminal() && finals[t.ID]+lost[t.ID] != 1 {
			w.failf("%s (%s) has %d final summaries, %d lost", t.ID, t.Status, finals[t.ID], lost[t.ID])
		}
	}
}

// graph is the ledger's edges as the snapshots show them: which task each
// session belongs to, and each task's parent session.
type graph struct {
	taskOf map[string]string // session → task
	parent map[string]string // task → parent session
}

func edges(tasks []bgtask.Task) graph {
	g := graph{taskOf: map[string]string{}, parent: map[string]string{}}
	for _, t := range tasks {
		g.parent[t.ID] = t.ParentSessionID
		for _, a := range t.Attempts {
			if a.SessionID != "" {
				g.taskOf[a.SessionID] = t.ID
			}
		}
	}
	return g
}

// known reports whether the Manager has seen session: a task's session or
// a task's parent.
func (g graph) known(session string) bool {
	if _, ok := g.taskOf[session]; ok {
		return true
	}
	for _, p := range g.parent {
		if p == session {
			return true
		}
	}
	return false
}

// inBranch reports whether session lies in c's branch, by the recorded
// edges: a task is the unit, so every session of the root's task (the task a
// Stop with Tree names, or the task the root session belongs to) is in it.
func (g graph) inBranch(session string, c *closureCall) bool {
	rootTask, rooted := c.task, c.task != ""
	if !rooted {
		rootTask, rooted = g.taskOf[c.root]
	}
	for range 10_000 {
		if session == c.root && session != "" {
			return true
		}
		t, ok := g.taskOf[session]
		if !ok {
			return false
		}
		if rooted && t == rootTask {
			return true
		}
		session = g.parent[t]
	}
	return false
}

// taskInBranch reports whether task t lies in c's branch.
func (g graph) taskInBranch(t bgtask.Task, c *closureCall) bool {
	if c.task == t.ID {
		return true
	}
	if rt, ok := g.taskOf[c.root]; ok && rt == t.ID {
		return true
	}
	return g.inBranch(t.ParentSessionID, c)
}

func (w *world) activeClosureCovers(tasks []bgtask.Task, parent string) string {
	up := edges(tasks)
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.closures {
		if !c.returned && up.inBranch(parent, c) {
			return c.root + c.task
		}
	}
	return ""
}

// checkClosures: after a closure returned nil, nothing in its branch runs.
func (w *world) checkClosures(tasks []bgtask.Task) {
	up := edges(tasks)
	w.mu.Lock()
	defer w.mu.Unlock()
	ids := make([]int, 0, len(w.closures))
	for id := range w.closures {
		ids = append(ids, id)
	}
	sort.Ints(ids)
	for _, id := range ids {
		c := w.closures[id]
		if !c.returned || c.checked {
			continue
		}
		c.checked = true
		w.log("closure #%d of %s returned: %v", id, c.root, c.err)
		if errors.Is(c.err, bgtask.ErrUnknownSession) {
			if c.known {
				w.failf("closure of %s: %v, but the session was known when it was called", c.root, c.err)
			}
			continue
		}
		if c.err != nil {
			if !errors.Is(c.err, bgtask.ErrBranchNotStopped) {
				w.failf("closure of %s: %v", c.root, c.err)
			}
			continue
		}
		for _, t := range tasks {
			if up.taskInBranch(t, c) && !t.Status.Terminal() {
				w.failf("closure of %s returned nil but %s (parent %s) is %s", c.root, t.ID, t.ParentSessionID, t.Status)
			}
		}
	}
}

// finish drains the run: nothing fails or hangs any more, everything blocked
// is released, Shutdown stops the rest; then every task must have ended and
// no goroutine of the Manager may be left.
func (w *world) finish() {
	w.host.mu.Lock()
	w.host.reliable, w.host.abortsFail = true, false
	w.host.mu.Unlock()
	w.notes.fail.Store(false)
	w.log("shutdown")
	done := make(chan error, 1)
	go func() { done <- w.m.Shutdown(context.Background()) }()
	deadline := time.After(time.Minute) // a hung shutdown is reported, not waited for forever
	for {
		_, hch := w.host.state()
		_, pch := probe.Parked(w.m)
		_, tch := w.clock.Created()
		w.host.releaseAll()
		if w.clock.Pending() > 0 {
			w.clock.Advance(10 * time.Second) // simulated time goes on: retries and timers fire
		}
		select {
		case err := <-done:
			w.callsDone.Wait()
			w.check()
			if err != nil && !strings.Contains(err.Error(), "notifications not delivered") {
				w.failf("shutdown: %v", err)
			}
			for _, t := range w.m.Snapshot().Tasks {
				if !t.Status.Terminal() {
					w.failf("%s did not end: %s", t.ID, t.Status)
				}
			}
			w.checkNotifications(w.m.Snapshot().Tasks, true)
			if !w.restarted { // across a restart, the journal's replay was the check
				if err := probe.Replay(w.m); err != nil {
					w.failf("%v", err)
				}
			}
			if n, _ := probe.Running(w.m); n != 0 {
				w.failf("%d goroutines outlived Shutdown", n)
			}
			return
		case <-hch:
		case <-pch:
		case <-tch:
		case <-deadline:
			w.failf("shutdown hung")
			return
		}
	}
}

// lifeOptions are the options of a process life: the run's, its gate as
// the notifier and, with health, a HealthChanged log of its own (a new
// life's health starts anew).
func (w *world) lifeOptions() []bgtask.Option {
	opts := append(w.cfg[:len(w.cfg):len(w.cfg)], bgtask.WithNotifier(w.gate))
	if w.health != nil {
		w.hlog = newHealthLog(w.clock.Now, w.health.ProbeTimeout)
		opts = append(opts, bgtask.WithMetrics(w.hlog))
	}
	return opts
}

// restart kills the harness process (nothing it does from now on is
// durable or reaches the world) and starts the next one on the same
// journal, as a crash and a restart would.
func (w *world) restart() {
	w.log("crash and restart")
	w.journal.mu.Lock()
	w.journal.crashed = true
	w.journal.mu.Unlock()
	w.gate.dead.Store(true)
	old := w.m
	var dying []bgtask.Task
	if w.health != nil {
		dying = old.Snapshot().Tasks
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	_ = old.Shutdown(ctx) // the dead process's goroutines, joined (the test's, not the world's)
	cancel()
	if w.health != nil {
		// Skips the dying life made since the last check (its last records
		// may replay in the next) were made by its health, not the next's:
		// checked against its log, once its last measures were told.
		w.checkSkips(dying)
	}
	if err := w.journal.reopen(); err != nil {
		w.failf("restart: reopening the journal: %v", err)
		return
	}
	w.gate = &gate{h: w.host, n: w.notes}
	m, err := bgtask.Open(context.Background(), w.hostFor(w.gate), w.lifeOptions()...)
	if err != nil {
		w.failf("restart: %v", err)
		return
	}
	w.m = m
	w.host.m.Store(m)
	w.restarted = true
}
