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

// funcManager is a Manager on a FuncHost running fn, with a recording
// notifier, shut down at the end of the test.
func funcManager(t *testing.T, fn RunFunc, opts ...Option) (*Manager, *recorder) {
	t.Helper()
	rec := &recorder{}
	m := mustOpen(NewFuncHost(fn), append([]Option{WithIDs(SequentialIDs()), WithNotifier(rec)}, opts...)...)
	shutdownAtCleanup(t, m)
	return m, rec
}

var oneModel = []Model{{Provider: "a", ID: "one"}}

// A supplemental prompt is invocation 2; the function answers 1 without
// returning, then returns the answer to 2. Each answer is released once, in
// order: invocation 1's as a NotifyAnswer, the last as the final summary.
func TestExtendAnswersEachInvocationOnceInOrder(t *testing.T) {
	running := make(chan struct{})
	m, rec := funcManager(t, func(ctx context.Context, run Run) (string, error) {
		close(running)
		select {
		case p := <-run.Prompts():
			run.Answer(1, "first answer")
			return "answer to " + p.Prompt, nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	})
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "start", Models: oneModel})
	require.NoError(t, err)
	recv(t, running, "the function to run")
	n, err := m.Extend(ctx, task.ID, "more")
	require.NoError(t, err)
	assert.Equal(t, 2, n)

	a1, err := m.WaitAnswer(ctx, task.ID, 1)
	require.NoError(t, err)
	assert.Equal(t, StatusCompleted, a1.Status)
	assert.Equal(t, "first answer", a1.Text)
	assert.Contains(t, a1.Envelope, `invocation="1"`)
	a2, err := m.WaitAnswer(ctx, task.ID, 2)
	require.NoError(t, err)
	assert.Equal(t, "answer to more", a2.Text)

	done, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "answer to more", done.Result)
	require.Len(t, done.Invocations, 2)
	assert.Equal(t, "start", done.Invocations[0].Prompt)
	assert.Equal(t, "more", done.Invocations[1].Prompt)

	require.NoError(t, m.Shutdown(ctx)) // every notification delivered
	assert.Equal(t, []NotificationKind{NotifyAnswer, NotifyFinalSummary}, rec.Kinds(task.ID))
	for _, n := range rec.All() {
		if n.Kind == NotifyAnswer {
			assert.Contains(t, n.Text, a1.Envelope)
		}
	}
	_, err = m.WaitAnswer(ctx, task.ID, 3)
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

// Extends arriving together are admitted one at a time: numbers follow
// the order the function receives them, never interleaved.
func TestConcurrentExtendsAreOrdered(t *testing.T) {
	const extra = 8
	running := make(chan struct{})
	var got []PromptRequest
	m, _ := funcManager(t, func(ctx context.Context, run Run) (string, error) {
		close(running)
		for len(got) < extra {
			select {
			case p := <-run.Prompts():
				got = append(got, p)
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
		return "all read", nil
	})
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "start", Models: oneModel})
	require.NoError(t, err)
	recv(t, running, "the function to run")
	var wg sync.WaitGroup
	nums := make([]int, extra)
	for i := range extra {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := m.Extend(ctx, task.ID, fmt.Sprintf("prompt %d", i))
			assert.NoError(t, err)
			nums[i] = n
		}()
	}
	wg.Wait()
	done, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	require.Len(t, got, extra)
	for i, p := range got {
		assert.Equal(t, i+2, p.Invocation, "received in invocation order")
		assert.Equal(t, p.Prompt, done.Invocations[p.Invocation-1].Prompt, "each number names its own prompt")
	}
	for i, n := range nums {
		assert.Equal(t, fmt.Sprintf("prompt %d", i), done.Invocations[n-1].Prompt)
	}
	for _, in := range done.Invocations {
		require.NotNil(t, in.Answer, "invocation %d answered", in.N)
		assert.Equal(t, "all read", in.Answer.Text)
	}
}

// An Extend that cannot be admitted says why and changes nothing.
func TestExtendRefusals(t *testing.T) {
	ctx := testCtx(t)
	m, _ := funcManager(t, func(ctx context.Context, run Run) (string, error) { return "done", nil })
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	_, err = m.Wait(ctx, task.ID)
	require.NoError(t, err)
	before, _ := m.Task(task.ID)

	_, err = m.Extend(ctx, task.ID, "late")
	assert.ErrorIs(t, err, ErrNotRunning)
	_, err = m.Extend(ctx, "nope", "x")
	assert.ErrorIs(t, err, ErrUnknownTask)
	_, err = m.Extend(ctx, task.ID, "  ")
	assert.ErrorIs(t, err, ErrInvalidArgument)
	var noCtx context.Context // a nil context is refused, not a crash
	_, err = m.Extend(noCtx, "", "x")
	assert.ErrorIs(t, err, ErrInvalidArgument)
	after, _ := m.Task(task.ID)
	assert.Equal(t, before, after, "a refused Extend changes nothing")

	h := newHarness(t, nil) // testHost has no PromptSession
	t2 := h.launch("a/one")
	h.settle()
	_, err = h.m.Extend(ctx, t2.ID, "more")
	assert.ErrorIs(t, err, errors.ErrUnsupported)
}

// promptHost is a testHost whose PromptSession calls wait at a gate.
type promptHost struct {
	*testHost
	*callGate[PromptRequest]
}

func (h *promptHost) PromptSession(ctx context.Context, req PromptRequest) error {
	return h.pass(ctx, req)
}

// A turn end that comes while a prompt is in flight does not end the task;
// if the host then refuses the prompt, the Extend changes nothing and the
// task ends with that turn's answer.
func TestTurnEndWhileAPromptIsInFlight(t *testing.T) {
	for _, refuse := range []bool{true, false} {
		t.Run(fmt.Sprintf("refused=%v", refuse), func(t *testing.T) {
			ctx := testCtx(t)
			host := &promptHost{testHost: &testHost{}, callGate: newCallGate[PromptRequest]()}
			m := mustOpen(host, WithIDs(SequentialIDs()))
			shutdownAtCleanup(t, m)
			task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "start", Models: oneModel})
			require.NoError(t, err)
			require.NoError(t, m.life.group.Wait(ctx))
			ses := m.mustTask(t, task.ID).SessionID
			res := make(chan error, 1)
			go func() {
				_, err := m.Extend(ctx, task.ID, "more")
				res <- err
			}()
			req := recv(t, host.entered, "the prompt call")
			assert.Equal(t, 2, req.Invocation)
			assert.Equal(t, ses, req.SessionID)
			require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "answer 1"}))
			assert.Equal(t, StatusRunning, m.mustTask(t, task.ID).Status, "not ended while a prompt is in flight")
			if refuse {
				host.release <- errors.New("no")
				assert.ErrorIs(t, recv(t, res, "Extend to return"), ErrPromptRefused)
				done, err := m.Wait(ctx, task.ID)
				require.NoError(t, err)
				assert.Equal(t, "answer 1", done.Result)
				assert.Empty(t, done.Invocations, "the refused prompt left nothing behind")
				return
			}
			host.release <- nil
			require.NoError(t, recv(t, res, "Extend to return"))
			a1, err := m.WaitAnswer(ctx, task.ID, 1)
			require.NoError(t, err)
			assert.Equal(t, "answer 1", a1.Text)
			assert.Equal(t, StatusRunning, m.mustTask(t, task.ID).Status, "invocation 2 is open")
			require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "answer 2", Invocation: 2}))
			done, err := m.Wait(ctx, task.ID)
			require.NoError(t, err)
			assert.Equal(t, "answer 2", done.Result)
			assert.Equal(t, "answer 2", done.Invocations[1].Answer.Text)
		})
	}
}

func (m *Manager) mustTask(t *testing.T, id string) Task {
	t.Helper()
	task, err := m.Task(id)
	require.NoError(t, err)
	return task
}

// A stop answers every open invocation with its outcome: none waits.
func TestCancelAnswersEveryOpenInvocation(t *testing.T) {
	running := make(chan struct{})
	m, _ := funcManager(t, func(ctx context.Context, run Run) (string, error) {
		close(running)
		<-run.Prompts()
		<-ctx.Done()
		return "", ctx.Err()
	})
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	recv(t, running, "the function to run")
	_, err = m.Extend(ctx, task.ID, "more")
	require.NoError(t, err)
	_, err = m.Stop(ctx, Target{Task: task.ID})
	require.NoError(t, err)
	for n := 1; n <= 2; n++ {
		a, err := m.WaitAnswer(ctx, task.ID, n)
		require.NoError(t, err)
		assert.Equal(t, StatusCancelled, a.Status, "invocation %d", n)
	}
}

// Fence refuses the side effects of a run once it is no longer current.
func TestFenceRefusesASupersededRun(t *testing.T) {
	before, after := make(chan error, 1), make(chan error, 1)
	m, _ := funcManager(t, func(ctx context.Context, run Run) (string, error) {
		before <- Fence(ctx)
		<-ctx.Done()
		after <- Fence(ctx)
		return "", ctx.Err()
	})
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	require.NoError(t, recv(t, before, "the function's first Fence"))
	_, err = m.Stop(ctx, Target{Task: task.ID})
	require.NoError(t, err)
	assert.ErrorIs(t, recv(t, after, "the function's Fence after its stop"), ErrSuperseded)
	assert.ErrorIs(t, Fence(context.Background()), ErrInvalidArgument)
	var noCtx context.Context // nil is refused, not a crash
	assert.ErrorIs(t, Fence(noCtx), ErrInvalidArgument)
}

// gatedTask launches a task whose session then launches a child; it
// returns the task, its session, the child and the child's session.
func gatedTask(h *harness) (task Task, ses string, kid Task, kidSes string) {
	h.t.Helper()
	task = h.launch("a/one")
	h.settle()
	ses = h.task(task.ID).SessionID
	kid, kidSes = h.child(ses)
	return task, ses, kid, kidSes
}

// The children gate: a turn end while a task the child's session launched
// runs is held; the first turn end after it ended and its summary was
// delivered is the answer.
func TestChildrenGateHoldsTheAnswerUntilChildrenSettle(t *testing.T) {
	h := newHarness(t, nil)
	task, ses, kid, kidSes := gatedTask(h)

	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "too soon"}))
	got := h.task(task.ID)
	assert.Equal(t, StatusRunning, got.Status, "no answer while a child runs")
	assert.Equal(t, ActivityAwaitingChildren, got.Activity)
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Reason: ReasonUnconsumedToolCall}))

	_, armed := h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: kidSes, Kind: SessionIdle, Text: "kid done"}))
	recv(t, armed, "the gate's watch timer") // the kid's final summary was delivered: the gate's watch starts
	assert.Equal(t, StatusCompleted, h.task(kid.ID).Status)
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "the held turn is not the answer")

	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "with the kid's result"}))
	done := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "with the kid's result", done.Result)
	assert.NotContains(t, done.Outcome.Envelope, "degraded")
}

// With no further turn after the children settled, the held turn is
// released at the gate timeout, marked degraded: nothing the child said is
// dropped.
func TestChildrenGateReleasesDegradedWithoutAFurtherTurn(t *testing.T) {
	h := newHarness(t, nil, WithGateTimeout(time.Minute))
	task, ses, _, kidSes := gatedTask(h)
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "my answer"}))
	_, armed := h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: kidSes, Kind: SessionIdle, Text: "kid done"}))
	recv(t, armed, "the gate's watch timer") // delivered: the gate's watch is armed on the fake clock
	assert.Equal(t, StatusRunning, h.task(task.ID).Status)
	h.clock.Advance(time.Minute)
	done := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "my answer", done.Result)
	assert.True(t, slicesContain(done.Outcome.Notices, "degraded"), "%v", done.Outcome.Notices)
	assert.Contains(t, done.Outcome.Envelope, "<task_notice>degraded")
}

func slicesContain(ss []string, sub string) bool {
	for _, s := range ss {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

// A task whose session launched nothing answers on its first turn end, as
// before.
func TestChildrenGateIsInertWithoutChildren(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(task.ID).SessionID, Kind: SessionIdle, Text: "ok"}))
	assert.Equal(t, StatusCompleted, h.wait(task.ID).Status)
}

// One start owner per key: of many concurrent Launches with one key,
// exactly one starts a run; the others are told which task holds it.
func TestKeyHasOneStartOwner(t *testing.T) {
	h := newHarness(t, nil)
	const n = 16
	var wg sync.WaitGroup
	ids := make(chan string, n)
	holders := make(chan string, n)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			task, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Key: "k", Models: mustModels(t, "a/one")})
			var held *KeyHeldError
			switch {
			case err == nil:
				ids <- task.ID
			case errors.As(err, &held):
				assert.ErrorIs(t, err, ErrKeyHeld)
				holders <- held.TaskID
			default:
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	close(ids)
	close(holders)
	var started []string
	for id := range ids {
		started = append(started, id)
	}
	require.Len(t, started, 1)
	for id := range holders {
		assert.Equal(t, started[0], id)
	}
	h.settle()
	assert.Len(t, h.host.Starts(), 1, "one run started")
	// Once it ended, the key is free again.
	require.NoError(t, h.observe(Event{SessionID: h.task(started[0]).SessionID, Kind: SessionIdle, Text: "ok"}))
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Key: "k", Models: mustModels(t, "a/one")})
	assert.NoError(t, err)
}

// With ExtendLive, a Launch whose key a live task holds becomes an Extend.
func TestKeyExtendLive(t *testing.T) {
	running := make(chan struct{})
	m, _ := funcManager(t, func(ctx context.Context, run Run) (string, error) {
		close(running)
		p := <-run.Prompts()
		return "got " + p.Prompt, nil
	})
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Key: "k", Models: oneModel})
	require.NoError(t, err)
	recv(t, running, "the function to run")
	same, err := m.Launch(ctx, Spec{ParentSessionID: "p", Key: "k", ExtendLive: true, Prompt: "again", Models: oneModel})
	require.NoError(t, err)
	assert.Equal(t, task.ID, same.ID)
	done, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, "got again", done.Result)
	a2, err := m.WaitAnswer(ctx, task.ID, 2)
	require.NoError(t, err)
	assert.True(t, slicesContain(a2.Notices, `key "k"`), "the collided key rides its answer: %v", a2.Notices)
	assert.Contains(t, a2.Envelope, "<task_notice>a Launch with key")
}

// openOn opens a Manager on host with the file journal in dir.
func openOn(t *testing.T, dir string, host Host) (*Manager, *crashJournal) {
	t.Helper()
	j := openJournal(t, dir)
	m, err := Open(context.Background(), host, WithJournal(j))
	require.NoError(t, err)
	return m, j
}

// promptingSvcHost is a svcHost (its sessions outlive the process) that
// accepts every prompt.
type promptingSvcHost struct{ *svcHost }

func (promptingSvcHost) PromptSession(context.Context, PromptRequest) error { return nil }

// Invocations, their answers and a task's key survive a restart: the new
// process sees the same invocations, refuses a second owner of the key, and
// files the answer the re-adopted session gives.
func TestInvocationsAndKeysSurviveARestart(t *testing.T) {
	dir := t.TempDir()
	host := promptingSvcHost{&svcHost{svc: newSessionService()}}
	ctx := testCtx(t)
	m1, j1 := openOn(t, dir, host)
	task, err := m1.Launch(ctx, Spec{ParentSessionID: "p", Key: "k", Prompt: "start", Models: oneModel})
	require.NoError(t, err)
	waitStatus(t, m1, task.ID, StatusRunning)
	ses := "s-" + task.CurrentAttemptID
	n, err := m1.Extend(ctx, task.ID, "more")
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.NoError(t, m1.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "answer 1", Invocation: 1}))
	before := m1.mustTask(t, task.ID)
	crash(t, m1, j1)

	m2, _ := openOn(t, dir, host)
	shutdownAtCleanup(t, m2)
	after := m2.mustTask(t, task.ID)
	require.Equal(t, StatusRunning, after.Status, "the session is alive: re-adopted")
	require.NoError(t, sameJSON("invocations", before.Invocations, after.Invocations))
	_, err = m2.Launch(ctx, Spec{ParentSessionID: "p", Key: "k", Models: oneModel})
	assert.ErrorIs(t, err, ErrKeyHeld)
	require.NoError(t, m2.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "answer 2", Invocation: 2}))
	done, err := m2.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, "answer 2", done.Result)
	a1, err := m2.WaitAnswer(ctx, task.ID, 1)
	require.NoError(t, err)
	assert.Equal(t, "answer 1", a1.Text)
}

// TaskProtocol promises what the gate does: pinned against the behaviour
// (TestChildrenGateHoldsTheAnswerUntilChildrenSettle runs it in full).
func TestTaskProtocolPromisesWhatBgtaskDoes(t *testing.T) {
	assert.Contains(t, TaskProtocol, deliveryPromise)
	assert.Contains(t, Envelope(Task{ID: "t", Status: StatusRunning, CurrentAttemptID: "a", Attempts: []Attempt{{ID: "a", Status: StatusRunning}}}),
		"<task_notice>"+deliveryPromise+"</task_notice>", "a running task's receipt repeats the protocol's delivery promise")
	for _, claim := range []string{"delivered to this conversation automatically", "never poll", "ending your turn does not return your result", "The first turn you end after they have all finished is the one returned"} {
		assert.Contains(t, TaskProtocol, claim)
	}
	h := newHarness(t, nil)
	task, ses, _, kidSes := gatedTask(h)
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "held"}))
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "ending a turn with a task running returns nothing")
	_, armed := h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: kidSes, Kind: SessionIdle, Text: "kid"}))
	recv(t, armed, "the gate's watch timer")
	found := false
	for _, n := range h.rec.All() {
		if n.ParentSessionID == ses && n.Kind == NotifyFinalSummary {
			found = true
		}
	}
	assert.True(t, found, "the child's result was delivered to the session automatically")
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "complete answer"}))
	assert.Equal(t, "complete answer", h.wait(task.ID).Result, "the first turn after they finished is returned")
}

// A child launched after the children settled, before the gate's watch
// fired, holds the candidate again: the watch starts over once it settles.
func TestChildrenGateWaitsForAChildLaunchedWhileItsWatchRuns(t *testing.T) {
	h := newHarness(t, nil, WithGateTimeout(time.Minute))
	task, ses, _, kidSes := gatedTask(h)
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "my answer"}))
	_, armed := h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: kidSes, Kind: SessionIdle, Text: "kid done"}))
	recv(t, armed, "the gate's watch timer")
	kid2 := h.launchSpec(Spec{ParentSessionID: ses, Models: mustModels(t, "a/one")})
	kid2Ses := waitStatus(t, h.m, kid2.ID, StatusRunning).SessionID // (settle would wait for the armed watch too)
	h.clock.Advance(time.Minute)                                    // the watch fires with kid2 running: nothing is released
	h.settle()
	assert.Equal(t, StatusRunning, h.task(task.ID).Status, "held while the new child runs")
	_, armed = h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: kid2Ses, Kind: SessionIdle, Text: "kid 2 done"}))
	recv(t, armed, "the gate's second watch timer") // settled again: a new watch
	h.clock.Advance(time.Minute)
	done := h.wait(task.ID)
	assert.Equal(t, "my answer", done.Result)
	assert.True(t, slicesContain(done.Outcome.Notices, "degraded"))
}

// A prompt call that hangs ends at Shutdown: its context is the Manager's
// as well as the caller's.
func TestAHangingPromptCallEndsAtShutdown(t *testing.T) {
	host := &promptHost{testHost: &testHost{}, callGate: newCallGate[PromptRequest]()}
	m := mustOpen(host, WithIDs(SequentialIDs()))
	ctx := context.Background() // the caller never gives up
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	require.NoError(t, m.life.group.Wait(testCtx(t)))
	res := make(chan error, 1)
	go func() {
		_, err := m.Extend(ctx, task.ID, "more")
		res <- err
	}()
	recv(t, host.entered, "the prompt call")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = m.Shutdown(sctx)
	select {
	case err := <-res:
		assert.Error(t, err)
	case <-sctx.Done():
		t.Fatal("the prompt call outlived Shutdown")
	}
}

// Fence reads the live run with no lock while the ledger rewrites the
// attempt (here: its final version, as it fails over): under -race this
// is a test that the two share no memory.
func TestFenceWhileTheAttemptIsRewritten(t *testing.T) {
	started := make(chan Run, 2)
	superseded := make(chan error, 2)
	m, _ := funcManager(t, func(ctx context.Context, run Run) (string, error) {
		started <- run
		if run.Attempt > 1 {
			return "second", nil
		}
		err := Fence(ctx)
		for err == nil {
			err = Fence(ctx)
		}
		superseded <- err
		<-ctx.Done()
		return "", ctx.Err()
	})
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "one"}, {Provider: "b", ID: "two"}}})
	require.NoError(t, err)
	run := recv(t, started, "the first run")
	require.NoError(t, m.Observe(Event{AttemptID: run.AttemptID, Token: run.Token, Kind: SessionError, Err: errRateLimited}))
	assert.ErrorIs(t, recv(t, superseded, "the first run's Fence to refuse it"), ErrSuperseded)
	done, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, "second", done.Result)
}

// A Notifier that says Delivered before handing a child's result to an
// in-process parent lets the parent answer at once on reading it: the
// answer is not held (nor released degraded later).
func TestDeliveredInsideNotifyLetsAParentAnswerAtOnce(t *testing.T) {
	results := make(chan string, 1)
	parent := make(chan string, 1)
	var m *Manager
	fn := func(ctx context.Context, run Run) (string, error) {
		if run.Agent == "kid" {
			return "kid result", nil
		}
		parent <- run.TaskID
		if _, err := m.Launch(ctx, Spec{ParentSessionID: run.SessionID, Agent: "kid", Models: oneModel}); err != nil {
			return "", err
		}
		select {
		case r := <-results:
			return "parent got " + r, nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	m = mustOpen(NewFuncHost(fn), WithIDs(SequentialIDs()), WithNotifier(NotifierFunc(func(ctx context.Context, n Notification) error {
		if n.Kind == NotifyFinalSummary && n.ParentSessionID != "p" {
			Delivered(ctx)
			Delivered(ctx) // once is what counts
			results <- n.Task.Result
			// Notify returns only once the parent ended: without Delivered
			// its turn end would come while this result is still out, and
			// wait at the gate for this very call.
			_, err := m.Wait(ctx, <-parent)
			return err
		}
		return nil
	})))
	shutdownAtCleanup(t, m)
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	done, err := m.Wait(ctx, task.ID) // held at the gate, this would wait 10 minutes
	require.NoError(t, err)
	assert.Equal(t, "parent got kid result", done.Result)
	assert.False(t, slicesContain(done.Outcome.Notices, "degraded"))
	Delivered(ctx) // outside a Notify: nothing
	var noCtx context.Context
	Delivered(noCtx)
	require.NoError(t, m.Shutdown(ctx))
	assert.Empty(t, m.Dropped().Undelivered)
}

// A prompt sent to a run that fails over is answered with that failure (the
// retry never received it), released only after invocation 1's answer, and
// told once.
func TestAPromptToARunThatFailsOverIsAnsweredInOrder(t *testing.T) {
	admitted := make(chan struct{})
	m, rec := funcManager(t, func(ctx context.Context, run Run) (string, error) {
		if run.Attempt > 1 {
			return "second", nil
		}
		<-run.Prompts()
		<-admitted // fails once the prompt is admitted (a failure before that refuses it)
		return "", errRateLimited
	})
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "one"}, {Provider: "b", ID: "two"}}})
	require.NoError(t, err)
	waitStatus(t, m, task.ID, StatusRunning)
	_, err = m.Extend(ctx, task.ID, "more")
	require.NoError(t, err)
	close(admitted)
	done, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, "second", done.Result)
	a1, err := m.WaitAnswer(ctx, task.ID, 1)
	require.NoError(t, err)
	assert.Equal(t, "second", a1.Text)
	a2, err := m.WaitAnswer(ctx, task.ID, 2)
	require.NoError(t, err)
	assert.Equal(t, StatusError, a2.Status)
	assert.Contains(t, a2.Text, "never received it")
	require.NoError(t, m.Shutdown(ctx))
	var told []int
	for _, n := range rec.All() {
		if n.TaskID == task.ID && n.Kind == NotifyAnswer {
			told = append(told, n.Invocation)
		}
	}
	assert.Equal(t, []int{1, 2}, told, "each answer told once, in order, before the final summary")
	kinds := rec.Kinds(task.ID)
	assert.Equal(t, NotifyFinalSummary, kinds[len(kinds)-1])
}

// resumeHost is a testHost that resumes sessions.
type resumeHost struct {
	*testHost
	mu      sync.Mutex
	resumed []string // session ids, in order
	refuse  error
}

func (h *resumeHost) ResumeSession(ctx context.Context, sid string, req SessionRequest) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.resumed = append(h.resumed, sid+" "+req.Prompt)
	return h.refuse
}

// A task continues an ended task's session: the first attempt resumes it,
// its events are the new task's, the old task never changes, and the new
// envelope reports the old output once, as prior output.
func TestContinueFromResumesTheEndedTasksSession(t *testing.T) {
	ctx := testCtx(t)
	host := &resumeHost{testHost: &testHost{}}
	m := mustOpen(host, WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	first, err := m.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "draft", Models: oneModel})
	require.NoError(t, err)
	ses := waitStatus(t, m, first.ID, StatusRunning).SessionID
	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "the </task> draft"}))
	before, err := m.Wait(ctx, first.ID)
	require.NoError(t, err)

	_, err = m.Launch(ctx, Spec{ParentSessionID: "p", ContinueFrom: "nope", Models: oneModel})
	assert.ErrorIs(t, err, ErrUnknownTask)
	next, err := m.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "now polish it", ContinueFrom: first.ID, Models: oneModel})
	require.NoError(t, err)
	running := waitStatus(t, m, next.ID, StatusRunning)
	assert.Equal(t, ses, running.SessionID, "the same session")
	assert.Equal(t, first.ID, running.ContinuedFrom)
	assert.Equal(t, []string{ses + " now polish it"}, host.resumed)
	assert.Len(t, host.Starts(), 1, "no new session was started for it")

	_, err = m.Launch(ctx, Spec{ParentSessionID: "p", ContinueFrom: first.ID, Models: oneModel})
	var se *SpecError
	require.ErrorAs(t, err, &se, "its session is the live task's now")

	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "the polished draft"}))
	done, err := m.Wait(ctx, next.ID)
	require.NoError(t, err)
	assert.Equal(t, "the polished draft", done.Result)
	assert.Equal(t, "the </task> draft", done.Outcome.PriorOutput)
	assert.Equal(t, 1, strings.Count(done.Outcome.Envelope, "<task_prior_output>"))
	assert.Equal(t, 1, strings.Count(done.Outcome.Envelope, "</task>"), "escaped like evidence: it cannot close the envelope")
	after, _ := m.Task(first.ID)
	assert.Equal(t, before, after, "the ended task never changes")
}

// ContinueFrom needs a Resumer, and an ended task with a session.
func TestContinueFromRefusals(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one")
	h.settle()
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", ContinueFrom: task.ID, Models: mustModels(t, "a/one")})
	assert.ErrorIs(t, err, errors.ErrUnsupported)

	ctx := testCtx(t)
	host := &resumeHost{testHost: &testHost{}}
	m := mustOpen(host, WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	live, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	waitStatus(t, m, live.ID, StatusRunning)
	_, err = m.Launch(ctx, Spec{ParentSessionID: "p", ContinueFrom: live.ID, Models: oneModel})
	var se *SpecError
	require.ErrorAs(t, err, &se)
	assert.Contains(t, se.Reason, "Extend it instead")

	// A resume the host refuses is the attempt's failed start.
	ses := m.mustTask(t, live.ID).SessionID
	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "ok"}))
	_, err = m.Wait(ctx, live.ID)
	require.NoError(t, err)
	host.mu.Lock()
	host.refuse = Permanent(errors.New("session archived"))
	host.mu.Unlock()
	next, err := m.Launch(ctx, Spec{ParentSessionID: "p", ContinueFrom: live.ID, Models: oneModel})
	require.NoError(t, err)
	done, err := m.Wait(ctx, next.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusError, done.Status)
	assert.Contains(t, done.Error, "session archived")
}

type resumingSvcHost struct{ *svcHost }

func (resumingSvcHost) ResumeSession(context.Context, string, SessionRequest) error { return nil }

// A continuation survives a restart: the session is the new task's, the
// old task is as it was, and the prior output is still reported once.
func TestContinueFromSurvivesARestart(t *testing.T) {
	dir := t.TempDir()
	host := resumingSvcHost{&svcHost{svc: newSessionService()}}
	ctx := testCtx(t)
	m1, j1 := openOn(t, dir, host)
	first, err := m1.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	ses := waitStatus(t, m1, first.ID, StatusRunning).SessionID
	require.NoError(t, m1.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "draft"}))
	waitStatus(t, m1, first.ID, StatusCompleted)
	next, err := m1.Launch(ctx, Spec{ParentSessionID: "p", ContinueFrom: first.ID, Models: oneModel})
	require.NoError(t, err)
	waitStatus(t, m1, next.ID, StatusRunning)
	// The binding of next's session is durable before the crash: a launch
	// returns once its records are, and batches land in order. (Running
	// is seen a moment before the binding is appended.)
	_, err = m1.Launch(ctx, Spec{ParentSessionID: "barrier", Models: oneModel})
	require.NoError(t, err)
	old := m1.mustTask(t, first.ID)
	crash(t, m1, j1)

	m2, _ := openOn(t, dir, host)
	shutdownAtCleanup(t, m2)
	require.NoError(t, sameJSON("the ended task", old, m2.mustTask(t, first.ID)))
	require.NoError(t, m2.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "polished"}))
	done, err := m2.Wait(ctx, next.ID)
	require.NoError(t, err)
	assert.Equal(t, "polished", done.Result)
	assert.Equal(t, "draft", done.Outcome.PriorOutput)
}

type panickingHost struct{ *testHost }

func (panickingHost) PromptSession(context.Context, PromptRequest) error { panic("prompt boom") }
func (panickingHost) ResumeSession(context.Context, string, SessionRequest) error {
	panic("resume boom")
}

// A host that panics in PromptSession or ResumeSession crashes nothing: the
// Extend is refused, the resumed attempt fails.
func TestPanickingPromptAndResumeCrashNothing(t *testing.T) {
	ctx := testCtx(t)
	m := mustOpen(panickingHost{&testHost{}}, WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	ses := waitStatus(t, m, task.ID, StatusRunning).SessionID
	_, err = m.Extend(ctx, task.ID, "more")
	assert.ErrorIs(t, err, ErrPromptRefused)
	assert.ErrorContains(t, err, "prompt boom")
	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "ok"}))
	done, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Empty(t, done.Invocations)
	next, err := m.Launch(ctx, Spec{ParentSessionID: "p", ContinueFrom: task.ID, Models: oneModel})
	require.NoError(t, err)
	failed, err := m.Wait(ctx, next.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusError, failed.Status)
	assert.Contains(t, failed.Error, "resume boom")
}

// A prompt call hanging in the host ends when the run it prompts ends.
func TestAHangingPromptCallEndsWithItsRun(t *testing.T) {
	host := &promptHost{testHost: &testHost{}, callGate: newCallGate[PromptRequest]()}
	m := mustOpen(host, WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	ses := waitStatus(t, m, task.ID, StatusRunning).SessionID
	res := make(chan error, 1)
	go func() {
		_, err := m.Extend(context.Background(), task.ID, "more") // a caller that never gives up
		res <- err
	}()
	recv(t, host.entered, "the prompt call")
	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionError, Err: Permanent(errors.New("gone"))}))
	select {
	case err := <-res:
		assert.Error(t, err)
	case <-ctx.Done():
		t.Fatal("the prompt call outlived its run")
	}
}
