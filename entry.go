package bgtask

import (
	"bytes"
	"context"
	"errors"
	"maps"
	"slices"
	"sync/atomic"
)

// entry is one task in the ledger: its records and their projection.
type entry struct {
	// The fields an event reads come first, on one cache line: resolving
	// an event and applying liveness to it touch nothing else.
	current  int       // index into attempts of the current attempt
	attempts []Attempt // the latest version of each attempt, in order
	state    Status    // the current attempt's status (write keeps it)
	activity Activity  // what the current run does now; a new attempt starts with none
	// The fields every closure reads come next.
	id       string   // info.id, kept beside the hot fields
	stop     Status   // a stop was asked for (recStopRequested): the status it gives; no retry follows
	stopBy   string   // who asked it: the stop record's note (stopCauseOf reads it)
	kids     []*entry // the tasks launched from any of sessions: byParent over them
	revision uint64   // number of projection changes applied
	seq      uint64   // the sequence of the latest record written to it: what a wait for it waits to be durable
	rt       runtime  // process-local run state; never in the ledger
	// hot is what only a task that may still change keeps (see hot); nil
	// once the task is frozen. Its fields are read through the entry.
	*hot
	info     *taskInfo
	sessions []string // every session indexed to one of its attempts, bound or orphaned
	// cold is, once the task settled and was frozen (freeze), its
	// attempts, sessions and evidence in one string (attempts and
	// sessions are then nil, hot is gone); "" until then. See cur, atts.
	cold string
	// outcome is computed once, at its first read after the task became
	// terminal, from the attempts and the evidence (both immutable by
	// then). Every carrier gets that value. A frozen task keeps none: its
	// reads compute it again.
	outcome *Outcome
	// notesOut counts its notifications produced and not yet delivered
	// (or given up): an ended task is kept until it is 0 (retention).
	notesOut int
	// inv holds the task's invocations once it was extended (Extend); nil
	// for a task that only ever had its launch prompt.
	inv *invocations
	// gate is the turn end held back by the children gate; nil while none
	// is (and always for a task whose sessions launched nothing).
	gate *gateHold
	// live is the token of the task's current run while it is live and no
	// stop was asked for it (nil otherwise): what Fence reads, lock-free.
	live atomic.Pointer[string]
	// loc is what only this process keeps of the task (see local); nil
	// while it keeps nothing.
	loc *local
	// skips are the models its chain skipped as they cooled
	// (recModelSkipped), in order: each moves the chain on by one.
	skips []Skip
	// acct is what it used and the budgets it spends from (usage.go);
	// nil while it reported no usage and is in no budget.
	acct *acct
}

// chainPos is the place in e's chain of attempt number n: its number
// (from 0), moved on by every model skipped, the last model reused past
// the chain's end.
func (e *entry) chainPos(n int) int {
	return min(n-1+len(e.skips), len(e.info.models)-1)
}

// modelFor is the model of e's attempt number n (see chainPos).
func (e *entry) modelFor(n int) Model { return e.info.models[e.chainPos(n)] }

// hot is the part of an entry that a task only needs while it may still
// change: what its current run reported, the room for its first attempt,
// and its final evidence until it is frozen. A frozen task gives it back
// to the ledger (spareHot), for a task launched later.
type hot struct {
	// first stores the first attempt beside the run's state, so reading
	// the current attempt of a task that never retried costs no
	// allocation of its own. attempts starts on it; a retry moves it out.
	first [1]Attempt
	seen  runSeen // what the current run reported; a closure never reads it
	// evidence is the latest final record's: when the task is terminal,
	// its current attempt's (zero: it reported none). Read it with ev.
	evidence evidence
	slot     slotHold // the concurrency slot the run holds, or its place in the queue
}

// local is what a task keeps only while this process lives, beside its
// records: never journaled, gone after a restart. Guarded by m.mu.
type local struct {
	run      RunFunc         // Spec.Run: the task's own function
	values   context.Context // Spec.InheritValues: the Launch context, for its values
	onDone   []*func(Task)   // Spec.OnDone (and those of Launches ExtendLive made Extends), until called
	stopWait func() bool     // ends the Spec.CancelWithCaller watch
	value    any             // the structured result of run valueTok (Event.Value)
	valueTok string
	err      error // the error value that ended run errTok
	errTok   string
	lines    []progressLine // the latest lines of progress (History), progressKept at most
}

// values is the Launch context whose values e's calls carry, or nil.
func (e *entry) values() context.Context {
	if e == nil || e.loc == nil {
		return nil
	}
	return e.loc.values
}

// keep returns e's process-local part, made on first use. m.mu is held.
func (e *entry) keep() *local {
	if e.loc == nil {
		e.loc = new(local)
	}
	return e.loc
}

// cur is e's current attempt. Of a frozen task it is a copy, read from
// cold: a frozen task is terminal, and nothing writes to it.
func (e *entry) cur() *Attempt {
	if e.cold != "" {
		a := e.thawAt(e.current)
		return &a
	}
	return &e.attempts[e.current]
}

// atts is e's attempts, in order: of a frozen task a new slice, read from
// cold.
func (e *entry) atts() []Attempt {
	if e.cold == "" {
		return e.attempts
	}
	r := e.coldReader()
	return r.attempts(e)
}

// count is how many attempts e made.
func (e *entry) count() int {
	if e.cold == "" {
		return len(e.attempts)
	}
	r := e.coldReader()
	return int(r.Uint())
}

// thawAt is attempt i of frozen task e.
func (e *entry) thawAt(i int) Attempt {
	r := e.coldReader()
	n := int(r.Uint())
	var a Attempt
	for j := 0; j <= i && j < n; j++ {
		a = r.attempt(e)
	}
	return a
}

// sessionList is every session indexed to one of e's attempts, in the
// order they were.
func (e *entry) sessionList() []string {
	if e.cold == "" {
		return e.sessions
	}
	var out []string
	e.eachSession(func(s string) bool {
		out = append(out, s)
		return true
	})
	return out
}

// eachAttempt calls f with each of e's attempts, in order, reading a
// frozen task's from cold as it goes (no slice made).
func (e *entry) eachAttempt(f func(i int, a *Attempt)) {
	if e.cold == "" {
		for i := range e.attempts {
			f(i, &e.attempts[i])
		}
		return
	}
	r := e.coldReader()
	for i := range int(r.Uint()) {
		a := r.attempt(e)
		f(i, &a)
	}
}

// eachSession calls f with each session indexed to one of e's attempts,
// in order, reading a frozen task's from cold as it goes; f returning
// false stops it.
func (e *entry) eachSession(f func(s string) bool) {
	if e.cold == "" {
		for _, s := range e.sessions {
			if !f(s) {
				return
			}
		}
		return
	}
	r := e.coldReader()
	var buf [4]string
	sids := buf[:0] // the attempts' sessions, which the sessions name by place
	for range r.Uint() {
		_, sid := r.skim()
		sids = append(sids, sid)
	}
	for range r.Uint() {
		var s string
		if j := r.Uint(); j == 0 {
			s = r.String()
		} else if int(j) <= len(sids) {
			s = sids[j-1]
		}
		if !f(s) {
			return
		}
	}
}

// ev is the evidence of e's latest final record (zero: none).
func (e *entry) ev() evidence {
	if e.hot != nil {
		return e.evidence
	}
	r := e.coldReader()
	r.sessions(r.attempts(e))
	return r.evidence()
}

// terminal reports whether the task has ended: its current attempt is
// terminal (a retry makes the next attempt current in the same step).
func (e *entry) terminal() bool { return e.state.Terminal() }

// attemptOf resolves an attempt id to its task and the attempt's place in
// it. The index keeps only the task (a smaller entry per attempt): the
// place is found from the current attempt back, where events mostly land.
func (l *ledger) attemptOf(id string) (attemptRef, bool) {
	e, ok := l.byAttempt[id]
	if !ok {
		return attemptRef{}, false
	}
	if e.cold == "" {
		for i := len(e.attempts) - 1; i >= 0; i-- {
			if e.attempts[i].ID == id {
				return attemptRef{e: e, index: i}, true
			}
		}
		return attemptRef{}, false // cannot happen: the index and the attempts agree
	}
	r := e.coldReader()
	for i := range int(r.Uint()) {
		if r.attempt(e).ID == id {
			return attemptRef{e: e, index: i}, true
		}
	}
	return attemptRef{}, false
}

// attemptRef locates an attempt.
type attemptRef struct {
	e     *entry
	index int
}

func (r attemptRef) attempt() *Attempt {
	if r.e.cold != "" {
		a := r.e.thawAt(r.index)
		return &a
	}
	return &r.e.attempts[r.index]
}

func (r attemptRef) isCurrent() bool { return r.e.current == r.index }

// Errors the ledger returns for refused writes. They mean a caller bug, not
// an input the user gave, and are logged at error level by the Manager.
var (
	errTerminalAttempt = errors.New("ledger: write to a terminal attempt refused")
	errNotCurrent      = errors.New("ledger: write to an attempt that is not current refused")
	errBadTransition   = errors.New("ledger: transition not allowed")
)

// reported is what the run with token reported that decides its outcome,
// for its final record; false if it reported nothing of the kind.
func (e *entry) reported(token string) (evidence, bool) {
	if e.hot == nil {
		return evidence{}, false // frozen: its run is long over
	}
	out := &e.seen.out
	if out.token != token || (out.output == "" && out.finish == "" && !out.noText && out.reason == "" && out.notice == "") {
		return evidence{}, false
	}
	return evidence{output: out.output, finish: out.finish, noText: out.noText, reason: out.reason, notice: out.notice}, true
}

// project is the one projection of an entry onto the Task snapshot: every
// task-level status field is read from the current attempt. The outcome of
// a terminal task is computed at its first projection. m.mu is held.
func (e *entry) project() Task {
	cur := e.cur()
	t := Task{
		ID:               e.info.id,
		ParentSessionID:  e.info.parent,
		Description:      e.info.description,
		Agent:            e.info.agent,
		Status:           cur.Status,
		Pending:          cur.Pending,
		SessionID:        cur.SessionID,
		Model:            cur.Model,
		StartedAt:        cur.StartedAt,
		CompletedAt:      cur.CompletedAt,
		Error:            cur.Error,
		Result:           cur.Result,
		CurrentAttemptID: cur.ID,
		Attempts:         cloneAttempts(e),
		Skips:            slices.Clone(e.skips),
		Revision:         e.revision,
		LaunchedAt:       e.info.launchedAt,
		Metadata:         maps.Clone(e.info.metadata),
		Attach:           bytes.Clone(e.info.opt().attach),
		Detached:         e.info.opt().detached,
		Activity:         e.liveActivity(),
	}
	if t.Activity != activityNone && e.hot != nil && e.seen.out.token == cur.Token {
		t.Progress = e.seen.out.progress
	}
	t.Key, t.ContinuedFrom = e.info.opt().key, e.info.opt().continues
	t.Prompt, t.Root, t.Depth = e.info.prompt, e.info.root, e.info.depth
	if l := e.loc; l != nil {
		if l.valueTok == cur.Token {
			t.Value = l.value
		}
		if l.errTok == cur.Token {
			t.Cause = l.err
		}
	}
	if e.inv != nil {
		t.Invocations = e.inv.clone()
	}
	if e.acct != nil {
		t.Usage, t.Budget = e.usage(), e.budgetState()
	}
	e.projectStop(&t)
	if e.terminal() {
		t.Outcome = e.projectOutcome(t).clone()
	}
	return t
}

// projectStop sets who asked t to stop, and the Cause a stop gives.
func (e *entry) projectStop(t *Task) {
	if e.stop != "" {
		c := stopCauseOf(e.stopBy)
		t.Stop = &c
		if t.Cause == nil && t.Status == e.stop && t.Status != StatusError {
			t.Cause = &StopError{Status: t.Status, Stop: c} // the stop ended it, as it asked
		}
	} else if t.Status == StatusCancelled && t.Cause == nil {
		// Cancelled with no stop recorded (a journal of an earlier release):
		// still never a nil Cause.
		t.Cause = &StopError{Status: t.Status, Stop: StopCause{Kind: StopOther, Note: "who asked was not recorded"}}
	}
}

// projectOutcome is a terminal task's outcome, computed at its first read
// from the attempts and the evidence (both immutable by then) and kept.
func (e *entry) projectOutcome(t Task) *Outcome {
	if e.outcome != nil {
		return e.outcome
	}
	var ev *evidence
	if x := e.ev(); x != (evidence{}) {
		ev = &x
	}
	o := outcomeOf(t, ev, e.info.sessions)
	if e.info.opt().prior != "" {
		o.withPrior(t.ID, e.info.opt().continues, e.info.opt().prior)
	}
	if e.cold == "" { // a frozen task keeps no outcome: it is computed at each read
		e.outcome = o
	}
	return o
}

// activity is what the current run does now: process-local, and only while
// it runs.
func (e *entry) liveActivity() Activity {
	if e.state != StatusRunning {
		return activityNone
	}
	return e.activity
}
