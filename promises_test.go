//go:build go1.25

package bgtask

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// promptHarness is newHarness on a host that also takes supplemental
// prompts (Extend): each PromptSession waits on the returned gate.
func promptHarness(t *testing.T, opts ...Option) (*harness, *promptHost) {
	t.Helper()
	host := &promptHost{testHost: &testHost{}, callGate: newCallGate[PromptRequest]()}
	return harnessOn(t, host, host.testHost, opts...), host
}

// heldAtTheGate launches, on h, a task whose session launched a child,
// ends a turn of the task while the child runs (the gate holds it as its
// candidate), then ends the child and waits until its final summary was
// delivered: the gate's release watch is armed on the fake clock.
func heldAtTheGate(h *harness, answer string) (task Task, ses string) {
	h.t.Helper()
	task, ses, _, kidSes := gatedTask(h)
	require.NoError(h.t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: answer}))
	_, armed := h.clock.Created()
	require.NoError(h.t, h.observe(Event{SessionID: kidSes, Kind: SessionIdle, Text: "kid done"}))
	recv(h.t, armed, "the gate's watch timer")
	require.Equal(h.t, StatusRunning, h.task(task.ID).Status)
	return task, ses
}

// The answer the children gate releases without a further turn
// is marked degraded (Answer.Degraded, WithGateTimeout), also for a task
// that was never extended.
func TestAGateTimeoutReleaseIsMarkedDegradedWithoutAnExtend(t *testing.T) {
	h := newHarness(t, nil, WithGateTimeout(time.Minute))
	task, _ := heldAtTheGate(h, "my answer")
	h.clock.Advance(time.Minute)
	a, err := h.m.WaitAnswer(testCtx(t), task.ID, 1)
	require.NoError(t, err)
	assert.Equal(t, StatusCompleted, a.Status)
	assert.Equal(t, "my answer", a.Text)
	assert.True(t, a.Degraded, "released by the gate's timeout: %+v", a)
	assert.True(t, slicesContain(a.Notices, "degraded"), "%v", a.Notices)
}

// A FuncHost run's last turn, held while a task it launched ran, is
// released degraded once that task settled: its answer says so.
func TestALastTurnReleasedAfterItsChildrenIsMarkedDegraded(t *testing.T) {
	kidGo := make(chan struct{})
	var m *Manager
	m, _ = funcManager(t, func(ctx context.Context, run Run) (string, error) {
		if run.Agent == "kid" {
			select {
			case <-kidGo:
				return "kid result", nil
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
		if _, err := m.Launch(ctx, Spec{ParentSessionID: run.SessionID, Agent: "kid", Models: oneModel}); err != nil {
			return "", err
		}
		return "my answer", nil // while the kid runs
	})
	ctx := testCtx(t)
	sub, err := m.Subscribe(ctx, 0)
	require.NoError(t, err)
	defer sub.Close()
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	held := false
	for c := range sub.C { // the function returned while the kid runs: its last turn is held
		if held = c.Task.ID == task.ID && c.Task.Activity == ActivityAwaitingChildren; held {
			break
		}
	}
	require.True(t, held, "the subscription ended: %v", sub.Err())
	close(kidGo)
	a, err := m.WaitAnswer(ctx, task.ID, 1)
	require.NoError(t, err)
	assert.Equal(t, "my answer", a.Text)
	assert.True(t, a.Degraded, "released by the gate once the kid settled: %+v", a)
	assert.True(t, slicesContain(a.Notices, "degraded"), "%v", a.Notices)
}

// A turn the gate releases at its timeout while an Extend's prompt is in
// flight waits for the prompt's fate, and keeps its degraded mark: as the
// answer to invocation 1 when the prompt is admitted, as the task's answer
// when it is refused.
func TestAGateReleaseDuringAPromptKeepsItsDegradedMark(t *testing.T) {
	for _, refuse := range []bool{false, true} {
		name := "admitted"
		if refuse {
			name = "refused"
		}
		t.Run(name, func(t *testing.T) {
			ctx := testCtx(t)
			h, host := promptHarness(t, WithGateTimeout(time.Minute))
			task, ses := heldAtTheGate(h, "my answer")
			extended := make(chan error, 1)
			go func() {
				_, err := h.m.Extend(ctx, task.ID, "more")
				extended <- err
			}()
			recv(t, host.entered, "the prompt call")
			h.clock.Advance(time.Minute) // the gate releases its candidate while the prompt is in flight
			h.settle()
			require.Equal(t, StatusRunning, h.task(task.ID).Status, "not ended while a prompt is in flight")
			if refuse {
				host.release <- errors.New("no")
				require.ErrorIs(t, recv(t, extended, "Extend to return"), ErrPromptRefused)
				done := h.wait(task.ID)
				assert.Equal(t, "my answer", done.Result)
				assert.True(t, slicesContain(done.Outcome.Notices, "degraded"), "%v", done.Outcome.Notices)
			} else {
				host.release <- nil
				require.NoError(t, recv(t, extended, "Extend to return"))
			}
			a1, err := h.m.WaitAnswer(ctx, task.ID, 1)
			require.NoError(t, err)
			assert.Equal(t, "my answer", a1.Text)
			assert.True(t, a1.Degraded, "released by the gate's timeout: %+v", a1)
			assert.True(t, slicesContain(a1.Notices, "degraded"), "%v", a1.Notices)
			if refuse {
				return
			}
			require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "answer 2", Invocation: 2}))
			a2, err := h.m.WaitAnswer(ctx, task.ID, 2)
			require.NoError(t, err)
			assert.Equal(t, "answer 2", a2.Text)
			assert.False(t, a2.Degraded, "a turn answered it")
		})
	}
}

// The gate's degraded notice rides the answers the released turn filed,
// and only those: a stop that later answers the invocation still open is
// not degraded and does not carry it, nor does the task's outcome.
func TestADegradedNoticeRidesOnlyTheAnswersItMarks(t *testing.T) {
	ctx := testCtx(t)
	h, host := promptHarness(t, WithGateTimeout(time.Minute))
	task, ses, _, kidSes := gatedTask(h)
	extended := make(chan error, 1)
	go func() {
		_, err := h.m.Extend(ctx, task.ID, "more")
		extended <- err
	}()
	recv(t, host.entered, "the prompt call")
	host.release <- nil
	require.NoError(t, recv(t, extended, "Extend to return"))
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "to 1", Invocation: 1}))
	_, armed := h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: kidSes, Kind: SessionIdle, Text: "kid done"}))
	recv(t, armed, "the gate's watch timer")
	h.clock.Advance(time.Minute) // releases the turn that answered 1; 2 is open
	a1, err := h.m.WaitAnswer(ctx, task.ID, 1)
	require.NoError(t, err)
	assert.True(t, a1.Degraded)
	assert.True(t, slicesContain(a1.Notices, "degraded"), "%v", a1.Notices)

	require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: task.ID})))
	a2, err := h.m.WaitAnswer(ctx, task.ID, 2)
	require.NoError(t, err)
	assert.Equal(t, StatusCancelled, a2.Status)
	assert.False(t, a2.Degraded)
	assert.False(t, slicesContain(a2.Notices, "degraded"), "%v", a2.Notices)
	assert.False(t, slicesContain(h.wait(task.ID).Outcome.Notices, "degraded"))
}

// intentJournal is an in-memory journal that says which records are
// durable: a batch is once its Commit.Wait returned. Armed, the next batch
// that announces a host call (start_requested, abort_requested) lets, in
// its Wait, every other goroutine of the test's synctest bubble run until
// it blocks (synctest.Wait) before the batch is durable: a host call the
// Manager set off before it waited for the batch is then made while the
// batch is not durable, every time.
type intentJournal struct {
	memJournal
	armed   atomic.Bool
	mu      sync.Mutex
	durable map[string]bool // kind+" "+attempt id
}

type intentCommit struct {
	j     *intentJournal
	keys  []string
	drain bool
}

func (j *intentJournal) Append(batch []Record) Commit {
	j.memJournal.Append(batch)
	c := &intentCommit{j: j}
	intent := false
	for _, r := range batch {
		c.keys = append(c.keys, r.Kind+" "+r.AttemptID)
		intent = intent || r.Kind == "start_requested" || r.Kind == "abort_requested"
	}
	c.drain = intent && j.armed.CompareAndSwap(true, false)
	return c
}

func (c *intentCommit) Wait() error {
	if c.drain {
		synctest.Wait() // whatever was set off before this Wait runs now
	}
	c.j.mu.Lock()
	defer c.j.mu.Unlock()
	for _, k := range c.keys {
		c.j.durable[k] = true
	}
	return nil
}

func (j *intentJournal) isDurable(kind, attempt string) bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.durable[kind+" "+attempt]
}

// The Manager calls the host (StartSession, AbortSession) only once
// the batch of records that announces the call is durable: after a crash
// the ledger knows of every call that may have been made.
func TestHostCallsAreMadeOnlyOnceTheirIntentIsDurable(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		j := &intentJournal{durable: map[string]bool{}}
		var mu sync.Mutex
		var violations []string
		attemptOf := map[string]string{} // session -> attempt
		host := &testHost{
			start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
				mu.Lock()
				defer mu.Unlock()
				if !j.isDurable("start_requested", req.AttemptID) {
					violations = append(violations, "StartSession for "+req.AttemptID+" before its start_requested was durable")
				}
				attemptOf[sid] = req.AttemptID
				return sid, nil
			},
			abort: func(ctx context.Context, sid string) error {
				mu.Lock()
				defer mu.Unlock()
				if !j.isDurable("abort_requested", attemptOf[sid]) {
					violations = append(violations, "AbortSession of "+sid+" before its abort_requested was durable")
				}
				return nil
			},
		}
		h := newHarness(t, host, WithJournal(j))

		j.armed.Store(true)
		task := h.launch("a/one")
		require.False(t, j.armed.Load(), "the launch announced its start")
		running := waitStatus(t, h.m, task.ID, StatusRunning)
		h.settle()

		j.armed.Store(true)
		require.NoError(t, stopErr(h.m.Stop(testCtx(t), Target{Task: task.ID})))
		require.False(t, j.armed.Load(), "the cancel announced its abort")
		assert.Equal(t, StatusCancelled, h.wait(task.ID).Status)
		h.settle()

		require.Len(t, host.Starts(), 1)
		assert.Equal(t, []string{running.SessionID}, host.Aborts())
		mu.Lock()
		defer mu.Unlock()
		assert.Empty(t, violations)
	})
}

// The children gate holds a task's turn until the tasks its session
// launched have ended and their final summaries were delivered to that
// session: a turn that ends while a child's summary is still on its way is
// held, not the answer.
func TestChildrenGateWaitsForTheChildsSummaryToBeDelivered(t *testing.T) {
	h := newHarness(t, nil, WithGateTimeout(time.Minute))
	task, ses, kid, kidSes := gatedTask(h)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	deliver := sync.OnceFunc(func() { close(release) })
	t.Cleanup(deliver)
	h.rec.mu.Lock()
	h.rec.hook = func(ctx context.Context, n Notification) error {
		if n.Kind == NotifyFinalSummary && n.ParentSessionID == ses {
			once.Do(func() { close(entered) })
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	}
	h.rec.mu.Unlock()

	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "too soon"}))
	require.NoError(t, h.observe(Event{SessionID: kidSes, Kind: SessionIdle, Text: "kid done"}))
	recv(t, entered, "the kid's final summary to reach the notifier") // the kid ended; its summary is being delivered, not yet accepted
	require.Equal(t, StatusCompleted, h.task(kid.ID).Status)

	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "still too soon"}))
	got := h.task(task.ID)
	require.Equal(t, StatusRunning, got.Status, "the kid's summary was not delivered yet: no answer")
	assert.Equal(t, ActivityAwaitingChildren, got.Activity)

	_, armed := h.clock.Created()
	deliver()
	recv(t, armed, "the gate's watch timer") // delivered: the gate's watch starts
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "with the kid's result"}))
	done := h.wait(task.ID)
	assert.Equal(t, "with the kid's result", done.Result)
	a, err := h.m.WaitAnswer(testCtx(t), task.ID, 1)
	require.NoError(t, err)
	assert.False(t, a.Degraded)
}

// WaitAnswer(n) returns only once invocations 1..n all have their
// answers (released in invocation order), even when n's was filed first:
// a prompt to a run that failed over is answered at the failover, while
// invocation 1 waits for the retry.
func TestWaitAnswerReturnsOnlyOnceEveryEarlierAnswerIsReleased(t *testing.T) {
	admitted, retrying, finish := make(chan struct{}), make(chan struct{}), make(chan struct{})
	m, _ := funcManager(t, func(ctx context.Context, run Run) (string, error) {
		if run.Attempt > 1 {
			close(retrying)
			select {
			case <-finish:
				return "second", nil
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
		select {
		case <-run.Prompts():
		case <-ctx.Done():
			return "", ctx.Err()
		}
		<-admitted
		return "", errRateLimited
	})
	ctx := testCtx(t)
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "one"}, {Provider: "b", ID: "two"}}})
	require.NoError(t, err)
	waitStatus(t, m, task.ID, StatusRunning)
	n, err := m.Extend(ctx, task.ID, "more")
	require.NoError(t, err)
	require.Equal(t, 2, n)
	close(admitted)
	recv(t, retrying, "the retry's function to run") // invocation 2 was answered at the failover; 1 is open

	m.mu.Lock()
	filed := m.led.tasks[task.ID].inv.list[1].Answer != nil
	m.unlock()
	require.True(t, filed, "invocation 2's answer is filed")
	gone, cancel := context.WithCancel(ctx)
	cancel()
	_, err = m.WaitAnswer(gone, task.ID, 2)
	assert.ErrorIs(t, err, context.Canceled, "invocation 1 has no answer yet: 2's is not released")
	invs := m.mustTask(t, task.ID).Invocations
	require.Len(t, invs, 2)
	assert.Nil(t, invs[1].Answer, "not released in a snapshot either")

	close(finish)
	a2, err := m.WaitAnswer(ctx, task.ID, 2)
	require.NoError(t, err)
	assert.Equal(t, StatusError, a2.Status)
	a1, err := m.WaitAnswer(ctx, task.ID, 1)
	require.NoError(t, err)
	assert.Equal(t, "second", a1.Text)
}

// A turn that stopped at a tool call is never an answer: at the
// children gate it does not replace the candidate the gate holds, which is
// what the gate releases.
func TestATurnPausedAtAToolCallIsNeverTheGatesCandidate(t *testing.T) {
	h := newHarness(t, nil, WithGateTimeout(time.Minute))
	task, ses, _, kidSes := gatedTask(h)
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "my answer"}))
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "let me call a tool", Reason: ReasonUnconsumedToolCall}))
	assert.Equal(t, ActivityAwaitingChildren, h.task(task.ID).Activity)

	_, armed := h.clock.Created()
	require.NoError(t, h.observe(Event{SessionID: kidSes, Kind: SessionIdle, Text: "kid done"}))
	recv(t, armed, "the gate's watch timer")
	h.clock.Advance(time.Minute)
	done := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "my answer", done.Result, "the held candidate, not the tool call's pause")
	assert.True(t, done.Outcome.HasAnswer)
}
