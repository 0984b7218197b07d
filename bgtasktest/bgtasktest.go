// Package bgtasktest is a kit for testing code that drives a bgtask
// Manager, deterministically and without sleeping: a Clock the test moves
// by hand, a scripted Host (session ids handed out in order; starts and
// aborts that fail or hang on demand; every call recorded; events sent to
// the Manager), a Notifier that records what parents were told, helpers
// that wait for a task's state on the Manager's change stream; and, for
// tests of code that reads tasks, BuildTask, which makes a snapshot of a
// task in any state (its id, launch, attempts, their statuses, models and
// times), and Load, which makes a Manager holding such tasks.
//
//	clk := bgtasktest.NewClock(time.Now())
//	host := bgtasktest.NewHost()
//	rec := &bgtasktest.Recorder{}
//	m, err := bgtask.Open(ctx, host, bgtask.WithClock(clk), bgtask.WithNotifier(rec),
//		bgtask.WithIDs(bgtask.SequentialIDs()))
//	host.Attach(m)
//	defer m.Shutdown(context.Background())
//
//	task, _ := m.Launch(ctx, spec)
//	running, _ := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
//	host.Fail(running.SessionID, errors.New("429 Too Many Requests"))
//	retried, _ := bgtasktest.WaitFor(ctx, m, task.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 })
//
// A test of code that reads a Manager (a view, an HTTP handler, a
// harness's status tool) loads the tasks it needs, in one line:
//
//	m, err := bgtasktest.Load(ctx, []bgtasktest.TaskBuild{done, failed, running})
//	defer m.Shutdown(ctx)
//
// Notifications are delivered by the Manager's own goroutines, after the
// change they report: Wait (or WaitStatus) can return before the task's
// final summary reached the Recorder. Wait for a notification itself with
// Recorder.AwaitFinal or Recorder.Await, never by reading All right after
// Wait:
//
//	done, _ := m.Wait(ctx, task.ID)
//	summary, _ := rec.AwaitFinal(ctx, task.ID)
//
// With testing/synctest (Go 1.25 and later) a test may use the wall clock
// instead: inside a bubble, time moves only when every goroutine of the
// bubble is blocked, so a Manager's timeouts fire at once and in order. The
// Manager's goroutines must then live in the bubble: create and shut down
// the Manager inside synctest.Test. Clock does not need a bubble, and
// works with a Host whose calls leave the process.
package bgtasktest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/clock"
)

// Clock is a bgtask.Clock that moves only when Advance is called: timers
// fire, in deadline order, when the time reaches them.
type Clock struct{ f *clock.Fake }

var _ bgtask.Clock = (*Clock)(nil)

// NewClock returns a Clock reading start.
func NewClock(start time.Time) *Clock { return &Clock{f: clock.NewFake(start)} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time { return c.f.Now() }

// NewTimer returns a timer that fires when the clock reaches now+d (at once
// for d <= 0).
func (c *Clock) NewTimer(d time.Duration) bgtask.Timer { return c.f.NewTimer(d) }

// Advance moves the time forward by d and fires every timer now due.
func (c *Clock) Advance(d time.Duration) { c.f.Advance(d) }

// Pending reports how many timers wait to fire.
func (c *Clock) Pending() int { return c.f.Pending() }

// Timers reports how many timers were made so far, and a channel closed
// when the next one is made: a test that must advance only once a timer
// exists (a retry delay, a deadline) waits on it instead of sleeping.
func (c *Clock) Timers() (made int, next <-chan struct{}) { return c.f.Created() }

// AwaitTimers waits until at least n timers were made in all, or ctx
// ends.
func (c *Clock) AwaitTimers(ctx context.Context, n int) error {
	for {
		made, next := c.f.Created()
		if made >= n {
			return nil
		}
		select {
		case <-next:
		case <-ctx.Done():
			return fmt.Errorf("bgtasktest: %d of %d timers made: %w", made, n, ctx.Err())
		}
	}
}

// Host is a scripted bgtask.Host. StartSession hands out "ses-1",
// "ses-2", ... in call order and AbortSession succeeds, unless a script
// says otherwise (FailStarts, HangStarts, FailAborts, HangAborts). Every
// call is recorded. Attach it to its Manager to send events (Emit, Idle,
// Fail). Its methods are safe for concurrent use.
type Host struct {
	mu       sync.Mutex
	m        *bgtask.Manager
	n        int
	starts   []bgtask.SessionRequest
	aborts   []string
	sessions map[string]string // attempt id → session id
	script   map[string][]step // "start" / "abort" → what the next calls do
	release  chan struct{}     // closed by Release: hung calls return
	changed  chan struct{}     // closed and replaced at every call, and when a call hangs or stops hanging
	hung     map[*hung]bool    // the calls hanging now
	stopped  map[string]bool   // tasks a stop was asked of (stopAsked)
	unhung   bool              // no call hangs any more (releaseAll)
}

// step is what one scripted call does: fail with err, or hang until
// Release (or its context) and then answer normally. A start that hangs
// untilStop also answers once a stop of its task was asked (a build's
// pending attempt: Stop and Shutdown can end it).
type step struct {
	err       error
	hang      bool
	untilStop bool
}

// hung is a call hanging: it waits for release, done (its context's), or
// stop (closed by stopAsked; nil but for a start that hangs untilStop).
type hung struct {
	task          string
	release, done <-chan struct{}
	stop          chan struct{}
}

// NewHost returns a Host with no script.
func NewHost() *Host {
	return &Host{sessions: map[string]string{}, script: map[string][]step{}, release: make(chan struct{}), changed: make(chan struct{}),
		hung: map[*hung]bool{}, stopped: map[string]bool{}}
}

// Attach names the Manager the host's events go to.
func (h *Host) Attach(m *bgtask.Manager) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.m = m
}

// FailStarts makes the next n StartSession calls fail with err.
func (h *Host) FailStarts(n int, err error) { h.add("start", n, step{err: err}) }

// HangStarts makes the next n StartSession calls block until Release or
// their context ends.
func (h *Host) HangStarts(n int) { h.add("start", n, step{hang: true}) }

// FailAborts makes the next n AbortSession calls fail with err: the child
// is still running.
func (h *Host) FailAborts(n int, err error) { h.add("abort", n, step{err: err}) }

// HangAborts makes the next n AbortSession calls block until Release or
// their context ends.
func (h *Host) HangAborts(n int) { h.add("abort", n, step{hang: true}) }

func (h *Host) add(call string, n int, s step) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for range n {
		h.script[call] = append(h.script[call], s)
	}
}

// Release lets every call hung so far return (as a hung start returns its
// session, a hung abort succeeds); later hangs wait for the next Release.
func (h *Host) Release() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.releaseLocked()
}

func (h *Host) releaseLocked() {
	close(h.release)
	h.release = make(chan struct{})
	h.bump()
}

// next takes the script's next step for call (of task, for a start) and
// records that a call came; a call that hangs is counted hung from then
// on, until hang returns. h.mu is held.
func (h *Host) next(ctx context.Context, call, task string) (step, *hung) {
	var s step
	if q := h.script[call]; len(q) > 0 {
		s, h.script[call] = q[0], q[1:]
	}
	h.bump()
	if !s.hang || h.unhung || s.untilStop && h.stopped[task] {
		return step{err: s.err}, nil
	}
	w := &hung{task: task, release: h.release, done: ctx.Done()}
	if s.untilStop {
		w.stop = make(chan struct{})
	}
	h.hung[w] = true
	return s, w
}

// bump wakes whoever waits for a change of the host. h.mu is held.
func (h *Host) bump() {
	close(h.changed)
	h.changed = make(chan struct{})
}

// hang blocks a hung call until Release (nil) or the end of ctx (its
// error), or, for a start that hangs untilStop, until a stop of its task
// is asked (nil).
func (h *Host) hang(ctx context.Context, w *hung) error {
	defer func() {
		h.mu.Lock()
		delete(h.hung, w)
		h.bump()
		h.mu.Unlock()
	}()
	select {
	case <-w.release:
		return nil
	case <-w.stop:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// releaseAll lets every call hung so far return, and every later one
// answer without hanging.
func (h *Host) releaseAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.unhung = true
	h.releaseLocked()
}

// stopAsked answers, from now on, every start of task that hangs
// untilStop: a stop of it was asked.
func (h *Host) stopAsked(task string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopped[task] {
		return
	}
	h.stopped[task] = true
	for w := range h.hung {
		if w.task == task && w.stop != nil {
			close(w.stop)
		}
	}
	h.bump()
}

// blocked reports how many calls hang and have nothing to return for yet
// (neither released nor cancelled), and a channel closed when the host
// changes.
func (h *Host) blocked() (int, <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for w := range h.hung {
		if !closed(w.release) && !closed(w.done) && !closed(w.stop) {
			n++
		}
	}
	return n, h.changed
}

// closed reports whether the close signal ch was given (never, for nil).
func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// StartSession records req and returns the next session id, or does what
// the script says.
func (h *Host) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	h.mu.Lock()
	h.n++
	sid := fmt.Sprintf("ses-%d", h.n)
	h.starts = append(h.starts, req)
	s, w := h.next(ctx, "start", req.TaskID)
	h.mu.Unlock()
	if s.hang {
		if err := h.hang(ctx, w); err != nil {
			return "", err
		}
	}
	if s.err != nil {
		return "", s.err
	}
	h.mu.Lock()
	h.sessions[req.AttemptID] = sid // handed out: the start returns it
	h.mu.Unlock()
	return sid, nil
}

// AbortSession records the session and succeeds, or does what the script
// says.
func (h *Host) AbortSession(ctx context.Context, sessionID string) error {
	h.mu.Lock()
	h.aborts = append(h.aborts, sessionID)
	s, w := h.next(ctx, "abort", "")
	h.mu.Unlock()
	if s.hang {
		if err := h.hang(ctx, w); err != nil {
			return err
		}
	}
	return s.err
}

// Starts returns the StartSession requests so far, in call order.
func (h *Host) Starts() []bgtask.SessionRequest {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.starts)
}

// Aborts returns the sessions AbortSession was asked to stop, in order.
func (h *Host) Aborts() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.aborts)
}

// Session returns the session StartSession handed out for attempt id.
func (h *Host) Session(attemptID string) (string, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	sid, ok := h.sessions[attemptID]
	return sid, ok
}

// AwaitCalls waits until the host has had at least n calls (starts and
// aborts together), or ctx ends.
func (h *Host) AwaitCalls(ctx context.Context, n int) error {
	for {
		h.mu.Lock()
		got, changed := len(h.starts)+len(h.aborts), h.changed
		h.mu.Unlock()
		if got >= n {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("bgtasktest: %d of %d host calls: %w", got, n, ctx.Err())
		}
	}
}

// Emit sends ev to the attached Manager (Observe).
func (h *Host) Emit(ev bgtask.Event) error {
	h.mu.Lock()
	m := h.m
	h.mu.Unlock()
	if m == nil {
		return errors.New("bgtasktest: Host.Emit before Attach")
	}
	return m.Observe(ev)
}

// Idle reports that session's turn ended with answer.
func (h *Host) Idle(session, answer string) error {
	return h.Emit(bgtask.Event{SessionID: session, Kind: bgtask.SessionIdle, Text: answer})
}

// Fail reports that session's turn failed with err.
func (h *Host) Fail(session string, err error) error {
	return h.Emit(bgtask.Event{SessionID: session, Kind: bgtask.SessionError, Err: err})
}

// Recorder is a bgtask.Notifier that keeps what it was given, in order.
// Refuse, if set, is asked first: a non-nil error refuses the
// notification (bgtask retries it, WithNotifyRetry). The zero Recorder is
// ready to use.
type Recorder struct {
	Refuse func(bgtask.Notification) error

	mu      sync.Mutex
	got     []bgtask.Notification
	changed chan struct{}
}

// Notify keeps n, unless Refuse refuses it.
func (r *Recorder) Notify(_ context.Context, n bgtask.Notification) error {
	if r.Refuse != nil {
		if err := r.Refuse(n); err != nil {
			return err
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, n)
	if r.changed != nil {
		close(r.changed)
		r.changed = nil
	}
	return nil
}

// All returns the notifications kept, in delivery order.
func (r *Recorder) All() []bgtask.Notification {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.got)
}

// Kinds returns the kinds of the notifications about task id ("": all),
// in order.
func (r *Recorder) Kinds(taskID string) []bgtask.NotificationKind {
	var out []bgtask.NotificationKind
	for _, n := range r.All() {
		if taskID == "" || n.TaskID == taskID {
			out = append(out, n.Kind)
		}
	}
	return out
}

// AwaitFinal waits for the final summary (bgtask.NotifyFinalSummary) of
// task taskID and returns it, or returns ctx's error. A task's final
// summary is sent after it ended, by the Manager's delivery goroutine:
// Wait returning does not mean it has arrived.
func (r *Recorder) AwaitFinal(ctx context.Context, taskID string) (bgtask.Notification, error) {
	return r.Await(ctx, func(n bgtask.Notification) bool {
		return n.Kind == bgtask.NotifyFinalSummary && n.TaskID == taskID
	})
}

// Await waits until a kept notification satisfies ok and returns it, or
// returns ctx's error. Notifications arrive after the changes they report
// (see the package doc).
func (r *Recorder) Await(ctx context.Context, ok func(bgtask.Notification) bool) (bgtask.Notification, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	seen := 0
	for {
		r.mu.Lock()
		got := r.got[seen:len(r.got):len(r.got)]
		if r.changed == nil {
			r.changed = make(chan struct{})
		}
		changed := r.changed
		r.mu.Unlock()
		for _, n := range got { // ok is the caller's: never under the lock
			if ok(n) {
				return n, nil
			}
		}
		seen += len(got)
		select {
		case <-changed:
		case <-ctx.Done():
			return bgtask.Notification{}, ctx.Err()
		}
	}
}

// WaitFor waits until task id's snapshot satisfies ok and returns it, or
// returns ctx's error (or the task's lookup error). It follows the
// Manager's change stream, so it also sees what Wait does not wait for:
// activity, progress, a retry's new attempt.
func WaitFor(ctx context.Context, m *bgtask.Manager, id string, ok func(bgtask.Task) bool) (bgtask.Task, error) {
	sub, err := m.Subscribe(ctx, 1024)
	if err != nil {
		return bgtask.Task{}, err
	}
	defer sub.Close()
	t, err := m.Task(id) // after subscribing: no change is missed
	if err != nil {
		return bgtask.Task{}, err
	}
	if ok(t) {
		return t, nil
	}
	for c := range sub.C {
		// A change older than the snapshot read above (buffered before it)
		// is not news.
		if c.Task.ID == id && c.Task.Revision >= t.Revision && ok(c.Task) {
			return c.Task, nil
		}
	}
	if err := sub.Err(); errors.Is(err, bgtask.ErrLagged) {
		return WaitFor(ctx, m, id, ok) // fell behind: look again from a fresh read
	}
	if ctx.Err() != nil {
		return bgtask.Task{}, ctx.Err()
	}
	return bgtask.Task{}, sub.Err()
}

// WaitStatus waits until task id has status s.
func WaitStatus(ctx context.Context, m *bgtask.Manager, id string, s bgtask.Status) (bgtask.Task, error) {
	return WaitFor(ctx, m, id, func(t bgtask.Task) bool { return t.Status == s })
}
