package bgtask_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// throttled is a provider's 429 that asks to be tried again after a while.
type throttled struct{ after time.Duration }

func (e throttled) Error() string             { return "429 Too Many Requests" }
func (e throttled) RetryAfter() time.Duration { return e.after }
func (e throttled) StatusCode() int           { return 429 }

// healthRig is a Manager with health on a hand-moved clock, whose models
// answer as fail says (nil: "ok"), counting the runs each model got. A
// model listed in hold blocks its runs until release is closed.
type healthRig struct {
	m     *bgtask.Manager
	clock *bgtasktest.Clock
	mu    sync.Mutex
	fail  map[string]error
	runs  map[string]int
	hold  map[string]chan struct{}
	start chan string // each run's model, as it starts (buffered)
}

func newHealthRig(t *testing.T, p *bgtask.HealthPolicy, opts ...bgtask.Option) *healthRig {
	t.Helper()
	r := &healthRig{clock: bgtasktest.NewClock(time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)),
		fail: map[string]error{}, runs: map[string]int{}, hold: map[string]chan struct{}{}, start: make(chan string, 64)}
	host := bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		k := run.Model.String()
		r.mu.Lock()
		r.runs[k]++
		err, hold := r.fail[k], r.hold[k]
		r.mu.Unlock()
		r.start <- k
		if hold != nil {
			select {
			case <-hold:
			case <-ctx.Done():
				return "", ctx.Err()
			}
			r.mu.Lock()
			err = r.fail[k]
			r.mu.Unlock()
		}
		if err != nil {
			return "", err
		}
		return "ok from " + k, nil
	})
	opts = append([]bgtask.Option{bgtask.WithClock(r.clock), bgtask.WithIDs(bgtask.SequentialIDs())}, opts...)
	if p != nil {
		opts = append(opts, bgtask.WithHealth(*p))
	}
	r.m = testkit.MustOpen(host, opts...)
	t.Cleanup(func() { _ = r.m.Shutdown(context.Background()) })
	return r
}

func (r *healthRig) set(model string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail[model] = err
}

func (r *healthRig) ran(model string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.runs[model]
}

// run launches a task on chain and waits for it to end.
func (r *healthRig) run(t *testing.T, chain ...string) bgtask.Task {
	t.Helper()
	return waitEnd(t, r.m, r.launch(t, chain...).ID)
}

// waitEnd waits for task id of m to end (at most 10 s: failure detection).
func waitEnd(t *testing.T, m *bgtask.Manager, id string) bgtask.Task {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done, err := m.Wait(ctx, id)
	require.NoError(t, err)
	return done
}

func (r *healthRig) launch(t *testing.T, chain ...string) bgtask.Task {
	t.Helper()
	var models []bgtask.Model
	for _, c := range chain {
		p, id, _ := strings.Cut(c, "/")
		models = append(models, bgtask.Model{Provider: p, ID: id})
	}
	task, err := r.m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "ses_parent", Prompt: "go", Models: models})
	require.NoError(t, err)
	return task
}

func healthOf(m *bgtask.Manager, key string) (bgtask.Health, bool) {
	for _, h := range m.Health() {
		if h.Model.String() == key || h.Provider && h.Model.Provider == key {
			return h, true
		}
	}
	return bgtask.Health{}, false
}

func TestHealthCoolsWhatEachFailureClassNames(t *testing.T) {
	tests := []struct {
		name   string
		err    error
		times  int    // failures it takes
		cooled string // what cools: a model, or a provider
		skips  string // a model the next task's chain skips
	}{
		{"rate limit cools the model", errors.New("429 Too Many Requests"), 1, "a/one", "a/one"},
		{"overload cools the model", errors.New("503 Service Unavailable: overloaded"), 1, "a/one", "a/one"},
		{"a model not found cools the model", errors.New("404 model not found"), 1, "a/one", "a/one"},
		{"a model not supported cools the model", errors.New("The model `one` is not supported"), 1, "a/one", "a/one"},
		{"a forbidden provider cools the provider", errors.New("403 Forbidden"), 1, "a", "a/two"},
		{"an unauthorized provider cools the provider", errors.New("401 Unauthorized"), 1, "a", "a/two"},
		{"server errors in a row cool the provider", errors.New("500 Internal Server Error"), 3, "a", "a/two"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newHealthRig(t, &bgtask.HealthPolicy{})
			r.set("a/one", tt.err)
			r.set("a/two", tt.err)
			for i := 0; i < tt.times; i++ {
				if i > 0 {
					h, _ := healthOf(r.m, tt.cooled)
					require.NotEqual(t, bgtask.HealthCooling, h.State, "cooled after %d failures, before %d", i, tt.times)
				}
				r.run(t, "a/one", "b/three") // a model not supported is not retried (a validation error)
			}
			h, ok := healthOf(r.m, tt.cooled)
			require.True(t, ok, "health: %+v", r.m.Health())
			assert.Equal(t, bgtask.HealthCooling, h.State)
			assert.True(t, h.Until.After(r.clock.Now()))
			before := r.ran(tt.skips)
			done := r.run(t, tt.skips, "b/three")
			require.Equal(t, bgtask.StatusCompleted, done.Status)
			assert.Equal(t, before, r.ran(tt.skips), "a run on %s while it cools", tt.skips)
			require.Len(t, done.Skips, 1)
			assert.Equal(t, tt.skips, done.Skips[0].Model.String())
			assert.Len(t, done.Attempts, 1, "a skip is no attempt")
			assert.Contains(t, bgtask.Timeline(done), "- Skipped "+tt.skips+" before attempt 1 — cooling (")
		})
	}
}

func TestHealthRetryAfterThenOneProbeThenALongerCooldown(t *testing.T) {
	r := newHealthRig(t, &bgtask.HealthPolicy{})
	r.set("a/one", throttled{after: 30 * time.Second})
	first := r.run(t, "a/one", "b/two")
	require.Equal(t, bgtask.StatusCompleted, first.Status)
	require.Len(t, first.Attempts, 2)
	h, _ := healthOf(r.m, "a/one")
	assert.Equal(t, r.clock.Now().Add(30*time.Second), h.Until, "the Retry-After decides the cooldown")
	assert.Equal(t, "rate_limited", h.Why)

	second := r.run(t, "a/one", "b/two")
	assert.Equal(t, 1, r.ran("a/one"))
	require.Len(t, second.Skips, 1)
	assert.Equal(t, "b/two", second.Attempts[0].Model.String())
	assert.Equal(t, "- Skipped a/one before attempt 1 — cooling (rate_limited) until 2026-12-02T10:00:30Z",
		strings.Split(bgtask.Timeline(second), "\n")[1])

	// The cooldown is over: one probe goes, the others skip while it runs.
	r.clock.Advance(30 * time.Second)
	hold := make(chan struct{})
	r.mu.Lock()
	r.hold["a/one"] = hold
	r.mu.Unlock()
	for len(r.start) > 0 { // the runs so far ended: what they told is stale
		<-r.start
	}
	probe := r.launch(t, "a/one", "b/two")
	require.Equal(t, "a/one", bgtask.RecvForTest(t, r.start, "the probe's start"))
	h, _ = healthOf(r.m, "a/one")
	assert.Equal(t, bgtask.HealthProbing, h.State)
	other := r.run(t, "a/one", "b/two")
	require.Len(t, other.Skips, 1)
	assert.Contains(t, other.Skips[0].Why, "probe in flight")
	assert.Equal(t, 2, r.ran("a/one"), "one probe only")

	close(hold) // the probe fails: a longer cooldown
	waitEnd(t, r.m, probe.ID)
	h, _ = healthOf(r.m, "a/one")
	assert.Equal(t, bgtask.HealthCooling, h.State)
	assert.Equal(t, r.clock.Now().Add(60*time.Second), h.Until, "a failed probe cools twice as long")

	// The model recovered: the next probe succeeds and it is healthy.
	r.clock.Advance(60 * time.Second)
	r.mu.Lock()
	delete(r.hold, "a/one")
	r.mu.Unlock()
	r.set("a/one", nil)
	ok := r.run(t, "a/one", "b/two")
	assert.Equal(t, "a/one", ok.Model.String())
	assert.Empty(t, ok.Skips)
	h, _ = healthOf(r.m, "a/one")
	assert.Equal(t, bgtask.HealthHealthy, h.State)
	assert.Zero(t, h.InARow)
	assert.EqualValues(t, 2, h.Cooldowns)
}

func TestHealthWaitsPendingForTheEarliestCooldown(t *testing.T) {
	r := newHealthRig(t, &bgtask.HealthPolicy{})
	r.set("a/one", throttled{after: 40 * time.Second})
	r.set("b/two", throttled{after: 20 * time.Second})
	failed := r.run(t, "a/one", "b/two")
	require.Equal(t, bgtask.StatusError, failed.Status)
	r.set("a/one", nil)
	r.set("b/two", nil)

	task := r.launch(t, "a/one", "b/two")
	assert.Equal(t, bgtask.StatusPending, task.Status)
	assert.Equal(t, bgtask.PendingCooldown, task.Pending, "every model cools: it waits")
	r.clock.Advance(19 * time.Second)
	now, err := r.m.Task(task.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.PendingCooldown, now.Pending)
	r.clock.Advance(time.Second)
	done := waitEnd(t, r.m, task.ID)
	assert.Equal(t, bgtask.StatusCompleted, done.Status)
	assert.Equal(t, "b/two", done.Model.String(), "the earliest to end, a/one skipped")
	require.Len(t, done.Skips, 1)
	assert.Equal(t, "a/one", done.Skips[0].Model.String())
}

func TestHealthAWaitPastTheMaximumFailsNamingTheCooldowns(t *testing.T) {
	r := newHealthRig(t, &bgtask.HealthPolicy{MaxWait: time.Minute})
	r.set("a/one", throttled{after: 5 * time.Minute})
	r.run(t, "a/one")
	before := r.ran("a/one")
	task := r.launch(t, "a/one")
	assert.Equal(t, bgtask.StatusError, task.Status, "a wait past the maximum is not begun")
	assert.Contains(t, task.Error, "a/one (rate_limited, until 2026-12-02T10:05:00Z)")
	assert.Contains(t, task.Error, "past the 1m0s")
	assert.Equal(t, before, r.ran("a/one"))
	assert.Empty(t, task.Attempts[0].SessionID, "no attempt ran")
}

func TestHealthResetByHandLetsAWaitingTaskGo(t *testing.T) {
	dir := t.TempDir()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	r := newHealthRig(t, &bgtask.HealthPolicy{}, bgtask.WithJournal(j))
	r.set("a/one", throttled{after: time.Minute})
	r.run(t, "a/one")
	r.set("a/one", nil)
	task := r.launch(t, "a/one")
	require.Equal(t, bgtask.PendingCooldown, task.Pending)

	require.ErrorIs(t, r.m.ResetHealth(context.Background(), "b/two"), bgtask.ErrNotCooling)
	require.NoError(t, r.m.ResetHealth(context.Background(), "a/one"))
	done := waitEnd(t, r.m, task.ID)
	assert.Equal(t, bgtask.StatusCompleted, done.Status)
	h, _ := healthOf(r.m, "a/one")
	assert.Equal(t, bgtask.HealthHealthy, h.State)
	require.NoError(t, r.m.Shutdown(context.Background()))

	view, err := bgtask.ReadFileJournal(dir)
	require.NoError(t, err)
	var kinds []string
	for _, rec := range view.Records {
		kinds = append(kinds, rec.Kind)
	}
	assert.Contains(t, kinds, "health_reset", "the reset is recorded")
}

func TestHealthSkipsAreReplayedExactlyAfterARestart(t *testing.T) {
	dir := t.TempDir()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	r := newHealthRig(t, &bgtask.HealthPolicy{}, bgtask.WithJournal(j))
	r.set("a/one", throttled{after: time.Minute})
	r.set("b/two", errors.New("403 Forbidden"))
	r.run(t, "a/one", "b/two", "c/three")
	skipped := r.run(t, "a/one", "b/two", "c/three")
	require.Len(t, skipped.Skips, 2)
	retried := r.run(t, "c/three", "a/one", "b/four", "d/five") // fails on c, skips a and b for d
	r.set("c/three", errors.New("429"))
	retried2 := r.run(t, "c/three", "a/one", "b/four", "d/five")
	require.Len(t, retried2.Skips, 2)
	require.Equal(t, 2, retried2.Skips[0].Attempt)
	require.NoError(t, r.m.Shutdown(context.Background()))

	j2, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	m2, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(context.Context, bgtask.Run) (string, error) { return "", nil }),
		bgtask.WithJournal(j2), bgtask.WithClock(r.clock), bgtask.WithIDs(bgtask.SequentialIDs()))
	require.NoError(t, err)
	defer func() { _ = m2.Shutdown(context.Background()) }()
	for _, want := range []bgtask.Task{skipped, retried, retried2} {
		got, err := m2.Task(want.ID)
		require.NoError(t, err)
		assert.Equal(t, want.Skips, got.Skips)
		assert.Equal(t, want.Attempts, got.Attempts)
		assert.Equal(t, bgtask.Timeline(want), bgtask.Timeline(got))
	}
	assert.Nil(t, m2.Health(), "health is this process's")
}

func TestHealthOffSkipsNothing(t *testing.T) {
	for name, p := range map[string]*bgtask.HealthPolicy{"no option": nil, "Off": {Off: true}} {
		t.Run(name, func(t *testing.T) {
			r := newHealthRig(t, p)
			r.set("a/one", throttled{after: time.Minute})
			r.run(t, "a/one", "b/two")
			second := r.run(t, "a/one", "b/two")
			assert.Empty(t, second.Skips)
			assert.Equal(t, 2, r.ran("a/one"), "every task finds it out")
			assert.Nil(t, r.m.Health())
		})
	}
}

func TestHealthASuccessSentBeforeTheCooldownEndsItOnlyIfThePolicySays(t *testing.T) {
	for _, early := range []bool{false, true} {
		r := newHealthRig(t, &bgtask.HealthPolicy{EarlySuccess: early})
		hold := make(chan struct{})
		r.mu.Lock()
		r.hold["a/one"] = hold
		r.mu.Unlock()
		inflight := r.launch(t, "a/one") // sent before the cooldown
		require.Equal(t, "a/one", bgtask.RecvForTest(t, r.start, "the in-flight run's start"))
		r.mu.Lock()
		delete(r.hold, "a/one")
		r.mu.Unlock()
		r.set("a/one", errors.New("429 Too Many Requests"))
		r.run(t, "a/one", "b/two")
		h, _ := healthOf(r.m, "a/one")
		require.Equal(t, bgtask.HealthCooling, h.State)

		r.set("a/one", nil)
		close(hold) // the request sent before succeeds
		done := waitEnd(t, r.m, inflight.ID)
		require.Equal(t, bgtask.StatusCompleted, done.Status, "an attempt in flight finishes as it will")
		h, _ = healthOf(r.m, "a/one")
		if early {
			assert.Equal(t, bgtask.HealthHealthy, h.State, "EarlySuccess")
		} else {
			assert.Equal(t, bgtask.HealthCooling, h.State, "a success sent before says nothing of now")
		}
	}
}

func TestHealthMetricsHearEveryChange(t *testing.T) {
	mt := &healthMetrics{}
	r := newHealthRig(t, &bgtask.HealthPolicy{}, bgtask.WithMetrics(mt))
	r.set("a/one", throttled{after: time.Second})
	r.run(t, "a/one", "b/two")
	r.clock.Advance(time.Second)
	r.set("a/one", nil)
	r.run(t, "a/one", "b/two")
	require.NoError(t, r.m.Shutdown(context.Background()))
	mt.mu.Lock()
	defer mt.mu.Unlock()
	assert.Equal(t, []bgtask.HealthState{bgtask.HealthCooling, bgtask.HealthProbing, bgtask.HealthHealthy}, mt.states)
}

type healthMetrics struct {
	bgtask.NopMetrics
	mu     sync.Mutex
	states []bgtask.HealthState
}

func (m *healthMetrics) HealthChanged(h bgtask.Health) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.states = append(m.states, h.State)
}
