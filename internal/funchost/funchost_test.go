package funchost

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// safety bounds every wait of a test: never a way to wait for a state,
// only a guard against a test that would otherwise hang.
const safety = 5 * time.Second

type ctxKey struct{}

// call is one report a run made to its Env.
type call struct {
	kind                  string // "StoppedWith", "Answered", "Failed"
	sid, attemptID, token string
	text                  string
	ended                 bool
	err                   error
	answer                string
}

func stopped(text string, ended bool) call {
	return call{kind: "StoppedWith", attemptID: "att", token: "tok", text: text, ended: ended}
}

func answered(sid, answer string) call {
	return call{kind: "Answered", sid: sid, attemptID: "att", token: "tok", answer: answer}
}

// fakeEnv is an Env that records what runs report.
type fakeEnv struct {
	refuse bool // Go starts nothing
	// bound, when non-nil, is what AwaitBound answers (or false once its
	// ctx ends); otherwise AwaitBound answers fixedBound at once.
	bound      chan bool
	fixedBound bool
	// boundOnCancel: AwaitBound answers true, but only once its ctx ended.
	boundOnCancel bool
	// awaiting, when non-nil, gets AwaitBound's ctx as it is entered.
	awaiting chan context.Context

	wg sync.WaitGroup

	mu         sync.Mutex
	calls      []call
	goCalls    int
	runCtxArgs [][3]string
	awaitArgs  [][3]string
	boundGiven int // AwaitBound calls that returned
}

func (e *fakeEnv) RunContext(taskID, attemptID, token string) context.Context {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.runCtxArgs = append(e.runCtxArgs, [3]string{taskID, attemptID, token})
	return context.WithValue(context.Background(), ctxKey{}, "run:"+attemptID)
}

func (e *fakeEnv) Go(f func()) bool {
	e.mu.Lock()
	e.goCalls++
	e.mu.Unlock()
	if e.refuse {
		return false
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		f()
	}()
	return true
}

func (e *fakeEnv) AwaitBound(ctx context.Context, attemptID, token, sid string) bool {
	e.mu.Lock()
	e.awaitArgs = append(e.awaitArgs, [3]string{attemptID, token, sid})
	e.mu.Unlock()
	if e.awaiting != nil {
		e.awaiting <- ctx
	}
	ok := e.fixedBound
	if e.boundOnCancel {
		<-ctx.Done()
		ok = true
	}
	if e.bound != nil {
		select {
		case ok = <-e.bound:
		case <-ctx.Done():
			ok = false
		}
	}
	e.mu.Lock()
	e.boundGiven++
	e.mu.Unlock()
	return ok
}

func (e *fakeEnv) record(c call) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.calls = append(e.calls, c)
}

func (e *fakeEnv) StoppedWith(attemptID, token, text string, ended bool) {
	e.record(call{kind: "StoppedWith", attemptID: attemptID, token: token, text: text, ended: ended})
}

func (e *fakeEnv) Answered(sid, attemptID, token, answer string, _ int, _ any) {
	e.record(call{kind: "Answered", sid: sid, attemptID: attemptID, token: token, answer: answer})
}

func (e *fakeEnv) Failed(sid, attemptID, token string, err error) {
	e.record(call{kind: "Failed", sid: sid, attemptID: attemptID, token: token, err: err})
}

func (e *fakeEnv) Text(err error) string { return "text(" + err.Error() + ")" }

func (e *fakeEnv) recorded() []call {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]call(nil), e.calls...)
}

// wait waits until every goroutine Go started has returned.
func (e *fakeEnv) wait(t *testing.T) {
	t.Helper()
	done := make(chan struct{})
	go func() { e.wg.Wait(); close(done) }()
	ctx, cancel := context.WithTimeout(context.Background(), safety)
	defer cancel()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("a run's goroutine did not return")
	}
}

var testRun = Run{TaskID: "task", AttemptID: "att", Token: "tok"}

func attached(t *testing.T, env *fakeEnv) *Host {
	t.Helper()
	h := New()
	require.NoError(t, h.Attach(env))
	return h
}

func safetyCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), safety)
	t.Cleanup(cancel)
	return ctx
}

// recv receives from c, failing the test if nothing comes in time.
func recv[T any](t *testing.T, c <-chan T, what string) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), safety)
	defer cancel()
	select {
	case v := <-c:
		return v
	case <-ctx.Done():
		t.Fatalf("timed out waiting for %s", what)
		var zero T
		return zero
	}
}

func TestStartBeforeAttach(t *testing.T) {
	h := New()
	assert.Nil(t, h.Env())
	called := false
	err := h.Start(testRun, "s1", func(context.Context) (string, error) { called = true; return "", nil })
	assert.ErrorIs(t, err, ErrNotAttached)
	assert.False(t, called)
	assert.NoError(t, h.Abort(safetyCtx(t), "s1"), "nothing was started under s1")
}

func TestAttachOnce(t *testing.T) {
	h := New()
	e1, e2 := &fakeEnv{}, &fakeEnv{}
	require.NoError(t, h.Attach(e1))
	assert.Same(t, e1, h.Env())
	assert.ErrorIs(t, h.Attach(e2), ErrAttached)
	assert.Same(t, e1, h.Env(), "the first Manager stays")
}

func TestGoRefusedStartsNothing(t *testing.T) {
	env := &fakeEnv{refuse: true, fixedBound: true}
	h := attached(t, env)
	called := false
	err := h.Start(testRun, "s1", func(context.Context) (string, error) { called = true; return "", nil })
	assert.ErrorIs(t, err, ErrNotStarted)
	assert.False(t, called)
	assert.Equal(t, 1, env.goCalls)

	// The run is not left behind: Abort finds no live run and returns at
	// once, not when its context ends.
	ctx := safetyCtx(t)
	assert.NoError(t, h.Abort(ctx, "s1"))
	assert.NoError(t, ctx.Err(), "Abort returned at once")
	assert.Empty(t, env.recorded())
}

func TestBodyRunsOnlyAfterBound(t *testing.T) {
	env := &fakeEnv{bound: make(chan bool), awaiting: make(chan context.Context, 1)}
	h := attached(t, env)
	started := make(chan context.Context, 1)
	boundBefore := make(chan int, 1)
	require.NoError(t, h.Start(testRun, "s1", func(ctx context.Context) (string, error) {
		env.mu.Lock()
		boundBefore <- env.boundGiven
		env.mu.Unlock()
		started <- ctx
		return "ok", nil
	}))

	awaitCtx := recv(t, env.awaiting, "AwaitBound")
	select {
	case <-started:
		t.Fatal("the body ran before the session was bound")
	default:
	}
	env.bound <- true

	bodyCtx := recv(t, started, "the body")
	assert.Equal(t, 1, <-boundBefore, "AwaitBound had answered before the body ran")
	env.wait(t)

	assert.Equal(t, [][3]string{{"task", "att", "tok"}}, env.runCtxArgs)
	assert.Equal(t, [][3]string{{"att", "tok", "s1"}}, env.awaitArgs)
	assert.Equal(t, "run:att", bodyCtx.Value(ctxKey{}), "the body's context is the run's")
	assert.Equal(t, "run:att", awaitCtx.Value(ctxKey{}), "AwaitBound waits with the run's context")
	assert.Error(t, bodyCtx.Err(), "the run's context is released once the run is over")
	assert.Equal(t, []call{answered("s1", "ok")}, env.recorded())
	assert.NoError(t, h.Abort(safetyCtx(t), "s1"), "the run is over")
}

func TestBodyNeverRunsWhenNotBound(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  *fakeEnv
		tell bool
	}{
		{"fixed", &fakeEnv{fixedBound: false}, false},
		{"channel", &fakeEnv{bound: make(chan bool, 1)}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := attached(t, tc.env)
			if tc.tell {
				tc.env.bound <- false
			}
			called := false
			require.NoError(t, h.Start(testRun, "s1", func(context.Context) (string, error) {
				called = true
				return "ok", nil
			}))
			tc.env.wait(t)
			assert.False(t, called)
			assert.Equal(t, 1, tc.env.boundGiven)
			assert.Empty(t, tc.env.recorded(), "a run that never ran reports nothing")
			assert.NoError(t, h.Abort(safetyCtx(t), "s1"))
		})
	}
}

// A run stopped while it waits to be bound never runs, even if the binding
// then succeeds.
func TestAbortBeforeBoundNeverRuns(t *testing.T) {
	env := &fakeEnv{boundOnCancel: true, awaiting: make(chan context.Context, 1)}
	h := attached(t, env)
	called := false
	require.NoError(t, h.Start(testRun, "s1", func(context.Context) (string, error) {
		called = true
		return "ok", nil
	}))
	recv(t, env.awaiting, "AwaitBound")
	assert.NoError(t, h.Abort(safetyCtx(t), "s1"))
	env.wait(t)
	assert.Equal(t, 1, env.boundGiven, "AwaitBound answered (true)")
	assert.False(t, called)
	assert.Empty(t, env.recorded())
}

func TestAnswer(t *testing.T) {
	env := &fakeEnv{fixedBound: true}
	h := attached(t, env)
	require.NoError(t, h.Start(testRun, "s1", func(context.Context) (string, error) { return "forty-two", nil }))
	env.wait(t)
	assert.Equal(t, []call{answered("s1", "forty-two")}, env.recorded())
}

func TestAnswerAfterAbort(t *testing.T) {
	env := &fakeEnv{fixedBound: true}
	h := attached(t, env)
	started := make(chan struct{})
	require.NoError(t, h.Start(testRun, "s1", func(ctx context.Context) (string, error) {
		close(started)
		<-ctx.Done()
		return "late answer", nil
	}))
	recv(t, started, "the body")
	require.NoError(t, h.Abort(safetyCtx(t), "s1"))
	// Abort returned: the run has returned and reported.
	assert.Equal(t, []call{answered("s1", "late answer")}, env.recorded(), "an answer is the truth, stop or not")
	env.wait(t)
	assert.Equal(t, []call{answered("s1", "late answer")}, env.recorded())
}

func TestErrorWithoutAbortFails(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"plain", errors.New("boom")},
		// Not asked to stop: even a cancellation is the run's failure.
		{"canceled", fmt.Errorf("gave up: %w", context.Canceled)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := &fakeEnv{fixedBound: true}
			h := attached(t, env)
			require.NoError(t, h.Start(testRun, "s1", func(context.Context) (string, error) { return "ignored", tc.err }))
			env.wait(t)
			calls := env.recorded()
			require.Len(t, calls, 1)
			assert.Equal(t, "Failed", calls[0].kind)
			assert.Equal(t, "s1", calls[0].sid)
			assert.Equal(t, "att", calls[0].attemptID)
			assert.Equal(t, "tok", calls[0].token)
			assert.Same(t, tc.err, calls[0].err)
		})
	}
}

func TestCanceledAfterAbortReportsNothing(t *testing.T) {
	for _, tc := range []struct {
		name string
		ret  func(ctx context.Context) error
	}{
		{"ctx.Err", func(ctx context.Context) error { return ctx.Err() }},
		{"wrapped", func(context.Context) error { return fmt.Errorf("stopping: %w", context.Canceled) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := &fakeEnv{fixedBound: true}
			h := attached(t, env)
			started := make(chan struct{})
			require.NoError(t, h.Start(testRun, "s1", func(ctx context.Context) (string, error) {
				close(started)
				<-ctx.Done()
				return "", tc.ret(ctx)
			}))
			recv(t, started, "the body")
			assert.NoError(t, h.Abort(safetyCtx(t), "s1"))
			env.wait(t)
			assert.Empty(t, env.recorded(), "the stop confirmed by Abort is the whole story")
		})
	}
}

func TestErrorAfterAbortKeptBeforeAbortReturns(t *testing.T) {
	env := &fakeEnv{fixedBound: true}
	h := attached(t, env)
	started := make(chan struct{})
	require.NoError(t, h.Start(testRun, "s1", func(ctx context.Context) (string, error) {
		close(started)
		<-ctx.Done()
		return "", errors.New("cleanup failed")
	}))
	recv(t, started, "the body")
	require.NoError(t, h.Abort(safetyCtx(t), "s1"))
	// Read before waiting on the goroutine: the text must already be kept.
	assert.Equal(t, []call{stopped("text(cleanup failed)", false)}, env.recorded())
	env.wait(t)
	assert.Equal(t, []call{stopped("text(cleanup failed)", false)}, env.recorded(), "no Failed: the stop gives the status")
	assert.NoError(t, h.Abort(safetyCtx(t), "s1"), "the run is gone")
}

// abortGivenUp starts a body that sees its cancellation but does not return
// until release is closed, and an Abort that gives up on it.
func abortGivenUp(t *testing.T, ret func() (string, error)) (env *fakeEnv, h *Host, release chan struct{}) {
	t.Helper()
	env = &fakeEnv{fixedBound: true}
	h = attached(t, env)
	started := make(chan struct{})
	sawCancel := make(chan struct{})
	release = make(chan struct{})
	require.NoError(t, h.Start(testRun, "s1", func(ctx context.Context) (string, error) {
		close(started)
		<-ctx.Done()
		close(sawCancel)
		<-release // ignores the cancellation
		return ret()
	}))

	abortCtx, giveUp := context.WithCancel(context.Background())
	defer giveUp()
	recv(t, started, "the body")
	res := make(chan error, 1)
	go func() { res <- h.Abort(abortCtx, "s1") }()
	recv(t, sawCancel, "the body to see its cancellation")
	select {
	case err := <-res:
		t.Fatalf("Abort returned %v while the body still ran", err)
	default:
	}
	giveUp()
	assert.ErrorIs(t, recv(t, res, "Abort"), ErrNotReturned)
	assert.Empty(t, env.recorded(), "nothing is reported while the body still runs")

	// A second Abort also gives up; it must not confirm anything either.
	done, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, h.Abort(done, "s1"), ErrNotReturned)
	return env, h, release
}

func TestAbortGivesUpThenErrorEnds(t *testing.T) {
	env, h, release := abortGivenUp(t, func() (string, error) { return "", errors.New("stuck") })
	close(release)
	env.wait(t)
	calls := env.recorded()
	require.NotEmpty(t, calls)
	// The run says itself that it has stopped, with its error's text.
	assert.Equal(t, stopped("text(stuck)", true), calls[len(calls)-1])
	for _, c := range calls {
		assert.Equal(t, "StoppedWith", c.kind, "no Failed or Answered: %+v", c)
		assert.Equal(t, "text(stuck)", c.text)
	}
	assert.NoError(t, h.Abort(safetyCtx(t), "s1"))
}

func TestAbortGivesUpThenCanceledEnds(t *testing.T) {
	env, h, release := abortGivenUp(t, func() (string, error) { return "", context.Canceled })
	close(release)
	env.wait(t)
	assert.Equal(t, []call{stopped("", true)}, env.recorded())
	assert.NoError(t, h.Abort(safetyCtx(t), "s1"))
}

func TestAbortGivesUpThenAnswer(t *testing.T) {
	env, _, release := abortGivenUp(t, func() (string, error) { return "done anyway", nil })
	close(release)
	env.wait(t)
	assert.Equal(t, []call{answered("s1", "done anyway")}, env.recorded())
}

func TestAbortUnknown(t *testing.T) {
	env := &fakeEnv{fixedBound: true}
	h := attached(t, env)
	ctx := safetyCtx(t)
	assert.NoError(t, h.Abort(ctx, "nope"))
	assert.NoError(t, ctx.Err(), "returned at once")
	done, cancel := context.WithCancel(context.Background())
	cancel()
	assert.NoError(t, h.Abort(done, "nope"), "even with an ended context")
}

func TestAbortOnlyItsRun(t *testing.T) {
	env := &fakeEnv{fixedBound: true}
	h := attached(t, env)
	started := make(chan string, 2)
	release2 := make(chan struct{})
	body := func(name string, release <-chan struct{}) Body {
		return func(ctx context.Context) (string, error) {
			started <- name
			select {
			case <-ctx.Done():
				return "", ctx.Err()
			case <-release:
				return name, nil
			}
		}
	}
	require.NoError(t, h.Start(testRun, "s1", body("one", nil)))
	require.NoError(t, h.Start(testRun, "s2", body("two", release2)))
	recv(t, started, "a body")
	recv(t, started, "a body")
	require.NoError(t, h.Abort(safetyCtx(t), "s1"))
	assert.Empty(t, env.recorded(), "s1 stopped quietly, s2 still runs")
	close(release2)
	env.wait(t)
	assert.Equal(t, []call{answered("s2", "two")}, env.recorded())
}

// A run Go refused will never run: an Abort that finds it in the window
// before Start forgets it returns at once, not after its own deadline.
func TestAnAbortOfARefusedRunDoesNotWait(t *testing.T) {
	h := New()
	env := &refusingAbortEnv{h: h, sid: "ses-r"}
	require.NoError(t, h.Attach(env))
	err := h.Start(Run{TaskID: "t", AttemptID: "a", Token: "k"}, "ses-r", func(context.Context) (string, error) { return "", nil })
	require.ErrorIs(t, err, ErrNotStarted)
	<-env.done
	require.NoError(t, env.abortErr, "the abort made while Go refused waited for a run that never ran")
}

// refusingAbortEnv refuses Go, once an Abort of the run has found it (the
// run is registered before Go is asked) and is waiting for it.
type refusingAbortEnv struct {
	h        *Host
	sid      string
	abortErr error
	done     chan struct{}
}

func (e *refusingAbortEnv) RunContext(string, string, string) context.Context {
	return context.Background()
}
func (e *refusingAbortEnv) Go(func()) bool {
	e.done = make(chan struct{})
	go func() {
		defer close(e.done)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		e.abortErr = e.h.Abort(ctx, e.sid)
	}()
	for { // until the abort has marked the run: it waits for it from then on
		e.h.mu.Lock()
		fr := e.h.runs[e.sid]
		e.h.mu.Unlock()
		fr.mu.Lock()
		asked := fr.aborted
		fr.mu.Unlock()
		if asked {
			return false
		}
		runtime.Gosched()
	}
}
func (e *refusingAbortEnv) AwaitBound(context.Context, string, string, string) bool { return true }
func (e *refusingAbortEnv) StoppedWith(string, string, string, bool)                {}
func (e *refusingAbortEnv) Answered(string, string, string, string, int, any)       {}
func (e *refusingAbortEnv) Failed(string, string, string, error)                    {}
func (e *refusingAbortEnv) Text(err error) string                                   { return err.Error() }
