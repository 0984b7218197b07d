package bgtask

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cdRetryAfter is a provider's 429 that says when to try again.
type cdRetryAfter struct{ after time.Duration }

func (e cdRetryAfter) Error() string             { return "429 Too Many Requests" }
func (e cdRetryAfter) RetryAfter() time.Duration { return e.after }
func (e cdRetryAfter) StatusCode() int           { return 429 }

// cdFail runs a task on model alone and has its run fail with err; it
// returns the task's end.
func cdFail(h *harness, model string, err error) Task {
	h.t.Helper()
	return cdFailOn(h.t, h.m, model, err)
}

// cdFailOn is cdFail on m.
func cdFailOn(t *testing.T, m *Manager, model string, err error) Task {
	t.Helper()
	ctx := testCtx(t)
	task, lerr := m.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, model)})
	require.NoError(t, lerr)
	run := waitStatus(t, m, task.ID, StatusRunning)
	require.NoError(t, m.Observe(Event{SessionID: run.SessionID, Kind: SessionError, Err: err}))
	end, werr := m.Wait(ctx, task.ID)
	require.NoError(t, werr)
	return end
}

// cdHealth is the health m keeps under key (Health.Key).
func cdHealth(t *testing.T, m *Manager, key string) Health {
	t.Helper()
	for _, x := range m.Health() {
		if x.Key() == key {
			return x
		}
	}
	t.Fatalf("no health of %s in %+v", key, m.Health())
	return Health{}
}

// How long a cooldown lasts (HealthPolicy's doc, README "How long"): the
// provider's Retry-After when it gave one, else Cooldown (Unavailable for
// a model not found or a provider refused, 403 or 401), at most
// MaxCooldown — a Retry-After too. The first failure in a row is not
// doubled.
func TestHealthACooldownLastsWhatThePolicySays(t *testing.T) {
	for _, c := range []struct {
		name string
		pol  HealthPolicy
		err  error
		key  string // what cools
		want time.Duration
	}{
		{"a rate limit: Cooldown's default", HealthPolicy{}, errors.New("429 Too Many Requests"), "a/one", 30 * time.Second},
		{"a rate limit: Cooldown", HealthPolicy{Cooldown: 7 * time.Second}, errors.New("429 Too Many Requests"), "a/one", 7 * time.Second},
		{"an overload: Cooldown", HealthPolicy{Cooldown: 9 * time.Second, Unavailable: time.Hour}, errors.New("503 Service Unavailable: overloaded"), "a/one", 9 * time.Second},
		{"a model not found: Unavailable's default", HealthPolicy{}, errors.New("404 model not found"), "a/one", 5 * time.Minute},
		{"a forbidden provider: Unavailable", HealthPolicy{Unavailable: 2 * time.Minute}, errors.New("403 Forbidden"), "a", 2 * time.Minute},
		{"an unauthorized provider: Unavailable's default", HealthPolicy{}, errors.New("401 Unauthorized"), "a", 5 * time.Minute},
		{"an unauthorized provider: Unavailable", HealthPolicy{Cooldown: time.Second, Unavailable: 3 * time.Minute}, errors.New("401 Unauthorized"), "a", 3 * time.Minute},
		{"a Retry-After, as given", HealthPolicy{}, cdRetryAfter{45 * time.Second}, "a/one", 45 * time.Second},
		{"a Retry-After, up to MaxCooldown", HealthPolicy{MaxCooldown: time.Minute}, cdRetryAfter{time.Hour}, "a/one", time.Minute},
		{"a Retry-After, up to MaxCooldown's default", HealthPolicy{}, cdRetryAfter{time.Hour}, "a/one", 10 * time.Minute},
		{"Cooldown, up to MaxCooldown", HealthPolicy{Cooldown: 2 * time.Minute, MaxCooldown: time.Minute}, errors.New("429 Too Many Requests"), "a/one", time.Minute},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, nil, WithHealth(c.pol))
			now := h.clock.Now()
			end := cdFail(h, "a/one", c.err)
			require.Equal(t, StatusError, end.Status)
			x := cdHealth(t, h.m, c.key)
			assert.Equal(t, HealthCooling, x.State)
			assert.Equal(t, now, x.Since)
			assert.Equal(t, now.Add(c.want), x.Until, "the cooldown lasts %s", c.want)
			assert.Equal(t, 1, x.InARow)
		})
	}
}

// Failures in a row double the cooldown, at most MaxCooldown: each
// probe's failure here cools for the next doubling (also twice the last),
// and the doubling stops at the bound.
func TestHealthFailuresInARowDoubleUpToMaxCooldown(t *testing.T) {
	h := newHarness(t, nil, WithHealth(HealthPolicy{Cooldown: 10 * time.Second, MaxCooldown: 35 * time.Second}))
	for i, want := range []time.Duration{10 * time.Second, 20 * time.Second, 35 * time.Second, 35 * time.Second} {
		now := h.clock.Now()
		cdFail(h, "a/one", errors.New("429 Too Many Requests"))
		x := cdHealth(t, h.m, "a/one")
		require.Equal(t, HealthCooling, x.State, "failure %d", i+1)
		assert.Equal(t, i+1, x.InARow)
		require.Equal(t, now.Add(want), x.Until, "failure %d in a row cools for %s", i+1, want)
		h.clock.Advance(want) // over: the next run is the probe
		require.Equal(t, HealthProbing, cdHealth(t, h.m, "a/one").State)
	}
}

// cdSucceed runs a task on model alone and has its run answer.
func cdSucceed(h *harness, model string) Task {
	h.t.Helper()
	task := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(h.t, model)})
	run := waitStatus(h.t, h.m, task.ID, StatusRunning)
	require.NoError(h.t, h.observe(Event{SessionID: run.SessionID, Kind: SessionIdle, Text: "done"}))
	return h.wait(task.ID)
}

// OutageAfter server errors in a row cool the provider; a success ends
// the failures in a row (HealthPolicy's doc), so errors on both sides of
// a success are not in a row.
func TestHealthASuccessEndsTheServerErrorsInARow(t *testing.T) {
	h := newHarness(t, nil, WithHealth(HealthPolicy{OutageAfter: 3}))
	serverError := errors.New("500 Internal Server Error")
	cdFail(h, "a/one", serverError)
	cdFail(h, "a/one", serverError)
	require.Equal(t, StatusCompleted, cdSucceed(h, "a/two").Status)
	cdFail(h, "a/one", serverError)
	require.NotEqual(t, HealthCooling, cdHealth(t, h.m, "a").State, "2 server errors, a success, 1 more: not 3 in a row")
	cdFail(h, "a/one", serverError)
	require.NotEqual(t, HealthCooling, cdHealth(t, h.m, "a").State, "2 in a row")
	cdFail(h, "a/one", serverError)
	x := cdHealth(t, h.m, "a")
	assert.Equal(t, HealthCooling, x.State, "3 in a row cool the provider")
	assert.Equal(t, "server_error", x.Why)
}

// A cooldown that is over reads probing (Health.State's doc: "probing
// (its cooldown is over)") before any attempt probed it.
func TestHealthACooldownOverReadsProbing(t *testing.T) {
	h := newHarness(t, nil, WithHealth(HealthPolicy{}))
	cdFail(h, "a/one", cdRetryAfter{time.Minute})
	assert.Equal(t, HealthCooling, cdHealth(t, h.m, "a/one").State)
	h.clock.Advance(time.Minute - time.Nanosecond)
	assert.Equal(t, HealthCooling, cdHealth(t, h.m, "a/one").State, "not over yet")
	h.clock.Advance(time.Nanosecond)
	assert.Equal(t, HealthProbing, cdHealth(t, h.m, "a/one").State, "over: the next attempt probes")
}

// A probe that goes unanswered for ProbeTimeout lets another attempt
// probe instead (HealthPolicy.ProbeTimeout); before that, the others
// skip the model ("probe in flight").
func TestHealthAProbeUnansweredForProbeTimeoutLetsAnotherProbe(t *testing.T) {
	h := newHarness(t, nil, WithHealth(HealthPolicy{ProbeTimeout: 2 * time.Minute}))
	cdFail(h, "a/one", cdRetryAfter{time.Minute})
	h.clock.Advance(time.Minute)
	probe := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/two")})
	probe = waitStatus(t, h.m, probe.ID, StatusRunning)
	require.Equal(t, "a/one", probe.Model.String(), "the probe")

	other := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/two")})
	other = waitStatus(t, h.m, other.ID, StatusRunning)
	assert.Equal(t, "b/two", other.Model.String())
	require.Len(t, other.Skips, 1)
	assert.Contains(t, other.Skips[0].Why, "probe in flight")

	h.clock.Advance(2*time.Minute - time.Nanosecond)
	again := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/two")})
	again = waitStatus(t, h.m, again.ID, StatusRunning)
	assert.Equal(t, "b/two", again.Model.String(), "the probe is still within its ProbeTimeout")

	h.clock.Advance(time.Nanosecond)
	next := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/two")})
	next = waitStatus(t, h.m, next.ID, StatusRunning)
	assert.Equal(t, "a/one", next.Model.String(), "the probe went unanswered for ProbeTimeout: another probes")
	assert.Empty(t, next.Skips)
	assert.Equal(t, StatusRunning, h.task(probe.ID).Status, "the first probe still runs")
}

// When a model and its provider both cool, a skip names the later of the
// two cooldowns (README "Skips"; admits: "the later of the model's and
// the provider's"), whichever it is.
func TestHealthASkipNamesTheLaterOfTheModelsAndTheProvidersCooldown(t *testing.T) {
	for _, c := range []struct {
		name      string
		modelFor  time.Duration // a/one's Retry-After
		wantWhy   string
		wantUntil time.Duration
	}{
		{"the model's is later", 10 * time.Minute, "rate_limited", 10 * time.Minute},
		{"the provider's is later", time.Minute, "provider forbidden", 5 * time.Minute},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, nil, WithHealth(HealthPolicy{})) // a provider refused cools for Unavailable: 5m
			now := h.clock.Now()
			cdFail(h, "a/one", cdRetryAfter{c.modelFor})
			cdFail(h, "a/two", errors.New("403 Forbidden"))
			task := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/three")})
			task = waitStatus(t, h.m, task.ID, StatusRunning)
			require.Len(t, task.Skips, 1)
			sk := task.Skips[0]
			assert.Equal(t, "a/one", sk.Model.String())
			assert.Equal(t, c.wantWhy, sk.Why)
			assert.Equal(t, now.Add(c.wantUntil), sk.Until)
		})
	}
}

// cdOpen opens a Manager with health on the file journal in dir, on clk,
// over a test host whose sessions are named after life (so that no two
// lives make the same session id).
func cdOpen(t *testing.T, dir, life string, clk *clock.Fake, host *testHost) *Manager {
	t.Helper()
	if host == nil {
		host = &testHost{}
	}
	host.start = func(_ context.Context, _ SessionRequest, sid string) (string, error) { return life + "-" + sid, nil }
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m, err := Open(testCtx(t), host, WithJournal(j), WithHealth(HealthPolicy{}), WithClock(clk), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	return m
}

// A probe's failure cools at least twice as long as the last cooldown
// (README "The probe"), also when that cooldown was taken back by a
// restart ("a restart takes back the cooldowns not yet over"): a 2m
// Retry-After, a restart, then a failed probe with no Retry-After cools
// for 4m (the policy's doubling alone would give 1m).
func TestHealthAProbeAfterARestartCoolsTwiceAsLongAsTheCooldownTakenBack(t *testing.T) {
	dir := t.TempDir()
	clk := clock.NewFake(t0)
	m1 := cdOpen(t, dir, "one", clk, nil)
	cdFailOn(t, m1, "a/one", cdRetryAfter{2 * time.Minute})
	require.NoError(t, m1.Shutdown(testCtx(t)))

	m2 := cdOpen(t, dir, "two", clk, nil)
	shutdownAtCleanup(t, m2)
	x := cdHealth(t, m2, "a/one")
	require.Equal(t, HealthCooling, x.State, "the cooldown is taken back")
	require.Equal(t, t0.Add(2*time.Minute), x.Until)
	clk.Advance(2 * time.Minute)
	now := clk.Now()
	cdFailOn(t, m2, "a/one", errors.New("429 Too Many Requests"))
	x = cdHealth(t, m2, "a/one")
	assert.Equal(t, HealthCooling, x.State)
	assert.Equal(t, now.Add(4*time.Minute), x.Until, "the failed probe cools twice as long as the 2m before the restart")
}

// A failure of an attempt sent before the cooldown began begins none,
// but a longer Retry-After moves the end (README "The probe"); the moved
// end is what a restart takes back ("each cooldown begun (or moved later
// by a longer Retry-After) is a cooldown_began record").
func TestHealthAnEndMovedByALateRetryAfterSurvivesARestart(t *testing.T) {
	dir := t.TempDir()
	clk := clock.NewFake(t0)
	m1 := cdOpen(t, dir, "one", clk, nil)
	ctx := testCtx(t)
	early, err := m1.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one")})
	require.NoError(t, err)
	early = waitStatus(t, m1, early.ID, StatusRunning) // sent before the cooldown
	cdFailOn(t, m1, "a/one", cdRetryAfter{time.Minute})
	require.Equal(t, t0.Add(time.Minute), cdHealth(t, m1, "a/one").Until)
	require.NoError(t, m1.Observe(Event{SessionID: early.SessionID, Kind: SessionError, Err: cdRetryAfter{5 * time.Minute}}))
	_, err = m1.Wait(ctx, early.ID)
	require.NoError(t, err)
	x := cdHealth(t, m1, "a/one")
	require.Equal(t, t0.Add(5*time.Minute), x.Until, "the longer Retry-After moves the end")
	assert.Equal(t, uint64(1), x.Cooldowns, "it begins no cooldown of its own")
	require.NoError(t, m1.Shutdown(ctx))

	m2 := cdOpen(t, dir, "two", clk, nil)
	shutdownAtCleanup(t, m2)
	x = cdHealth(t, m2, "a/one")
	assert.Equal(t, HealthCooling, x.State)
	assert.Equal(t, t0.Add(5*time.Minute), x.Until, "the restart takes back the moved end")
}
