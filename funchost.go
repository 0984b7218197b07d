package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"runtime/debug"
	"sync"
	"sync/atomic"

	"github.com/bgtask/bgtask/internal/funchost"
)

// RunFunc is a subagent written as a Go function: it does one attempt's
// work and returns the final answer, or an error. It must return once ctx
// ends (a Stop, a closure or Shutdown stopped the attempt). To return a
// structured result beside the answer text, wrap a function with
// Returning.
type RunFunc func(ctx context.Context, run Run) (answer string, err error)

// Returning makes a RunFunc of a function that returns a value of the
// harness's own type: the value is kept beside the task while the
// process lives (Task.Value, ValueOf), and text(v) is the answer text the
// parent model reads (the Result, the envelope). A nil text renders the
// value with fmt.Sprint. An error is returned as it is (Task.Cause keeps
// it); text is not called then. A nil result (a nil pointer, map, slice,
// interface, …) with a nil error ends the attempt in error with
// ErrNilResult, never retried; text is not called with it. A panic in
// text is the run's panic (a *PanicError).
func Returning[T any](fn func(ctx context.Context, run Run) (T, error), text func(T) string) RunFunc {
	if fn == nil {
		panic("Returning with a nil function")
	}
	return func(ctx context.Context, run Run) (string, error) {
		v, err := fn(ctx, run)
		if err != nil {
			return "", err
		}
		if isNil(v) {
			if run.m != nil {
				run.m.logAttrs(slog.LevelWarn, "a Returning function returned a nil result and no error",
					slog.String("task", run.TaskID), slog.String("attempt", run.AttemptID), slog.String("type", fmt.Sprintf("%T", v)))
			}
			return "", Permanent(ErrNilResult)
		}
		if run.value != nil {
			var kept any = v
			run.value.Store(&kept)
		}
		if text == nil {
			return fmt.Sprint(v), nil
		}
		return text(v), nil
	}
}

// isNil reports whether v is a nil pointer, map, slice, channel, function
// or interface: a result with nothing in it.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	switch r := reflect.ValueOf(v); r.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Slice, reflect.Chan, reflect.Func, reflect.Interface:
		return r.IsNil()
	}
	return false
}

// Run is what a RunFunc is told about the attempt it runs, and how it
// reports progress. It is a value; its methods are safe for concurrent use.
type Run struct {
	// TaskID and AttemptID name the attempt this run is.
	TaskID    string
	AttemptID string
	Attempt   int    // the attempt number, 1-based
	Token     string // the attempt's run token
	SessionID string // minted by the FuncHost for this attempt
	// ParentSessionID is the task's (Spec.ParentSessionID).
	ParentSessionID string
	// Model is the attempt's model.
	Model Model
	// Agent, Prompt and Description are the task's Spec fields.
	Agent, Prompt string
	Description   string
	Metadata      map[string]string // the task's Spec.Metadata: this run's copy
	Root          string            // the task's tree (Task.Root, Task.Depth)
	// Depth: see Root.
	Depth int

	report func(kind EventKind, progress string)
	inbox  *inbox
	value  *atomic.Pointer[any] // what a Returning function returned
	m      *Manager
}

// Manager returns the Manager running this attempt: what a function uses
// to launch beneath itself (Launch with the function's context), look
// tasks up, wait for them, or stop them.
func (r Run) Manager() *Manager { return r.m }

// Prompts delivers the task's supplemental prompts (Extend), in invocation
// order, as a Prompter host is given them (Invocation, Prompt). A prompt is admitted when the function receives it; an Extend
// waits for that (or for its context), and one the function never takes
// before it returns is refused, changing nothing. The function's return
// answers every invocation up to the last it received.
func (r Run) Prompts() <-chan PromptRequest {
	if r.inbox == nil {
		return nil
	}
	return r.inbox.ch
}

// Answer ends a turn without returning: text answers every invocation up
// to n (the last the function had received) that has no answer yet. When
// that answers everything admitted, the task completes with text, and the
// function should return.
func (r Run) Answer(n int, text string) {
	if r.inbox != nil {
		r.inbox.answer(n, text)
	}
}

// inbox is how a FuncHost function receives supplemental prompts.
type inbox struct {
	ch   chan PromptRequest // unbuffered: a prompt is admitted when taken
	done chan struct{}      // closed when the function returned
	// mu is held by PromptSession across its hand-off and the update of
	// seen, so the function's return (after done closed) reads seen only
	// once a prompt it took is counted.
	mu     sync.Mutex
	seen   int // the last invocation the function received (1: the launch prompt); guarded by mu
	answer func(n int, text string)
}

// Busy reports that the function is generating (liveness; never ends the
// run).
func (r Run) Busy() { r.report(SessionBusy, "") }

// Waiting reports that the function waits on a tool, a permission or
// input (Task.Activity waiting; never ends the run).
func (r Run) Waiting() { r.report(SessionWaiting, "") }

// Progress reports a line of progress: Task.Progress shows it (bounded to
// maxProgressRunes, one line), and it is the evidence a later failure
// reports, as a child's latest output is.
func (r Run) Progress(text string) { r.report(SessionBusy, text) }

// Compacted reports that the function compacted its context (never changes
// status).
func (r Run) Compacted() { r.report(SessionCompacted, "") }

// FuncHost is a Host whose child sessions are Go functions running in this
// process: each attempt runs fn on its own goroutine, under a session id the
// host mints. Create it with NewFuncHost and pass it to Open; one FuncHost
// serves one Manager. fn starts only once the Manager has bound the
// attempt's session, so the task reads running for as long as fn runs; an
// attempt stopped or replaced before that never runs fn.
//
// fn's return is the evidence: an answer becomes SessionIdle with that text,
// an error SessionError (so the fallback chain applies, and Permanent is
// respected), and a panic is recovered as a non-retryable *PanicError
// (Task.Cause) carrying the panic's value and stack, and logged at error
// level. Every report carries the attempt id and
// run token, so a function that returns late can never complete a later
// attempt.
//
// AbortSession cancels the attempt's context and returns only once fn has
// returned; the task then ends with the stop's status (cancelled, or
// interrupt at Shutdown), and an error fn returned after the stop was asked
// — other than its context's cancellation — is kept as the attempt's error
// text and evidence. An answer is still the truth (the task ends
// completed). If fn ignores its context, AbortSession waits until its own
// context ends and returns an error: the task stays running until fn
// really returns. The goroutines belong to the Manager; Shutdown waits for
// them (see its doc for a function that ignores its context).
type FuncHost struct {
	fn      RunFunc
	h       *funchost.Host // the runs, and the stop protocol (internal/funchost)
	inboxes sync.Map       // session id → *inbox, while its function may run
}

// PromptSession hands a supplemental prompt to the function running the
// session (see Run.Prompts): nil once the function received it; an error
// if it returned first, or ctx ended.
func (h *FuncHost) PromptSession(ctx context.Context, req PromptRequest) error {
	v, ok := h.inboxes.Load(req.SessionID)
	if !ok {
		return errors.New("no function runs session " + req.SessionID)
	}
	ib := v.(*inbox)
	ib.mu.Lock()
	defer ib.mu.Unlock()
	select { // once done is closed, nobody can take the prompt: done is chosen
	case ib.ch <- req:
		ib.seen = req.Invocation
		return nil
	case <-ib.done:
		return errors.New("the function returned before it took the prompt")
	case <-ctx.Done():
		return ctx.Err()
	}
}

// NewFuncHost returns a Host that runs fn for every attempt.
func NewFuncHost(fn RunFunc) *FuncHost {
	if fn == nil {
		panic("NewFuncHost with a nil RunFunc")
	}
	return &FuncHost{fn: fn, h: funchost.New()}
}

// attach is called by Open.
func (h *FuncHost) attach(m *Manager) {
	if err := h.h.Attach(funcEnv{m: m, h: h}); err != nil {
		panic("a FuncHost serves one Manager")
	}
}

// StartSession starts fn for the attempt and returns the session id it runs
// under.
func (h *FuncHost) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	env, _ := h.h.Env().(funcEnv)
	m := env.m
	sid := "fn_" + req.AttemptID
	ib := &inbox{ch: make(chan PromptRequest), done: make(chan struct{}), seen: 1}
	ib.answer = func(n int, text string) {
		_ = m.Observe(Event{SessionID: sid, AttemptID: req.AttemptID, Token: req.Token, Kind: SessionIdle, Text: text, Invocation: n})
	}
	root, depth := m.treeOf(req.TaskID)
	fn := h.fn
	if own := m.runFuncOf(req.TaskID); own != nil {
		fn = own // Spec.Run
	}
	run := Run{
		TaskID: req.TaskID, AttemptID: req.AttemptID, Attempt: req.AttemptNumber, Token: req.Token,
		SessionID: sid, ParentSessionID: req.ParentSessionID, Model: req.Model, Agent: req.Agent, Prompt: req.Prompt,
		Description: req.Description, Metadata: req.Metadata, Root: root, Depth: depth,
		report: func(k EventKind, progress string) {
			_ = m.Observe(Event{SessionID: sid, AttemptID: req.AttemptID, Token: req.Token, Kind: k, Text: progress, Progress: progress})
		},
		inbox: ib,
		value: new(atomic.Pointer[any]),
		m:     m,
	}
	h.inboxes.Store(sid, ib)
	seen := func() int { // called once the function returned: done is closed
		ib.mu.Lock()
		defer ib.mu.Unlock()
		return ib.seen
	}
	value := func() any {
		if v := run.value.Load(); v != nil {
			return *v
		}
		return nil
	}
	err := h.h.Start(funchost.Run{TaskID: req.TaskID, AttemptID: req.AttemptID, Token: req.Token, Seen: seen, Value: value}, sid,
		func(ctx context.Context) (string, error) {
			defer func() {
				close(ib.done) // before its answer is reported: no prompt is taken after it
				h.inboxes.Delete(sid)
			}()
			return callRunFunc(fn, ctx, run)
		})
	if err != nil {
		h.inboxes.Delete(sid)
	}
	switch {
	case errors.Is(err, funchost.ErrNotAttached):
		return "", Permanent(errors.New("FuncHost used without New"))
	case err != nil:
		return "", ErrShutdown
	}
	return sid, nil
}

// runFuncOf returns task id's own function (Spec.Run), or nil.
func (m *Manager) runFuncOf(id string) RunFunc {
	m.mu.Lock()
	defer m.unlock()
	if e := m.led.tasks[id]; e != nil && e.loc != nil {
		return e.loc.run
	}
	return nil
}

// noRunFunc is the function of the in-process host a Manager makes for
// tasks with their own (Spec.Run): only those tasks reach it.
func noRunFunc(context.Context, Run) (string, error) {
	return "", Permanent(errors.New("the task has no function of its own"))
}

// treeOf returns task id's root session and depth (Task.Root, Task.Depth).
func (m *Manager) treeOf(id string) (root string, depth int) {
	m.mu.Lock()
	defer m.unlock()
	if e := m.led.tasks[id]; e != nil {
		return e.info.root, e.info.depth
	}
	return "", 0
}

// funcEnv is what a FuncHost's runs need of the Manager.
type funcEnv struct {
	m *Manager
	h *FuncHost // the host whose runs these are
}

func (f funcEnv) RunContext(taskID, attemptID, token string) context.Context {
	f.m.mu.Lock()
	e := f.m.led.tasks[taskID]
	values := e.values()
	f.m.mu.Unlock()
	return &runCtx{Context: f.m.life.ctx, v: runValue{ref: RunRef{TaskID: taskID, AttemptID: attemptID, Token: token}, kind: callRun, e: e}, values: values}
}

func (f funcEnv) Go(fn func()) bool { return f.m.goLocked(fn) }

func (f funcEnv) AwaitBound(ctx context.Context, attemptID, token, sid string) bool {
	ok := f.m.awaitBound(ctx, attemptID, token, sid) && ctx.Err() == nil
	if !ok {
		f.h.inboxes.Delete(sid) // the function never runs: no prompt can reach it
	}
	return ok
}

func (f funcEnv) StoppedWith(attemptID, token, text string, ended bool) {
	f.m.stoppedWith(attemptID, token, text, ended)
}

func (f funcEnv) Answered(sid, attemptID, token, answer string, seen int, value any) {
	_ = f.m.Observe(Event{SessionID: sid, AttemptID: attemptID, Token: token, Kind: SessionIdle, Text: answer, Invocation: seen, Value: value, last: true})
}

func (f funcEnv) Failed(sid, attemptID, token string, err error) {
	_ = f.m.Observe(Event{SessionID: sid, AttemptID: attemptID, Token: token, Kind: SessionError, Err: err})
}

func (f funcEnv) Text(err error) string { return safeText(err) }

// awaitBound waits until attempt attemptID's run (token) is bound to sid
// and running, and reports true; or reports false as soon as that can no
// longer happen (the run was replaced or ended, or ctx ended).
func (m *Manager) awaitBound(ctx context.Context, attemptID, token, sid string) bool {
	for {
		m.mu.Lock()
		ref, ok := m.led.attemptOf(attemptID)
		if !ok {
			m.unlock()
			return false
		}
		a := ref.attempt()
		switch {
		case a.Token != token || !ref.isCurrent() || a.Status.Terminal():
			m.unlock()
			return false
		case a.Status == StatusRunning:
			bound := a.SessionID == sid
			m.unlock()
			return bound
		}
		changed := ref.e.waitChange()
		m.unlock()
		if m.await(ctx, changed) != nil {
			return false
		}
	}
}

// stoppedWith keeps the error text a run returned after it was asked to
// stop: the stop gives the attempt's status, the text (if any) is its error
// and evidence. With ended, the run has stopped and no abort in flight will
// confirm it: the attempt ends now with the stop's status. It changes
// nothing if the run was replaced or ended.
func (m *Manager) stoppedWith(attemptID, token, text string, ended bool) {
	m.step(&runReturnedIn{attemptID: attemptID, token: token, text: text, ended: ended})
}

// callRunFunc runs fn; a panic in it ends the attempt in error with a
// *PanicError (its value and stack), never retried, and logged at error
// level with the stack.
func callRunFunc(fn RunFunc, ctx context.Context, run Run) (answer string, err error) {
	defer func() {
		if r := recover(); r != nil {
			p := &PanicError{Where: "subagent function", Value: r, Stack: debug.Stack()}
			if run.m != nil {
				run.m.logAttrs(slog.LevelError, "subagent function panicked", slog.String("task", run.TaskID),
					slog.String("attempt", run.AttemptID), slog.String("session", run.SessionID),
					slog.String("panic", panicText(r)), slog.String("stack", string(p.Stack)))
			}
			answer, err = "", Permanent(p)
		}
	}()
	return fn(ctx, run)
}

// AbortSession cancels the run's context and waits for fn to return, or for
// ctx to end (then it returns an error and the run goes on). An unknown or
// finished session is already stopped: nil.
func (h *FuncHost) AbortSession(ctx context.Context, sessionID string) error {
	if err := h.h.Abort(ctx, sessionID); err != nil {
		return fmt.Errorf("subagent %s %w: %w", sessionID, err, ctx.Err())
	}
	return nil
}
