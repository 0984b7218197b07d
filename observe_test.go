package bgtask

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Observability: lifecycle lines at info, what is held at debug, and the
// Metrics.

// levelSink is a logSink that takes lines at level and above.
type levelSink struct {
	logSink
	level slog.Level
}

func (s *levelSink) Enabled(_ context.Context, l slog.Level) bool { return l >= s.level }

func TestInfoLinesTellEveryLifecycleMilestone(t *testing.T) { infoLines(t) }

// On a journal whose commits take a while, each unlock logs once its
// records are durable: the lines still come out in commit order (they
// did not: an attempt's start was logged after its failure).
func TestInfoLinesKeepTheirOrderOnASlowJournal(t *testing.T) {
	for range 10 {
		fj, err := OpenFileJournal(t.TempDir())
		require.NoError(t, err)
		infoLines(t, WithJournal(slowJournal{fj}))
	}
}

func infoLines(t *testing.T, opts ...Option) {
	sink := &levelSink{level: slog.LevelInfo}
	h := newHarness(t, nil, append(opts, WithLogger(slog.New(sink)))...)
	task := h.running("chat", func(s *Spec) { s.Models = mustModels(t, "a/one", "b/two", "c/three") })
	for range 2 {
		require.NoError(t, h.observe(Event{SessionID: h.task(task.ID).SessionID, Kind: SessionError, Err: errors.New("429 Too Many Requests")}))
		task = waitFor(t, h.m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
	}
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	done := h.wait(task.ID)
	// With a journal the last line is logged once the end is durable, a
	// moment after Wait may return: Shutdown joins whatever logs it.
	require.NoError(t, h.m.Shutdown(context.Background()))

	var msgs []string
	for _, r := range sink.Records() {
		msgs = append(msgs, r["msg"])
		assert.NotEmpty(t, r["task"], "every line names its task: %v", r)
		assert.NotEmpty(t, r["attempt"], "and its attempt: %v", r)
		if r["msg"] != "task launched" { // no session yet
			assert.NotEmpty(t, r["session"], "and its session: %v", r)
		}
		switch r["msg"] {
		case "retry scheduled":
			assert.Equal(t, string(ReasonProviderError), r["reason"], "with the reason class")
		case "task ended":
			assert.Equal(t, "cancelled", r["outcome"])
			assert.Equal(t, "3", r["attempts"])
		}
	}
	assert.Equal(t, []string{
		"task launched",
		"attempt started", "retry scheduled",
		"attempt started", "retry scheduled",
		"attempt started",
		"stop asked",
		"task ended",
	}, msgs)
	assert.Equal(t, StatusCancelled, done.Status)
}

func TestDebugLinesTellWhatWasHeldAndRejected(t *testing.T) {
	sink := &levelSink{level: slog.LevelDebug}
	release := make(chan struct{})
	host := &testHost{start: func(ctx context.Context, _ SessionRequest, sid string) (string, error) {
		<-release
		return sid, nil
	}}
	h := newHarness(t, host, WithLogger(slog.New(sink)))
	h.launch("a/one")
	require.NoError(t, h.m.Observe(Event{SessionID: "ses-1", Kind: SessionBusy}), "held: a start is in flight")
	close(release)
	h.settle()
	assert.ErrorIs(t, h.m.Observe(Event{SessionID: "nobody", Kind: SessionBusy}), ErrUnknownSession)
	var msgs []string
	for _, r := range sink.Records() {
		if r["level"] == "DEBUG" {
			msgs = append(msgs, r["msg"])
		}
	}
	assert.Contains(t, msgs, "event held until its session is bound")
	assert.Contains(t, msgs, "event ignored")
}

// recMetrics records what a Manager measured.
type recMetrics struct {
	NopMetrics
	mu       sync.Mutex
	counts   map[string]int
	waits    []time.Duration
	live     []int
	depths   map[string][]int
	endToEnd []time.Duration
}

func (r *recMetrics) add(k string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.counts[k]++
}

func (r *recMetrics) TaskLaunched(Task)                { r.add("launched") }
func (r *recMetrics) AttemptStarted(_ Task, a Attempt) { r.add("started " + a.Model.String()) }
func (r *recMetrics) RetryScheduled(_ Task, _ Attempt, reason Reason) {
	r.add("retry " + string(reason))
}
func (r *recMetrics) AttemptEnded(_ Task, a Attempt, _ time.Duration) {
	r.add("attempt " + string(a.Status))
}
func (r *recMetrics) TaskEnded(_ Task, state Status, _ Reason, d time.Duration) {
	r.add("ended " + string(state))
	r.mu.Lock()
	r.endToEnd = append(r.endToEnd, d)
	r.mu.Unlock()
}
func (r *recMetrics) QueueWaited(_ string, d time.Duration) {
	r.mu.Lock()
	r.waits = append(r.waits, d)
	r.mu.Unlock()
}
func (r *recMetrics) LiveTasks(n int) {
	r.mu.Lock()
	r.live = append(r.live, n)
	r.mu.Unlock()
}
func (r *recMetrics) QueueDepth(key string, n int) {
	r.mu.Lock()
	r.depths[key] = append(r.depths[key], n)
	r.mu.Unlock()
}

func TestMetricsMeasureLaunchesAttemptsRetriesOutcomesAndQueues(t *testing.T) {
	mt := &recMetrics{counts: map[string]int{}, depths: map[string][]int{}}
	h := newHarness(t, nil, WithMetrics(mt), WithModelLimits(ModelLimits{Default: 1}))
	first := h.running("chat", func(s *Spec) { s.Models = mustModels(t, "a/one", "b/two") })
	queued := h.running("chat", func(s *Spec) { s.Models = mustModels(t, "a/one") })
	require.Equal(t, PendingQueued, queued.Pending)
	h.clock.Advance(3 * time.Second)
	require.NoError(t, h.observe(Event{SessionID: first.SessionID, Kind: SessionError, Err: errors.New("HTTP 503 overloaded")}))
	queued = waitFor(t, h.m, queued.ID, func(t Task) bool { return t.Status == StatusRunning })
	require.NoError(t, h.observe(Event{SessionID: queued.SessionID, Kind: SessionIdle, Text: "ok"}))
	second := waitFor(t, h.m, first.ID, func(t Task) bool { return t.Status == StatusRunning })
	h.clock.Advance(2 * time.Second)
	require.NoError(t, h.observe(Event{SessionID: second.SessionID, Kind: SessionIdle, Text: "ok"}))
	h.wait(first.ID)
	h.settle()

	mt.mu.Lock()
	defer mt.mu.Unlock()
	assert.Equal(t, map[string]int{
		"launched": 2, "started a/one": 2, "started b/two": 1,
		"retry provider_error": 1, "attempt error": 1, "attempt completed": 2, "ended completed": 2,
	}, mt.counts)
	assert.Equal(t, []time.Duration{3 * time.Second}, mt.waits, "the queued attempt waited 3s for its slot")
	assert.Equal(t, []int{1, 2, 1, 0}, mt.live, "live tasks as they changed")
	assert.Equal(t, []int{1, 0}, mt.depths["model:a/one"], "the queue of a/one grew and drained")
	assert.Equal(t, []time.Duration{3 * time.Second, 5 * time.Second}, mt.endToEnd)
}

type panickyMetrics struct{ NopMetrics }

func (panickyMetrics) TaskLaunched(Task) { panic("metrics bug") }

func TestAPanickingMetricsCrashesNothing(t *testing.T) {
	h := newHarness(t, nil, WithMetrics(panickyMetrics{}))
	task := h.running("chat")
	require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "ok"}))
	assert.Equal(t, StatusCompleted, h.wait(task.ID).Status)
	assert.Equal(t, uint64(1), h.m.Dropped().LoggerPanics, "counted")
}
