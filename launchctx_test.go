package bgtask

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// nest is a lead task whose function launches one child with its own
// context (no ParentSessionID, no Run value threaded) and returns at once.
type nest struct {
	m        *Manager
	lead     Task
	kid      Task
	returned chan struct{} // closed once the lead's function returned
	release  chan struct{} // closed to let the child answer
}

func newNest(t *testing.T, m *Manager, kid Spec) *nest {
	t.Helper()
	n := &nest{m: m, returned: make(chan struct{}), release: make(chan struct{})}
	kids := make(chan Task, 1)
	kid.Run = func(ctx context.Context, r Run) (string, error) {
		select {
		case <-n.release:
			return "kid done", nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	var err error
	n.lead, err = m.Launch(testCtx(t), Spec{ParentSessionID: "chat", Description: "lead", Budget: &Budget{Spawns: 1},
		Run: func(ctx context.Context, run Run) (string, error) {
			defer close(n.returned)
			k, err := run.Manager().Launch(ctx, kid)
			if err != nil {
				return "", err
			}
			kids <- k
			return "lead done", nil
		}})
	require.NoError(t, err)
	select {
	case n.kid = <-kids:
	case <-testCtx(t).Done():
		t.Fatal("the lead never launched its child")
	}
	recv(t, n.returned, "the lead's function to return")
	return n
}

func TestALaunchWithARunsContextGoesBeneathThatRun(t *testing.T) {
	m := mustOpen(nil, WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	n := newNest(t, m, Spec{Description: "kid"})
	lead, err := m.Task(n.lead.ID)
	require.NoError(t, err)
	require.NotEmpty(t, lead.SessionID)
	assert.Equal(t, lead.SessionID, n.kid.ParentSessionID, "the run's session is the child's parent")
	assert.Equal(t, "chat", n.kid.Root, "in the lead's tree")
	assert.Equal(t, lead.Depth+1, n.kid.Depth)
	assert.False(t, n.kid.Detached)

	// Not detached: the child holds its parent's end (the children gate).
	assert.Equal(t, StatusRunning, mustTask(t, m, n.lead.ID).Status, "the lead's function returned, its child runs: the lead waits for it")
	_, err = m.Launch(testCtx(t), Spec{ParentSessionID: lead.SessionID, Run: func(context.Context, Run) (string, error) { return "", nil }})
	require.ErrorIs(t, err, ErrBudget, "the child counted as the tree's one spawn")
	close(n.release)
	done, err := m.Wait(testCtx(t), n.lead.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.True(t, mustTask(t, m, n.kid.ID).Status.Terminal(), "the lead ended only once its child had")
}

func TestADetachedChildDoesNotHoldItsParentYetStopsWithItsBranch(t *testing.T) {
	m := mustOpen(nil, WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	n := newNest(t, m, Spec{Description: "background kid", Detached: true})
	assert.True(t, n.kid.Detached)
	done, err := m.Wait(testCtx(t), n.lead.ID)
	require.NoError(t, err, "a detached child does not hold its parent's end")
	assert.Equal(t, StatusCompleted, done.Status)
	assert.False(t, mustTask(t, m, n.kid.ID).Status.Terminal(), "and goes on after it")

	rep, err := m.Stop(testCtx(t), Target{Task: n.lead.ID, Tree: true})
	require.NoError(t, err)
	require.Len(t, rep.Stopped, 1)
	assert.Equal(t, n.kid.ID, rep.Stopped[0].TaskID, "stopped with its parent's branch")
	kid := mustTask(t, m, n.kid.ID)
	assert.Equal(t, StatusCancelled, kid.Status)
	require.NotNil(t, kid.Stop)
	assert.Equal(t, StopCause{Kind: StopClosure, TaskID: n.lead.ID}, *kid.Stop)
}

func TestADetachedChildIsDetachedAfterARestart(t *testing.T) {
	dir := t.TempDir()
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m := mustOpen(&testHost{}, WithJournal(j), WithIDs(SequentialIDs()))
	lead, err := m.Launch(testCtx(t), Spec{ParentSessionID: "chat", Models: oneModel})
	require.NoError(t, err)
	lead = waitFor(t, m, lead.ID, func(t Task) bool { return t.SessionID != "" })
	kid, err := m.Launch(testCtx(t), Spec{ParentSessionID: lead.SessionID, Models: oneModel, Detached: true, Attach: map[string]int{"n": 1}})
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(testCtx(t)))

	j, err = OpenFileJournal(dir)
	require.NoError(t, err)
	m = mustOpen(&testHost{}, WithJournal(j), WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	got := mustTask(t, m, kid.ID)
	assert.True(t, got.Detached, "journaled with the launch")
	v, ok := Attached[map[string]int](got)
	assert.True(t, ok)
	assert.Equal(t, map[string]int{"n": 1}, v)
}

// origin is what a spawn tool attaches: where the answer goes.
type origin struct {
	Channel string `json:"channel"`
	Chat    int64  `json:"chat"`
}

// badJSON is a value whose MarshalJSON panics: user code.
type badJSON struct{}

func (badJSON) MarshalJSON() ([]byte, error) { panic("boom") }

func TestAnAttachedValueIsReadBackTypedFromAnySnapshot(t *testing.T) {
	h := newHarness(t, nil)
	want := origin{Channel: "telegram", Chat: -100123}
	task := h.launchSpec(Spec{ParentSessionID: "chat", Models: oneModel, Attach: want})
	for name, got := range map[string]Task{"Launch": task, "Task": h.task(task.ID), "Snapshot": h.m.Snapshot().Tasks[0]} {
		v, ok := Attached[origin](got)
		assert.True(t, ok, name)
		assert.Equal(t, want, v, name)
	}
	raw, err := json.Marshal(h.task(task.ID))
	require.NoError(t, err)
	var decoded Task
	require.NoError(t, json.Unmarshal(raw, &decoded))
	v, ok := Attached[origin](decoded)
	assert.True(t, ok, "through JSON, as bgtaskhttp and pgledger carry it")
	assert.Equal(t, want, v)

	_, ok = Attached[int](decoded)
	assert.False(t, ok, "not an int")
	_, ok = Attached[origin](h.launchSpec(Spec{ParentSessionID: "chat", Models: oneModel}))
	assert.False(t, ok, "nothing attached")
	snap := h.task(task.ID)
	snap.Attach[0] = 'x'
	assert.Equal(t, want, must(Attached[origin](h.task(task.ID))), "a snapshot's Attach is a copy")

	for name, bad := range map[string]any{"a channel": make(chan int), "a panicking MarshalJSON": badJSON{}, "too large": make([]byte, maxAttachBytes)} {
		_, err := h.m.Launch(testCtx(t), Spec{ParentSessionID: "chat", Models: oneModel, Attach: bad})
		var se *SpecError
		require.ErrorAs(t, err, &se, name)
		assert.Equal(t, "Attach", se.Field, name)
		assert.ErrorIs(t, err, ErrInvalidArgument, name)
	}
	assert.Len(t, h.m.Snapshot().Tasks, 2, "a refused launch records nothing")
}

func must[T any](v T, ok bool) T {
	if !ok {
		panic("not ok")
	}
	return v
}

func TestALaunchWithAnotherManagersRunContextIsNotNested(t *testing.T) {
	other := mustOpen(nil)
	shutdownAtCleanup(t, other)
	m := mustOpen(&testHost{})
	shutdownAtCleanup(t, m)
	got := make(chan Task, 1)
	_, err := other.Launch(testCtx(t), Spec{Run: func(ctx context.Context, run Run) (string, error) {
		task, err := m.Launch(ctx, Spec{Models: oneModel})
		if err != nil {
			return "", err
		}
		got <- task
		return "", nil
	}})
	require.NoError(t, err)
	select {
	case task := <-got:
		assert.Empty(t, task.ParentSessionID, "the run is another Manager's")
	case <-testCtx(t).Done():
		t.Fatal("no launch")
	}
}

func TestRunReturnsTheEnd(t *testing.T) {
	m := mustOpen(nil)
	shutdownAtCleanup(t, m)
	done, err := m.Run(testCtx(t), Spec{Run: func(context.Context, Run) (string, error) { return "42", nil }})
	require.NoError(t, err)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "42", done.Result)

	_, err = m.Run(testCtx(t), Spec{Key: "k", ExtendLive: true, Run: func(context.Context, Run) (string, error) { return "", nil }})
	var se *SpecError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, "ExtendLive", se.Field)
}

// runResult is what a Run returned.
type runResult struct {
	t   Task
	err error
}

// runRunning calls h.m.Run with ctx on a goroutine and returns once the
// task it launched is running: its result comes on the channel. The task's
// id is the one its session start was asked for.
func runRunning(t *testing.T, h *harness, ctx context.Context) (<-chan runResult, string) {
	t.Helper()
	starting := make(chan string, 1)
	h.host.mu.Lock()
	h.host.start = func(_ context.Context, req SessionRequest, sid string) (string, error) {
		starting <- req.TaskID
		return sid, nil
	}
	h.host.mu.Unlock()
	out := make(chan runResult, 1)
	go func() {
		t, err := h.m.Run(ctx, Spec{ParentSessionID: "chat", Models: oneModel})
		out <- runResult{t, err}
	}()
	var id string
	select {
	case id = <-starting:
	case <-testCtx(t).Done():
		t.Fatal("Run started no session")
	}
	waitFor(t, h.m, id, func(t Task) bool { return t.Status == StatusRunning })
	return out, id
}

// A synchronous subagent whose caller gives up: Run stops the task, and
// returns only once its child really stopped, with the caller's error.
func TestRunStopsTheTaskWithItsCallerAndReturnsTheRealEnd(t *testing.T) {
	asked, confirm := make(chan struct{}), make(chan struct{})
	host := &testHost{abort: func(ctx context.Context, sid string) error {
		close(asked)
		<-confirm
		return nil
	}}
	h := newHarness(t, host)
	ctx, cancel := context.WithCancel(context.Background())
	out, id := runRunning(t, h, ctx)
	cancel()
	select {
	case <-asked:
	case r := <-out:
		t.Fatalf("Run returned without stopping its task: %v %v", r.t.Status, r.err)
	case <-testCtx(t).Done():
		t.Fatal("no abort was asked after the caller's context ended")
	}
	select {
	case r := <-out:
		t.Fatalf("Run returned before the child stopped: %v %v", r.t.Status, r.err)
	default:
	}
	assert.Equal(t, StatusRunning, h.task(id).Status, "honest: running until the host confirms")
	close(confirm)
	r := recv(t, out, "Run to return")
	require.ErrorIs(t, r.err, context.Canceled)
	assert.Equal(t, StatusCancelled, r.t.Status, "the real end")
	assert.Equal(t, id, r.t.ID)
}

func TestRunWhoseStopFailsSaysSo(t *testing.T) {
	refused := errors.New("the session service refused")
	h := newHarness(t, &testHost{abort: func(context.Context, string) error { return refused }})
	ctx, cancel := context.WithCancel(context.Background())
	out, _ := runRunning(t, h, ctx)
	cancel()
	r := recv(t, out, "Run to return")
	require.ErrorIs(t, r.err, context.Canceled)
	require.ErrorIs(t, r.err, ErrBranchNotStopped, "the stop of its tree failed")
	assert.Contains(t, r.err.Error(), refused.Error(), "and why")
	assert.Equal(t, StatusRunning, r.t.Status, "the child did not stop: it is not called cancelled")
}

func TestStopRefusesATargetThatNamesNothingOrSeveralThings(t *testing.T) {
	h := newHarness(t, nil)
	task := h.running("chat")
	for name, tg := range map[string]Target{
		"zero":             {},
		"task and session": {Task: task.ID, Session: "chat"},
		"tree alone":       {Tree: true},
		"tree of session":  {Session: "chat", Tree: true},
		"blank task":       {Task: "  "},
		"blank session":    {Session: "\t"},
		"run, no token":    {Run: RunRef{TaskID: task.ID}},
		"run and task":     {Task: task.ID, Run: RunRef{TaskID: task.ID, Token: task.Current().Token}},
	} {
		_, err := h.m.Stop(testCtx(t), tg)
		assert.ErrorIs(t, err, ErrInvalidArgument, name)
	}
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "nothing was stopped")
	_, err := h.m.Stop(testCtx(t), Target{Task: "nobody"})
	assert.ErrorIs(t, err, ErrUnknownTask)
	_, err = h.m.Stop(testCtx(t), Target{Session: "nobody"})
	assert.ErrorIs(t, err, ErrUnknownSession)
}

// NoWait, for each kind of Target: Stop returns once the stop is asked,
// before the child stopped; the task then ends cancelled.
func TestStopWithNoWaitReturnsBeforeTheChildStopped(t *testing.T) {
	for _, tt := range []struct {
		name   string
		target func(Task) Target
	}{
		{"task", func(k Task) Target { return Target{Task: k.ID, NoWait: true} }},
		{"tree", func(k Task) Target { return Target{Task: k.ID, Tree: true, NoWait: true} }},
		{"session", func(k Task) Target { return Target{Session: "chat", NoWait: true} }},
		{"run", func(k Task) Target {
			return Target{Run: RunRef{TaskID: k.ID, AttemptID: k.CurrentAttemptID, Token: k.Current().Token}, NoWait: true}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			confirm := make(chan struct{})
			h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
				select {
				case <-confirm:
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			}})
			task := h.running("chat")
			_, err := h.m.Stop(testCtx(t), tt.target(task))
			require.NoError(t, err)
			assert.Equal(t, StatusRunning, h.task(task.ID).Status, "running until the host confirms")
			close(confirm)
			assert.Equal(t, StatusCancelled, h.wait(task.ID).Status)
		})
	}
}

func TestStopReportsTheRunItStopped(t *testing.T) {
	h := newHarness(t, nil)
	task := h.running("chat")
	rep, err := h.m.Stop(testCtx(t), Target{Task: task.ID})
	require.NoError(t, err)
	require.Len(t, rep.Stopped, 1)
	assert.Equal(t, StoppedRun{TaskID: task.ID, AttemptID: task.CurrentAttemptID, SessionID: task.SessionID, Token: task.Current().Token, Status: StatusCancelled}, rep.Stopped[0])
	rep, err = h.m.Stop(testCtx(t), Target{Task: task.ID})
	require.NoError(t, err, "an ended task: nothing to do")
	assert.Empty(t, rep.Stopped)
}

// Run's error is nil only for a clean answer: a failure, a panic and an
// answer that is not clean each say why, with the task's snapshot.
func TestRunSaysWhyThereIsNoCleanAnswer(t *testing.T) {
	m := mustOpen(nil)
	shutdownAtCleanup(t, m)
	refused := errors.New("429 Too Many Requests")
	done, err := m.Run(testCtx(t), Spec{Run: func(context.Context, Run) (string, error) { return "", Permanent(refused) }})
	require.ErrorIs(t, err, refused)
	assert.Equal(t, StatusError, done.Status)

	done, err = m.Run(testCtx(t), Spec{Run: func(context.Context, Run) (string, error) { panic("boom") }})
	var p *PanicError
	require.ErrorAs(t, err, &p)
	assert.Equal(t, StatusError, done.Status)

	h := newHarness(t, nil)
	out, id := runRunning(t, h, context.Background())
	require.NoError(t, h.observe(Event{SessionID: h.task(id).SessionID, Kind: SessionIdle, Text: "half an ans", Reason: ReasonOutputLimit}))
	r := recv(t, out, "Run to return")
	require.ErrorIs(t, r.err, ReasonOutputLimit, "completed, but cut off: not a clean answer")
	assert.Equal(t, StatusCompleted, r.t.Status)
	assert.Equal(t, "half an ans", r.t.Result)
}

// A Launch refused, for any reason, records nothing and keeps Spec.ID
// free: the same id launches at once afterwards. (Each case has parents
// of its own: MaxPerParent is 1 for every parent.)
func TestARefusedLaunchKeepsItsIDFree(t *testing.T) {
	h := newHarness(t, nil, WithTreeLimits(TreeLimits{MaxPerParent: 1, ParentWait: time.Minute}))
	busy := h.running("full")
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	waiting, stop := context.WithCancel(context.Background())
	refusals := map[string]func(id string) error{
		"an ended context": func(id string) error {
			_, err := h.m.Launch(ended, Spec{ParentSessionID: "p-" + id, ID: id, Models: oneModel})
			return err
		},
		"a bad spec": func(id string) error {
			_, err := h.m.Launch(testCtx(t), Spec{ParentSessionID: "p-" + id, ID: id, Models: oneModel, MaxAttempts: -1})
			return err
		},
		"a context that ends in the parent's queue": func(id string) error {
			go func() {
				waitFor(t, h.m, busy.ID, func(Task) bool { return true })
				stop()
			}()
			_, err := h.m.Launch(waiting, Spec{ParentSessionID: "full", ID: id, Models: oneModel})
			return err
		},
		"a held key": func(id string) error {
			h.running("holder-"+id, func(s *Spec) { s.Key = "k-" + id })
			_, err := h.m.Launch(testCtx(t), Spec{ParentSessionID: "p-" + id, ID: id, Models: oneModel, Key: "k-" + id})
			return err
		},
	}
	n := 0
	for name, refuse := range refusals {
		n++
		id := "mine-" + strconv.Itoa(n)
		require.Error(t, refuse(id), name)
		_, err := h.m.Task(id)
		require.ErrorIs(t, err, ErrUnknownTask, "%s: nothing was recorded", name)
		task, err := h.m.Launch(testCtx(t), Spec{ParentSessionID: "ok-" + id, ID: id, Models: oneModel})
		require.NoError(t, err, "%s: the id is free", name)
		assert.Equal(t, id, task.ID)
	}
}
