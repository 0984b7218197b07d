package bgtask

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func newFuncHarness(t *testing.T, fn RunFunc, opts ...Option) *harness {
	t.Helper()
	h := &harness{t: t, rec: &recorder{}}
	host := NewFuncHost(fn)
	all := append([]Option{WithIDs(SequentialIDs()), WithNotifier(h.rec)}, opts...)
	h.m = mustOpen(host, all...)
	shutdownAtCleanup(t, h.m)
	return h
}

func TestFuncHostAnswerCompletesTheTask(t *testing.T) {
	var got Run
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		got = run
		run.Busy()
		return "answer to " + run.Prompt, nil
	})
	task := h.launchSpec(Spec{ParentSessionID: "p", Agent: "explore", Prompt: "q", Models: mustModels(t, "a/one")})
	done := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "answer to q", done.Result)
	assert.Equal(t, "fn_"+done.Attempts[0].ID, done.SessionID, "the host minted the session id")
	assert.Equal(t, task.ID, got.TaskID)
	assert.Equal(t, done.Attempts[0].ID, got.AttemptID)
	assert.Equal(t, 1, got.Attempt)
	assert.Equal(t, "a/one", got.Model.String())
	assert.Equal(t, "explore", got.Agent)
	assert.Equal(t, "p", got.ParentSessionID)
	assert.Equal(t, done.SessionID, got.SessionID)
}

func TestFuncHostErrorsFollowTheFallbackChain(t *testing.T) {
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		switch run.Attempt {
		case 1:
			return "", errForbidden
		case 2:
			return "", errRateLimited
		}
		return "third time", nil
	})
	done := h.wait(h.launch("a/one", "b/two", "c/three").ID)
	assert.Equal(t, StatusCompleted, done.Status)
	require.Len(t, done.Attempts, 3)
	assert.Equal(t, errForbidden.Error(), done.Attempts[0].Error)
	assert.Equal(t, errRateLimited.Error(), done.Attempts[1].Error)
}

func TestFuncHostPermanentErrorEndsTheTask(t *testing.T) {
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		return "", Permanent(errRateLimited)
	})
	done := h.wait(h.launch("a/one", "b/two").ID)
	assert.Equal(t, StatusError, done.Status)
	assert.Len(t, done.Attempts, 1)
}

func TestFuncHostPanicIsANonRetryableError(t *testing.T) {
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		panic("nil map write in tool loop")
	})
	done := h.wait(h.launch("a/one", "b/two").ID)
	assert.Equal(t, StatusError, done.Status)
	assert.Len(t, done.Attempts, 1, "a panic is not retried")
	assert.Contains(t, done.Error, "nil map write in tool loop")
}

func TestFuncHostCancelOfCooperativeFunction(t *testing.T) {
	started := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		close(started)
		<-ctx.Done()
		return "", ctx.Err()
	})
	task := h.launch("a/one", "b/two")
	recv(t, started, "the function to start")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	got := h.task(task.ID)
	assert.Equal(t, StatusCancelled, got.Status, "the function returned: it stopped")
	assert.Len(t, got.Attempts, 1)
	assert.Empty(t, got.Error, "its ctx error is the abort's doing, not a failure")
}

func TestFuncHostCancelOfFunctionThatIgnoresItsContext(t *testing.T) {
	started := make(chan struct{})
	release := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		close(started)
		<-release // ignores ctx
		return "", errors.New("finally noticed")
	})
	task := h.launch("a/one", "b/two")
	recv(t, started, "the function to start")
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := h.m.Stop(ctx, Target{Task: task.ID})
	require.ErrorIs(t, err, context.DeadlineExceeded, "Stop times out")
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "never reported stopped while it runs")

	close(release)
	done := h.wait(task.ID)
	assert.Equal(t, StatusCancelled, done.Status, "when it returns, the confirmed abort is recorded")
	assert.Len(t, done.Attempts, 1)
}

func TestFuncHostAnswerAfterAbortIsStillTheTruth(t *testing.T) {
	started := make(chan struct{})
	release := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		close(started)
		<-release
		return "made it anyway", nil
	})
	task := h.launch("a/one")
	recv(t, started, "the function to start")
	errc := make(chan error, 1)
	waiting := make(chan string, 1)
	h.m.hooks.waiting = func(id string) { waiting <- id }
	go func() { errc <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	recv(t, waiting, "Stop to wait for the function")
	close(release)
	require.NoError(t, recv(t, errc, "Stop to return"))
	done := h.task(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "made it anyway", done.Result)
}

func TestFuncHostLateReturnNeverCompletesALaterAttempt(t *testing.T) {
	firstRelease := make(chan struct{})
	secondStarted := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		if run.Attempt == 1 {
			run.Busy()
			// The host also reports an error for this session (say, the
			// provider stream broke) while the function keeps going.
			return "", errRateLimited
		}
		close(secondStarted)
		<-firstRelease
		<-ctx.Done()
		return "", ctx.Err()
	})
	task := h.launch("a/one", "b/two")
	recv(t, secondStarted, "the second attempt's function to start")
	before := h.task(task.ID)
	require.Equal(t, 2, len(before.Attempts))
	// A report for attempt 1, as a late return would make it, is stale.
	first := before.Attempts[0]
	err := h.m.Observe(Event{SessionID: first.SessionID, AttemptID: first.ID, Token: first.Token, Kind: SessionIdle, Text: "late"})
	assert.ErrorIs(t, err, ErrStaleEvent)
	assert.Equal(t, before, h.task(task.ID))
	close(firstRelease)
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
}

func TestFuncHostCompactionReportsKeepTheTaskRunning(t *testing.T) {
	reported := make(chan struct{})
	release := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		run.Busy()
		run.Compacted()
		run.Busy()
		close(reported)
		<-release
		return "after compaction", nil
	})
	task := h.launch("a/one")
	recv(t, reported, "the function's reports")
	assert.NotEqual(t, StatusCancelled, h.task(task.ID).Status)
	assert.False(t, h.task(task.ID).Status.Terminal())
	close(release)
	assert.Equal(t, StatusCompleted, h.wait(task.ID).Status)
}

func TestFuncHostCancelFromInsideItsOwnFunction(t *testing.T) {
	var m *Manager
	inner := make(chan error, 1)
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		inner <- stopErr(m.Stop(ctx, Target{Task: run.TaskID}))
		<-ctx.Done()
		return "", ctx.Err()
	})
	m = h.m
	task := h.launch("a/one")
	assert.ErrorIs(t, recv(t, inner, "the Stop made inside the function"), ErrStopPending)
	assert.Equal(t, StatusCancelled, h.wait(task.ID).Status)
}

func TestFuncHostShutdownStopsEveryFunction(t *testing.T) {
	var started sync.WaitGroup
	started.Add(3)
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		started.Done()
		<-ctx.Done()
		return "", ctx.Err()
	})
	var ids []string
	for range 3 {
		ids = append(ids, h.launch("a/one").ID)
	}
	started.Wait()
	require.NoError(t, h.m.Shutdown(context.Background()))
	for _, id := range ids {
		assert.Equal(t, StatusInterrupt, h.task(id).Status)
	}
	assert.Zero(t, h.m.life.group.Running())
}

func TestFuncHostManyConcurrentTasks(t *testing.T) {
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		run.Busy()
		if run.Attempt == 1 && run.TaskID[len(run.TaskID)-1]%2 == 0 {
			return "", errRateLimited
		}
		return fmt.Sprintf("%s/%d", run.TaskID, run.Attempt), nil
	})
	var wg sync.WaitGroup
	ids := make(chan string, 100)
	for range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			task, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/1", "b/2")})
			if assert.NoError(t, err) {
				ids <- task.ID
			}
		}()
	}
	wg.Wait()
	close(ids)
	n := 0
	for id := range ids {
		done := h.wait(id)
		assert.Equal(t, StatusCompleted, done.Status)
		assert.Equal(t, fmt.Sprintf("%s/%d", id, len(done.Attempts)), done.Result)
		n++
	}
	assert.Equal(t, 100, n)
	checkInvariants(t, h.m)
}

func TestFuncHostServesOneManager(t *testing.T) {
	host := NewFuncHost(func(ctx context.Context, run Run) (string, error) { return "", nil })
	m := mustOpen(host)
	defer func() { require.NoError(t, m.Shutdown(context.Background())) }()
	assert.Panics(t, func() { mustOpen(host) })
}

func TestFuncHostProgressAndWaitingShowOnTheTaskAndInTheStream(t *testing.T) {
	step := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		run.Progress("reading 3 files\nand more")
		<-step
		run.Waiting()
		<-step
		run.Progress(strings.Repeat("x", 500))
		<-step
		return "", errors.New("provider went away")
	})
	sub, err := h.m.Subscribe(context.Background(), 256)
	require.NoError(t, err)
	defer sub.Close()
	task := h.launchSpec(Spec{ParentSessionID: "p", Models: mustModels(t, "a/one")})
	next := func(ok func(Task) bool) Task {
		t.Helper()
		for {
			c, open := recvOK(t, sub.C, "the change awaited on the stream")
			if !open {
				t.Fatal("stream closed")
			}
			if c.Task.ID == task.ID && ok(c.Task) {
				return c.Task
			}
		}
	}
	got := next(func(t Task) bool { return t.Progress != "" })
	assert.Equal(t, "reading 3 files and more", got.Progress, "one line")
	assert.Equal(t, ActivityGenerating, got.Activity)
	send(t, step, struct{}{}, "the function (its first step)")
	got = next(func(t Task) bool { return t.Activity == ActivityWaiting })
	assert.Equal(t, "reading 3 files and more", got.Progress, "kept while it waits")
	send(t, step, struct{}{}, "the function (its second step)")
	got = next(func(t Task) bool { return t.Progress != "reading 3 files and more" })
	assert.LessOrEqual(t, len([]rune(got.Progress)), maxProgressRunes)
	send(t, step, struct{}{}, "the function (its last step)")
	done := h.wait(task.ID)
	assert.Empty(t, done.Progress, "only while it runs")
	assert.Contains(t, done.Outcome.Evidence, "xxxx", "the last progress is the failure's evidence")
}
