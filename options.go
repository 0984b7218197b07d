package bgtask

import (
	"context"
	"log/slog"
	"time"
)

// Clock is the Manager's time source (WithClock): every timeout, delay,
// deadline and timestamp the Manager keeps is read from it, so a test can
// move time by hand (bgtasktest.Clock) and never sleeps to wait for a
// state. The default is the wall clock. A Clock must be safe for
// concurrent use, and may be called with the Manager's lock held: it must
// not block or call into the Manager.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// NewTimer returns a timer that fires once, d from now (at once for
	// d <= 0), unless it is stopped first.
	NewTimer(d time.Duration) Timer
}

// Timer is a Clock's timer: C delivers the time once when it fires, Stop
// prevents that and reports whether it did (as time.Timer's do).
type Timer = interface {
	C() <-chan time.Time
	Stop() bool
}

// Option configures a Manager.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	notifyAttempts    int
	notifyBackoff     func(attempt int, cause error) time.Duration
	limits            *ModelLimits
	stallTimeout      time.Duration
	gateTimeout       time.Duration
	notifier          Notifier
	notesAtCommit     bool // notifier is a fleet.AtCommit and there is a journal: see push
	logger            *slog.Logger
	silent            bool // logger discards everything: no log line is worth building
	logInfo, logDebug bool // the logger's handler takes info (debug) lines, as it said at Open (the lines are built only then)
	clock             Clock
	ids               IDGenerator
	retryable         func(err error, retryable bool) bool
	retryDelay        func(attempt int, cause error) time.Duration
	holdLimit         int
	queueLimit        int // notifications waiting per parent
	undeliveredLimit  int // notifications kept for Dropped().Undelivered
	journal           Journal
	journalSet        bool                                                // WithJournal was given, maybe with nil
	startGate         func(ctx context.Context, req SessionRequest) error // WithStartGate
	retention         Retention
	tree              TreeLimits
	budget            *Budget       // WithBudget: every root launch's that sets none; nil: none
	metrics           Metrics       // WithMetrics; nil: none
	health            *HealthPolicy // WithHealth, defaults filled in; nil: no health kept

	err error // an invalid option, found by Open: every Launch returns it
}

// Retention bounds the ended tasks a Manager keeps in memory
// (WithRetention). Live tasks are always kept.
type Retention struct {
	// MaxEnded is how many ended tasks are kept; the oldest ended that
	// may go (see WithRetention) is forgotten first. 0: defaultMaxEnded;
	// < 0: no bound.
	MaxEnded int
	// MaxAge forgets a task that ended longer ago than this. 0: no age
	// bound. Age is looked at as tasks end (an idle Manager forgets
	// nothing).
	MaxAge time.Duration
}

// WithRetention sets how many ended tasks, and for how long, a Manager
// keeps. An ended task stays while its parent session has live tasks
// (they may still be reported together) and until its notifications are
// delivered. A forgotten task's id answers ErrForgotten (Task, Wait,
// Stop) for the last 100,000 forgotten; with a journal, compaction drops
// it from disk too. Default: the last defaultMaxEnded ended tasks.
func WithRetention(r Retention) Option {
	return optionFunc(func(c *config) {
		if r.MaxEnded == 0 {
			r.MaxEnded = defaultMaxEnded
		}
		c.retention = r
	})
}

// WithJournal makes the Manager durable: every record it commits is
// appended to j, and made durable before anything it describes takes
// effect (a host call, a notification); Open replays j and recovers what
// was live. The Manager owns j from then on and closes it at the end of
// Shutdown. Default: none — the Manager is memory-only, and a restart
// forgets every task (its children keep running, unknown).
func WithJournal(j Journal) Option {
	return optionFunc(func(c *config) { c.journal, c.journalSet = j, true })
}

// WithStartGate makes every session start (StartSession, and
// ResumeSession for Spec.ContinueFrom) ask gate first: outside the lock,
// after the start's intent is durable, with the request the host would
// get. A non-nil error refuses the start for good: the attempt fails with
// it, as a permanent error (no retry follows), and the host is not called.
// A journal shared by several processes uses it (pgledger refuses a start
// inside a branch another process is closing); a panic is a refusal.
func WithStartGate(gate func(ctx context.Context, req SessionRequest) error) Option {
	return optionFunc(func(c *config) { c.startGate = gate })
}

// WithNotifier sends notifications to n. Default: none are sent.
func WithNotifier(n Notifier) Option { return optionFunc(func(c *config) { c.notifier = n }) }

// loggerTakes asks l's handler (user code) whether it takes lines of
// level; a panic is a no.
func loggerTakes(l *slog.Logger, level slog.Level) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	return l.Enabled(context.Background(), level)
}

// WithLogger logs through l, each line with task, attempt and session
// attributes where it has them:
//
//   - info: one line per milestone — task launched, attempt started,
//     retry scheduled (with its reason class), stop asked (who asked:
//     stop.kind and what it names, stop.root, stop.task), task ended
//     (with its outcome, attempts and stop), branch closure begun and
//     ended (what began it, with the runs stopped, failed and still
//     stopping), and, after a restart, what the recovery found and did;
//   - debug: every event held for a session start in flight, or rejected
//     (stale, unknown);
//   - warn and error: the anomalies — a failed abort or host call, a
//     notification refused every time, a journal that failed.
//
// An attribute with nothing to say (no reason for a clean answer, no
// session yet) is left out, never written empty. Whether the handler takes
// info and debug lines is asked once, at Open: lines it would drop are
// never built. A panic in the logger is swallowed and counted
// (Dropped().LoggerPanics). Default: nothing is logged.
func WithLogger(l *slog.Logger) Option { return optionFunc(func(c *config) { c.logger = l }) }

// WithClock reads time and makes timers from c. Default: the wall clock. c
// is called with the Manager's lock held: it must be fast and must not call
// into the Manager.
func WithClock(c Clock) Option { return optionFunc(func(cfg *config) { cfg.clock = c }) }

// WithIDs makes task, attempt and run ids with g. Default: random UUIDs.
func WithIDs(g IDGenerator) Option { return optionFunc(func(c *config) { c.ids = g }) }

// WithMetrics reports the Manager's measurements to mt; see Metrics.
// Default: none.
func WithMetrics(mt Metrics) Option { return optionFunc(func(c *config) { c.metrics = mt }) }

// WithHoldLimit bounds the events held while session starts are in flight:
// at most n events for sessions not yet bound (all together), and at most n
// per attempt for events that name their AttemptID. Default: 1024. A
// liveness event (busy, waiting, compacted) beyond the bound is dropped:
// Observe refuses it with ErrUnknownSession. An event that ends a run
// (idle, error, interrupted, deleted) is never lost to the bound: it takes
// the place of the oldest held liveness event, or, when only such ends are
// held, is held past the bound (up to twice it). A session event is
// held only until every start that was in flight when it arrived has
// returned; an Event that carries AttemptID is never crowded out by events
// for other sessions, so hosts that know the attempt should send it.
func WithHoldLimit(n int) Option { return optionFunc(func(c *config) { c.holdLimit = n }) }
