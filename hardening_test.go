package bgtask

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// startsAfter is a host whose session starts return once release is
// closed (or their context ends), with session sid ("": the default).
func startsAfter(release <-chan struct{}, sid string) *testHost {
	return &testHost{start: func(ctx context.Context, req SessionRequest, def string) (string, error) {
		select {
		case <-release:
			if sid != "" {
				return sid, nil
			}
			return def, nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}}
}

// callGate holds host calls: each reports what it was called with on
// entered and blocks until the test releases it with the call's error (or
// its context ends).
type callGate[T any] struct {
	entered chan T
	release chan error
}

func newCallGate[T any]() *callGate[T] {
	return &callGate[T]{entered: make(chan T, 16), release: make(chan error, 16)}
}

func (g *callGate[T]) pass(ctx context.Context, v T) error {
	g.entered <- v
	select {
	case err := <-g.release:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// newAbortGate is a gate for a testHost's aborts (abort: held.pass).
func newAbortGate() *callGate[string] { return newCallGate[string]() }

func TestChildFailureWhileCancelAbortIsInFlightEndsError(t *testing.T) {
	held := newAbortGate()
	h := newHarness(t, &testHost{abort: held.pass})
	task := h.launch("a/one", "b/two")
	h.settle()
	sid := h.task(task.ID).SessionID
	errc := make(chan error, 1)
	go func() { errc <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	recv(t, held.entered, "the Stop's abort")
	require.NoError(t, h.observe(Event{SessionID: sid, Kind: SessionError, Err: errRateLimited}))
	got := h.wait(task.ID)
	assert.Equal(t, StatusError, got.Status, "the child stopped on its own error, not because of the stop")
	assert.Equal(t, errRateLimited.Error(), got.Error)
	assert.Len(t, got.Attempts, 1, "a cancel request forbids a retry")
	held.release <- nil
	require.NoError(t, recv(t, errc, "Stop to return"))
	assert.Equal(t, got, h.task(task.ID), "the abort landing after the end changes nothing")
}

func TestChildFailureAfterAFailedCancelEndsErrorWithoutRetry(t *testing.T) {
	h := newHarness(t, &testHost{abort: func(context.Context, string) error { return errors.New("abort refused") }})
	task := h.launch("a/one", "b/two")
	h.settle()
	sid := h.task(task.ID).SessionID
	require.Error(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	require.Equal(t, StatusRunning, h.task(task.ID).Status)
	require.NoError(t, h.observe(Event{SessionID: sid, Kind: SessionError, Err: errRateLimited}))
	got := h.wait(task.ID)
	assert.Equal(t, StatusError, got.Status)
	assert.Equal(t, errRateLimited.Error(), got.Error)
	assert.Len(t, got.Attempts, 1, "a cancel request, failed or not, forbids a retry")
}

func TestChildFailureInsideAClosingBranchEndsError(t *testing.T) {
	held := newAbortGate()
	h := newHarness(t, &testHost{abort: held.pass})
	task, sid := h.child("root")
	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); done <- err }()
	recv(t, held.entered, "the closure's abort")
	require.NoError(t, h.observe(Event{SessionID: sid, Kind: SessionError, Err: errRateLimited}))
	got := h.wait(task.ID)
	assert.Equal(t, StatusError, got.Status)
	assert.Len(t, got.Attempts, 1, "no retry inside a closing branch")
	held.release <- nil
	require.NoError(t, recv(t, done, "the branch's Stop to return"))
}

func TestRetrySessionKeptAfterItsArrivalAbortFailedIsAnnounced(t *testing.T) {
	// Attempt 2's start returns a session together with an error; its
	// arrival abort fails, so the session is bound and runs. The parent
	// must be told, as for any retry session.
	h := newHarness(t, &testHost{
		start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
			if req.AttemptNumber == 2 {
				return sid, errors.New("502 bad gateway")
			}
			return sid, nil
		},
		abort: func(ctx context.Context, sid string) error {
			if sid == "ses-2" {
				return errors.New("abort refused")
			}
			return nil
		},
	})
	task := h.launch("a/one", "b/two", "c/three")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	h.settle()
	got := h.task(task.ID)
	require.Equal(t, StatusRunning, got.Status)
	require.Equal(t, "ses-2", got.SessionID)
	assert.Equal(t, []NotificationKind{NotifyRetryScheduled, NotifyRetrySessionReady}, h.rec.Kinds(task.ID))
}

func TestFuncHostRunIsBoundBeforeTheFunctionRuns(t *testing.T) {
	// The host's StartSession is slow to return after the FuncHost made
	// the session: a function that ran before the bind would see its task
	// pending. The wait below only gives that bug its chance to show.
	var m *Manager
	saw := make(chan Task, 1)
	fh := NewFuncHost(func(ctx context.Context, run Run) (string, error) {
		task, _ := m.Task(run.TaskID)
		saw <- task
		return "ok", nil
	})
	var early []Task
	host := &slowReturn{Host: fh, after: func() {
		select {
		case got := <-saw:
			early = append(early, got)
		case <-time.After(100 * time.Millisecond): // failure detection only
		}
	}}
	h := &harness{t: t, rec: &recorder{}}
	h.m = mustOpen(host, WithIDs(SequentialIDs()))
	m = h.m
	fh.attach(h.m)
	shutdownAtCleanup(t, h.m)
	task := h.launch("a/one")
	done := h.wait(task.ID)
	assert.Empty(t, early, "the function ran before its session was bound")
	assert.Equal(t, StatusCompleted, done.Status)
	if len(early) == 0 {
		s := recv(t, saw, "the function's look at its task")
		assert.Equal(t, StatusRunning, s.Status, "the function runs only once its session is bound")
		assert.Equal(t, "fn_"+s.CurrentAttemptID, s.SessionID)
	}
}

// slowReturn calls after once the wrapped StartSession returned, before it
// returns itself.
type slowReturn struct {
	Host
	after func()
}

func (s *slowReturn) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	sid, err := s.Host.StartSession(ctx, req)
	s.after()
	return sid, err
}

func TestFuncHostCancelBeforeBindEndsCancelledWithItsSession(t *testing.T) {
	// A Stop lands while StartSession is in flight: the arriving session is
	// bound (running), then aborted, and cancelled only when confirmed.
	startIn := make(chan struct{})
	proceed := make(chan struct{})
	ran := make(chan struct{}, 1)
	fh := NewFuncHost(func(ctx context.Context, run Run) (string, error) {
		ran <- struct{}{}
		<-ctx.Done()
		return "", ctx.Err()
	})
	host := &gatedStart{Host: fh, in: startIn, proceed: proceed}
	h := &harness{t: t, rec: &recorder{}}
	h.m = mustOpen(host, WithIDs(SequentialIDs()), WithNotifier(h.rec))
	fh.attach(h.m)
	shutdownAtCleanup(t, h.m)
	task := h.launch("a/one", "b/two")
	recv(t, startIn, "the start")
	errc := make(chan error, 1)
	waiting := make(chan string, 1)
	h.m.hooks.waiting = func(id string) { waiting <- id }
	go func() { errc <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	recv(t, waiting, "Stop to wait for the start")
	close(proceed)
	require.NoError(t, recv(t, errc, "Stop to return"))
	got := h.task(task.ID)
	assert.Equal(t, StatusCancelled, got.Status)
	require.Len(t, got.Attempts, 1)
	assert.NotEmpty(t, got.Attempts[0].SessionID, "the session existed: the timeline names it")
	assert.False(t, got.Attempts[0].StartedAt.IsZero())
}

// gatedStart holds StartSession until proceed is closed.
type gatedStart struct {
	Host
	in      chan struct{}
	proceed chan struct{}
}

func (g *gatedStart) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	g.in <- struct{}{}
	<-g.proceed
	return g.Host.StartSession(ctx, req)
}

func TestCloseBranchOfATaskSessionCoversItsEarlierAttemptsChildren(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one", "b/two")
	h.settle()
	first := h.task(task.ID).SessionID
	child, _ := h.child(first) // launched from attempt 1's session
	require.NoError(t, h.observe(Event{SessionID: first, Kind: SessionError, Err: errRateLimited}))
	h.settle()
	cur := h.task(task.ID)
	require.Equal(t, 2, len(cur.Attempts))
	require.Equal(t, StatusRunning, cur.Status)
	_, err := h.m.Stop(context.Background(), Target{Session: cur.SessionID})
	require.NoError(t, err)
	assert.Equal(t, []Status{StatusCancelled, StatusCancelled}, statuses(h, task.ID, child.ID))
}

func TestCloseTaskStopsTheTaskAndEverythingBelowIt(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one", "b/two")
	h.settle()
	first := h.task(task.ID).SessionID
	child, childSes := h.child(first) // launched by attempt 1
	grand, _ := h.child(childSes)
	outside, _ := h.child("parent")
	require.NoError(t, h.observe(Event{SessionID: first, Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.Equal(t, 2, len(h.task(task.ID).Attempts))
	rep, err := h.m.Stop(context.Background(), Target{Task: task.ID, Tree: true})
	require.NoError(t, err)
	assert.Equal(t, task.ID, rep.TaskID)
	assert.Equal(t, []Status{StatusCancelled, StatusCancelled, StatusCancelled, StatusRunning},
		statuses(h, task.ID, child.ID, grand.ID, outside.ID))
	assert.Equal(t, task.ID, h.m.Snapshot().Closures[0].TaskID)

	// An ended task is no obstacle: what it launched is stopped.
	done := h.launch("a/one")
	h.settle()
	doneSes := h.task(done.ID).SessionID
	require.NoError(t, h.observe(Event{SessionID: doneSes, Kind: SessionIdle, Text: "ok"}))
	kid, _ := h.child(doneSes) // launched after it ended (the children gate holds a turn end while its kids run)
	_, err = h.m.Stop(context.Background(), Target{Task: done.ID, Tree: true})
	require.NoError(t, err)
	assert.Equal(t, []Status{StatusCompleted, StatusCancelled}, statuses(h, done.ID, kid.ID))

	_, err = h.m.Stop(context.Background(), Target{Task: "nope", Tree: true})
	assert.ErrorIs(t, err, ErrUnknownTask)
}

func TestAnEarlyRunEndIsNeverLostToTheHoldLimit(t *testing.T) {
	// Events come while the start is in flight; at the bound, liveness is
	// dropped but the event that ends the run is held and applied.
	type step struct {
		ev      func(a Attempt) Event
		wantErr error
	}
	bySession := func(sid string, k EventKind, text string) func(Attempt) Event {
		return func(Attempt) Event { return Event{SessionID: sid, Kind: k, Text: text} }
	}
	byAttempt := func(k EventKind, text string) func(Attempt) Event {
		return func(a Attempt) Event { return Event{AttemptID: a.ID, Kind: k, Text: text} }
	}
	tests := []struct {
		name  string
		limit int
		give  []step
		want  string // the answer the task completes with
	}{
		{name: "by session, after the bound is full of liveness", limit: 2, give: []step{
			{ev: bySession("ses-1", SessionBusy, "")},
			{ev: bySession("ses-1", SessionBusy, "")},
			{ev: bySession("ses-1", SessionIdle, "the answer")},
		}, want: "the answer"},
		{name: "by attempt: liveness past the bound is dropped, the end kept", limit: 1, give: []step{
			{ev: byAttempt(SessionBusy, "")},
			{ev: byAttempt(SessionWaiting, ""), wantErr: ErrUnknownSession},
			{ev: byAttempt(SessionIdle, "done")},
		}, want: "done"},
		{name: "another session's end does not crowd out the child's", limit: 1, give: []step{
			// a harness that forwards every session's events: the parent
			// chat goes idle while the child's start is in flight
			{ev: bySession("ses-1", SessionBusy, "")},
			{ev: bySession("parent", SessionIdle, "not the child")},
			{ev: bySession("ses-1", SessionIdle, "the child's answer")},
		}, want: "the child's answer"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			release := make(chan struct{})
			h := newHarness(t, startsAfter(release, ""), WithHoldLimit(tt.limit))
			task := h.launch("a/one")
			for i, st := range tt.give {
				err := h.m.Observe(st.ev(task.Attempts[0]))
				if st.wantErr != nil {
					assert.ErrorIs(t, err, st.wantErr, "event %d", i)
				} else {
					require.NoError(t, err, "event %d", i)
				}
			}
			close(release)
			got := h.wait(task.ID)
			assert.Equal(t, StatusCompleted, got.Status)
			assert.Equal(t, tt.want, got.Result)
		})
	}
}

func TestFuncHostErrorAfterAbortIsKeptAsTheError(t *testing.T) {
	started := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		close(started)
		<-ctx.Done()
		return "", errors.New("502 bad gateway while stopping")
	})
	task := h.launch("a/one", "b/two")
	recv(t, started, "the function to start")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	got := h.task(task.ID)
	assert.Equal(t, StatusCancelled, got.Status, "the stop gives the status")
	assert.Equal(t, "502 bad gateway while stopping", got.Error, "the error it returned is kept")
	require.NotNil(t, got.Outcome)
	assert.Contains(t, got.Outcome.Evidence, "502 bad gateway")
	assert.Len(t, got.Attempts, 1)
}

func TestNilContextsAreBackground(t *testing.T) {
	h := newHarness(t, nil)
	//lint:ignore SA1012 a nil context is what is under test
	task, err := h.m.Launch(nil, Spec{ParentSessionID: "p", Models: mustModels(t, "a/one")}) //nolint:staticcheck
	require.NoError(t, err)
	h.settle()
	//lint:ignore SA1012 a nil context is what is under test
	require.NoError(t, stopErr(h.m.Stop(nil, Target{Task: task.ID}))) //nolint:staticcheck
	//lint:ignore SA1012 a nil context is what is under test
	got, err := h.m.Wait(nil, task.ID) //nolint:staticcheck
	require.NoError(t, err)
	assert.Equal(t, StatusCancelled, got.Status)
	other := h.launch("a/one")
	h.settle()
	//lint:ignore SA1012 a nil context is what is under test
	_, err = h.m.Stop(nil, Target{Session: "parent"}) //nolint:staticcheck
	require.NoError(t, err)
	assert.Equal(t, StatusCancelled, h.task(other.ID).Status)
	h.launch("a/one") // the fence is down
	//lint:ignore SA1012 a nil context is what is under test
	sub, err := h.m.Subscribe(nil, 1) //nolint:staticcheck
	require.NoError(t, err)
	sub.Close()
	//lint:ignore SA1012 a nil context is what is under test
	require.NoError(t, stopErr(h.m.Stop(nil, Target{Run: RunRef{TaskID: other.ID, Token: "a run that ended"}}))) //nolint:staticcheck
	//lint:ignore SA1012 a nil context is what is under test
	_, err = h.m.Stop(nil, Target{Task: other.ID, Tree: true}) //nolint:staticcheck
	require.NoError(t, err)
	//lint:ignore SA1012 a nil context is what is under test
	require.NoError(t, h.m.Shutdown(nil)) //nolint:staticcheck
}

func TestCloseBranchRefusesBlankAndUnknownSessions(t *testing.T) {
	h := newHarness(t, nil)
	h.launch("a/one")
	h.settle()
	_, err := h.m.Stop(context.Background(), Target{Session: ""})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = h.m.Stop(context.Background(), Target{Session: "  "})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = h.m.Stop(context.Background(), Target{Session: "never-seen"})
	assert.ErrorIs(t, err, ErrUnknownSession)
	h.settle()
	assert.Empty(t, h.m.Snapshot().Closures, "no record for a refused closure")
	for _, n := range h.rec.All() {
		assert.NotEqual(t, NotifyBranchClosed, n.Kind, "no notification for a refused closure")
	}
	_, err = h.m.Stop(context.Background(), Target{Session: "parent"}) // a parent is known
	require.NoError(t, err)
}

func TestSpecRefusesBlankFieldsAndReservedPrefixInAnyCase(t *testing.T) {
	h := newHarness(t, nil)
	tests := []struct {
		name  string
		give  Spec
		field string
	}{
		{name: "blank parent", give: Spec{ParentSessionID: " \t", Models: []Model{{Provider: "a", ID: "b"}}}, field: "ParentSessionID"},
		{name: "blank provider", give: Spec{ParentSessionID: "p", Models: []Model{{Provider: " ", ID: "b"}}}, field: "Models[0].Provider"},
		{name: "blank id", give: Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "\n"}}}, field: "Models[0].ID"},
		{name: "reserved prefix upper case", give: Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "b"}}, Metadata: map[string]string{"BgTask.x": "1"}}, field: `Metadata["BgTask.x"]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := h.m.Launch(context.Background(), tt.give)
			var se *SpecError
			require.ErrorAs(t, err, &se)
			assert.Equal(t, tt.field, se.Field)
		})
	}
	assert.Empty(t, h.m.Snapshot().Tasks)
}

// panicky is an error whose own methods panic: user code failing on a
// Manager goroutine.
type panicky struct{ status bool }

func (p panicky) Error() string {
	if p.status {
		return "502 bad gateway"
	}
	panic("Error exploded")
}

func (p panicky) StatusCode() int {
	if p.status {
		panic("StatusCode exploded")
	}
	return 502
}

func TestUserCodeThatPanicsOnAManagerGoroutineFailsTheAttemptNotTheProcess(t *testing.T) {
	tests := []struct {
		name     string
		startErr error
		runErr   error
		opts     []Option
		want     string // in the attempt's error text
	}{
		{name: "start error whose Error panics", startErr: panicky{}, want: "Error method panicked: Error exploded"},
		{name: "run error whose Error panics", runErr: panicky{}, want: "Error method panicked: Error exploded"},
		{name: "StatusCode that panics", runErr: panicky{status: true}, want: "classifying this error panicked: StatusCode exploded"},
		{name: "classifier that panics", runErr: errRateLimited,
			opts: []Option{WithRetryable(func(error, bool) bool { panic("classifier exploded") })}, want: "classifying this error panicked: classifier exploded"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var h *harness
			if tt.startErr != nil {
				h = newHarness(t, &testHost{start: func(context.Context, SessionRequest, string) (string, error) { return "", tt.startErr }}, tt.opts...)
			} else {
				h = newFuncHarness(t, func(context.Context, Run) (string, error) { return "", tt.runErr }, tt.opts...)
			}
			task := h.launch("a/one", "b/two")
			got := h.wait(task.ID)
			assert.Equal(t, StatusError, got.Status)
			assert.Len(t, got.Attempts, 1, "a panic is a non-retryable error")
			assert.Contains(t, got.Error, tt.want)
		})
	}
}

// panickyHandler is a slog.Handler that panics on every record.
type panickyHandler struct{}

func (panickyHandler) Enabled(context.Context, slog.Level) bool  { return true }
func (panickyHandler) Handle(context.Context, slog.Record) error { panic("logger exploded") }
func (h panickyHandler) WithAttrs([]slog.Attr) slog.Handler      { return h }
func (h panickyHandler) WithGroup(string) slog.Handler           { return h }

func TestALoggerThatPanicsIsSwallowedAndCounted(t *testing.T) {
	h := newHarness(t, &testHost{abort: func(context.Context, string) error { return errors.New("abort refused") }},
		WithLogger(slog.New(panickyHandler{})))
	task := h.launch("a/one", "b/two")
	h.settle()
	// A failed abort logs from the recorder goroutine; a rejected event
	// logs from Observe.
	require.Error(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	assert.ErrorIs(t, h.m.Observe(Event{SessionID: "nobody", Kind: SessionBusy}), ErrUnknownSession)
	require.NoError(t, h.observe(Event{SessionID: h.task(task.ID).SessionID, Kind: SessionIdle, Text: "ok"}))
	assert.Equal(t, StatusCompleted, h.wait(task.ID).Status, "the Manager went on")
	h.settle() // the recorder goroutine writes its line as it releases the lock
	assert.GreaterOrEqual(t, h.m.Dropped().LoggerPanics, uint64(2))
}

func TestRetryDelayFuncSeesTheFailureAndItsRetryAfter(t *testing.T) {
	type seen struct {
		n     int
		cause error
	}
	saw := make(chan seen, 4)
	h := newHarness(t, nil, WithRetryDelay(func(n int, cause error) time.Duration {
		saw <- seen{n, cause}
		d, _ := RetryAfter(cause)
		return d
	}))
	task := h.launch("a/one", "b/two")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: retryAfterErr{d: 30 * time.Second}}))
	s := recv(t, saw, "the retry delay function's call")
	assert.Equal(t, 2, s.n)
	var ra retryAfterErr
	require.ErrorAs(t, s.cause, &ra, "the delay function sees the error value itself")
	h.waitTimers(1)
	require.Equal(t, PendingRetryDelay, h.task(task.ID).Pending)
	h.clock.Advance(30 * time.Second)
	h.until(func() bool { return h.task(task.ID).Status == StatusRunning })
	assert.Equal(t, 2, len(h.host.Starts()))
}

type retryAfterErr struct{ d time.Duration }

func (e retryAfterErr) Error() string             { return "429 Too Many Requests" }
func (e retryAfterErr) RetryAfter() time.Duration { return e.d }

func TestARetryDelayFunctionThatPanicsEndsTheAttemptItWouldDelay(t *testing.T) {
	h := newHarness(t, nil, WithRetryDelay(func(int, error) time.Duration { panic("delay exploded") }))
	task := h.launch("a/one", "b/two")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	got := h.wait(task.ID)
	assert.Equal(t, StatusError, got.Status)
	require.Len(t, got.Attempts, 2)
	assert.Contains(t, got.Error, "retry delay function panicked: delay exploded")
}

func TestShutdownReturnsAtItsDeadlineWhenAHostIgnoresItsContext(t *testing.T) {
	stuck := make(chan struct{})
	entered := make(chan struct{}, 1)
	m, task, err := shutdownRunningTask(t, func(ctx context.Context, sid string) error {
		entered <- struct{}{}
		<-stuck // ignores ctx
		return nil
	})
	assert.Contains(t, err.Error(), task.ID, "names what is still running")
	assert.Contains(t, err.Error(), "still in Host")
	got, _ := m.Task(task.ID)
	assert.Equal(t, StatusRunning, got.Status, "not stopped, so not reported stopped")
	close(stuck)
	// A later Shutdown waits for what the first left running.
	require.NoError(t, m.Shutdown(context.Background()))
	assert.Zero(t, m.life.group.Running())
	recv(t, entered, "the abort")
}

func TestShutdownReturnsAtItsDeadlineWhenANotifierIgnoresItsContext(t *testing.T) {
	stuck := make(chan struct{})
	m := mustOpen(&testHost{}, WithIDs(SequentialIDs()), WithNotifier(NotifierFunc(func(ctx context.Context, n Notification) error {
		<-stuck
		return nil
	})))
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "one"}}})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err = m.Shutdown(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "1 notifications not delivered", "what is left is named")
	close(stuck)
	require.NoError(t, m.Shutdown(context.Background()))
	got, _ := m.Task(task.ID)
	assert.Equal(t, StatusInterrupt, got.Status)
}

func TestAStuckNotifierKeepsItsQueuesBounded(t *testing.T) {
	stuck := make(chan struct{})
	entered := make(chan struct{}, 1)
	h := newHarness(t, nil, WithNotifyLimits(3, 4), WithNotifyRetry(1, nil))
	h.rec.hook = func(ctx context.Context, n Notification) error {
		select {
		case entered <- struct{}{}:
		default:
		}
		select {
		case <-stuck:
		case <-ctx.Done():
		}
		return errors.New("refused")
	}
	for range 6 {
		task := h.launch("a/one")
		h.answer(task.ID)
	}
	recv(t, entered, "a notification to reach the notifier")
	h.m.mu.Lock()
	pending := h.m.notes.lanes.Pending()
	h.m.unlock()
	assert.LessOrEqual(t, pending, 3, "a parent's queue is bounded")
	lost := h.m.Dropped().Undelivered
	assert.LessOrEqual(t, len(lost), 4, "Undelivered is bounded")
	assert.NotZero(t, h.m.Dropped().NotifyDropped, "what no bound could keep is counted")
	var logged bool
	for _, r := range h.logs.Records() {
		if r["level"] == "ERROR" && r["msg"] == "undelivered notification dropped: Undelivered is full (WithNotifyLimits)" {
			logged = true
		}
	}
	assert.True(t, logged)
	close(stuck)
}

// answer ends task id with an answer once its session is bound.
func (h *harness) answer(id string) {
	h.t.Helper()
	h.until(func() bool { return h.task(id).Status == StatusRunning })
	require.NoError(h.t, h.observe(Event{SessionID: h.task(id).SessionID, Kind: SessionIdle, Text: "ok"}))
}

func TestAllCompleteSaysCancelledNotFailed(t *testing.T) {
	h := newHarness(t, nil)
	a := h.launch("a/one")
	b := h.launch("a/one")
	c := h.launch("a/one")
	h.settle()
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: a.ID})))
	require.NoError(t, h.observe(Event{SessionID: h.task(b.ID).SessionID, Kind: SessionError, Err: Permanent(errors.New("boom"))}))
	require.NoError(t, h.observe(Event{SessionID: h.task(c.ID).SessionID, Kind: SessionIdle, Text: "ok"}))
	h.settle()
	var text string
	var order []string
	for _, n := range h.rec.All() {
		if n.Kind == NotifyAllComplete {
			text = n.Text
			for _, t := range n.Tasks {
				order = append(order, t.ID)
			}
		}
	}
	assert.Contains(t, text, "3 tasks under parent: 1 failed, 1 cancelled, 1 completed.")
	assert.Equal(t, []string{b.ID, a.ID, c.ID}, order, "failures first, then stops, then answers")
}

func TestFuncHostReturnAfterItsAbortGaveUpEndsTheTask(t *testing.T) {
	started := make(chan struct{})
	release := make(chan struct{})
	m := mustOpen(NewFuncHost(func(ctx context.Context, run Run) (string, error) {
		close(started)
		<-release // ignores ctx for a while
		return "", ctx.Err()
	}), WithIDs(SequentialIDs()))
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "one"}}})
	require.NoError(t, err)
	recv(t, started, "the function to start")
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, m.Shutdown(ctx), context.DeadlineExceeded)
	got, _ := m.Task(task.ID)
	require.Equal(t, StatusRunning, got.Status, "its abort gave up: it is not reported stopped")
	close(release)
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second) // failure detection only
	defer wcancel()
	got, err = m.Wait(wctx, task.ID)
	require.NoError(t, err, "the function returned: the task must end")
	assert.Equal(t, StatusInterrupt, got.Status, "the stop Shutdown asked for")
	require.NoError(t, m.Shutdown(context.Background()))
}

func TestStartFailureWhileACancelWaitsKeepsItsError(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		close(entered)
		<-release
		return "", errors.New("503 no capacity")
	}})
	task := h.launch("a/one", "b/two")
	recv(t, entered, "the start")
	waiting := make(chan string, 1)
	h.m.hooks.waiting = func(id string) { waiting <- id }
	errc := make(chan error, 1)
	go func() { errc <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	recv(t, waiting, "Stop to wait for the start")
	close(release)
	require.NoError(t, recv(t, errc, "Stop to return"))
	got := h.task(task.ID)
	assert.Equal(t, StatusCancelled, got.Status, "no child existed: the stop is true")
	assert.Contains(t, got.Error, "503 no capacity", "the start's failure is kept")
	assert.Len(t, got.Attempts, 1)
}

func TestChildFailureDuringShutdownEndsErrorWithoutRetry(t *testing.T) {
	held := newAbortGate()
	h := newHarness(t, &testHost{abort: held.pass})
	task := h.launch("a/one", "b/two")
	h.settle()
	sid := h.task(task.ID).SessionID
	done := make(chan error, 1)
	go func() { done <- h.m.Shutdown(context.Background()) }()
	recv(t, held.entered, "Shutdown's abort")
	require.NoError(t, h.m.Observe(Event{SessionID: sid, Kind: SessionError, Err: errRateLimited}))
	held.release <- nil
	require.NoError(t, recv(t, done, "Shutdown to return"))
	got := h.task(task.ID)
	assert.Equal(t, StatusError, got.Status)
	assert.Len(t, got.Attempts, 1, "no retry during Shutdown")
}

func TestAllCompleteCountsInterruptedApart(t *testing.T) {
	h := newHarness(t, nil)
	a := h.launch("a/one")
	b := h.launch("a/one")
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(a.ID).SessionID, Kind: SessionInterrupted}))
	require.NoError(t, h.observe(Event{SessionID: h.task(b.ID).SessionID, Kind: SessionIdle, Text: "ok"}))
	h.settle()
	var text string
	for _, n := range h.rec.All() {
		if n.Kind == NotifyAllComplete {
			text = n.Text
		}
	}
	assert.Contains(t, text, "2 tasks under parent: 0 failed, 1 interrupted, 1 completed.")
}

func TestCloseTaskOfATaskWithNoSession(t *testing.T) {
	release := make(chan struct{})
	h := newHarness(t, startsAfter(release, ""))
	task := h.launch("a/one")
	done := make(chan error, 1)
	var rep ClosureReport
	go func() {
		var err error
		rep, err = h.m.Stop(context.Background(), Target{Task: task.ID, Tree: true})
		done <- err
	}()
	h.until(func() bool {
		h.m.mu.Lock()
		defer h.m.unlock()
		return len(h.m.closures.active) == 1
	})
	close(release) // the start returns inside the closure: bound, then aborted
	require.NoError(t, recv(t, done, "the closing Stop to return"))
	got := h.task(task.ID)
	assert.Equal(t, StatusCancelled, got.Status)
	assert.Equal(t, task.ID, rep.TaskID)
	h.settle()
	var text string
	for _, n := range h.rec.All() {
		if n.Kind == NotifyBranchClosed {
			text = n.Text
		}
	}
	assert.Contains(t, text, task.ID)
	assert.NotContains(t, text, "Session :", "a task closed before it had a session is named by its id")
}

func TestCloseBranchOfASessionAStartInFlightCreatesStopsIt(t *testing.T) {
	release := make(chan struct{})
	h := newHarness(t, startsAfter(release, "made-later"))
	task := h.launch("a/one")
	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "made-later"}); done <- err }()
	h.until(func() bool {
		h.m.mu.Lock()
		defer h.m.unlock()
		return len(h.m.closures.active) == 1
	})
	close(release)
	require.NoError(t, recv(t, done, "the branch's Stop to return"), "the start in flight created the root: it is known")
	assert.Equal(t, StatusCancelled, h.task(task.ID).Status)
}

// explodingIDs panics once its budget of ids is spent.
type explodingIDs struct {
	IDGenerator
	left atomic.Int32
}

func (g *explodingIDs) NewID(kind string) string {
	if g.left.Add(-1) < 0 {
		panic("ids exploded")
	}
	return g.IDGenerator.NewID(kind)
}

func TestAnIDGeneratorThatPanicsFailsTheCallNotTheProcess(t *testing.T) {
	ids := &explodingIDs{IDGenerator: SequentialIDs()}
	ids.left.Store(3) // a task and its first attempt (id, token)
	h := newHarness(t, nil, WithIDs(ids))
	task := h.launch("a/one", "b/two")
	h.settle()
	// The retry needs ids it cannot get: the attempt ends in error, named.
	require.NoError(t, h.observe(Event{SessionID: "ses-1", Kind: SessionError, Err: errRateLimited}))
	got := h.wait(task.ID)
	assert.Equal(t, StatusError, got.Status)
	assert.Contains(t, got.Error, "IDGenerator panicked")
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/one")})
	assert.ErrorContains(t, err, "IDGenerator panicked")
}

func TestShutdownAtItsDeadlineNamesTheTaskItLeavesRunning(t *testing.T) {
	// The abort honours its context: it ends when Shutdown's grace does,
	// failing, and the task stays running. The error must say which.
	m, task, err := shutdownRunningTask(t, func(ctx context.Context, sid string) error {
		<-ctx.Done()
		return ctx.Err()
	})
	assert.Contains(t, err.Error(), task.ID)
	got, _ := m.Task(task.ID)
	assert.Equal(t, StatusRunning, got.Status)
}

func TestAFullNotificationQueueGivesUpRetryNoticesBeforeFinalSummaries(t *testing.T) {
	waiting := []Notification{{Kind: NotifyFinalSummary}, {Kind: NotifyAllComplete}, {Kind: NotifyRetrySessionReady}, {Kind: NotifyRetryScheduled}}
	assert.Equal(t, 2, lessNeeded(waiting), "the oldest retry notice")
	assert.Equal(t, 0, lessNeeded(waiting[:2]), "only finals: the oldest")
}

// shutdownRunningTask launches one task on a host whose aborts are abort,
// waits until it runs, and shuts the Manager down with a 50 ms deadline,
// which must end first.
func shutdownRunningTask(t *testing.T, abort func(ctx context.Context, sid string) error) (*Manager, Task, error) {
	t.Helper()
	m := mustOpen(&testHost{abort: abort}, WithIDs(SequentialIDs()))
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "one"}}})
	require.NoError(t, err)
	require.NoError(t, m.life.group.Wait(context.Background()))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err = m.Shutdown(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	return m, task, err
}
