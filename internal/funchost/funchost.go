// Package funchost runs child sessions as Go functions in this process: the
// body of bgtask's FuncHost. Each run gets its own goroutine (owned by the
// Manager, started through Env.Go) and a session id the host mints. A run's
// function starts only once the Manager has bound its session, and its
// return is reported as the run's evidence.
//
// The stop protocol is the delicate part. Abort cancels the run's context
// and waits for the function to return. A function that returns an error
// after it was asked to stop has that error kept as the stop's error text
// (Env.StoppedWith) before Abort can see it finished, so the text is never
// lost to the confirmation. If Abort gives up waiting (its context ended),
// the run, once it does return, says itself that it has stopped: no abort
// will confirm it.
package funchost

import (
	"context"
	"errors"
	"sync"
)

// Env is what a Host needs of the Manager it serves.
type Env interface {
	// RunContext is the context a run's function gets: the Manager's
	// lifetime, carrying the run.
	RunContext(taskID, attemptID, token string) context.Context
	// Go starts f on a goroutine the Manager owns; false once it starts
	// none (Shutdown).
	Go(f func()) bool
	// AwaitBound waits until the attempt's run (token) is bound to sid and
	// running (true), or that can no longer happen (false).
	AwaitBound(ctx context.Context, attemptID, token, sid string) bool
	// StoppedWith keeps the error text a run returned after it was asked
	// to stop; with ended, the run has stopped and no abort will confirm it.
	StoppedWith(attemptID, token, text string, ended bool)
	// Answered and Failed report the function's return as the run's event.
	// value is the run's structured result (Run.Value), or nil.
	Answered(sid, attemptID, token, answer string, seen int, value any)
	Failed(sid, attemptID, token string, err error)
	// Text renders a function's error (user code, guarded).
	Text(err error) string
}

// Run names one run of a function.
type Run struct {
	TaskID, AttemptID, Token string
	// Seen, if set, is the last invocation the function had received
	// when it returned: its answer answers up to that one.
	Seen func() int
	// Value, if set, is the run's structured result once the function
	// returned an answer.
	Value func() any
}

// Body is a run's function, called with the run's context.
type Body func(ctx context.Context) (answer string, err error)

// ErrNotAttached: the host was used before a Manager attached to it.
var ErrNotAttached = errors.New("used without a Manager")

// ErrAttached: a second Manager tried to attach.
var ErrAttached = errors.New("already serves a Manager")

// ErrNotStarted: the Manager starts no more goroutines.
var ErrNotStarted = errors.New("the manager starts no more runs")

// Host is the set of live runs of one Manager.
type Host struct {
	mu   sync.Mutex // guards env, runs
	env  Env
	runs map[string]*run // live runs by session id
}

type run struct {
	cancel context.CancelFunc
	done   chan struct{} // closed after the function returned and its outcome was reported

	mu       sync.Mutex // guards aborted, gaveUp, finished
	aborted  bool       // Abort asked it to stop
	gaveUp   bool       // an Abort stopped waiting before it returned
	finished bool       // the function returned, or will never run
}

// New returns a Host with no Manager yet.
func New() *Host { return &Host{runs: make(map[string]*run)} }

// Attach makes env the Manager the host serves, once.
func (h *Host) Attach(env Env) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.env != nil {
		return ErrAttached
	}
	h.env = env
	return nil
}

// Env returns the Manager attached, or nil.
func (h *Host) Env() Env {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.env
}

// Start starts run r under session sid: body runs on a goroutine of the
// Manager once the session is bound. It returns ErrNotAttached or
// ErrNotStarted when it starts nothing.
func (h *Host) Start(r Run, sid string, body Body) error {
	env := h.Env()
	if env == nil {
		return ErrNotAttached
	}
	ctx, cancel := context.WithCancel(env.RunContext(r.TaskID, r.AttemptID, r.Token))
	fr := &run{cancel: cancel, done: make(chan struct{})}
	h.mu.Lock()
	h.runs[sid] = fr
	h.mu.Unlock()
	if !env.Go(func() { h.run(env, r, sid, fr, ctx, body) }) {
		// It will never run: an Abort that found it meanwhile must not
		// wait for it.
		fr.mu.Lock()
		fr.finished = true
		fr.mu.Unlock()
		h.forget(sid)
		cancel()
		close(fr.done)
		return ErrNotStarted
	}
	return nil
}

func (h *Host) forget(sid string) {
	h.mu.Lock()
	delete(h.runs, sid)
	h.mu.Unlock()
}

// run is the goroutine of one run.
func (h *Host) run(env Env, r Run, sid string, fr *run, ctx context.Context, body Body) {
	defer func() {
		h.forget(sid)
		fr.cancel()
		close(fr.done)
	}()
	// Bind first, then run: the function runs only once the Manager bound
	// its session, so the task reads running for as long as it runs. A run
	// that is never adopted, or stopped first, never runs.
	if !env.AwaitBound(ctx, r.AttemptID, r.Token, sid) || ctx.Err() != nil {
		return
	}
	answer, err := body(ctx)
	var text string
	if err != nil && !errors.Is(err, context.Canceled) {
		text = env.Text(err) // user code: before any lock
	}
	fr.mu.Lock()
	fr.finished = true
	aborted, gaveUp := fr.aborted, fr.gaveUp
	if aborted && text != "" {
		// Stopped by Abort: the stop gives the status, an error of its
		// own is kept as its error text — recorded before an Abort can see
		// the run finished and confirm the stop.
		env.StoppedWith(r.AttemptID, r.Token, text, false)
	}
	fr.mu.Unlock()
	switch {
	case err == nil:
		seen := 0
		if r.Seen != nil {
			seen = r.Seen()
		}
		var value any
		if r.Value != nil {
			value = r.Value()
		}
		env.Answered(sid, r.AttemptID, r.Token, answer, seen, value) // an answer is the truth, stop or not
	case !aborted:
		env.Failed(sid, r.AttemptID, r.Token, err)
	case gaveUp:
		// The abort that asked it to stop gave up waiting, so none will
		// confirm it: it has stopped now, and says so itself.
		env.StoppedWith(r.AttemptID, r.Token, text, true)
	}
}

// ErrNotReturned: the function did not return before Abort's context
// ended.
var ErrNotReturned = errors.New("did not return after cancellation")

// Abort cancels the run of session sid and waits until its function has
// returned (nil), or ctx ends first (ErrNotReturned, wrapping nothing: the
// caller adds ctx's error). A session with no live run has stopped: nil.
func (h *Host) Abort(ctx context.Context, sid string) error {
	h.mu.Lock()
	fr := h.runs[sid]
	h.mu.Unlock()
	if fr == nil {
		return nil
	}
	fr.mu.Lock()
	fr.aborted = true
	fr.mu.Unlock()
	fr.cancel()
	select {
	case <-fr.done:
		return nil
	case <-ctx.Done():
		fr.mu.Lock()
		defer fr.mu.Unlock()
		if fr.finished {
			return nil // it returned just now: stopped
		}
		fr.gaveUp = true // it will say so itself when it returns
		return ErrNotReturned
	}
}
