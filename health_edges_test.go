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

// scripted is a host whose every run waits for the test to say how it
// ends: started tells each run (its task and model) as it starts, and
// end(task) ends that task's run in flight with err (nil: "ok").
type scripted struct {
	mu      sync.Mutex
	ends    map[string]chan error // task → its run's end
	runs    map[string]int        // model → runs
	started chan string           // "task model", as each run starts
}

func newScripted() *scripted {
	return &scripted{ends: map[string]chan error{}, runs: map[string]int{}, started: make(chan string, 64)}
}

func (s *scripted) endOf(task string) chan error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ends[task] == nil {
		s.ends[task] = make(chan error, 1)
	}
	return s.ends[task]
}

func (s *scripted) host() bgtask.Host {
	return bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		s.mu.Lock()
		s.runs[run.Model.String()]++
		s.mu.Unlock()
		end := s.endOf(run.TaskID)
		s.started <- run.TaskID + " " + run.Model.String()
		select {
		case err := <-end:
			if err != nil {
				return "", err
			}
			return "ok", nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	})
}

func (s *scripted) end(task string, err error) { s.endOf(task) <- err }

func (s *scripted) ran(model string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.runs[model]
}

// scriptRig is a Manager with health on a hand-moved clock over a
// scripted host.
type scriptRig struct {
	m     *bgtask.Manager
	clock *bgtasktest.Clock
	s     *scripted
}

func newScriptRig(t *testing.T, p bgtask.HealthPolicy, opts ...bgtask.Option) *scriptRig {
	t.Helper()
	r := &scriptRig{clock: bgtasktest.NewClock(time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)), s: newScripted()}
	opts = append([]bgtask.Option{bgtask.WithClock(r.clock), bgtask.WithIDs(bgtask.SequentialIDs()), bgtask.WithHealth(p)}, opts...)
	r.m = testkit.MustOpen(r.s.host(), opts...)
	t.Cleanup(func() { _ = r.m.Shutdown(context.Background()) })
	return r
}

func (r *scriptRig) launch(t *testing.T, models ...bgtask.Model) bgtask.Task {
	t.Helper()
	task, err := r.m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "ses_parent", Prompt: "go", Models: models})
	require.NoError(t, err)
	return task
}

func (r *scriptRig) wait(t *testing.T, id string) bgtask.Task {
	t.Helper()
	return waitEnd(t, r.m, id)
}

// started is the next run to start: "task model".
func (r *scriptRig) started(t *testing.T) string {
	t.Helper()
	select {
	case s := <-r.s.started:
		return s
	case <-time.After(10 * time.Second): // failure detection only
		t.Fatal("no run started")
		return ""
	}
}

// startedTask is the task of the next run to start.
func (r *scriptRig) startedTask(t *testing.T) string {
	t.Helper()
	task, _, _ := strings.Cut(r.started(t), " ")
	return task
}

var (
	aOne = bgtask.Model{Provider: "a", ID: "one"}
	bTwo = bgtask.Model{Provider: "b", ID: "two"}
)

// When a cooldown ends, the tasks that waited for it do not fail while
// its probe is in flight: they wait for the probe's verdict (bounded by
// MaxWait), and go once it succeeds; a probe that ends with no verdict
// (cancelled) lets the next waiter probe.
func TestHealthWaitersOutlastTheProbe(t *testing.T) {
	r := newScriptRig(t, bgtask.HealthPolicy{})
	first := r.launch(t, aOne)
	require.Equal(t, first.ID+" a/one", r.started(t))
	r.s.end(first.ID, throttled{after: 30 * time.Second})
	require.Equal(t, bgtask.StatusError, r.wait(t, first.ID).Status)

	w1, w2, w3 := r.launch(t, aOne), r.launch(t, aOne), r.launch(t, aOne)
	for _, w := range []bgtask.Task{w1, w2, w3} {
		require.Equal(t, bgtask.PendingCooldown, w.Pending)
	}
	r.clock.Advance(30 * time.Second)
	probeID := r.startedTask(t) // the first waiter to look again probes
	h, _ := healthOf(r.m, "a/one")
	require.Equal(t, bgtask.HealthProbing, h.State)

	// The probe is cancelled: no verdict, the next waiter probes.
	require.NoError(t, testkit.StopErr(r.m.Stop(context.Background(), bgtask.Target{Task: probeID})))
	assert.Equal(t, bgtask.StatusCancelled, r.wait(t, probeID).Status)
	secondID := r.startedTask(t)
	assert.NotEqual(t, probeID, secondID)
	assert.Equal(t, 3, r.s.ran("a/one"), "one probe at a time")

	// It succeeds: the model is healthy and the last waiter goes.
	r.s.end(secondID, nil)
	assert.Equal(t, bgtask.StatusCompleted, r.wait(t, secondID).Status)
	thirdID := r.startedTask(t)
	r.s.end(thirdID, nil)
	done := r.wait(t, thirdID)
	assert.Equal(t, bgtask.StatusCompleted, done.Status, "%s: %s", thirdID, done.Error)
	h, _ = healthOf(r.m, "a/one")
	assert.Equal(t, bgtask.HealthHealthy, h.State)

	// A task launched while a probe is in flight, every model cooling,
	// waits for the verdict too: it does not fail at once.
	late := r.launch(t, aOne)
	require.Equal(t, late.ID+" a/one", r.started(t))
	r.s.end(late.ID, throttled{after: 10 * time.Second})
	r.wait(t, late.ID)
	r.clock.Advance(10 * time.Second)
	p2 := r.launch(t, aOne)
	require.Equal(t, p2.ID+" a/one", r.started(t))
	behind := r.launch(t, aOne)
	assert.Equal(t, bgtask.StatusPending, behind.Status, "it waits for the probe: %s", behind.Error)
	assert.Equal(t, bgtask.PendingCooldown, behind.Pending)
	r.s.end(p2.ID, nil)
	require.Equal(t, behind.ID+" a/one", r.started(t))
	r.s.end(behind.ID, nil)
	assert.Equal(t, bgtask.StatusCompleted, r.wait(t, behind.ID).Status)
}

// A waiter whose probe fails and whose next cooldown ends past MaxWait
// fails then, naming the cooldown, not before.
func TestHealthAFailedProbeEndsTheWaitPastTheMaximum(t *testing.T) {
	r := newScriptRig(t, bgtask.HealthPolicy{MaxWait: 40 * time.Second})
	first := r.launch(t, aOne)
	r.started(t)
	r.s.end(first.ID, throttled{after: 30 * time.Second})
	r.wait(t, first.ID)
	w := r.launch(t, aOne)
	r.clock.Advance(20 * time.Second)
	probe := r.launch(t, aOne) // not yet: it waits too
	r.clock.Advance(10 * time.Second)
	pid := r.startedTask(t)
	other := w.ID
	if pid == w.ID {
		other = probe.ID
	}
	r.s.end(pid, throttled{after: 30 * time.Second}) // the probe fails: 60 s, past the limit of both
	done := r.wait(t, other)
	assert.Equal(t, bgtask.StatusError, done.Status)
	assert.Contains(t, done.Error, "a/one (rate_limited, until 2026-12-02T10:01:30Z)")
	assert.Equal(t, 2, r.s.ran("a/one"))
}

// A failure of a request sent before a cooldown began, told after that
// cooldown is over, begins no cooldown of its own and leaves the probe
// alone: the probe's success ends the cooldown.
func TestHealthALateFailureFromBeforeTheCooldownLeavesTheProbe(t *testing.T) {
	r := newScriptRig(t, bgtask.HealthPolicy{})
	old := r.launch(t, aOne)
	r.started(t)
	y := r.launch(t, aOne)
	r.started(t)
	r.s.end(y.ID, throttled{after: 30 * time.Second})
	r.wait(t, y.ID)
	r.clock.Advance(30 * time.Second)
	p := r.launch(t, aOne)
	require.Equal(t, p.ID+" a/one", r.started(t))

	r.s.end(old.ID, errors.New("429 Too Many Requests")) // sent before: stale
	r.wait(t, old.ID)
	h, _ := healthOf(r.m, "a/one")
	assert.EqualValues(t, 1, h.Cooldowns, "no cooldown of its own")
	assert.Equal(t, 1, h.InARow)
	assert.EqualValues(t, 2, h.Failures, "it is counted")
	assert.Equal(t, bgtask.HealthProbing, h.State)

	r.s.end(p.ID, nil)
	assert.Equal(t, bgtask.StatusCompleted, r.wait(t, p.ID).Status)
	h, _ = healthOf(r.m, "a/one")
	assert.Equal(t, bgtask.HealthHealthy, h.State, "the probe's success ends it")
}

// An attempt queued for a concurrency slot does not start a session on a
// model that began to cool while it queued: given the slot, it chooses
// again (here: skips to the next model).
func TestHealthAQueuedAttemptSkipsAModelThatCooledWhileItQueued(t *testing.T) {
	r := newScriptRig(t, bgtask.HealthPolicy{}, bgtask.WithModelLimits(bgtask.ModelLimits{Models: map[string]int{"a/one": 1}}))
	t1 := r.launch(t, aOne, bTwo)
	require.Equal(t, t1.ID+" a/one", r.started(t))
	t2 := r.launch(t, aOne, bTwo)
	require.Equal(t, bgtask.PendingQueued, t2.Pending)

	r.s.end(t1.ID, throttled{after: time.Minute})
	for range 2 {
		task, model, _ := strings.Cut(r.started(t), " ") // t1's retry and t2, in either order
		assert.Equal(t, "b/two", model)
		r.s.end(task, nil)
	}
	done := r.wait(t, t2.ID)
	assert.Equal(t, bgtask.StatusCompleted, done.Status)
	assert.Equal(t, "b/two", done.Model.String())
	require.Len(t, done.Skips, 1)
	assert.Equal(t, "a/one", done.Skips[0].Model.String())
	assert.Equal(t, 1, r.s.ran("a/one"), "no session on a/one while it cools")
}

// A model with no provider cools alone (a 403 has no provider to cool),
// under the key "/id": the journal holding its cooldown opens again, and
// a reset takes that key. A run with no model keeps no health.
func TestHealthAModelWithNoProviderCoolsAlone(t *testing.T) {
	dir := t.TempDir()
	clk := bgtasktest.NewClock(time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC))
	host := func() bgtask.Host {
		return bgtask.NewFuncHost(func(_ context.Context, run bgtask.Run) (string, error) {
			if run.Model.ID == "solo" {
				return "", errors.New("403 Forbidden")
			}
			return "", throttled{after: time.Minute}
		})
	}
	open := func() *bgtask.Manager {
		j, err := bgtask.OpenFileJournal(dir)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		m, err := bgtask.Open(ctx, host(), bgtask.WithJournal(j), bgtask.WithClock(clk), bgtask.WithHealth(bgtask.HealthPolicy{}))
		require.NoError(t, err)
		return m
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m := open()
	for _, models := range [][]bgtask.Model{{{ID: "solo"}}, nil} {
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "p", Models: models})
		require.NoError(t, err)
		done, err := m.Wait(ctx, task.ID)
		require.NoError(t, err)
		require.Equal(t, bgtask.StatusError, done.Status)
	}
	hs := m.Health()
	require.Len(t, hs, 1, "%+v", hs)
	assert.Equal(t, "/solo", hs[0].Key())
	assert.False(t, hs[0].Provider)
	assert.Equal(t, bgtask.HealthCooling, hs[0].State)
	require.NoError(t, m.Shutdown(ctx))

	m = open()
	hs = m.Health()
	require.Len(t, hs, 1, "the restart takes it back")
	assert.Equal(t, "/solo", hs[0].Key())
	require.NoError(t, m.ResetHealth(ctx, "/solo"))
	assert.Equal(t, bgtask.HealthHealthy, m.Health()[0].State)
	require.NoError(t, m.Shutdown(ctx))
}
