package bgtask

import "time"

// Metrics receives the Manager's measurements (WithMetrics): counters
// (launches, attempts started, retries by reason, outcomes by state),
// durations for histograms (queue wait, attempt duration, end to end) and
// gauges (live tasks, queue depth per concurrency key). The methods are
// called outside the Manager's lock, one at a time, in the order the
// measurements were made (so a gauge's last value is its current one):
// they must be quick and must not block or call into the Manager, which
// waits for them before its next measurements. A panic in one is recovered and counted
// as LoggerPanics are. Embed NopMetrics to implement only some; the
// otelmetrics module adapts OpenTelemetry.
type Metrics interface {
	TaskLaunched(t Task)
	AttemptStarted(t Task, a Attempt)
	// RetryScheduled: attempt failed fails over; reason is its outcome's
	// class (ReasonProviderError, ReasonDeadline, ...).
	RetryScheduled(t Task, failed Attempt, reason Reason)
	// AttemptEnded: a started attempt ended, after d running.
	AttemptEnded(t Task, a Attempt, d time.Duration)
	// TaskEnded: state is the outcome's (Outcome.State), d the time from
	// launch to end.
	TaskEnded(t Task, state Status, reason Reason, d time.Duration)
	// QueueWaited: an attempt got a slot of key after waiting d.
	QueueWaited(key string, d time.Duration)
	// LiveTasks and QueueDepth are gauges, reported as they change.
	LiveTasks(n int)
	QueueDepth(key string, queued int)
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
