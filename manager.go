package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/bgtask/bgtask/internal/dispatch"
	"github.com/bgtask/bgtask/internal/feed"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/bgtask/bgtask/internal/funchost"
	"github.com/bgtask/bgtask/internal/group"
	"github.com/bgtask/bgtask/internal/held"
	"github.com/bgtask/bgtask/internal/slots"
)

// orBackground treats a nil context as context.Background(), at every entry
// point that takes one: a nil context is never a crash and never leaves a
// fence or a watcher behind.
func orBackground(ctx context.Context) context.Context {
	if ctx == nil {
		return context.Background()
	}
	return ctx
}

// logRec is a log line queued while m.mu is held and emitted after it is
// released: the logger is user code too.
type logRec struct {
	level slog.Level
	msg   string
	attrs []slog.Attr
}

// Manager supervises background tasks. It is safe for concurrent use. Create
// it with Open and stop it with Shutdown.
type Manager struct {
	hosts hosts  // who runs the child sessions; never changed after Open
	cfg   config // Open's options, defaults filled in: never changed after Open

	life lifetime // its context and the goroutines it owns; see lifetime

	// mu is the one lock of the core state: it guards led, order and
	// every component below that says it is guarded by m.mu.
	mu    sync.Mutex
	led   *ledger
	order []*entry // tasks in launch order

	calls    hostCalls      // starts and aborts in flight, held events; guarded by m.mu
	closures branchClosures // the closures in progress; its passMu, then m.mu
	changes  changeFeed     // change sequence, signal, subscribers; guarded by m.mu
	notes    notifications  // what parents are told; guarded by m.mu, but for lanes and counters
	out      outbox         // effects and log lines waiting for m.mu's release; guarded by m.mu, but for a counter
	hooks    testHooks      // set by tests before use, never changed after
}

// hosts are who runs a Manager's child sessions.
type hosts struct {
	main     Host        // Open's host (an in-process FuncHost for Open(ctx, nil))
	funcs    *FuncHost   // runs the tasks with their own function (Spec.Run): main itself when it is a FuncHost
	ownOnly  bool        // Open(ctx, nil): every task must bring its own function
	sessions sessionKind // what main can do with an ended task's session (the envelope's notice)
}

// lifetime is the Manager's life and the goroutines it owns. ctx and cancel
// are set by Open and never changed. group and watchers are safe for
// concurrent use; every goroutine of group is reserved under m.mu (an
// effect) or started by a goroutine of group already counted, which join
// relies on. closing is guarded by m.mu. parked has its own lock.
type lifetime struct {
	// ctx is the Manager's lifetime, not a request's: host and notifier
	// calls derive their contexts from it, and Shutdown cancels it.
	ctx    context.Context
	cancel context.CancelFunc

	group group.Group
	// watchers owns the goroutines that only wait for a subscriber's
	// context; kept apart so waiting for the work in group never waits
	// for a subscription. Shutdown joins both.
	watchers group.Group

	closing bool // Shutdown began: no new work

	// parked is the waits parked now, which the simulation harness sets
	// against the goroutines running in group.
	parked parking

	jerr          atomic.Pointer[error] // the journal's failure (poison), once it failed
	dead          chan struct{}         // closed once jerr is set: waits for what will never be recorded end
	journalClosed sync.Once             // Shutdown closes the journal, once nothing can commit
}

// hostCalls is what stands between a run and the Host, guarded by m.mu:
// the slots that admit session starts, the starts and aborts in flight
// (Shutdown waits for both), and the events held until a start in flight
// binds the session or attempt they name.
type hostCalls struct {
	pool     *slots.Pool[queued]    // concurrency slots; nil without WithModelLimits
	startSeq uint64                 // last session start issued
	inflight map[uint64]struct{}    // session starts in flight, by seq
	abortsN  int                    // aborts in flight
	held     *held.Set[observation] // events waiting for a start in flight to bind their session
	// usage is the usage record's part a report reuses when no journal
	// keeps its records (they are applied and dropped under m.mu).
	usage   usageRec
	prompts map[*entry]*promptLane  // the Extend lanes of live tasks: one host prompt call at a time
	fanout  map[string][]*fanWaiter // Launches waiting for a live-task slot of their parent session, in arrival order
	health  *healthBook             // what the calls' failures say of models and providers (WithHealth); nil: none kept
}

// fanWaiter is a Launch waiting for a slot of its parent session
// (TreeLimits.MaxPerParent): ch is closed when it may look again.
type fanWaiter struct {
	ch    chan struct{}
	woken bool
	since time.Time
}

// promptLane serializes the Extends of one task: its turn is taken, in
// arrival order, for the admission check, the host call and the record,
// then handed to the next. (The waits are close signals, as parked waits
// must be: the simulation's probe reads them.)
type promptLane struct {
	busy     bool            // an Extend holds the turn
	waiters  []chan struct{} // Extends waiting for it, in arrival order: closed when handed it
	users    int             // Extends holding or waiting for the turn
	inflight int             // host prompt calls in flight: the task does not end meanwhile
	stopCall func()          // ends the call in flight, when the run it prompts ends
	early    []turnEnd       // turn ends that came while a prompt was in flight, in order
}

// changeFeed is how changes are heard of, guarded by m.mu: the manager-wide
// change sequence and the epoch it counts in, the signal that wakes
// waiters of any change, and the subscribers.
type changeFeed struct {
	epoch     uint64        // this Manager's life: wall-clock nanoseconds at Open
	seq       uint64        // manager-wide change sequence
	anyChange chan struct{} // manager-wide change signal, like runtime.changed
	subs      *feed.Feed[Change]
}

// notifications is what the parents are told. seq, rounds and lost are
// guarded by m.mu; lanes is safe for concurrent use (pushed to under
// m.mu); failures and dropped are atomic.
type notifications struct {
	lanes    *dispatch.Lanes[Notification]
	seq      uint64            // notification production sequence
	lastID   string            // the ID of the latest notification produced (kept through a compaction)
	rounds   map[string]*round // per parent: the tasks of its current round
	lost     []Notification    // notifications the Notifier never accepted
	failures atomic.Uint64     // notifications not delivered (Drops.NotifyFailures)
	dropped  atomic.Uint64     // undelivered notifications given up past the bound
}

// settle waits until the records up to seq — the latest of the tasks a
// wait returns, not those other tasks committed since, which may be a
// sync later — are durable (at once without a journal), so that what the
// wait returns survives a crash; or returns ctx's error, or the journal's
// once it failed. m.mu is held; it is released while waiting and held
// again on return.
func (m *Manager) settle(ctx context.Context, seq uint64) error {
	if m.cfg.journal == nil {
		return nil
	}
	target := min(seq, m.led.seq)
	for {
		ok, ch := m.out.durable.reached(target)
		if ok {
			return nil
		}
		m.mu.Unlock()
		err := m.await(ctx, ch)
		m.mu.Lock()
		if err != nil {
			return err
		}
	}
}

// Open returns a Manager that runs child sessions through host: the one
// way to make a Manager, in memory or durable. It returns an error, and no
// Manager, for options that do not fit together (each named).
//
// A nil host makes an in-process Manager: every task brings its own
// function (Spec.Run), and a Launch without one is refused (a *SpecError
// naming Run). An in-process Manager owes Shutdown like any other: it
// stops what still runs and joins the goroutines it owns (one waits on
// its life until then, even once every task has ended).
//
// With WithJournal it is durable: it replays the journal and recovers what
// was live before it returns. Every task comes back as committed. A run that
// may have had a child is asked about through the host (StatusHost):
// alive, it is re-adopted; ended, it ends with that evidence; gone, or with
// a host that cannot say, it ends interrupt ("lost across restart") —
// never cancelled or completed without evidence. A run that never asked
// for a child starts now. Notifications produced and not delivered are
// delivered again, in their order, with their IDs. What is owed is derived
// from the state replayed, not only from the records: a recorded retry
// starts the attempt it chose, an ended task whose final summary was never
// produced gets one, a round whose tasks all ended gets its all_complete
// once, and a run whose deadline passed while nobody ran is stopped
// through the host (found by FindSession if need be) and ends only when
// the host confirms. ctx bounds the host calls of the recovery. A journal
// Open cannot make sense of is an error (naming, for the file journal, the
// file, the offset and the record kind); Open never panics on one. The
// Manager owns the journal from the call on: when Open fails, it has
// closed it.
func Open(ctx context.Context, host Host, opts ...Option) (*Manager, error) {
	m := newManager(host, opts)
	err := m.cfg.err
	if err == nil && m.cfg.journal != nil {
		err = m.recover(orBackground(ctx))
	}
	if err != nil {
		m.life.cancel()
		stop, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		_ = m.Shutdown(stop)
		return nil, err
	}
	return m, nil
}

// recover replays the journal, records the new process life's epoch, and
// reconciles what was live (reconcile), waiting for the host's answers.
func (m *Manager) recover(ctx context.Context) error {
	began := m.now()
	if t, ok := m.cfg.journal.(interface{ TornTail() string }); ok {
		var torn string
		if err := guardJournal("TornTail", func() error { torn = t.TornTail(); return nil }); err != nil {
			return err
		}
		if torn != "" {
			m.logAttrs(slog.LevelWarn, "the journal's last record was torn (a crash mid-write) and was cut off", slog.String("where", torn))
		}
	}
	m.mu.Lock()
	rv, err := m.restore(ctx)
	if err != nil {
		// What was replayed before the failure is half a ledger (a task
		// launched without its first attempt, say): nothing of it lives in
		// this process, and the Shutdown that follows must not act on it.
		m.led, m.order = newLedger(m.cfg.ids), nil
		m.mu.Unlock()
		return err
	}
	m.out.durable.advance(m.led.seq) // what was replayed is durable
	rv.restart = m.led.seq > 0       // a previous life left records: this is a restart
	m.led.tap = func(r record) { m.out.recs = append(m.out.recs, r) }
	m.healthRestore(m.now()) // before any run is admitted: the previous life's cooldowns
	m.led.emit(record{kind: recEpoch, at: m.now(), recordExt: &recordExt{epoch: m.changes.epoch, note: m.epochNote("")}})
	m.reconcile(rv)
	for before := -1; before != len(m.led.ended); { // what the journal still held past retention
		before = len(m.led.ended)
		m.sweep()
	}
	for _, e := range m.led.ended { // what stays is kept as a live Manager keeps it: frozen
		if e.notesOut == 0 {
			m.led.warm = append(m.led.warm, e)
		}
	}
	if len(m.led.warm) > freezeLag {
		m.goLater(m.freezeReplayed)
	}
	if err := m.unlock(); err != nil {
		return err
	}
	for range rv.left {
		select {
		case <-rv.pending:
		case <-ctx.Done():
			return fmt.Errorf("recovering from the journal: %w", ctx.Err())
		}
	}
	// A closure the crash interrupted is finished: its fence up again, its
	// runs stopped, its record written. One whose root or task is no
	// longer known is dropped, and one that outlives ctx goes on: neither
	// is counted finished.
	closures := 0
	for _, seq := range slices.Sorted(maps.Keys(rv.closing)) {
		c := rv.closing[seq]
		var err error
		if c.task != "" {
			_, err = m.closeTask(ctx, c.task, m.restartedBy(c.task), "", false)
		} else {
			_, err = m.closeBranch(ctx, c.root, closedByRestart, "", false)
		}
		if errors.Is(err, ErrUnknownSession) || errors.Is(err, ErrUnknownTask) {
			continue
		}
		if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
			closures++
		}
		if err != nil {
			m.logAttrs(slog.LevelWarn, "finishing a closure the restart interrupted", slog.String("session", c.root), slog.String("task", c.task), slog.String("err", safeText(err)))
		}
	}
	m.mu.Lock()
	m.restopBudgets() // a spent budget's branch with a run that outlived its closure: stopped again
	_ = m.unlock()
	if rv.restart {
		m.mu.Lock()
		rv.counts.Closures = closures
		m.recovered(rv, m.now().Sub(began))
		if err := m.unlock(); err != nil {
			return err
		}
	}
	return m.poisoned()
}

func newManager(host Host, opts []Option) *Manager {
	ownOnly := host == nil
	if ownOnly { // in-process only: every task brings its own function
		host = &FuncHost{fn: noRunFunc, h: funchost.New()}
	}
	cfg := config{holdLimit: 1024, notifyAttempts: 3, notifyBackoff: Backoff(200*time.Millisecond, 5*time.Second, 0.2),
		queueLimit: defaultNotifyQueueLimit, undeliveredLimit: defaultUndeliveredLimit,
		retention: Retention{MaxEnded: defaultMaxEnded}}
	for _, o := range opts {
		o.apply(&cfg)
	}
	if cfg.logger == nil {
		cfg.logger = slog.New(slog.DiscardHandler)
	}
	cfg.silent = cfg.logger.Handler() == slog.DiscardHandler
	if !cfg.silent {
		cfg.logInfo, cfg.logDebug = loggerTakes(cfg.logger, slog.LevelInfo), loggerTakes(cfg.logger, slog.LevelDebug)
	}
	if cfg.clock == nil {
		cfg.clock = clock.Real{}
	}
	if cfg.ids == nil {
		cfg.ids = newUUIDs()
	}
	if cfg.holdLimit <= 0 {
		cfg.holdLimit = 1024
	}
	if cfg.notifyAttempts < 1 {
		cfg.notifyAttempts = 1
	}
	if cfg.notifyBackoff == nil {
		cfg.notifyBackoff = func(int, error) time.Duration { return 0 }
	}
	if _, ok := cfg.notifier.(fleet.AtCommit); ok && cfg.journal != nil && !isNil(cfg.journal) {
		cfg.notesAtCommit = true
	}
	var badJournal error
	if cfg.journalSet && isNil(cfg.journal) {
		cfg.journal = nil // nothing to close
		badJournal = fmt.Errorf("%w: WithJournal was given no journal (nil): did opening it fail?", ErrInvalidArgument)
	}
	m := &Manager{
		hosts:    hosts{main: host, sessions: sessionKindOf(host)},
		cfg:      cfg,
		led:      newLedger(cfg.ids),
		closures: branchClosures{active: make(map[*closure]struct{})},
		changes:  changeFeed{subs: feed.New[Change](ErrLagged)},
		notes:    notifications{rounds: make(map[string]*round)},
		calls:    hostCalls{inflight: make(map[uint64]struct{}), held: held.New[observation](cfg.holdLimit)},
	}
	m.life.ctx, m.life.cancel = context.WithCancel(context.Background())
	m.life.dead = make(chan struct{})
	m.changes.epoch = uint64(time.Now().UnixNano()) // wall clock on purpose: it tells processes apart
	m.notes.lanes = dispatch.New(m.goLater, m.deliver)
	m.notes.lanes.SetLimit(cfg.queueLimit, lessNeeded)
	if cfg.health != nil {
		m.calls.health = newHealthBook(cfg.health)
		if hs, ok := cfg.journal.(HealthStore); ok {
			m.calls.health.store = hs
		}
	}
	errs := []error{cfg.err, badJournal}
	if cfg.limits != nil {
		m.calls.pool = slots.New[queued]()
		errs = append(errs, cfg.limits.validate())
	}
	if cfg.stallTimeout < 0 {
		errs = append(errs, fmt.Errorf("%w: WithStallTimeout takes a duration ≥ 0", ErrInvalidArgument))
	}
	errs = append(errs, cfg.tree.validate())
	m.cfg.err = errors.Join(errs...)
	m.attachHosts(ownOnly)
	return m
}

// attachHosts ties m's hosts to it: a FuncHost host serves the tasks with
// their own function too; any other gets an in-process host beside it.
func (m *Manager) attachHosts(ownOnly bool) {
	if a, ok := m.hosts.main.(interface{ attach(*Manager) }); ok {
		a.attach(m)
	}
	m.hosts.ownOnly = ownOnly
	if fh, ok := m.hosts.main.(*FuncHost); ok {
		m.hosts.funcs = fh
		return
	}
	m.hosts.funcs = &FuncHost{fn: noRunFunc, h: funchost.New()}
	m.hosts.funcs.attach(m)
}

// goLocked starts f on a goroutine the Manager owns, taking m.mu so that
// the start cannot race the end of Shutdown. It reports false after
// Shutdown.
func (m *Manager) goLocked(f func()) bool {
	m.mu.Lock()
	defer m.unlock()
	return m.life.group.Go(f)
}

// unlock releases m.mu, then emits the log lines and runs the effects
// queued while it was held. With a journal, the records committed while
// it was held are appended (in commit order: under the lock) and made
// durable before any effect runs; an error is returned, and the Manager
// stops acting on the world (see poison).
func (m *Manager) unlock() error { return m.unlockOn(nil) }

// unlockOn is unlock on worker w of the Manager's group, as the last thing
// the function w runs does: the first effect may run on w once that
// function returns, instead of on a new goroutine (see group.Worker).
func (m *Manager) unlockOn(w *group.Worker) error { return m.unlockUntil(context.Background(), w) }

// unlockCtx is unlock for a caller whose wait for its records to be
// durable keeps to ctx: once ctx ends first, it returns ctx's error
// wrapped in errNotDurable, and the rest — the wait, then the effects, the
// log lines, the callbacks — goes on, on a goroutine of the Manager, in the
// order it would have.
func (m *Manager) unlockCtx(ctx context.Context) error { return m.unlockUntil(ctx, nil) }

// released is what an unlock does once m.mu is released: wait for its
// records (up to last) to be durable, then start its effects, emit its log
// lines and measurements in its turn, and run its callbacks.
type released struct {
	fx       []effect
	lines    []logRec
	later    []func()
	measures []func()
	turn     uint64
	ordered  bool
	last     uint64
}

// logAttrs writes one line through the logger, which is user code: a panic
// in it is swallowed and counted (Drops.LoggerPanics), never passed on. m.mu
// must not be held.
func (m *Manager) logAttrs(level slog.Level, msg string, attrs ...slog.Attr) {
	defer func() {
		if r := recover(); r != nil {
			m.out.panics.Add(1)
		}
	}()
	ctx := context.Background()
	if !m.cfg.logger.Enabled(ctx, level) {
		return
	}
	m.cfg.logger.LogAttrs(ctx, level, msg, dropEmpty(attrs)...)
}

// dropEmpty leaves out the attributes whose value is an empty string: a
// line names what it knows (a reason, a session, a stop) and says nothing
// of what is not, never `reason=""`. attrs is the caller's own (every line
// builds its attributes afresh): it is compacted in place.
func dropEmpty(attrs []slog.Attr) []slog.Attr {
	out := attrs[:0]
	for _, a := range attrs {
		if a.Value.Kind() == slog.KindString && a.Value.String() == "" {
			continue
		}
		out = append(out, a)
	}
	clear(attrs[len(out):])
	return out
}

// logLocked queues a log line; m.mu is held and released with unlock.
func (m *Manager) logLocked(level slog.Level, msg string, attrs ...slog.Attr) {
	m.out.lines = append(m.out.lines, logRec{level: level, msg: msg, attrs: attrs})
}

func (m *Manager) now() time.Time { return m.cfg.clock.Now() }

// ledgerBug queues a log line for a write the ledger refused: a bug in the
// Manager, never trusted away. m.mu is held.
func (m *Manager) ledgerBug(e *entry, err error) {
	m.logLocked(slog.LevelError, "ledger refused a write", slog.String("task", e.info.id), slog.String("err", safeText(err)))
}

// rejectedLocked queues the debug line of an event that was not applied.
func (m *Manager) rejectedLocked(ev Event, who resolved, err error) {
	m.logLocked(slog.LevelDebug, "event ignored", rejectedAttrs(ev, who, err)...)
}

func rejectedAttrs(ev Event, who resolved, err error) []slog.Attr {
	return []slog.Attr{
		slog.String("reason", err.Error()),
		slog.String("kind", string(ev.Kind)),
		slog.String("task", who.taskID),
		slog.String("attempt", who.attemptID),
		slog.String("session", ev.SessionID),
		slog.String("eventAttempt", ev.AttemptID),
	}
}

// logRejected logs, without the lock, an event Observe did not apply. It
// allocates nothing when debug logging is off.
func (m *Manager) logRejected(ev Event, who resolved, err error) {
	defer func() {
		if r := recover(); r != nil {
			m.out.panics.Add(1)
		}
	}()
	ctx := context.Background()
	if !m.cfg.logger.Enabled(ctx, slog.LevelDebug) {
		return
	}
	m.cfg.logger.LogAttrs(ctx, slog.LevelDebug, "event ignored", dropEmpty(rejectedAttrs(ev, who, err))...)
}

// Shutdown refuses new work (ErrShutdown), aborts every running child
// through the host and records it interrupt (with its final summary), waits
// for the notifications already produced to be delivered, then cancels the
// contexts of host and notifier calls still outstanding and returns once no
// goroutine of the Manager is left.
//
// ctx bounds the graceful part: when it ends, Shutdown cancels the
// outstanding contexts at once and waits at most shutdownGrace more for the
// calls to return. Like http.Server's Shutdown, it then returns an error
// that wraps ctx's error and names what is still running: the goroutines
// still inside a Host, Notifier or FuncHost function that ignores its
// context are the user's from then on (no new goroutine starts), and the
// tasks they serve keep their live state. A child whose abort failed stays
// in its live state and is named in the returned error, as are
// notifications left undelivered. Shutdown may be called more than once;
// later calls wait like the first, also for what an earlier call left
// running.
//
// Every Manager owes Shutdown, an in-process one too: until it is called,
// one goroutine waits on the Manager's life even once every task ended.
// With nothing left behind it returns nil, also when ctx had already
// ended; a run it stops ends interrupt once it really stopped (an
// in-process function that returns its context's error as it hears the
// stop included).
//
// Called with the context of a Host or Notifier callback, Shutdown cannot
// wait for that callback to return: it begins the shutdown (refusing work
// and aborting children) and returns ErrStopPending at once. Call it again
// from outside any callback to wait for the end.
func (m *Manager) Shutdown(ctx context.Context) error {
	ctx = orBackground(ctx)
	m.step(&shutdownIn{})
	if _, inCallback := RunFromContext(ctx); inCallback {
		return ErrStopPending
	}

	// What ctx cut short is not an error in itself: what it left is
	// (named below, with ctx's error), and nothing else.
	_ = m.awaitStops(ctx)
	_ = m.notes.lanes.Wait(ctx)
	var errs []error
	if err := m.poisoned(); err != nil {
		errs = append(errs, fmt.Errorf("shutdown: nothing was recorded since: %w", err))
	}
	m.life.cancel()
	m.closeSubscriptions(ErrShutdown)
	if err := m.join(ctx); err != nil {
		errs = append(errs, err)
	}
	m.life.watchers.Close()
	_ = m.life.watchers.Wait(context.Background())
	if left := m.leftBehind(); len(left) > 0 {
		if err := ctx.Err(); err != nil {
			left = append(left, fmt.Errorf("shutdown: %w", err))
		}
		errs = append(errs, left...)
	}
	if j := m.cfg.journal; j != nil && m.life.group.Running() == 0 {
		m.life.journalClosed.Do(func() {
			if err := guardJournal("Close", j.Close); err != nil {
				errs = append(errs, fmt.Errorf("shutdown: closing the journal: %w", err))
			}
		})
	}
	return errors.Join(errs...)
}

// leftBehind names what a Shutdown leaves: children whose abort failed or
// never returned, and notifications not delivered.
func (m *Manager) leftBehind() []error {
	var errs []error
	m.mu.Lock()
	lost := len(m.notes.lost)
	var live []string
	for _, e := range m.order {
		if !e.terminal() {
			live = append(live, e.info.id+" (session "+e.cur().SessionID+")")
		}
	}
	m.unlock()
	if len(live) > 0 {
		errs = append(errs, fmt.Errorf("shutdown: children did not stop (their abort failed or never returned): %v", live))
	}
	if n := m.notes.lanes.Pending() + lost; n > 0 {
		errs = append(errs, fmt.Errorf("shutdown: %d notifications not delivered (see Undelivered)", n))
	}
	return errs
}

// onShutdown decides the start of Shutdown, once: no new work from now on,
// and every live task's run is stopped (interrupt). m.mu is held.
func (m *Manager) onShutdown() {
	if m.life.closing {
		return
	}
	m.life.closing = true
	for _, q := range m.calls.fanout { // a Launch waiting for a slot looks again, and is refused
		for _, w := range q {
			if !w.woken {
				w.woken = true
				close(w.ch)
			}
		}
	}
	now := m.now()
	for _, e := range slices.Clone(m.order) { // an end here may forget an ended task (retention)
		if e.terminal() {
			continue
		}
		m.wantStop(e, stopByShutdown, now)
		m.stopRun(e, now)
	}
}

// shutdownGrace is how long Shutdown, once its context has ended and the
// contexts of outstanding host and notifier calls are cancelled, still
// waits for those calls to return before it gives up on them.
const shutdownGrace = time.Second

// join waits until no goroutine of the Manager runs and closes the group so
// none starts again. Every goroutine is reserved under m.mu (or started
// by one already counted), so the check and the close are one step. When ctx ends, the goroutines get shutdownGrace to
// honour their cancelled contexts; then the group is closed anyway and the
// error names what is left.
func (m *Manager) join(ctx context.Context) error {
	var ended error // ctx's error, once it ended
	for {
		err := m.life.group.Wait(ctx)
		if err != nil && ended == nil {
			ended = err
			grace, cancel := context.WithTimeout(context.Background(), shutdownGrace)
			defer cancel()
			ctx = grace
			continue
		}
		m.mu.Lock()
		if n := m.life.group.Running(); n == 0 || err != nil {
			m.life.group.Close()
			m.unlock()
			if n == 0 {
				return nil
			}
			return fmt.Errorf("shutdown: %w: %d goroutines are still in Host, Notifier or FuncHost calls that ignore their cancelled context", ended, n)
		}
		m.unlock()
	}
}

// awaitStops waits until no session start or abort is in flight, or ctx
// ends. After the journal failed no answer is recorded any more, so it
// waits for none (join waits for the calls themselves).
func (m *Manager) awaitStops(ctx context.Context) error {
	for {
		m.mu.Lock()
		busy := (len(m.calls.inflight) > 0 || m.calls.abortsN > 0) && m.poisoned() == nil
		ch := m.waitAny()
		m.unlock()
		if !busy {
			return nil
		}
		if err := m.await(ctx, ch); err != nil && ctx.Err() != nil {
			return fmt.Errorf("shutdown: %w", ctx.Err())
		} // a journal failure: busy is false from now on
	}
}
