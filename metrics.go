package bgtask

import "time"

// Metrics receives the Manager's measurements (WithMetrics): counters
// (launches, attempts started, retries by reason, outcomes by state, stops
// by who asked, branch closures, a restart's recovery), durations for
// histograms (queue wait, attempt duration, end to end, a closure, a
// recovery) and gauges (live tasks, queue depth per concurrency key). They
// are the facts the info log lines tell (WithLogger), with the same names.
//
// The methods are called outside the Manager's lock, one at a time, in the
// order the measurements were made (so a gauge's last value is its current
// one): they must be quick and must not block or call into the Manager,
// which waits for them before its next measurements. A panic in one is
// recovered and counted in Dropped().LoggerPanics, as a logger's are. Embed
// NopMetrics to implement only some (methods added in later releases then
// record nothing); the otelmetrics module adapts OpenTelemetry.
//
// A class passed (a Reason, a StopKind, ClosureSummary.By) is empty only
// where its method says so (TaskEnded's reason): an adapter that makes
// attributes of them leaves an empty one out rather than export "".
type Metrics interface {
	TaskLaunched(t Task)
	AttemptStarted(t Task, a Attempt)
	// RetryScheduled: attempt failed fails over; reason is its outcome's
	// class (ReasonProviderError, ReasonDeadline, ...).
	RetryScheduled(t Task, failed Attempt, reason Reason)
	// AttemptEnded: a started attempt ended, after d running.
	AttemptEnded(t Task, a Attempt, d time.Duration)
	// TaskEnded: state is the outcome's (Outcome.State), d the time from
	// launch to end. reason is the outcome's class (Outcome.Reason): empty
	// for a clean answer and for a task a stop ended (t.Stop says who
	// asked), when state says it all.
	TaskEnded(t Task, state Status, reason Reason, d time.Duration)
	// QueueWaited: an attempt got a slot of key after waiting d.
	QueueWaited(key string, d time.Duration)
	// LiveTasks and QueueDepth are gauges, reported as they change.
	LiveTasks(n int)
	QueueDepth(key string, queued int)
	// StopAsked: a stop of t was asked and recorded, by cause (t.Stop):
	// once per task, for the first stop asked of it — by a cancel, a
	// branch closure, the caller's context, the task's deadline, a deleted
	// session, a spent budget or Shutdown. The task ends later (TaskEnded).
	StopAsked(t Task, cause StopCause)
	// ClosureBegun: a branch closure raised its fence (c's counts are 0).
	ClosureBegun(c ClosureSummary)
	// ClosureEnded: the closure took its fence down after d, having
	// stopped what c counts.
	ClosureEnded(c ClosureSummary, d time.Duration)
	// Recovered: a Manager reopened on a journal that held a previous
	// life's records finished its recovery after d, as c counts (once,
	// from Open).
	Recovered(c RecoveryCounts, d time.Duration)
	// HealthChanged: a model's or provider's health changed (WithHealth):
	// a cooldown began or was moved, its probe was let through, it ended.
	HealthChanged(h Health)
	// UsageReported: an attempt of task id, on model, reported usage u
	// (a delta: Event.Usage, Run.Usage), late reports of ended runs
	// included.
	UsageReported(id string, model Model, u Usage)
	// BudgetCrossed: budget s reached its soft threshold (hard false) or
	// a hard limit (hard, s.Exceeded names it: its branch is stopped).
	BudgetCrossed(s BudgetState, hard bool)
}

// ClosureSummary is a branch closure as Metrics.ClosureBegun and
// ClosureEnded see it: what it closed, what began it, the stop it asked,
// and (at its end) what became of the runs it asked to stop.
type ClosureSummary struct {
	// SessionID is the root session closed; TaskID the task closed as a
	// unit (Stop with Target.Tree, or the task the root session belongs
	// to), empty while the root is no task's session.
	SessionID, TaskID string
	// By is what began it: "stop_session" or "stop_tree" (Stop with
	// Target.Session, or Target.Task and Tree), "caller" (the launch
	// context of a task with Spec.CancelWithCaller ended),
	// "session_deleted" (the host reported the root session deleted: its
	// branch is closed), "budget" (the budget the task holds was spent: its
	// branch is stopped) or "restart" (a closure a crash interrupted,
	// finished at the restart).
	By string
	// Stop is the stop it asked of every run in its branch: kind closure
	// (its root or task), caller, or budget.
	Stop StopCause
	// Stopped, Failed and Stopping count the runs of its ClosureReport
	// (ended; abort failed, still live; asked to stop and not ended when
	// it returned), Passes its scans.
	Stopped, Failed, Stopping, Passes int
	// Dropped: the root turned out to be no task's session and no task's
	// parent (ErrUnknownSession): nothing was recorded.
	Dropped bool
	// Ended says why the closure ended before every run it asked to stop
	// had stopped or failed to, when it did: "" (it ran to its end, or
	// was Dropped), "cancelled" (its caller's context ended first),
	// "shutdown" (Shutdown cut it short, or it could not go on after
	// Shutdown) or "journal_failed" (the journal failed while it waited).
	// Its counts are what it had seen then; its Stopping runs may still
	// stop.
	Ended string
}

// Why a closure ended early (ClosureSummary.Ended).
const (
	closureCancelled     = "cancelled"
	closureShutdown      = "shutdown"
	closureJournalFailed = "journal_failed"
)

// RecoveryCounts is what a restart's recovery found in the journal and
// did (Metrics.Recovered, and the info line "recovered from the
// journal"). Each run live at the crash is counted once, in exactly one
// of Readopted, Ended, Interrupted, Stopped and Started: Live is their
// sum. A task between attempts at the crash (its retry recorded, its next
// attempt not) is live, and counted by what becomes of the attempt the
// recovery makes for it (Retried counts those attempts again).
type RecoveryCounts struct {
	// Tasks is the tasks the journal held (ended ones kept included), Live
	// those live after the replay: the runs live at the crash.
	Tasks, Live int
	// Readopted: runs whose session the host found alive, taken back (a
	// stop asked before the restart goes on).
	Readopted int
	// Ended: runs whose session the host found ended: they end with that
	// evidence (or ended by themselves while the host was asked).
	Ended int
	// Interrupted: runs ended interrupt — their session gone, or no host
	// that could say (lostAcrossRestart), or a start whose outcome was lost
	// or whose session could not be taken back (startOutcomeUnknown).
	Interrupted int
	// Stopped: runs a stop ended — a stop asked before the restart, or a
	// deadline that passed meanwhile: at once when no child was ever
	// made, or once its abort landed, before or after the host's answer.
	Stopped int
	// Started: runs that had not asked for a child, admitted again: they
	// start now.
	Started int
	// Retried: retries the journal held whose next attempt it did not:
	// that attempt is made now, and counted in one of the above too
	// (Started, unless it is stopped or cannot run).
	Retried int
	// Redelivered: notifications produced and not delivered, queued again
	// with their IDs; Owed: notifications owed and never produced (a final
	// summary, an all_complete), produced now; Undelivered: notifications
	// given up before the restart, kept in Dropped().Undelivered.
	Redelivered, Owed, Undelivered int
	// Closures: closures the crash interrupted, finished by the recovery
	// (one whose root or task is no longer known is dropped, and one that
	// outlives the recovery's context goes on: neither is counted).
	Closures int
}

// NopMetrics implements Metrics and records nothing: embed it.
type NopMetrics struct{}

// TaskLaunched records nothing.
func (NopMetrics) TaskLaunched(Task) {}

// AttemptStarted records nothing.
func (NopMetrics) AttemptStarted(Task, Attempt) {}

// RetryScheduled records nothing.
func (NopMetrics) RetryScheduled(Task, Attempt, Reason) {}

// AttemptEnded records nothing.
func (NopMetrics) AttemptEnded(Task, Attempt, time.Duration) {}

// TaskEnded records nothing.
func (NopMetrics) TaskEnded(Task, Status, Reason, time.Duration) {}

// QueueWaited records nothing.
func (NopMetrics) QueueWaited(string, time.Duration) {}

// LiveTasks records nothing.
func (NopMetrics) LiveTasks(int) {}

// QueueDepth records nothing.
func (NopMetrics) QueueDepth(string, int) {}

// StopAsked records nothing.
func (NopMetrics) StopAsked(Task, StopCause) {}

// ClosureBegun records nothing.
func (NopMetrics) ClosureBegun(ClosureSummary) {}

// ClosureEnded records nothing.
func (NopMetrics) ClosureEnded(ClosureSummary, time.Duration) {}

// Recovered records nothing.
func (NopMetrics) Recovered(RecoveryCounts, time.Duration) {}

// HealthChanged records nothing.
func (NopMetrics) HealthChanged(Health) {}

// UsageReported records nothing.
func (NopMetrics) UsageReported(string, Model, Usage) {}

// BudgetCrossed records nothing.
func (NopMetrics) BudgetCrossed(BudgetState, bool) {}

// measure queues a call of the Metrics for once m.mu is released. m.mu is
// held; call it only with m.cfg.metrics set.
func (m *Manager) measure(f func(Metrics)) {
	m.out.measures = append(m.out.measures, func() {
		defer func() {
			if recover() != nil {
				m.out.panics.Add(1)
			}
		}()
		f(m.cfg.metrics)
	})
}
