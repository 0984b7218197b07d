package bgtask

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Invocations and the children gate.
//
// Every prompt sent into a task's child conversation is an invocation: the
// launch prompt is 1, Extend admits the next. A turn end answers every
// invocation up to the last it had seen that has no answer yet; answers are
// released in invocation order, each once (to WaitAnswer, and as a parent
// notification: NotifyAnswer, or the final summary for the last); the task
// ends only once its last admitted invocation is answered. A task that is
// never extended carries no invocation state: its turn end is its end.

// Extend sends prompt into the running task's child conversation as its
// next invocation and returns the invocation's number (the launch prompt
// is 1). The host must implement Prompter; the prompt is queued for the
// child's next turn, not interrupting the one in flight. Extends of one
// task are admitted one at a time, in the order they arrive, and each host
// prompt call is made only after the one before it returned. An Extend
// that cannot be admitted changes nothing and says why: ErrNotRunning (the
// task ended, has no session yet, or is being stopped), ErrShutdown,
// ErrBranchClosing, errors.ErrUnsupported (the Host is no Prompter), ErrPromptRefused (wrapping the host's
// error), ErrUnknownTask or ErrForgotten, or ctx's error while it waited
// its turn.
// An Extend never starts a run. Its answer: WaitAnswer.
func (m *Manager) Extend(ctx context.Context, taskID, prompt string) (int, error) {
	return m.extend(ctx, taskID, prompt, "")
}

// extend is Extend; notice, if set, rides the invocation's answer.
func (m *Manager) extend(ctx context.Context, taskID, prompt, notice string) (int, error) {
	ctx = orBackground(ctx)
	switch {
	case ctx.Err() != nil:
		return 0, ctx.Err()
	case blank(taskID):
		return 0, fmt.Errorf("%w: Extend with no task id", ErrInvalidArgument)
	case blank(prompt):
		return 0, fmt.Errorf("%w: Extend with an empty prompt", ErrInvalidArgument)
	}
	if err := m.poisoned(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	e := m.led.tasks[taskID]
	if e == nil {
		err := m.missing(taskID)
		m.unlock()
		return 0, err
	}
	p, ok := m.hosts.main.(Prompter)
	if e.info.inProcess {
		p, ok = m.hosts.funcs, true // its own function takes prompts as a FuncHost's does
	}
	if !ok {
		m.unlock()
		return 0, errNoPrompter
	}
	if e.terminal() { // no turn to wait for
		m.unlock()
		return 0, fmt.Errorf("%w: task %s is %s", ErrNotRunning, e.id, e.state)
	}
	lane, err := m.takeTurn(ctx, e) // unlocks m.mu
	if err != nil {
		return 0, err
	}
	defer m.passTurn(e, lane)
	// The call's context ends with the caller's, when the run it prompts
	// ends (its answer could change nothing: the core cancels it then),
	// and at Shutdown, as every host call's does.
	callCtx, cancel := context.WithCancel(m.life.ctx)
	defer cancel()
	if ctx.Done() != nil { // a caller that can give up
		defer context.AfterFunc(ctx, cancel)()
	}
	in := extendIn{e: e, prompt: prompt, notice: notice, actor: ActorOf(ctx), cancel: cancel}
	if err := m.step(&in); err != nil { // it records nothing: the admission is recorded once the host took the prompt
		return 0, err
	}
	if in.err != nil {
		return 0, in.err
	}
	in.done = true
	in.hostErr = m.callPrompt(withRunOf(callCtx, e, in.req, in.values), p, in.req)
	if err := m.stepCtx(ctx, &in); err != nil {
		return 0, durabilityUnknown(err, "Extend", e.id)
	}
	return in.n, in.err
}

// takeTurn waits, in arrival order, for e's Extend turn and returns the
// lane holding it; the caller passes it on (passTurn). m.mu is held, and
// released.
func (m *Manager) takeTurn(ctx context.Context, e *entry) (*promptLane, error) {
	if m.calls.prompts == nil {
		m.calls.prompts = make(map[*entry]*promptLane)
	}
	lane := m.calls.prompts[e]
	if lane == nil {
		lane = &promptLane{}
		m.calls.prompts[e] = lane
	}
	lane.users++
	if !lane.busy {
		lane.busy = true
		m.unlock()
		return lane, nil
	}
	handed := make(chan struct{})
	lane.waiters = append(lane.waiters, handed)
	m.unlock()
	err := m.parkOn(ctx, handed)
	if err == nil {
		return lane, nil
	}
	m.mu.Lock()
	if i := slices.Index(lane.waiters, handed); i >= 0 {
		lane.waiters = slices.Delete(lane.waiters, i, i+1)
		m.leaveLane(e, lane)
	} else { // handed the turn as ctx ended: on to the next
		m.handOn(e, lane)
	}
	m.unlock()
	return nil, err
}

// passTurn gives e's Extend turn to the next waiting Extend, if any.
func (m *Manager) passTurn(e *entry, lane *promptLane) {
	m.mu.Lock()
	m.handOn(e, lane)
	m.unlock()
}

// handOn passes the turn of lane, held by a leaving Extend, to the first
// waiter. m.mu is held.
func (m *Manager) handOn(e *entry, lane *promptLane) {
	if len(lane.waiters) > 0 {
		close(lane.waiters[0]) // its owner now
		lane.waiters = lane.waiters[1:]
	} else {
		lane.busy = false
	}
	m.leaveLane(e, lane)
}

// leaveLane counts an Extend out of lane; an ended task's last one takes
// the lane away (a live task keeps it for the next Extend). m.mu is held.
func (m *Manager) leaveLane(e *entry, lane *promptLane) {
	if lane.users--; lane.users == 0 && e.terminal() {
		delete(m.calls.prompts, e)
	}
}

// callPrompt calls the host's PromptSession, which is user code: a panic
// is its refusal.
func (m *Manager) callPrompt(ctx context.Context, p Prompter, req PromptRequest) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("Host.PromptSession panicked: %s", panicText(r))
		}
	}()
	return guardError(p.PromptSession(ctx, req))
}

// WaitAnswer waits for the answer of invocation n of a task (1 is its
// launch prompt) and returns it. Answers are released in invocation order:
// n's answer is returned only once every invocation before it has its
// own. ErrInvalidArgument if the task never admitted invocation n.
func (m *Manager) WaitAnswer(ctx context.Context, taskID string, n int) (Answer, error) {
	ctx = orBackground(ctx)
	for {
		m.mu.Lock()
		e := m.led.tasks[taskID]
		if e == nil {
			err := m.missing(taskID)
			m.unlock()
			return Answer{}, err
		}
		admitted := 1
		if e.inv != nil {
			admitted = len(e.inv.list)
		}
		switch {
		case n < 1 || (n > admitted && e.terminal()):
			m.unlock()
			return Answer{}, fmt.Errorf("%w: task %s has no invocation %d", ErrInvalidArgument, taskID, n)
		case e.inv != nil && e.inv.released(n):
			a := *e.inv.list[n-1].Answer
			a.Notices = slices.Clone(a.Notices)
			err := m.settle(ctx, e.seq)
			m.unlock()
			if err != nil {
				return Answer{}, err
			}
			return a, nil
		case e.inv == nil && n == 1 && e.terminal():
			t := e.project()
			err := m.settle(ctx, e.seq)
			m.unlock()
			if err != nil {
				return Answer{}, err
			}
			return answerOfTask(t), nil
		}
		changed := e.waitChange()
		m.unlock()
		if err := m.await(ctx, changed); err != nil {
			return Answer{}, err
		}
	}
}

// answerOfTask is the answer of a task that was never extended: its
// outcome.
func answerOfTask(t Task) Answer {
	o := t.Outcome
	a := Answer{Invocation: 1, Status: o.State, Text: o.Error, Degraded: slices.ContainsFunc(o.Notices, isDegradedNotice),
		Notices: slices.Clone(o.Notices), At: t.CompletedAt, Envelope: o.Envelope}
	if o.HasAnswer {
		a.Text = o.Answer
	}
	return a
}

// invocations is a task's invocations, once it was extended.
type invocations struct {
	list []Invocation // list[i] is invocation i+1; list[0] the launch prompt
	// answered is how many invocations from the first have their answers:
	// those are released. The ledger's writer keeps it, so neither a
	// release nor a turn end walks the list.
	answered int
}

// file records ans as the answer of invocation n (the ledger's writer).
// ans is the record's, immutable: it is shared, never written.
func (iv *invocations) file(n int, ans *Answer) {
	iv.list[n-1].Answer = ans
	for iv.answered < len(iv.list) && iv.list[iv.answered].Answer != nil {
		iv.answered++
	}
}

// turnEnd is one turn end of a run (a SessionIdle), as the gate holds it
// and as an Extend in flight keeps it until the prompt's fate is known.
type turnEnd struct {
	token  string // the run that ended the turn
	text   string
	finish string
	noText bool
	upTo   int // the last invocation the turn had seen; 0: the latest admitted
	at     time.Time
	last   bool   // the run is over (a FuncHost function returned): no turn follows
	notice string // the gate's, on a turn it released degraded, kept while the turn waits (replayEarly)
}

// released reports whether invocation n and every one before it has its
// answer: answers are released in order.
func (iv *invocations) released(n int) bool { return n >= 1 && n <= iv.answered }

// records are the records that rebuild iv: its admissions, then its
// answers (compaction).
func (iv *invocations) records(task string) []record {
	var out []record
	for _, in := range iv.list[1:] {
		adm := in
		adm.Answer = nil
		out = append(out, record{kind: recInvocationAdmitted, task: task, at: in.AdmittedAt, inv: &adm})
	}
	for _, in := range iv.list {
		if in.Answer != nil {
			filed := Invocation{N: in.N, Answer: in.Answer}
			out = append(out, record{kind: recAnswerFiled, task: task, at: in.Answer.At, inv: &filed})
		}
	}
	return out
}

// clone is the projection of iv onto a snapshot: an answer shows once it
// is released (every invocation before it has its own).
func (iv *invocations) clone() []Invocation {
	out := slices.Clone(iv.list)
	for i := range out {
		if i >= iv.answered {
			out[i].Answer = nil // filed (at a retry), not yet released
		} else if a := out[i].Answer; a != nil {
			c := *a
			c.Notices = slices.Clone(a.Notices)
			out[i].Answer = &c
		}
	}
	return out
}

// turnEnded files turn end t of e's current run and ends the task if that
// answered everything admitted. notice, when set, rides the answer (a
// degraded gate). A turn end that arrives while a prompt is in flight is
// kept until that prompt is admitted or refused (replayEarly). m.mu is
// held.
func (m *Manager) turnEnded(e *entry, t turnEnd, notice string) {
	admitted := 1
	if e.inv != nil {
		admitted = len(e.inv.list)
	}
	if t.upTo <= 0 {
		t.upTo = admitted
	}
	if lane := m.calls.prompts[e]; lane != nil && lane.inflight > 0 {
		t.notice = notice // a degraded release stays degraded when it is filed
		lane.early = append(lane.early, t)
		return
	}
	out := e.output()
	out.finish, out.noText, out.notice = t.finish, t.noText, notice
	if iv := e.inv; iv != nil {
		lastOpen := iv.list[len(iv.list)-1].Answer == nil
		o := answerOutcome(e.id, StatusCompleted, t.text, "", evidence{output: t.text, finish: t.finish, noText: t.noText, notice: notice})
		from, to := m.fileAnswers(e, min(t.upTo, admitted), o, notice != "", t.at)
		ending := m.settled(e)
		// Ending with this turn as the last invocation's answer: the final
		// summary carries it. (One filed earlier, at a retry, is told.)
		m.releaseAnswers(e, from, to, ending && lastOpen)
		if !ending {
			out.notice = "" // it rode the answers filed now, not what ends the run later
			return          // an invocation is still open: the run goes on
		}
	}
	m.finalize(e, e.cur().ID, StatusCompleted, "", t.text, t.at)
}

// fileAnswers answers every invocation of e up to upTo that has none yet
// with o, and returns the invocations whose answers that released (from,
// to: indexes into e.inv.list), since answers are released in order.
// m.mu is held.
func (m *Manager) fileAnswers(e *entry, upTo int, o *Outcome, degraded bool, at time.Time) (from, to int) {
	iv := e.inv
	from = iv.answered
	for n := from + 1; n <= upTo && n <= len(iv.list); n++ {
		if iv.list[n-1].Answer == nil && !m.fileAnswer(e, n, o, degraded, at) {
			break
		}
	}
	return from, iv.answered
}

// releaseAnswers tells the parent the answers of invocations from..to-1
// (indexes), in order, each once; with skipLast the last invocation's is
// left to the final summary, which carries it. m.mu is held.
func (m *Manager) releaseAnswers(e *entry, from, to int, skipLast bool) {
	if m.cfg.notifier == nil {
		return
	}
	iv := e.inv
	for i := from; i < to; i++ {
		if skipLast && i == len(iv.list)-1 {
			break
		}
		m.notifyOf(e, NotifyAnswer, i+1, answerText(e.id, e.info.description, *iv.list[i].Answer))
	}
}

// answerAtEnd answers every open invocation of e, which has just ended,
// with its outcome: none is left waiting. m.mu is held.
func (m *Manager) answerAtEnd(e *entry) {
	iv := e.inv
	if iv == nil || iv.released(len(iv.list)) {
		return
	}
	lastOpen := iv.list[len(iv.list)-1].Answer == nil
	t := e.project()
	from, to := m.fileAnswers(e, len(iv.list), t.Outcome, false, t.CompletedAt)
	m.releaseAnswers(e, from, to, lastOpen)
}

// answerAtRetry answers the supplemental invocations still open when e's
// run failed over to a new attempt: they were sent to the failed session,
// and the retry, which starts from the launch prompt, never receives them.
// They are released once invocation 1 is answered. m.mu is held.
func (m *Manager) answerAtRetry(e *entry, failed Attempt, why string, at time.Time) {
	iv := e.inv
	if iv == nil || len(iv.list) < 2 {
		return
	}
	text := "the run this prompt was sent to (attempt " + strconv.Itoa(failed.Number) + " on " + failed.Model.String() + ") failed: " + why + "; the retry starts from the launch prompt and never received it"
	o := answerOutcome(e.id, StatusError, "", text, evidence{reason: ReasonUnknown})
	for n := 2; n <= len(iv.list); n++ {
		if iv.list[n-1].Answer == nil && !m.fileAnswer(e, n, o, false, at) {
			return
		}
	}
}

// fileAnswer records o as the answer of invocation n of e. m.mu is held.
func (m *Manager) fileAnswer(e *entry, n int, o *Outcome, degraded bool, at time.Time) bool {
	if note := e.inv.list[n-1].Notice; note != "" { // a fact of its admission rides its answer
		c := *o
		c.Notices = append(slices.Clone(o.Notices), note)
		o = &c
	}
	// The record's invocation and its answer are made as one: the ledger
	// keeps the answer, the record only passes through.
	filed := &struct {
		inv Invocation
		ans Answer
	}{}
	ans := &filed.ans
	*ans = Answer{Invocation: n, Status: o.State, Degraded: degraded, Notices: o.Notices, At: at, Envelope: renderAnswerEnvelope(e.id, n, o)}
	if o.HasAnswer {
		ans.Text = o.Answer
	} else {
		ans.Text = o.Error
	}
	filed.inv = Invocation{N: n, Answer: ans}
	return m.commit(e, record{kind: recAnswerFiled, task: e.id, at: at, inv: &filed.inv})
}

// childrenOutstanding reports whether a task launched from e's current
// session (and not Detached) is still live, or has notifications not yet
// delivered to that session. m.mu is held.
func (m *Manager) childrenOutstanding(e *entry) bool {
	sid := e.cur().SessionID
	for _, k := range e.kids {
		if k.info.parent == sid && !k.info.opt().detached && (!k.terminal() || k.notesOut > 0) {
			return true
		}
	}
	return false
}

// childrenLive reports whether a task launched from e's current session
// (and not Detached) is still live. m.mu is held.
func (m *Manager) childrenLive(e *entry) bool {
	sid := e.cur().SessionID
	for _, k := range e.kids {
		if k.info.parent == sid && !k.info.opt().detached && !k.terminal() {
			return true
		}
	}
	return false
}

// gateHold is a turn end the children gate holds back: the candidate
// answer while tasks the child's session launched are outstanding.
type gateHold struct {
	turnEnd
	armed bool // the release watch runs: the children settled
}

// atGate decides a turn end of e's run at the children gate: while tasks
// its session launched are outstanding, the turn is held as the candidate
// (a turn that stopped at a tool call is not even that), and true says so.
// The gate is inert for a task whose sessions launched nothing. m.mu is
// held.
func (m *Manager) atGate(e *entry, t turnEnd) bool {
	if len(e.kids) == 0 {
		return false
	}
	// A run's last turn (a FuncHost function returned) is held only while
	// a task it launched is live: one that ended was the function's to
	// wait for (Wait, OnDone), not its notification's to reach it, and no
	// further turn can come.
	if !m.childrenOutstanding(e) || (t.last && !m.childrenLive(e)) {
		if e.gate != nil { // this turn, after they settled, is the answer
			e.gate = nil
			m.setActivity(e, activityNone)
		}
		return false
	}
	if idleReason(t.finish) == ReasonUnconsumedToolCall {
		return true // a pause at a tool call is never an answer
	}
	e.gate = &gateHold{turnEnd: t}
	m.setActivity(e, ActivityAwaitingChildren)
	return true
}

// taskSettled follows a task k that has ended and has no notification
// out (its final summary was delivered or given up): its parent's gate
// may open, and its Spec.OnDone is called. m.mu is held.
func (m *Manager) taskSettled(k *entry) {
	m.kidSettled(k)
	if l := k.loc; l != nil && len(l.onDone) > 0 {
		m.callOnDone(l.onDone, k.project())
		l.onDone = nil
	}
	m.led.warm = append(m.led.warm, k) // frozen at the unlock, once nothing reads it (freezeSome)
}

// callOnDone has each of hooks called with t once m.mu is released, on a
// goroutine of the Manager; a panic in one is logged. m.mu is held.
func (m *Manager) callOnDone(hooks []*func(Task), t Task) {
	for _, hook := range hooks {
		done := *hook
		m.out.later = append(m.out.later, func() {
			defer func() {
				if r := recover(); r != nil {
					m.logAttrs(slog.LevelError, "Spec.OnDone panicked", slog.String("task", t.ID), slog.String("panic", panicText(r)))
				}
			}()
			done(t)
		})
	}
}

// kidSettled follows a task k that has ended and has no notification out:
// if it was the last outstanding task of the session that launched it, and
// that session's task holds a candidate, the candidate's release watch
// starts. m.mu is held.
func (m *Manager) kidSettled(k *entry) {
	ref, ok := m.led.bySession[k.info.parent]
	if !ok || !ref.isCurrent() {
		return
	}
	e := ref.e
	g := e.gate
	if g == nil || g.armed || e.terminal() || e.cur().Token != g.token || m.childrenOutstanding(e) {
		return
	}
	g.armed = true
	if g.last { // no turn can follow the run's last: it is the answer now
		m.releaseGate(e, g, degradedNotice+"the child's run ended while tasks it launched were still running; its last turn was released once they had ended")
		return
	}
	d := m.gateTimeout()
	t := m.cfg.clock.NewTimer(d)
	done := m.runDone(e)
	m.goLater(func() {
		select {
		case <-t.C():
			m.step(&gateCheckIn{e: e, g: g})
		case <-done:
			t.Stop()
		case <-m.life.ctx.Done():
			t.Stop()
		}
	})
}

// gateTimeout is how long a candidate waits for a further turn once the
// children settled: WithGateTimeout, else the stall timeout, else 10
// minutes.
func (m *Manager) gateTimeout() time.Duration {
	switch {
	case m.cfg.gateTimeout > 0:
		return m.cfg.gateTimeout
	case m.cfg.stallTimeout > 0:
		return m.cfg.stallTimeout
	}
	return defaultGateTimeout
}

// defaultGateTimeout is how long the children gate waits, by default, for
// a turn after the tasks a child launched settled, before it releases the
// turn it held, degraded.
const defaultGateTimeout = 10 * time.Minute

// onGateCheck releases the candidate g of e, degraded, if no turn came
// since the children settled. m.mu is held.
func (m *Manager) onGateCheck(in *gateCheckIn) {
	e, g := in.e, in.g
	if e.gate != g || e.terminal() || e.cur().Token != g.token || e.state != StatusRunning {
		return
	}
	if m.childrenOutstanding(e) {
		g.armed = false // launched another meanwhile: its settling arms the watch again
		return
	}
	m.releaseGate(e, g, degradedNotice+"the children gate released the child's last turn; no further turn came within "+m.gateTimeout().String()+" after the tasks it launched had ended")
}

// degradedNotice starts the notice of every answer the children gate
// released without a turn (Answer.Degraded): an outcome's notices say by it
// whether its answer was.
const degradedNotice = "degraded: "

// isDegradedNotice reports whether notice is the children gate's, on an
// answer it released degraded.
func isDegradedNotice(notice string) bool { return strings.HasPrefix(notice, degradedNotice) }

// releaseGate files g, the turn the children gate held, as the answer,
// with notice. m.mu is held.
func (m *Manager) releaseGate(e *entry, g *gateHold, notice string) {
	e.gate = nil
	m.setActivity(e, activityNone)
	t := g.turnEnd
	t.at = m.now()
	m.turnEnded(e, t, notice)
}

// onExtend decides an Extend of in.e: before the host call, whether the
// prompt may be sent and as which invocation (the task's run is running,
// no stop was asked, no closure fences it); after it, the admission
// record, or nothing when the host refused (the task may then end, if it
// waited only for this). m.mu is held.
func (m *Manager) onExtend(in *extendIn) (int, error) {
	e := in.e
	lane := m.calls.prompts[e]
	if !in.done {
		switch {
		case e.terminal():
			return 0, fmt.Errorf("%w: task %s is %s", ErrNotRunning, e.id, e.state)
		case e.state != StatusRunning:
			return 0, fmt.Errorf("%w: task %s has no session yet (%s)", ErrNotRunning, e.id, e.state)
		case e.stop != "":
			return 0, fmt.Errorf("%w: task %s is being stopped", ErrNotRunning, e.id)
		case m.life.closing:
			return 0, ErrShutdown
		case m.inClosingBranch(e):
			return 0, fmt.Errorf("%w: task %s is inside a branch being closed", ErrBranchClosing, e.id)
		}
		n := 2
		if e.inv != nil {
			n = len(e.inv.list) + 1
		}
		a := e.cur()
		in.req = PromptRequest{TaskID: e.id, AttemptID: a.ID, Token: a.Token, SessionID: a.SessionID, Invocation: n, Prompt: in.prompt}
		in.values = e.values()
		lane.stopCall = in.cancel
		lane.inflight++
		return n, nil
	}
	lane.inflight--
	lane.stopCall = nil
	early := lane.early
	lane.early = nil
	defer m.replayEarly(e, early) // whatever became of the prompt
	a, now := e.cur(), m.now()
	switch {
	case in.hostErr != nil:
		return 0, fmt.Errorf("%w: %w", ErrPromptRefused, in.hostErr)
	case e.terminal() || a.Token != in.req.Token:
		return 0, fmt.Errorf("%w: the run of task %s ended before the prompt was admitted", ErrNotRunning, e.id)
	}
	inv := Invocation{N: in.req.Invocation, Prompt: in.prompt, AdmittedAt: now, Notice: in.notice, Actor: in.actor}
	if !m.commit(e, record{kind: recInvocationAdmitted, task: e.id, at: now, attempt: *a, inv: &inv}) {
		return 0, fmt.Errorf("%w: the ledger refused the invocation", ErrNotRunning)
	}
	return inv.N, nil
}

// replayEarly files, in order, the turn ends that arrived while a prompt
// was in flight, now that the prompt's fate is known. m.mu is held.
func (m *Manager) replayEarly(e *entry, early []turnEnd) {
	for _, t := range early {
		if !e.terminal() && e.cur().Token == t.token {
			m.turnEnded(e, t, t.notice)
		}
	}
}

// settled reports whether every admitted invocation of e is answered and
// no prompt is in flight: the task may end. m.mu is held.
func (m *Manager) settled(e *entry) bool {
	if lane := m.calls.prompts[e]; lane != nil && lane.inflight > 0 {
		return false
	}
	return e.inv == nil || e.inv.released(len(e.inv.list))
}

// inClosingBranch reports whether a closure in progress covers e, without
// recording a stop. m.mu is held.
func (m *Manager) inClosingBranch(e *entry) bool {
	for c := range m.closures.active {
		if m.taskInBranch(e, c) {
			return true
		}
	}
	return false
}

// Extendable reports whether an Extend of task id can be admitted now:
// the task runs, on a session, no stop was asked of it, and what runs it
// takes prompts (a Host that is a Prompter, or the task's own function,
// Spec.Run). A page offers extend where it is true; Extend says why where
// it is not.
func (m *Manager) Extendable(id string) bool {
	m.mu.Lock()
	defer m.unlock()
	e := m.led.tasks[id]
	if e == nil || e.terminal() {
		return false
	}
	if t := e.project(); t.Status != StatusRunning || t.SessionID == "" || t.Stop != nil {
		return false
	}
	_, ok := m.hosts.main.(Prompter)
	return ok || e.info.inProcess
}
