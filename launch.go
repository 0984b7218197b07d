package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"

	"github.com/bgtask/bgtask/internal/textbound"
)

// Launch records a task and its first attempt (pending) and returns its
// snapshot. The child session is started on a goroutine the Manager owns;
// Launch does not wait for it. ctx bounds the Launch itself (with a
// journal, the wait for its records to be durable), and, with
// Spec.InheritValues or Spec.CancelWithCaller, lends the task its values
// or its end; a ctx that has already ended is refused with its error,
// whatever the Spec says, and nothing is recorded.
//
// A Launch with ctx of a run of this Manager — the context of a FuncHost
// function or a Spec.Run function, or of a Host's PromptSession — and no
// Spec.ParentSessionID goes beneath that run: its parent is the run's
// session. No Run value needs threading through a framework: the
// context carries it. The child is in the run's tree (stopped with its
// branch, counted in its budgets and limits) and, unless Spec.Detached,
// holds the run's end until it has ended (the children gate).
//
// A refused Launch records nothing and keeps Spec.ID free. One whose ctx
// ended while its records were being made durable (a journal) returns
// the task it launched with a *DurabilityUnknownError: the task exists
// in this process, and runs.
func (m *Manager) Launch(ctx context.Context, spec Spec) (Task, error) {
	ctx = orBackground(ctx)
	if err := ctx.Err(); err != nil {
		return Task{}, err
	}
	if spec.ParentSessionID == "" {
		spec.ParentSessionID = m.runSession(ctx)
	}
	if err := m.checkSpec(&spec); err != nil {
		return Task{}, err
	}
	if err := m.poisoned(); err != nil {
		return Task{}, err
	}
	m.healthSync(ctx) // the fleet's cooldowns, when the view is stale (HealthStore)
	in := launchIn{info: spec.taskInfo()}
	if spec.OnDone != nil || spec.InheritValues || spec.Run != nil {
		in.loc = &local{run: spec.Run}
		if spec.OnDone != nil {
			in.loc.onDone = []*func(Task){&spec.OnDone}
		}
		if spec.InheritValues {
			in.loc.values = ctx
		}
	}
	if err := m.launchDecide(ctx, &in); err != nil {
		return Task{}, err
	}
	if in.out.err != nil {
		_ = m.unlockCtx(ctx)
		var held *KeyHeldError
		if spec.ExtendLive && errors.As(in.out.err, &held) {
			return m.extendLive(ctx, held, &spec)
		}
		return Task{}, in.out.err
	}
	task := in.out.e.project()
	if err := m.unlockCtx(ctx); err != nil {
		return task, durabilityUnknown(err, "Launch", task.ID) // launched here; durable later, or never if the journal fails
	}
	if spec.CancelWithCaller {
		m.watchCaller(ctx, in.out.e)
	}
	return task, nil
}

// checkSpec refuses a spec this Manager cannot launch: one invalid in
// itself, or asking what the Manager cannot give.
func (m *Manager) checkSpec(spec *Spec) error {
	if err := spec.validate(); err != nil {
		return err
	}
	if spec.ParentSessionID == "" && m.cfg.notifier != nil {
		return &SpecError{Field: "ParentSessionID", Reason: "is empty, and the Manager has a Notifier: its notifications go to the parent session"}
	}
	if m.hosts.ownOnly && spec.Run == nil {
		return &SpecError{Field: "Run", Reason: "is nil, and the Manager has no Host (Open(ctx, nil)): every task brings its own function"}
	}
	if m.cfg.err != nil {
		return m.cfg.err
	}
	if spec.ContinueFrom != "" {
		if _, ok := m.hosts.main.(Resumer); !ok || spec.Run != nil {
			return errNoResumer
		}
	}
	return nil
}

// extendLive makes a Launch whose key a live task holds that task's next
// invocation (Spec.ExtendLive), and returns the task's snapshot.
func (m *Manager) extendLive(ctx context.Context, held *KeyHeldError, spec *Spec) (Task, error) {
	note := "a Launch with key " + strconv.Quote(held.Key) + ", which this task held, became this invocation (Spec.ExtendLive)"
	var hook *func(Task)
	if spec.OnDone != nil { // before the Extend: the task cannot end unseen in between
		hook = &spec.OnDone
		m.alsoOnDone(held.TaskID, hook)
	}
	if _, err := m.extend(ctx, held.TaskID, spec.Prompt, note); err != nil {
		if !errors.Is(err, ErrNotRunning) { // else the task is ending: OnDone tells of it
			m.dropOnDone(held.TaskID, hook)
		}
		return Task{}, err
	}
	return m.Task(held.TaskID)
}

// watchCaller stops task e when ctx ends first (Spec.CancelWithCaller).
// The caller's context is user code: it is looked at outside m.mu.
func (m *Manager) watchCaller(ctx context.Context, e *entry) {
	if ctx.Done() == nil {
		return
	}
	id := e.id
	stop := context.AfterFunc(ctx, func() { m.callerDone(id) })
	m.mu.Lock()
	if e.terminal() {
		m.unlock()
		stop()
		return
	}
	e.keep().stopWait = stop
	m.unlock()
}

// alsoOnDone adds the OnDone of a Launch that extends task id
// (Spec.ExtendLive) to the task's: it is called when the task ends, as
// the task's own is. m.mu is taken.
func (m *Manager) alsoOnDone(id string, hook *func(Task)) {
	m.mu.Lock()
	defer m.unlock()
	if e := m.led.tasks[id]; e != nil && !e.terminal() {
		l := e.keep()
		l.onDone = append(l.onDone, hook)
	}
}

// dropOnDone takes back a hook alsoOnDone added, for an Extend that
// failed (the Launch failed: it is told nothing). m.mu is taken.
func (m *Manager) dropOnDone(id string, hook *func(Task)) {
	if hook == nil {
		return
	}
	m.mu.Lock()
	defer m.unlock()
	if e := m.led.tasks[id]; e != nil && e.loc != nil {
		e.loc.onDone = slices.DeleteFunc(e.loc.onDone, func(h *func(Task)) bool { return h == hook })
	}
}

// launchDecide decides launch in, waiting in its parent's queue while
// TreeLimits.MaxPerParent says so (at most ParentWait, and never past
// ctx). It returns with m.mu held, unless it returns an error.
func (m *Manager) launchDecide(ctx context.Context, in *launchIn) error {
	var timer Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		m.mu.Lock()
		m.decide(in)
		if in.out.wait == nil {
			if in.out.err != nil && in.ticket != nil {
				m.leaveFanout(in)
			}
			return nil
		}
		wait, since := in.out.wait, in.ticket.since
		if timer == nil {
			timer = m.cfg.clock.NewTimer(m.cfg.tree.ParentWait)
			if m.hooks.queued != nil { // once its timer runs, for tests
				m.hooks.queued(in.info.parent)
			}
		}
		m.unlock()
		var err error
		select {
		case <-wait:
			continue
		case <-ctx.Done():
			err = ctx.Err()
		case <-timer.C():
			t := m.cfg.tree
			err = &LimitError{Limit: ErrFanOutLimit, Max: t.MaxPerParent, Session: in.info.parent, Waited: m.now().Sub(since)}
		}
		m.mu.Lock()
		m.leaveFanout(in)
		m.unlock()
		return err
	}
}

// callerDone stops task id, whose caller's context ended
// (Spec.CancelWithCaller), with its branch, as Stop with Tree does: on a
// goroutine of the Manager, which logs the close's error.
func (m *Manager) callerDone(id string) {
	m.goLocked(func() {
		m.mu.Lock()
		e := m.led.tasks[id]
		live := e != nil && !e.terminal()
		m.unlock()
		if !live {
			return
		}
		if _, err := m.closeTask(m.life.ctx, id, closedByCaller, "", false); err != nil && !errors.Is(err, ErrShutdown) {
			m.logAttrs(slog.LevelWarn, "stopping a task whose caller's context ended failed",
				slog.String("task", id), slog.String("err", safeText(err)))
		}
	})
}

// continuation resolves info's Spec.ContinueFrom: an ended task that holds
// its session still (not continued by another already); the session and
// the task's output, bounded, go into info. m.mu is held.
func (m *Manager) continuation(info *taskInfo) error {
	old := m.led.tasks[info.opt().continues]
	if old == nil {
		return m.missing(info.opt().continues)
	}
	sid := old.cur().SessionID
	switch {
	case !old.terminal():
		return &SpecError{Field: "ContinueFrom", Reason: "names live task " + old.id + " (Extend it instead)"}
	case sid == "":
		return &SpecError{Field: "ContinueFrom", Reason: "names task " + old.id + ", which has no session to continue"}
	case old.info.inProcess:
		return fmt.Errorf("%w: task %s ran its own function (Spec.Run): nothing remains of its session", errors.ErrUnsupported, old.id)
	}
	if holder, ok := m.led.bySession[sid]; !ok || holder.e != old {
		if !ok { // the task that continued it was forgotten since (retention), and the session with it
			return &SpecError{Field: "ContinueFrom", Reason: "names task " + old.id + ", whose session a task since forgotten continued"}
		}
		return &SpecError{Field: "ContinueFrom", Reason: "names task " + old.id + ", whose session task " + holder.e.id + " continued: continue that one"}
	}
	o := old.project().Outcome
	prior := o.Evidence
	if o.HasAnswer {
		prior = o.Answer
	}
	info.extra().resume = sid
	info.extra().prior, _ = textbound.Middle(prior, maxEvidenceRunes)
	return nil
}

// onLaunch decides a launch: refused while shutting down or inside a
// closing branch; else the task is recorded with its first attempt, which
// is admitted. m.mu is held.
func (m *Manager) onLaunch(in *launchIn) reply {
	info := new(taskInfo)
	*info = in.info
	info.sessions = m.sessionsOf(info)
	if m.life.closing {
		return reply{err: ErrShutdown}
	}
	if err := m.budgetAdmit(info); err != nil { // before the fence: a budget spent says so while its closure runs
		return reply{err: err}
	}
	if m.closingParent(info.parent) {
		return reply{err: fmt.Errorf("%w: parent session %s is inside a branch being closed", ErrBranchClosing, info.parent)}
	}
	if o := m.led.live(info.opt().key); o != nil { // before any id is drawn: a refused launch leaves no trace
		return reply{err: &KeyHeldError{Key: info.opt().key, TaskID: o.id}}
	}
	if info.id != "" && m.led.taken(info.id) {
		return reply{err: fmt.Errorf("%w: %q", ErrIDTaken, info.id)}
	}
	if wait, err := m.treeAdmit(in); wait != nil || err != nil {
		return reply{wait: wait, err: err}
	}
	if info.opt().continues != "" {
		if err := m.continuation(info); err != nil {
			return reply{err: err}
		}
	}
	if info.id == "" {
		id, err := m.taskID()
		if err != nil {
			return reply{err: err}
		}
		info.id = id
	}
	info.launchedAt = m.now()
	e, first, err := m.led.open(info)
	if err != nil {
		return reply{err: err}
	}
	m.order = append(m.order, e)
	e.loc = in.loc
	m.joinRound(e)
	if !m.commit(e, first) { // cannot happen (open checked it): never leave a task without an attempt
		m.led.drop(e)
		m.order = m.order[:len(m.order)-1]
		if r := e.rt.round; r != nil { // it joined last
			r.live--
			r.tasks = r.tasks[:len(r.tasks)-1]
		}
		return reply{err: errors.New("the ledger refused a task's first attempt")}
	}
	m.admit(e, *e.cur())
	m.launched(e)
	if info.opt().timeout > 0 && !e.terminal() {
		m.armDeadline(e, Attempt{})
	}
	if in.ticket != nil { // it had its turn: the next in line may look
		m.leaveFanout(in)
	}
	return reply{e: e}
}

// sessionsOf is what can be done with the session of a task launched
// here once it ended: nothing for one that ran its own function.
func (m *Manager) sessionsOf(info *taskInfo) sessionKind {
	if info.inProcess {
		return sessionsGone
	}
	return m.hosts.sessions
}

// joinRound counts a new task in its parent's current round (the tasks
// whose ends one all_complete reports). Rounds exist only to tell a parent
// all is done: without a Notifier there are none. m.mu is held.
func (m *Manager) joinRound(e *entry) {
	if m.cfg.notifier == nil {
		return
	}
	r := m.notes.rounds[e.info.parent]
	if r == nil {
		r = &round{parent: e.info.parent}
		m.notes.rounds[e.info.parent] = r
	}
	r.live++
	r.tasks = append(r.tasks, e)
	e.rt.round = r
}

// taskID draws a task id from the IDGenerator; one that a caller already
// chose (Spec.ID) is drawn again, a few times. m.mu is held.
func (m *Manager) taskID() (string, error) {
	for range 4 {
		id, err := newID(m.cfg.ids, idTask)
		if err != nil || !m.led.taken(id) {
			return id, err
		}
	}
	return "", errors.New("the IDGenerator keeps returning task ids in use")
}

// treeAdmit applies WithTreeLimits to launch in: an error refuses it; a
// channel says it waits, in its parent's queue, until the channel is
// closed. m.mu is held.
func (m *Manager) treeAdmit(in *launchIn) (<-chan struct{}, error) {
	t, parent := &m.cfg.tree, in.info.parent
	root, depth := m.led.lineage(parent)
	switch {
	case t.MaxDepth > 0 && depth > t.MaxDepth:
		return nil, &LimitError{Limit: ErrDepthLimit, Max: t.MaxDepth, Session: parent}
	case t.MaxPerRoot > 0 && m.led.liveRoot[root] >= t.MaxPerRoot:
		return nil, &LimitError{Limit: ErrTreeLimit, Max: t.MaxPerRoot, Session: root}
	case t.MaxPerParent == 0:
		return nil, nil
	}
	q := m.calls.fanout[parent]
	ahead := len(q) > 0 && q[0] != in.ticket
	if !ahead && m.led.liveBy[parent] < t.MaxPerParent {
		return nil, nil
	}
	if in.ticket == nil {
		if t.ParentWait <= 0 {
			return nil, &LimitError{Limit: ErrFanOutLimit, Max: t.MaxPerParent, Session: parent}
		}
		in.ticket = &fanWaiter{ch: make(chan struct{}), since: m.now()}
		if m.calls.fanout == nil {
			m.calls.fanout = make(map[string][]*fanWaiter)
		}
		m.calls.fanout[parent] = append(q, in.ticket)
	} else if in.ticket.woken { // woken, and beaten to the slot: wait again
		in.ticket.ch, in.ticket.woken = make(chan struct{}), false
	}
	return in.ticket.ch, nil
}

// leaveFanout takes launch in out of its parent's queue, and lets the
// next one look if there is room. m.mu is held.
func (m *Manager) leaveFanout(in *launchIn) {
	parent := in.info.parent
	q := slices.DeleteFunc(m.calls.fanout[parent], func(w *fanWaiter) bool { return w == in.ticket })
	in.ticket = nil
	if len(q) == 0 {
		delete(m.calls.fanout, parent)
		return
	}
	m.calls.fanout[parent] = q
	m.wakeFanout(parent)
}

// wakeFanout lets the first Launch waiting for a slot of parent look
// again, if one is free. m.mu is held.
func (m *Manager) wakeFanout(parent string) {
	q := m.calls.fanout[parent]
	if len(q) == 0 || m.led.liveBy[parent] >= m.cfg.tree.MaxPerParent || q[0].woken {
		return
	}
	q[0].woken = true
	close(q[0].ch)
}

// runSession is the session of the run of this Manager that ctx carries
// (a FuncHost or Spec.Run function's, a PromptSession's), or "".
func (m *Manager) runSession(ctx context.Context) string {
	v, ok := ctx.Value(runKey{}).(*runValue)
	if !ok || v.e == nil || (v.kind != callRun && v.kind != callPrompt) {
		return ""
	}
	m.mu.Lock()
	defer m.unlock()
	if m.led.tasks[v.ref.TaskID] != v.e { // another Manager's run, or one forgotten
		return ""
	}
	for i := len(v.e.attempts) - 1; i >= 0; i-- {
		if a := &v.e.attempts[i]; a.Token == v.ref.Token {
			return a.SessionID
		}
	}
	return ""
}

// Run launches spec and waits for its end: a synchronous subagent. Its
// error is nil only for a clean answer (Outcome.State completed): else it
// is why not — the task's Cause (a *StopError, the host's or function's
// error, a *PanicError), or its Outcome's Reason — in plain words a model
// may read; the task's final snapshot comes with it. A launch refused
// returns the Launch's error and a zero Task.
//
// When ctx ends first, the task is stopped with everything beneath it, as
// its caller's (StopCaller), and Run still returns its real end —
// cancelled once its child really stopped — with an error that matches
// ctx's and says the stop. An abort the host refuses leaves the task running: Run then
// returns its snapshot as it is, with ctx's error and the host's. The
// wait for the stop is bounded by the Manager's life (Shutdown), not by
// ctx.
//
// Run is Launch (the same Spec, nested beneath the run ctx carries, as
// Launch does) then Wait; a Spec with ExtendLive is refused (it may
// extend a task that another caller waits for).
func (m *Manager) Run(ctx context.Context, spec Spec) (Task, error) {
	ctx = orBackground(ctx)
	if spec.ExtendLive {
		return Task{}, &SpecError{Field: "ExtendLive", Reason: "cannot be used with Run: it may extend a task another caller launched"}
	}
	t, err := m.Launch(ctx, spec)
	if err != nil {
		var du *DurabilityUnknownError
		if !errors.As(err, &du) { // one whose durability is unknown was launched: it is stopped below
			return t, err
		}
	}
	done, err := m.Wait(ctx, t.ID)
	if err == nil {
		return done, endError(done)
	}
	if ctx.Err() == nil {
		return done, err
	}
	cause := ctx.Err()
	bg := context.WithoutCancel(ctx)
	if _, serr := m.closeTask(bg, t.ID, closedByCaller, "", false); serr != nil && !errors.Is(serr, ErrStopPending) {
		now, terr := m.Task(t.ID)
		if terr != nil {
			now = done
		}
		return now, fmt.Errorf("%w: %w", serr, cause)
	}
	if done, err = m.Wait(bg, t.ID); err != nil {
		return done, fmt.Errorf("%w: %w", err, cause)
	}
	if err := endError(done); err != nil {
		return done, fmt.Errorf("%w: %w", err, cause) // one line: "stopped: the caller of task t-1 went away: context canceled"
	}
	return done, cause
}

// endError is why ended task t gave no clean answer, or nil if it did (see
// Run).
func endError(t Task) error {
	switch {
	case t.Outcome != nil && t.Outcome.State == StatusCompleted:
		return nil
	case t.Cause != nil:
		return t.Cause
	case t.Outcome != nil && t.Outcome.Reason != "":
		if t.Outcome.Error != "" {
			return fmt.Errorf("%w: %s", t.Outcome.Reason, t.Outcome.Error)
		}
		return t.Outcome.Reason
	case t.Error != "":
		return errors.New(t.Error)
	}
	return errors.New("the task ended " + string(t.Status) + " with no answer")
}
