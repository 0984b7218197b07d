package bgtask

import (
	"context"
	"errors"
	goruntime "runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestConfirmedAbortIsRecordedWhileOtherAbortsHang(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan string, 64)
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		entered <- sid
		if sid == "ses-1" {
			return nil // confirmed at once
		}
		<-release
		return nil
	}})
	first, _ := h.child("root")
	for range maxAbortWorkers {
		h.child("root")
	}
	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); done <- err }()
	for range maxAbortWorkers + 1 {
		recv(t, entered, "an abort of the closure") // ses-1's abort returned; every worker now hangs in one
	}
	wctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // failure detection only
	defer cancel()
	got, err := h.m.Wait(wctx, first.ID)
	require.NoError(t, err, "the confirmed stop waited behind the hung aborts")
	close(release)
	require.NoError(t, recv(t, done, "the branch's Stop to return"))
	assert.Equal(t, StatusCancelled, got.Status, "the host confirmed ses-1's abort")
}

func TestAnAbortThatWaitsOnAnotherStoppedTaskDoesNotDeadlock(t *testing.T) {
	var m *Manager
	var firstID atomic.Value
	var timeouts atomic.Int32
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		if sid == "ses-1" {
			return nil
		}
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second) // failure detection only
		defer cancel()
		if _, err := m.Wait(wctx, firstID.Load().(string)); err != nil {
			timeouts.Add(1)
		}
		return nil
	}})
	m = h.m
	first, _ := h.child("root")
	firstID.Store(first.ID)
	for range maxAbortWorkers {
		h.child("root")
	}
	_, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.NoError(t, err)
	assert.Zero(t, timeouts.Load())
}

func TestFenceCoversTasksUnderASessionBoundDuringTheClosure(t *testing.T) {
	releaseStart := make(chan struct{})
	releaseAbort := make(chan struct{})
	abortO := make(chan struct{})
	startG2 := make(chan struct{})
	h := newHarness(t, &testHost{
		start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
			switch {
			case req.ParentSessionID == "root" && req.Prompt == "T":
				<-releaseStart
				return "x-session", nil
			case req.ParentSessionID == "x-session" && req.Prompt == "G2":
				<-startG2
			}
			return sid, nil
		},
		abort: func(ctx context.Context, sid string) error {
			if sid == "ses-1" {
				close(abortO)
				<-releaseAbort
			}
			return nil
		},
	})
	h.child("root") // ses-1: its abort holds the first pass
	// G and G2 were launched from the session T's start will return, before
	// it is bound.
	g, gSes := h.child("x-session")
	g2 := h.launchSpec(Spec{ParentSessionID: "x-session", Prompt: "G2", Models: mustModels(t, "a/one")})
	tt := h.launchSpec(Spec{ParentSessionID: "root", Prompt: "T", Models: mustModels(t, "a/one")})

	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); done <- err }()
	recv(t, abortO, "ses-1's abort") // the first pass is waiting

	close(releaseStart) // T binds x-session and is aborted on arrival
	require.Equal(t, StatusCancelled, h.wait(tt.ID).Status)

	// No scan has reached G or G2 yet; the fence covers them all the same.
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: gSes, Models: mustModels(t, "a/one")})
	assert.ErrorIs(t, err, ErrBranchClosing)
	require.NoError(t, h.observe(Event{SessionID: gSes, Kind: SessionError, Err: errRateLimited}))
	assert.Len(t, h.task(g.ID).Attempts, 1, "no retry inside a closing branch")
	assert.Equal(t, StatusError, h.task(g.ID).Status, "G ended on its own failure")
	close(startG2)
	got2 := h.wait(g2.ID)
	assert.Equal(t, StatusCancelled, got2.Status, "an arriving session in scope is bound, then aborted")
	assert.NotEmpty(t, got2.SessionID)
	assert.Contains(t, h.host.Aborts(), got2.SessionID)

	close(releaseAbort)
	require.NoError(t, recv(t, done, "the branch's Stop to return"))
	assert.Equal(t, StatusCancelled, h.task(g2.ID).Status)
}

func TestClosureRecordIsNotAliasedWithTheReport(t *testing.T) {
	h := newHarness(t, nil)
	h.child("root")
	rep, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.NoError(t, err)
	require.Len(t, rep.Stopped, 1)
	rep.Stopped[0].Status = "tampered"
	assert.Equal(t, StatusCancelled, h.m.Snapshot().Closures[0].Stopped[0].Status)
}

func TestClosureWaitsForTheSessionOfAFailedStart(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	h := newHarness(t, &testHost{
		start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
			close(entered)
			select {
			case <-release:
			case <-ctx.Done():
				return "", ctx.Err()
			}
			return sid, errors.New("prompt failed after the session was created")
		},
		abort: func(ctx context.Context, sid string) error { return errors.New("wedged") },
	})
	task := h.launchSpec(Spec{ParentSessionID: "root", Models: mustModels(t, "a/one")})
	recv(t, entered, "the start")
	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); done <- err }()
	h.until(func() bool {
		h.m.mu.Lock()
		defer h.m.unlock()
		return len(h.m.closures.active) == 1 && h.m.led.tasks[task.ID].stop != ""
	})
	close(release)
	err := recv(t, done, "the branch's Stop to return")
	assert.ErrorIs(t, err, ErrBranchNotStopped, "ses-1 exists and its abort failed")
	assert.Equal(t, StatusRunning, h.task(task.ID).Status)
	assert.Contains(t, h.host.Aborts(), "ses-1")
	var ce *ClosureError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "ses-1", ce.Failed[0].SessionID)
}

func TestClosureRootBoundDuringTheClosureIsStopped(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		close(entered)
		<-release
		return "the-root", nil
	}})
	task := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	recv(t, entered, "the start")
	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "the-root"}); done <- err }()
	h.until(func() bool {
		h.m.mu.Lock()
		defer h.m.unlock()
		return len(h.m.closures.active) == 1
	})
	select {
	case err := <-done:
		t.Fatalf("the closure returned (%v) while the start that creates its root was in flight", err)
	default:
	}
	close(release) // the root session is bound to the task during the closure
	require.NoError(t, recv(t, done, "the branch's Stop to return"))
	assert.Equal(t, StatusCancelled, h.wait(task.ID).Status)
}

func TestClosureFromACallbackFinishesInTheBackground(t *testing.T) {
	var m *Manager
	inner := make(chan error, 1)
	var kidID atomic.Value
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		if ref, ok := RunFromContext(ctx); ok && ref.TaskID == kidID.Load() {
			_, err := m.Stop(ctx, Target{Session: "root"})
			inner <- err
		}
		return nil
	}})
	m = h.m
	_, ses := h.child("root")
	kid, kidSes := h.child(ses)
	grand, _ := h.child(kidSes)
	kidID.Store(kid.ID)
	require.NoError(t, stopErr(m.Stop(context.Background(), Target{Task: kid.ID})))
	assert.ErrorIs(t, recv(t, inner, "the Stop made inside the abort callback"), ErrStopPending)
	assert.Equal(t, StatusCancelled, h.wait(grand.ID).Status, "the closure went on without its caller")
	h.until(func() bool { return len(m.Snapshot().Closures) == 1 })
	_, err := m.Launch(context.Background(), Spec{ParentSessionID: "root", Models: mustModels(t, "a/one")})
	assert.NoError(t, err, "its fence came down when it finished")
}

// Found by the simulation (seed 2): two closures waiting on the same start
// in flight woke each other forever.
func TestOverlappingClosuresWaitingOnAStartDoNotWakeEachOther(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		close(entered)
		select {
		case <-release:
		case <-ctx.Done():
			return "", ctx.Err()
		}
		return sid, nil
	}})
	h.launchSpec(Spec{ParentSessionID: "root", Models: mustModels(t, "a/one")})
	recv(t, entered, "the start")
	reports := make(chan ClosureReport, 2)
	for range 2 {
		go func() {
			rep, err := h.m.Stop(context.Background(), Target{Session: "root"})
			assert.NoError(t, err)
			reports <- rep
		}()
	}
	h.until(func() bool {
		h.m.mu.Lock()
		defer h.m.unlock()
		return len(h.m.closures.active) == 2
	})
	for range 1000 { // let a spinning pair of closures spin
		goruntime.Gosched()
	}
	close(release)
	for range 2 {
		rep := recv(t, reports, "each of the two Stops to return")
		assert.LessOrEqual(t, rep.Passes, 4, "a closure made %d passes while it waited", rep.Passes)
	}
}

// slowJournal makes every commit take a while to become durable, as a
// database's does: a run's start then often returns in the moment between
// a closure raising its fence and its first pass.
type slowJournal struct{ Journal }

type slowCommit struct{ Commit }

func (c slowCommit) Wait() error {
	time.Sleep(2 * time.Millisecond) // latency, not a wait for a state
	return c.Commit.Wait()
}

func (j slowJournal) Append(b []Record) Commit { return slowCommit{j.Journal.Append(b)} }

func TestAClosureListsTheRunsItsFenceStopped(t *testing.T) {
	// A start that returned after a Stop of the branch raised its fence and
	// before its first pass was aborted on arrival, and the report left it
	// out (found running the root tests on PostgreSQL).
	for range 40 {
		fj, err := OpenFileJournal(t.TempDir())
		require.NoError(t, err)
		h := newHarness(t, nil, WithJournal(slowJournal{fj}))
		p := h.running("chat")
		kid := h.running(p.SessionID)
		late, err := h.m.Launch(context.Background(), Spec{ParentSessionID: p.SessionID, Models: mustModels(t, "a/one")})
		require.NoError(t, err) // its start is on its way
		rep, err := h.m.Stop(context.Background(), Target{Session: "chat"})
		require.NoError(t, err)
		var ids []string
		for _, r := range rep.Stopped {
			ids = append(ids, r.TaskID)
			assert.Equal(t, StatusCancelled, r.Status)
		}
		require.ElementsMatch(t, []string{p.ID, kid.ID, late.ID}, ids, "every run the closure stopped is in its report")
		got, _ := h.m.Task(late.ID)
		require.Equal(t, StatusCancelled, got.Status)
	}
}
