package bgtasktest_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type kit struct {
	clk  *bgtasktest.Clock
	host *bgtasktest.Host
	rec  *bgtasktest.Recorder
	m    *bgtask.Manager
	ctx  context.Context
}

func newKit(t *testing.T, opts ...bgtask.Option) *kit {
	t.Helper()
	k := &kit{clk: bgtasktest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)), host: bgtasktest.NewHost(), rec: &bgtasktest.Recorder{}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	k.ctx = ctx
	k.m = testkit.MustOpen(k.host, append([]bgtask.Option{bgtask.WithClock(k.clk), bgtask.WithNotifier(k.rec), bgtask.WithIDs(bgtask.SequentialIDs())}, opts...)...)
	k.host.Attach(k.m)
	t.Cleanup(func() { assert.NoError(t, k.m.Shutdown(context.Background())) })
	return k
}

var twoModels = []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {Provider: "google", ID: "gemini"}}

func TestAFallbackWithARetryDelayDrivenByHand(t *testing.T) {
	k := newKit(t, bgtask.WithRetryDelay(func(int, error) time.Duration { return 5 * time.Second }))
	task, err := k.m.Launch(k.ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "q", Models: twoModels})
	require.NoError(t, err)
	first, err := bgtasktest.WaitStatus(k.ctx, k.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	assert.Equal(t, "ses-1", first.SessionID)
	made, _ := k.clk.Timers()
	require.NoError(t, k.host.Fail(first.SessionID, errors.New("429 Too Many Requests")))
	require.NoError(t, k.clk.AwaitTimers(k.ctx, made+1), "the retry delay's timer")
	waiting, err := bgtasktest.WaitFor(k.ctx, k.m, task.ID, func(t bgtask.Task) bool { return t.Pending == bgtask.PendingRetryDelay })
	require.NoError(t, err)
	assert.Len(t, waiting.Attempts, 2)
	k.clk.Advance(5 * time.Second)
	second, err := bgtasktest.WaitStatus(k.ctx, k.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, k.host.Idle(second.SessionID, "42"))
	done, err := k.m.Wait(k.ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, "42", done.Result)
	_, err = k.rec.Await(k.ctx, func(n bgtask.Notification) bool { return n.Kind == bgtask.NotifyFinalSummary })
	require.NoError(t, err)
	assert.Equal(t, []bgtask.NotificationKind{bgtask.NotifyRetryScheduled, bgtask.NotifyRetrySessionReady, bgtask.NotifyFinalSummary}, k.rec.Kinds(task.ID))
	starts := k.host.Starts()
	require.Len(t, starts, 2)
	assert.Equal(t, "gemini", starts[1].Model.ID)
	assert.Equal(t, []string{"ses-1"}, k.host.Aborts(), "the failed session was stopped before the retry")
}

func TestAHungStartThenACancelIsHonest(t *testing.T) {
	k := newKit(t)
	k.host.HangStarts(1)
	task, err := k.m.Launch(k.ctx, bgtask.Spec{ParentSessionID: "chat", Models: twoModels})
	require.NoError(t, err)
	require.NoError(t, k.host.AwaitCalls(k.ctx, 1))
	cancelled := make(chan error, 1)
	go func() { cancelled <- testkit.StopErr(k.m.Stop(k.ctx, bgtask.Target{Task: task.ID})) }()
	k.host.Release() // the session arrives after the stop was asked: it is aborted, then cancelled
	require.NoError(t, <-cancelled)
	done, err := k.m.Wait(k.ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, done.Status)
	assert.Equal(t, []string{"ses-1"}, k.host.Aborts())
}

func TestAFailedAbortLeavesTheTaskRunning(t *testing.T) {
	k := newKit(t)
	k.host.FailAborts(1, errors.New("session service busy"))
	task, err := k.m.Launch(k.ctx, bgtask.Spec{ParentSessionID: "chat", Models: twoModels})
	require.NoError(t, err)
	_, err = bgtasktest.WaitStatus(k.ctx, k.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	_, err = k.m.Stop(k.ctx, bgtask.Target{Task: task.ID})
	assert.ErrorContains(t, err, "session service busy")
	now, err := k.m.Task(task.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, now.Status, "never reported stopped")
	require.NoError(t, testkit.StopErr(k.m.Stop(k.ctx, bgtask.Target{Task: task.ID})), "the next abort succeeds")
}

func TestAFailedStartFallsBack(t *testing.T) {
	k := newKit(t)
	k.host.FailStarts(1, errors.New("503 Service Unavailable"))
	task, err := k.m.Launch(k.ctx, bgtask.Spec{ParentSessionID: "chat", Models: twoModels})
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(k.ctx, k.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	assert.Equal(t, 2, running.Current().Number)
	sid, ok := k.host.Session(running.CurrentAttemptID)
	assert.True(t, ok)
	assert.Equal(t, running.SessionID, sid)
}

func TestARefusingRecorderIsRetried(t *testing.T) {
	refused := 0
	k := newKit(t, bgtask.WithNotifyRetry(2, nil))
	k.rec.Refuse = func(bgtask.Notification) error {
		if refused == 0 {
			refused++
			return errors.New("chat busy")
		}
		return nil
	}
	task, err := k.m.Launch(k.ctx, bgtask.Spec{ParentSessionID: "chat", Models: twoModels})
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(k.ctx, k.m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, k.host.Idle(running.SessionID, "ok"))
	n, err := k.rec.Await(k.ctx, func(n bgtask.Notification) bool { return n.Kind == bgtask.NotifyFinalSummary })
	require.NoError(t, err)
	assert.Equal(t, task.ID, n.TaskID)
	assert.Equal(t, 1, refused)
}

func TestWaitForGivesUpWithItsContext(t *testing.T) {
	k := newKit(t)
	task, err := k.m.Launch(k.ctx, bgtask.Spec{ParentSessionID: "chat", Models: twoModels})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(k.ctx)
	cancel()
	_, err = bgtasktest.WaitStatus(ctx, k.m, task.ID, bgtask.StatusCompleted)
	assert.ErrorIs(t, err, context.Canceled)
	_, err = bgtasktest.WaitFor(k.ctx, k.m, "nope", func(bgtask.Task) bool { return true })
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	assert.Error(t, bgtasktest.NewHost().Emit(bgtask.Event{SessionID: "s", Kind: bgtask.SessionBusy}), "no Manager attached")
}

// passThrough is a host adapter under test: it forwards to the service and
// counts the calls.
type passThrough struct {
	bgtask.Host
	starts *atomic.Int64
}

func (p passThrough) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	p.starts.Add(1)
	return p.Host.StartSession(ctx, req)
}

func (p passThrough) PromptSession(ctx context.Context, req bgtask.PromptRequest) error {
	return p.Host.(bgtask.Prompter).PromptSession(ctx, req)
}

func (p passThrough) SessionStatus(ctx context.Context, sid string) (bgtask.SessionReport, error) {
	return p.Host.(bgtask.StatusHost).SessionStatus(ctx, sid)
}

func (p passThrough) FindSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	return p.Host.(bgtask.StatusHost).FindSession(ctx, req)
}

func TestTheSimulationRunsAgainstYourAdapterAndInvariants(t *testing.T) {
	for seed := range uint64(20) {
		var starts atomic.Int64
		checks := 0
		var mu sync.Mutex
		trace, err := bgtasktest.Simulate(bgtasktest.SimOptions{Seed: seed, Steps: 80,
			Host: func(service bgtask.Host) bgtask.Host {
				return passThrough{Host: service, starts: &starts}
			},
			Check: func(m *bgtask.Manager, tasks []bgtask.Task) error {
				mu.Lock()
				defer mu.Unlock()
				checks++
				for _, task := range tasks {
					if len(task.Attempts) == 0 {
						return fmt.Errorf("task %s has no attempt", task.ID)
					}
				}
				return nil
			}})
		require.NoError(t, err, "seed %d", seed)
		assert.NotEmpty(t, trace)
		assert.Positive(t, starts.Load(), "the adapter was in the path")
		mu.Lock()
		assert.GreaterOrEqual(t, checks, 80, "asked after every step")
		mu.Unlock()
	}
	_, err := bgtasktest.Simulate(bgtasktest.SimOptions{Seed: 1, Steps: 30, Check: func(*bgtask.Manager, []bgtask.Task) error {
		return errors.New("always broken")
	}})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "always broken")
	assert.Contains(t, err.Error(), "seed 1")
}

// countingJournal is a journal of yours: here the file journal, counting
// what passes through it.
type countingJournal struct {
	bgtask.Journal
	appends *atomic.Int64
}

func (c countingJournal) Append(b []bgtask.Record) bgtask.Commit {
	c.appends.Add(1)
	return c.Journal.Append(b)
}

// The simulation runs on your journal: opened at the start and after every
// crash (the crashed life's one closed first), and replayed by each life.
func TestTheSimulationRunsOnYourJournal(t *testing.T) {
	restarted := 0
	for seed := range uint64(10) {
		dir := t.TempDir()
		var opens, appends atomic.Int64
		_, err := bgtasktest.Simulate(bgtasktest.SimOptions{Seed: seed, Steps: 80, Journal: func() (bgtask.Journal, error) {
			opens.Add(1)
			j, err := bgtask.OpenFileJournal(dir) // refused if the last life's were still open
			if err != nil {
				return nil, err
			}
			return countingJournal{Journal: j, appends: &appends}, nil
		}})
		require.NoError(t, err, "seed %d", seed)
		assert.Positive(t, opens.Load())
		assert.Positive(t, appends.Load(), "the Manager wrote through the journal")
		if opens.Load() > 1 {
			restarted++
		}
		j, err := bgtask.OpenFileJournal(dir)
		require.NoError(t, err, "the last life's journal was closed at the end")
		require.NoError(t, j.Close())
	}
	assert.Positive(t, restarted, "no seed crashed and reopened the journal")
}

func TestAwaitFinalWaitsForThatTasksSummary(t *testing.T) {
	k := newKit(t)
	a, err := k.m.Launch(k.ctx, bgtask.Spec{ParentSessionID: "chat", Models: twoModels})
	require.NoError(t, err)
	b, err := k.m.Launch(k.ctx, bgtask.Spec{ParentSessionID: "chat", Models: twoModels})
	require.NoError(t, err)
	runB, err := bgtasktest.WaitStatus(k.ctx, k.m, b.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, k.host.Idle(runB.SessionID, "b's answer"))
	got, err := k.rec.AwaitFinal(k.ctx, b.ID)
	require.NoError(t, err)
	assert.Equal(t, b.ID, got.TaskID)

	short, cancel := context.WithCancel(k.ctx)
	cancel()
	_, err = k.rec.AwaitFinal(short, a.ID) // a is still running: no summary yet
	assert.ErrorIs(t, err, context.Canceled)

	runA, err := bgtasktest.WaitStatus(k.ctx, k.m, a.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, k.host.Idle(runA.SessionID, "a's answer"))
	got, err = k.rec.AwaitFinal(k.ctx, a.ID)
	require.NoError(t, err)
	assert.Equal(t, a.ID, got.TaskID)
	assert.Equal(t, bgtask.NotifyFinalSummary, got.Kind)
}
