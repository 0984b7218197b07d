// Package otelmetrics reports a bgtask Manager's measurements
// (bgtask.Metrics) as OpenTelemetry instruments:
//
//	mt, err := otelmetrics.New(otel.Meter("bgtask"))
//	m, err := bgtask.Open(ctx, host, bgtask.WithMetrics(mt))
//
// Counters, with their attributes:
//
//   - bgtask.tasks.launched;
//   - bgtask.attempts.started (model);
//   - bgtask.retries (reason);
//   - bgtask.tasks.ended (state, reason): reason is left out when the
//     outcome has none (a clean answer, a task a stop ended), never "";
//   - bgtask.stops.asked (stop.kind: cancel, closure, caller, deadline,
//     session_deleted, shutdown, budget, other): the first stop asked of a
//     task;
//   - bgtask.closures.begun (by, stop.kind) and bgtask.closures.ended (by,
//     stop.kind, outcome): by is what began the closure (stop_session or
//     stop_tree: Manager.Stop; caller, session_deleted, restart, or budget: a
//     hard limit reached), outcome stopped (every run it asked to stop
//     ended), failed (an abort failed), stopping (it returned before every
//     stop landed), unknown_session, or, for a closure cut short
//     (bgtask.ClosureSummary.Ended), cancelled (its caller's context
//     ended), shutdown or journal_failed;
//   - bgtask.closure.runs (by, result: stopped, failed, stopping): the
//     runs closures asked to stop, by what became of them;
//   - bgtask.health.changes (key, state, why): a model's or provider's
//     health changed (bgtask.WithHealth);
//   - bgtask.usage.tokens (direction: input, output, cached; provider,
//     model), unit {token}: the tokens attempts reported using
//     (bgtask.Usage); cached tokens are part of input, counted again
//     under their own direction, so input plus output is what a
//     bgtask.Budget counts;
//   - bgtask.usage.requests (provider, model), unit {request}: the model
//     requests attempts reported;
//   - bgtask.usage.cost (provider, model), unit {millionth}: what they
//     cost, in millionths of the harness's currency unit (bgtask.Cost:
//     divide by 1e6 for units; bgtask never converts currencies);
//   - bgtask.budget.crossings (level: soft, hard; limit: tokens, cost,
//     requests): a budget reached its soft threshold or a hard limit;
//     limit, the hard limit reached, is left out of a soft crossing;
//   - bgtask.recoveries: restarts recovered from a journal;
//     bgtask.recovery.runs (outcome: readopted, ended, interrupted,
//     stopped, started): the runs live at the crash, each counted once, in
//     the one outcome the recovery gave it — their sum is the runs live
//     at the crash (a task between attempts counts by the attempt the
//     recovery makes for it); bgtask.recovery.retries: those attempts,
//     counted again; bgtask.recovery.notifications (outcome: redelivered,
//     owed, undelivered); bgtask.recovery.closures: closures a crash
//     interrupted that the recovery finished.
//
// Histograms, in seconds: bgtask.queue.wait (key), bgtask.attempt.duration
// (model, status), bgtask.task.duration (state), bgtask.closure.duration
// (by, outcome), bgtask.recovery.duration. Gauges: bgtask.tasks.live,
// bgtask.queue.depth (key). Task, session and root ids are never
// attributes (unbounded); the log lines (bgtask.WithLogger) carry them.
package otelmetrics

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/bgtask/bgtask"
)

// Metrics is bgtask.Metrics on OpenTelemetry instruments. Its methods
// only record: they never block.
type Metrics struct {
	launched, started, retries, ended metric.Int64Counter
	queueWait, attempt, task          metric.Float64Histogram
	live, depth                       metric.Int64Gauge

	stops                                                                      metric.Int64Counter
	closuresBegun, closuresEnded, closureRuns                                  metric.Int64Counter
	closure                                                                    metric.Float64Histogram
	healthChanges                                                              metric.Int64Counter
	tokens, requests, cost, crossings                                          metric.Int64Counter
	recoveries, recoveryRuns, recoveryRetries, recoveryNotes, recoveryClosures metric.Int64Counter
	recovery                                                                   metric.Float64Histogram
}

var _ bgtask.Metrics = (*Metrics)(nil)

// New makes the instruments on meter.
func New(meter metric.Meter) (*Metrics, error) {
	if meter == nil {
		return nil, errors.New("otelmetrics: a nil Meter")
	}
	var m Metrics
	var errs []error
	counter := func(name, desc string, opts ...metric.Int64CounterOption) metric.Int64Counter {
		c, err := meter.Int64Counter(name, append([]metric.Int64CounterOption{metric.WithDescription(desc)}, opts...)...)
		errs = append(errs, err)
		return c
	}
	seconds := func(name, desc string) metric.Float64Histogram {
		h, err := meter.Float64Histogram(name, metric.WithDescription(desc), metric.WithUnit("s"))
		errs = append(errs, err)
		return h
	}
	gauge := func(name, desc string) metric.Int64Gauge {
		g, err := meter.Int64Gauge(name, metric.WithDescription(desc))
		errs = append(errs, err)
		return g
	}
	m.launched = counter("bgtask.tasks.launched", "tasks launched")
	m.started = counter("bgtask.attempts.started", "attempts whose child session runs, by model")
	m.retries = counter("bgtask.retries", "attempts that failed over to the next, by reason class")
	m.ended = counter("bgtask.tasks.ended", "tasks ended, by outcome state and reason")
	m.queueWait = seconds("bgtask.queue.wait", "time an attempt waited for a concurrency slot, by key")
	m.attempt = seconds("bgtask.attempt.duration", "time an attempt's child session ran, by model and status")
	m.task = seconds("bgtask.task.duration", "time from launch to end, by outcome state")
	m.live = gauge("bgtask.tasks.live", "live (pending or running) tasks")
	m.depth = gauge("bgtask.queue.depth", "attempts waiting for a concurrency slot, by key")
	m.stops = counter("bgtask.stops.asked", "stops asked of tasks, by who asked")
	m.closuresBegun = counter("bgtask.closures.begun", "branch closures begun, by what began them")
	m.closuresEnded = counter("bgtask.closures.ended", "branch closures ended, by what began them and how they ended")
	m.closureRuns = counter("bgtask.closure.runs", "runs branch closures asked to stop, by what became of them")
	m.closure = seconds("bgtask.closure.duration", "time a branch closure's fence was up, by what began it and how it ended")
	m.recoveries = counter("bgtask.recoveries", "restarts recovered from a journal")
	m.healthChanges = counter("bgtask.health.changes", "a model's or provider's health changed")
	m.tokens = counter("bgtask.usage.tokens", "tokens attempts reported using, by direction (input, output, cached: cached tokens are part of input), provider and model", metric.WithUnit("{token}"))
	m.requests = counter("bgtask.usage.requests", "model requests attempts reported, by provider and model", metric.WithUnit("{request}"))
	m.cost = counter("bgtask.usage.cost", "cost attempts reported, in millionths of the harness's currency unit (bgtask.Cost), by provider and model", metric.WithUnit("{millionth}"))
	m.crossings = counter("bgtask.budget.crossings", "budgets that reached their soft threshold or a hard limit, by level (soft, hard) and the hard limit reached")
	m.recoveryRuns = counter("bgtask.recovery.runs", "runs live at a crash, by what the recovery made of them")
	m.recoveryRetries = counter("bgtask.recovery.retries", "recorded retries whose next attempt a recovery made")
	m.recoveryNotes = counter("bgtask.recovery.notifications", "notifications a recovery queued again, produced or kept undelivered")
	m.recoveryClosures = counter("bgtask.recovery.closures", "closures a crash interrupted, finished by the recovery")
	m.recovery = seconds("bgtask.recovery.duration", "time a recovery from a journal took")
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return &m, nil
}

var bg = context.Background()

// TaskLaunched counts a launch (bgtask.tasks.launched).
func (m *Metrics) TaskLaunched(bgtask.Task) { m.launched.Add(bg, 1) }

// AttemptStarted counts an attempt whose child runs, by model
// (bgtask.attempts.started).
func (m *Metrics) AttemptStarted(_ bgtask.Task, a bgtask.Attempt) {
	m.started.Add(bg, 1, metric.WithAttributes(attribute.String("model", a.Model.String())))
}

// RetryScheduled counts a fail-over by its reason class (bgtask.retries).
func (m *Metrics) RetryScheduled(_ bgtask.Task, _ bgtask.Attempt, reason bgtask.Reason) {
	m.retries.Add(bg, 1, metric.WithAttributes(attribute.String("reason", string(reason))))
}

// AttemptEnded records how long the attempt ran, by model and status
// (bgtask.attempt.duration).
func (m *Metrics) AttemptEnded(_ bgtask.Task, a bgtask.Attempt, d time.Duration) {
	m.attempt.Record(bg, d.Seconds(), metric.WithAttributes(attribute.String("model", a.Model.String()), attribute.String("status", string(a.Status))))
}

// TaskEnded counts the end by state and reason; reason is left out when
// the outcome has none (a clean answer, a stopped task): the state says it.
func (m *Metrics) TaskEnded(_ bgtask.Task, state bgtask.Status, reason bgtask.Reason, d time.Duration) {
	attrs := metric.WithAttributes(attribute.String("state", string(state)))
	if reason != "" {
		attrs = metric.WithAttributes(attribute.String("state", string(state)), attribute.String("reason", string(reason)))
	}
	m.ended.Add(bg, 1, attrs)
	m.task.Record(bg, d.Seconds(), metric.WithAttributes(attribute.String("state", string(state))))
}

// QueueWaited records an attempt's wait for a slot of key
// (bgtask.queue.wait).
func (m *Metrics) QueueWaited(key string, d time.Duration) {
	m.queueWait.Record(bg, d.Seconds(), metric.WithAttributes(attribute.String("key", key)))
}

// LiveTasks records the live tasks (bgtask.tasks.live).
func (m *Metrics) LiveTasks(n int) { m.live.Record(bg, int64(n)) }

// QueueDepth records the attempts waiting for a slot of key
// (bgtask.queue.depth).
func (m *Metrics) QueueDepth(key string, n int) {
	m.depth.Record(bg, int64(n), metric.WithAttributes(attribute.String("key", key)))
}

// StopAsked counts a task's first stop, by who asked (bgtask.stops.asked).
func (m *Metrics) StopAsked(_ bgtask.Task, c bgtask.StopCause) {
	m.stops.Add(bg, 1, metric.WithAttributes(attribute.String("stop.kind", string(c.Kind))))
}

// ClosureBegun counts a closure, by what began it and the stop it asks
// (bgtask.closures.begun).
func (m *Metrics) ClosureBegun(c bgtask.ClosureSummary) {
	m.closuresBegun.Add(bg, 1, metric.WithAttributes(attribute.String("by", c.By), attribute.String("stop.kind", string(c.Stop.Kind))))
}

// ClosureEnded counts a closure's end by how it ended, records how long
// its fence was up, and counts the runs it asked to stop by what became
// of them (bgtask.closures.ended, bgtask.closure.duration,
// bgtask.closure.runs).
func (m *Metrics) ClosureEnded(c bgtask.ClosureSummary, d time.Duration) {
	outcome := "stopped"
	switch {
	case c.Dropped:
		outcome = "unknown_session"
	case c.Ended != "":
		outcome = c.Ended // cut short: cancelled, shutdown, journal_failed
	case c.Failed > 0:
		outcome = "failed"
	case c.Stopping > 0:
		outcome = "stopping"
	}
	by := attribute.String("by", c.By)
	m.closuresEnded.Add(bg, 1, metric.WithAttributes(by, attribute.String("stop.kind", string(c.Stop.Kind)), attribute.String("outcome", outcome)))
	m.closure.Record(bg, d.Seconds(), metric.WithAttributes(by, attribute.String("outcome", outcome)))
	for _, r := range []struct {
		result string
		n      int
	}{{"stopped", c.Stopped}, {"failed", c.Failed}, {"stopping", c.Stopping}} {
		if r.n > 0 {
			m.closureRuns.Add(bg, int64(r.n), metric.WithAttributes(by, attribute.String("result", r.result)))
		}
	}
}

// HealthChanged counts a change of a model's or provider's health
// (bgtask.health.changes); why is left out when empty.
func (m *Metrics) HealthChanged(h bgtask.Health) {
	attrs := []attribute.KeyValue{attribute.String("key", h.Key()), attribute.String("state", string(h.State))}
	if h.Why != "" {
		attrs = append(attrs, attribute.String("why", h.Why))
	}
	m.healthChanges.Add(bg, 1, metric.WithAttributes(attrs...))
}

// Recovered counts a recovery and what it found and did, and records
// how long it took (bgtask.recoveries, bgtask.recovery.*).
func (m *Metrics) Recovered(c bgtask.RecoveryCounts, d time.Duration) {
	m.recoveries.Add(bg, 1)
	m.recovery.Record(bg, d.Seconds())
	add := func(ctr metric.Int64Counter, n int, outcome string) {
		if n <= 0 {
			return
		}
		if outcome == "" {
			ctr.Add(bg, int64(n))
			return
		}
		ctr.Add(bg, int64(n), metric.WithAttributes(attribute.String("outcome", outcome)))
	}
	add(m.recoveryRuns, c.Readopted, "readopted")
	add(m.recoveryRuns, c.Ended, "ended")
	add(m.recoveryRuns, c.Interrupted, "interrupted")
	add(m.recoveryRuns, c.Stopped, "stopped")
	add(m.recoveryRuns, c.Started, "started")
	add(m.recoveryRetries, c.Retried, "")
	add(m.recoveryNotes, c.Redelivered, "redelivered")
	add(m.recoveryNotes, c.Owed, "owed")
	add(m.recoveryNotes, c.Undelivered, "undelivered")
	add(m.recoveryClosures, c.Closures, "")
}

// UsageReported counts u's tokens by direction (input, output, cached),
// its requests and its cost (in millionths, as bgtask.Cost), each with
// the model as bgtask.attempts.started names it (model: "provider/id")
// and its provider (left out for a model with none). A zero figure adds
// nothing.
func (m *Metrics) UsageReported(_ string, model bgtask.Model, u bgtask.Usage) {
	attrs := make([]attribute.KeyValue, 0, 3)
	if model.Provider != "" {
		attrs = append(attrs, attribute.String("provider", model.Provider))
	}
	attrs = append(attrs, attribute.String("model", model.String()))
	for _, d := range [...]struct {
		direction string
		n         int64
	}{{"input", u.InputTokens}, {"output", u.OutputTokens}, {"cached", u.CachedTokens}} {
		if d.n > 0 {
			m.tokens.Add(bg, d.n, metric.WithAttributes(append(attrs, attribute.String("direction", d.direction))...))
		}
	}
	if u.Requests > 0 {
		m.requests.Add(bg, u.Requests, metric.WithAttributes(attrs...))
	}
	if u.Cost > 0 {
		m.cost.Add(bg, int64(u.Cost), metric.WithAttributes(attrs...))
	}
}

// BudgetCrossed counts a budget's crossing by level (soft or hard) and,
// for a hard one, the limit reached (s.Exceeded: tokens, cost, requests).
// A soft crossing carries no limit: which figure reached the threshold is
// not in s, and s.Exceeded may name a hard limit the same report reached.
func (m *Metrics) BudgetCrossed(s bgtask.BudgetState, hard bool) {
	if !hard {
		m.crossings.Add(bg, 1, metric.WithAttributes(attribute.String("level", "soft")))
		return
	}
	attrs := []attribute.KeyValue{attribute.String("level", "hard")}
	if s.Exceeded != "" {
		attrs = append(attrs, attribute.String("limit", s.Exceeded))
	}
	m.crossings.Add(bg, 1, metric.WithAttributes(attrs...))
}
