// Package otelmetrics reports a bgtask Manager's measurements
// (bgtask.Metrics) as OpenTelemetry instruments:
//
//	mt, err := otelmetrics.New(otel.Meter("bgtask"))
//	m := bgtask.New(host, bgtask.WithMetrics(mt))
//
// Counters: bgtask.tasks.launched, bgtask.attempts.started (model),
// bgtask.retries (reason), bgtask.tasks.ended (state, reason).
// Histograms, in seconds: bgtask.queue.wait (key), bgtask.attempt.duration
// (model, status), bgtask.task.duration (state). Gauges: bgtask.tasks.live,
// bgtask.queue.depth (key).
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
}

var _ bgtask.Metrics = (*Metrics)(nil)

// New makes the instruments on meter.
func New(meter metric.Meter) (*Metrics, error) {
	if meter == nil {
		return nil, errors.New("otelmetrics: a nil Meter")
	}
	var m Metrics
	var errs []error
	counter := func(name, desc string) metric.Int64Counter {
		c, err := meter.Int64Counter(name, metric.WithDescription(desc))
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
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return &m, nil
}

var bg = context.Background()

func (m *Metrics) TaskLaunched(bgtask.Task) { m.launched.Add(bg, 1) }

func (m *Metrics) AttemptStarted(_ bgtask.Task, a bgtask.Attempt) {
	m.started.Add(bg, 1, metric.WithAttributes(attribute.String("model", a.Model.String())))
}

func (m *Metrics) RetryScheduled(_ bgtask.Task, _ bgtask.Attempt, reason bgtask.Reason) {
	m.retries.Add(bg, 1, metric.WithAttributes(attribute.String("reason", string(reason))))
}

func (m *Metrics) AttemptEnded(_ bgtask.Task, a bgtask.Attempt, d time.Duration) {
	m.attempt.Record(bg, d.Seconds(), metric.WithAttributes(attribute.String("model", a.Model.String()), attribute.String("status", string(a.Status))))
}

func (m *Metrics) TaskEnded(_ bgtask.Task, state bgtask.Status, reason bgtask.Reason, d time.Duration) {
	attrs := metric.WithAttributes(attribute.String("state", string(state)), attribute.String("reason", string(reason)))
	m.ended.Add(bg, 1, attrs)
	m.task.Record(bg, d.Seconds(), metric.WithAttributes(attribute.String("state", string(state))))
}

func (m *Metrics) QueueWaited(key string, d time.Duration) {
	m.queueWait.Record(bg, d.Seconds(), metric.WithAttributes(attribute.String("key", key)))
}

func (m *Metrics) LiveTasks(n int) { m.live.Record(bg, int64(n)) }

func (m *Metrics) QueueDepth(key string, n int) {
	m.depth.Record(bg, int64(n), metric.WithAttributes(attribute.String("key", key)))
}
