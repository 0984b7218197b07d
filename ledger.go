package bgtask

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask/internal/codec"
	"github.com/bgtask/bgtask/internal/textbound"
	"github.com/bgtask/bgtask/internal/wal"
)

// The ledger is the one source of truth: a sequence of self-contained
// records, from which every attempt and every task-level field is a
// projection. A change enters it one way, Manager.commit, which writes a
// batch of records (each checked by ledger.check: the attempt state machine
// refuses what it forbids, any write to a terminal attempt among them) and
// derives every follow-up from what was written. The record builders make
// the records from the attempts' latest versions; ledger.apply is the way
// in for a record not yet resolved to its task (a launch, a replay). Memory
// keeps the projection only; the tap sees every record as it is committed,
// which is what a journal persists, and replayLedger rebuilds the same
// projection from them.

// recordKind says what a record did.
type recordKind uint8

const (
	recTaskLaunched       recordKind = iota + 1 // a task and its spec
	recAttemptCreated                           // a new attempt, pending; it becomes current
	recAttemptPending                           // a pending attempt's reason changed
	recSessionBound                             // a pending attempt got its session and runs
	recAttemptFinal                             // an attempt reached a terminal status
	recRetryScheduled                           // the current attempt failed and the next was chosen
	recSessionOrphan                            // a session was created for an attempt no longer current
	recBranchClosed                             // a branch closure ended (manager-wide, not per task)
	recStopRequested                            // a stop of the task was asked for (which, and by whom); no retry follows
	recStopWithdrawn                            // the abort a stop asked for failed: the run goes on
	recNotifyProduced                           // a notification was produced for a parent
	recNotifyDelivered                          // the Notifier accepted a notification, or it was given up (note says why)
	recStartRequested                           // a StartSession call for the attempt is about to be made
	recAbortRequested                           // an AbortSession call for the run is about to be made
	recEpoch                                    // a process life began on this ledger (manager-wide)
	recClosureOpened                            // a branch closure began: its fence is up until it ends
	recClosureDropped                           // a closure ended with nothing to record (its root was no one's)
	recInvocationAdmitted                       // a supplemental prompt was handed to the task's child session (Extend)
	recAnswerFiled                              // a turn end answered an invocation, released in invocation order
)

var recordKindNames = [...]string{
	recTaskLaunched:       "task_launched",
	recAttemptCreated:     "attempt_created",
	recAttemptPending:     "attempt_pending",
	recSessionBound:       "session_bound",
	recAttemptFinal:       "attempt_finalized",
	recRetryScheduled:     "retry_scheduled",
	recSessionOrphan:      "session_orphaned",
	recBranchClosed:       "branch_closed",
	recStopRequested:      "stop_requested",
	recStopWithdrawn:      "stop_withdrawn",
	recNotifyProduced:     "notification_produced",
	recNotifyDelivered:    "notification_delivered",
	recStartRequested:     "start_requested",
	recAbortRequested:     "abort_requested",
	recEpoch:              "epoch",
	recClosureOpened:      "closure_opened",
	recClosureDropped:     "closure_dropped",
	recInvocationAdmitted: "invocation_admitted",
	recAnswerFiled:        "answer_filed",
}

func (k recordKind) String() string {
	if int(k) < len(recordKindNames) && recordKindNames[k] != "" {
		return recordKindNames[k]
	}
	return fmt.Sprintf("record(%d)", k)
}

// record is one immutable ledger entry: a value that stands alone. It
// carries its task's id ("" for a manager-wide record: a closure, an
// all-complete notification), a sequence number strictly increasing across
// the Manager, its kind and what its kind needs — no pointer to a live
// structure (what it points to is immutable and its own). Attempt records
// carry the whole new version of the attempt, so applying one is a
// replacement, checked against the state machine.
type record struct {
	seq     uint64
	kind    recordKind
	task    string
	at      time.Time
	attempt Attempt // attempt records, stops: the attempt (run) it concerns
	// evidence (recAttemptFinal) is what the run reported that decides its
	// outcome: inline, as most final records carry some.
	evidence evidence
	// inv (recInvocationAdmitted: the invocation, with no answer;
	// recAnswerFiled: with its answer) is inline: a round trip of Extend
	// writes two such records, and they need nothing else.
	inv *Invocation
	// *recordExt holds what only some kinds carry; attempt records, by far
	// the most, carry none.
	*recordExt
}

// recordExt is the part of a record only some kinds carry. Everything it
// points to is immutable once the record is made.
type recordExt struct {
	spec    *taskInfo      // recTaskLaunched: the whole spec
	session string         // recSessionOrphan
	note    string         // recStopRequested: who asked; recStopWithdrawn: the abort's error
	stop    Status         // recStopRequested: the status the stop gives
	closure *ClosureRecord // recBranchClosed, by value
	notice  *notice        // recNotifyProduced, recNotifyDelivered
	epoch   uint64         // recEpoch: the process life's number
	opened  uint64         // recBranchClosed, recClosureDropped: the sequence of the closure's opening record
}

// noExt is the extension of a record that has none, for encoding one whose
// only extended field is inline (record.inv). Never written to.
var noExt recordExt

// evidence is what a run reported that decides its outcome, kept in its
// final record: its last output, how its turn ended, and the reason of the
// failure that ended it (worked out outside the lock).
type evidence struct {
	output string
	finish FinishReason
	noText bool
	reason Reason
	notice string // a fact that rides the answer (the children gate released it degraded)
}

// notice is a notification as the ledger records it: what was produced for
// whom (the text as rendered), or, delivered, only its sequence.
type notice struct {
	id         string // Notification.ID: stable across restarts
	seq        uint64 // Notification.Seq
	kind       NotificationKind
	parent     string
	text       string
	attempt    string   // retry notifications: the attempt the task had just made current
	tasks      []string // NotifyAllComplete: the round's tasks, in the order given
	invocation int      // NotifyAnswer: the invocation answered
	closure    uint64   // NotifyBranchClosed: the sequence of its closure record
}

// taskInfo is what a task was launched with; it never changes.
type taskInfo struct {
	id          string
	parent      string
	description string
	agent       string
	prompt      string
	models      []Model
	maxAttempts int // resolved: > 0
	metadata    map[string]string
	launchedAt  time.Time
	// x is what only some specs set (read it with opt, write it with
	// extra): nil when the spec set none of it, which most do not.
	x *taskExtra
	// Worked out as the launch is applied, then recorded with it: the
	// session at the top of the task's tree, and its depth in it (1:
	// launched from a session no task owns).
	root  string
	depth int
}

// taskExtra is the part of a task's spec that only some specs set.
type taskExtra struct {
	key       string // Spec.Key: one live task per key
	continues string // Spec.ContinueFrom: the ended task whose session it resumes
	resume    string // that task's session, resumed by the first attempt
	prior     string // that task's output, reported once as prior output
	// Spec.Timeout, Spec.AttemptTimeout, Spec.RetryOnTimeout: the task's
	// and each run's wall-clock deadline (0: none).
	timeout, attemptTimeout time.Duration
	retryOnTimeout          bool
}

// noExtra is the taskExtra of a spec that set none of it. Never written.
var noExtra taskExtra

// opt is ti's optional part, to read (zero values when the spec set none).
func (ti *taskInfo) opt() *taskExtra {
	if ti.x == nil {
		return &noExtra
	}
	return ti.x
}

// extra is ti's optional part, to write while the task is being made.
func (ti *taskInfo) extra() *taskExtra {
	if ti.x == nil {
		ti.x = new(taskExtra)
	}
	return ti.x
}

// roomFor is the room to make, at once, for the attempts of a task that
// may make n of them: n, up to a few.
func roomFor(n int) int { return min(n, 8) }

// check refuses a spec no launch makes (a journal bgtask did not write):
// a task needs a model and at least one attempt, and its place in its
// tree and its deadlines are not negative.
func (ti *taskInfo) check() error {
	switch {
	case len(ti.models) == 0:
		return errors.New("bgtask: ledger: a task launched with no model")
	case ti.maxAttempts < 1:
		return fmt.Errorf("bgtask: ledger: a task launched with %d attempts at most", ti.maxAttempts)
	case ti.depth < 0:
		return fmt.Errorf("bgtask: ledger: a task launched at depth %d", ti.depth)
	case ti.opt().timeout < 0 || ti.opt().attemptTimeout < 0:
		return errors.New("bgtask: ledger: a task launched with a negative timeout")
	}
	return nil
}

// modelFor returns the model of attempt number n (1-based): the chain in
// order, the last model reused past its end.
func (ti *taskInfo) modelFor(n int) Model {
	return ti.models[min(n, len(ti.models))-1]
}

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
}

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
	values   context.Context // Spec.InheritValues: the Launch context, for its values
	onDone   []*func(Task)   // Spec.OnDone (and those of Launches ExtendLive made Extends), until called
	stopWait func() bool     // ends the Spec.CancelWithCaller watch
	value    any             // the structured result of run valueTok (Event.Value)
	valueTok string
	err      error // the error value that ended run errTok
	errTok   string
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
	errTerminalAttempt = errors.New("bgtask: ledger: write to a terminal attempt refused")
	errNotCurrent      = errors.New("bgtask: ledger: write to an attempt that is not current refused")
	errBadTransition   = errors.New("bgtask: ledger: transition not allowed")
)

// ledger holds every task and the indexes that resolve events.
type ledger struct {
	seq       uint64
	ids       IDGenerator
	tasks     map[string]*entry
	byAttempt map[string]*entry     // attemptID → its task (attemptOf finds the attempt)
	bySession map[string]attemptRef // sessionID → the attempt it was created for
	byParent  map[string][]*entry   // parent sessionID → the tasks launched from it
	byKey     map[string]*entry     // Spec.Key → the last task launched with it (live or not)
	byRoot    map[string][]*entry   // root session → the tasks of its tree, in launch order
	byMeta    map[string][]*entry   // metaKey(k, v) → the tasks with that metadata, in launch order
	closures  []record              // recBranchClosed records, in order
	// tap, when set, sees every record as it is committed, in sequence
	// order (the Manager's journal batch). It is called with the Manager's
	// lock held.
	tap     func(record)
	keepLog bool     // recordAll: keep every record in log (tests)
	log     []record // what recordAll keeps
	// widened counts the records that can widen a branch or start a run:
	// a launch, a new attempt, a session indexed. A closure whose last scan
	// saw the same count knows a new scan would find the same runs.
	widened uint64

	// Retention: the ended tasks still in memory, oldest end first; the
	// live tasks per parent session and per root session; the ids of
	// forgotten tasks (bounded, oldest dropped first).
	ended         []*entry
	liveBy        map[string]int
	liveRoot      map[string]int
	tombs         map[string]struct{}
	tombOrder     []string
	forgotten     uint64 // tasks forgotten, ever (a journal is compacted as they add up)
	notesOut      int    // notifications out for tasks in memory: the sum of their notesOut
	compactedAt   uint64 // forgotten at the last compaction
	compactQueued bool   // a compaction is queued (an effect)

	// Freezing (freeze): the settled tasks not yet frozen, and the hot
	// parts frozen tasks gave back, for tasks launched later.
	warm     []*entry
	spareHot []*hot
	coldBuf  []byte // freeze's scratch buffer
	// lastChain is the model chain of the latest launch: a launch with
	// the same chain (most of a harness's) shares it (chain).
	lastChain []Model
}

func newLedger(ids IDGenerator) *ledger {
	return &ledger{
		ids:       ids,
		tasks:     make(map[string]*entry),
		byAttempt: make(map[string]*entry),
		bySession: make(map[string]attemptRef),
		byParent:  make(map[string][]*entry),
		byKey:     make(map[string]*entry),
		byRoot:    make(map[string][]*entry),
		byMeta:    make(map[string][]*entry),
		liveRoot:  make(map[string]int),
		liveBy:    make(map[string]int),
		tombs:     make(map[string]struct{}),
	}
}

// live is the live task launched with key, or nil.
func (l *ledger) live(key string) *entry {
	if key == "" {
		return nil
	}
	if o := l.byKey[key]; o != nil && o.current >= 0 && !o.terminal() {
		return o
	}
	return nil
}

// liveEnded counts live task e out of its parent's and its root's.
func (l *ledger) liveEnded(e *entry) {
	countDown(l.liveBy, e.info.parent)
	countDown(l.liveRoot, e.info.root)
}

// launchedLive reports whether one of e's sessions launched a task that is
// still live: e stays in memory, its tree whole (a closure walks it, a
// launch from its session is counted deeper in it).
func (l *ledger) launchedLive(e *entry) bool {
	live := false
	e.eachSession(func(s string) bool {
		live = l.liveBy[s] > 0
		return !live
	})
	return live
}

// taken reports whether a task the ledger knows has id: in memory, or
// forgotten lately (a tombstone).
func (l *ledger) taken(id string) bool {
	_, known := l.tasks[id]
	_, gone := l.tombs[id]
	return known || gone
}

// countDown takes one from counts[k], deleting it at 0.
func countDown(counts map[string]int, k string) {
	if n := counts[k] - 1; n > 0 {
		counts[k] = n
	} else {
		delete(counts, k)
	}
}

// lineage is where a task launched from session parent sits: the root
// session of its tree and its depth (1 when no task owns parent).
func (l *ledger) lineage(parent string) (root string, depth int) {
	if ref, ok := l.bySession[parent]; ok {
		return ref.e.info.root, ref.e.info.depth + 1
	}
	return parent, 1
}

// metaKey is the byMeta key of one metadata pair.
func metaKey(k, v string) string { return k + "\x00" + v }

// replayOne applies one replayed record: the kinds that change no task
// are numbered, a closure record is kept, the rest are applied (the entry
// they concern is returned). What a journal bgtask did not write may say
// anything: a record is refused unless it carries what its kind needs.
func (l *ledger) replayOne(rec record) (*entry, error) {
	switch rec.kind {
	case recNotifyProduced, recNotifyDelivered, recStartRequested, recAbortRequested, recEpoch, recClosureOpened, recClosureDropped:
		l.stamp(&rec)
		return nil, nil
	case recBranchClosed:
		if rec.recordExt == nil || rec.closure == nil {
			return nil, errors.New("bgtask: ledger: a closure record must carry its closure")
		}
		l.stamp(&rec)
		l.closures = append(l.closures, rec)
		return nil, nil
	case recSessionBound, recSessionOrphan:
		if err := l.checkTree(rec); err != nil {
			return nil, err
		}
	}
	return l.apply(rec)
}

// checkTree refuses a replayed bind (or orphan) of a session to a task
// that the session launched, or launched an ancestor of: the task would
// be its own descendant, and wait for its own end (the children gate)
// forever. A host that hands out such a session is broken; a journal that
// holds one is not a tree.
func (l *ledger) checkTree(rec record) error {
	sid := rec.attempt.SessionID
	if rec.kind == recSessionOrphan {
		if rec.recordExt == nil {
			return nil // check refuses it
		}
		sid = rec.session
	}
	x := l.tasks[rec.task]
	for range len(l.tasks) { // up the tree, by the sessions that launched each task
		if x == nil {
			return nil
		}
		if x.info.parent == sid {
			return fmt.Errorf("bgtask: ledger: session %q launched task %s, an ancestor of the task it would run (or itself)", sid, x.id)
		}
		ref, ok := l.bySession[x.info.parent]
		if !ok {
			return nil
		}
		x = ref.e
	}
	return nil
}

// drop takes back a task just opened whose first attempt could not be
// written (a bug, logged): nothing may see a task without an attempt.
func (l *ledger) drop(e *entry) {
	delete(l.tasks, e.id)
	l.liveEnded(e)
	l.unindex(e)
	if ref, ok := l.bySession[e.info.parent]; ok {
		if k := ref.e.kids; len(k) > 0 && k[len(k)-1] == e {
			ref.e.kids = k[:len(k)-1]
		}
	}
}

// unindex takes e out of the indexes of its launch: under its parent (and
// its parent task's kids), its root, its metadata.
func (l *ledger) unindex(e *entry) {
	drop := func(index map[string][]*entry, k string) {
		if rest := without(index[k], e); len(rest) > 0 {
			index[k] = rest
		} else {
			delete(index, k)
		}
	}
	drop(l.byParent, e.info.parent)
	drop(l.byRoot, e.info.root)
	for k, v := range e.info.metadata {
		drop(l.byMeta, metaKey(k, v))
	}
	if ref, ok := l.bySession[e.info.parent]; ok {
		ref.e.kids = without(ref.e.kids, e)
	}
}

// recordClosure appends a branch closure's record, by value: cr is the
// record's own (its slices are not shared with anything that changes).
func (l *ledger) recordClosure(cr ClosureRecord, task string, opened uint64) {
	rec := record{kind: recBranchClosed, task: task, at: cr.At, recordExt: &recordExt{closure: &cr, opened: opened}}
	l.stamp(&rec)
	l.closures = append(l.closures, rec)
}

// emit commits a record that changes no projection (a notification
// produced or delivered): it is numbered and handed to the tap, and not
// kept in memory.
func (l *ledger) emit(rec record) uint64 {
	if !l.recording() {
		return 0
	}
	l.stamp(&rec)
	return rec.seq
}

// recording reports whether committed records go anywhere (a journal, a
// test's log): records that change no projection are made only then.
func (l *ledger) recording() bool { return l.tap != nil || l.keepLog }

// stamp numbers rec (a replayed record keeps its number) and hands it to
// the tap.
func (l *ledger) stamp(rec *record) {
	if rec.seq == 0 {
		l.seq++
		rec.seq = l.seq
	} else {
		l.seq = max(l.seq, rec.seq)
	}
	if l.keepLog {
		l.log = append(l.log, *rec)
	}
	if l.tap != nil {
		l.tap(*rec)
	}
}

// apply validates rec, appends it and updates the projection: the only
// way in for a record whose task and attempt are not yet resolved (a
// launch, a replayed journal). The helpers resolve once and call write.
func (l *ledger) apply(rec record) (*entry, error) {
	if rec.task == "" {
		return nil, errors.New("bgtask: ledger: a record to resolve must name its task")
	}
	var e *entry
	if rec.kind == recTaskLaunched {
		if rec.recordExt == nil || rec.spec == nil || rec.spec.id != rec.task {
			return nil, errors.New("bgtask: ledger: a launch record must carry its task's spec")
		}
		if err := rec.spec.check(); err != nil {
			return nil, err
		}
		if _, dup := l.tasks[rec.task]; dup {
			return nil, fmt.Errorf("bgtask: task id %q is already in use", rec.task)
		}
		if o := l.live(rec.spec.opt().key); o != nil { // the invariant, for a replay too
			return nil, &KeyHeldError{Key: rec.spec.opt().key, TaskID: o.id}
		}
		rec.spec.models = l.chain(rec.spec.models)
		e = &entry{id: rec.spec.id, info: rec.spec, current: -1, hot: l.newHot()}
		if rec.spec.depth == 0 { // a new launch, or a record of format 2: its parent is in memory
			rec.spec.root, rec.spec.depth = l.lineage(rec.spec.parent)
		}
		l.liveBy[rec.spec.parent]++ // it ends with its terminal attempt (ended, or a replay's count below)
		l.liveRoot[rec.spec.root]++
		e.attempts = e.first[:0]
		l.tasks[rec.task] = e
		if k := rec.spec.opt().key; k != "" {
			l.byKey[k] = e
		}
		l.byParent[rec.spec.parent] = append(l.byParent[rec.spec.parent], e)
		l.byRoot[rec.spec.root] = append(l.byRoot[rec.spec.root], e)
		for k, v := range rec.spec.metadata {
			l.byMeta[metaKey(k, v)] = append(l.byMeta[metaKey(k, v)], e)
		}
		if ref, ok := l.bySession[rec.spec.parent]; ok {
			ref.e.kids = append(ref.e.kids, e)
		}
		return e, l.write(e, attemptRef{}, &rec)
	}
	e = l.tasks[rec.task]
	if e == nil {
		return nil, fmt.Errorf("%w: %q", ErrUnknownTask, rec.task)
	}
	return e, l.put(e, &rec)
}

// write checks rec against e (and ref, the attempt it rewrites, if any),
// appends it and updates the projection. It is the only writer of attempts
// and indexes.
func (l *ledger) write(e *entry, ref attemptRef, rec *record) error {
	if e.cold != "" {
		l.thaw(e) // rare: a record for a frozen task (it is frozen again once it settles)
	}
	if err := l.check(e, ref, rec); err != nil {
		return err
	}
	// Attempt times carry no monotonic reading: a frozen task's (read
	// from cold) are then the very values its live attempts held.
	a := &rec.attempt
	a.StartedAt, a.CompletedAt = a.StartedAt.Round(0), a.CompletedAt.Round(0)
	rec.task = e.id
	l.stamp(rec) // handed to the tap (a journal, a test): memory keeps only the projection
	e.seq = rec.seq
	switch rec.kind {
	case recTaskLaunched, recAttemptCreated, recSessionBound, recSessionOrphan:
		l.widened++
	}
	switch rec.kind {
	case recAttemptCreated:
		if len(e.attempts) == cap(e.attempts) && e.info.maxAttempts > len(e.attempts) {
			// Out of first's room: make room for every attempt the task may
			// make, once (for a few: MaxAttempts has no upper bound, and a
			// task that fails over that often grows as any slice does).
			e.attempts = append(make([]Attempt, 0, roomFor(e.info.maxAttempts)), e.attempts...)
		}
		e.attempts = append(e.attempts, rec.attempt)
		e.current = len(e.attempts) - 1
		e.state, e.activity = rec.attempt.Status, ActivityNone
		tok := rec.attempt.Token // its own copy: Fence reads it with no lock, while versions rewrite the attempt
		e.live.Store(&tok)
		l.byAttempt[rec.attempt.ID] = e
		e.revision++
	case recAttemptPending, recSessionBound, recAttemptFinal:
		e.attempts[ref.index] = rec.attempt
		if ref.index == e.current {
			e.state = rec.attempt.Status
			if e.state.Terminal() {
				e.live.Store(nil)
			}
		}
		switch rec.kind {
		case recSessionBound:
			l.indexSession(e, ref, rec.attempt.SessionID)
		case recAttemptFinal:
			e.evidence = rec.evidence
		}
		e.revision++
	case recSessionOrphan:
		l.indexSession(e, ref, rec.session)
	case recStopRequested:
		e.stop = rec.stop
		e.live.Store(nil)
	case recInvocationAdmitted:
		if e.inv == nil {
			e.inv = &invocations{list: []Invocation{{N: 1, Prompt: e.info.prompt, AdmittedAt: e.info.launchedAt}}}
		}
		e.inv.list = append(e.inv.list, *rec.inv)
		e.revision++
	case recAnswerFiled:
		e.inv.file(rec.inv.N, rec.inv.Answer)
		e.revision++
	}
	return nil
}

// indexSession resolves session to ref's attempt of e, and makes the tasks
// already launched from it e's kids.
func (l *ledger) indexSession(e *entry, ref attemptRef, session string) {
	l.bySession[session] = ref
	if e.sessions == nil {
		e.sessions = make([]string, 0, roomFor(e.info.maxAttempts)) // one per attempt, usually
	}
	e.sessions = append(e.sessions, session)
	e.kids = append(e.kids, l.byParent[session]...)
}

// check refuses a record the state machine does not allow. Terminal attempts
// are immutable: any write to one is refused here, not trusted to callers.
func (l *ledger) check(e *entry, ref attemptRef, rec *record) error {
	switch rec.kind {
	case recTaskLaunched:
		return nil
	case recAttemptCreated:
		if e.current >= 0 && !e.cur().Status.Terminal() {
			return fmt.Errorf("%w: attempt %s is still %s", errBadTransition, e.cur().ID, e.cur().Status)
		}
		if _, dup := l.byAttempt[rec.attempt.ID]; dup {
			return fmt.Errorf("bgtask: attempt id %q is already in use", rec.attempt.ID)
		}
		if rec.attempt.Status != StatusPending || rec.attempt.Number != e.count()+1 || rec.attempt.SessionID != "" {
			return fmt.Errorf("%w: a new attempt must be pending, with no session, and number %d", errBadTransition, e.count()+1)
		}
		return nil
	case recRetryScheduled:
		return nil
	case recInvocationAdmitted, recAnswerFiled:
		return checkInvocation(e, rec)
	case recStopRequested:
		if rec.recordExt == nil || !rec.stop.Terminal() || e.stop != "" {
			return fmt.Errorf("%w: a stop must name its terminal status, once", errBadTransition)
		}
		return nil
	case recStopWithdrawn:
		return nil
	}
	if ref.e != e || ref.attempt().ID != rec.attempt.ID {
		return fmt.Errorf("bgtask: ledger: unknown attempt %q", rec.attempt.ID)
	}
	old := ref.attempt()
	if rec.kind == recSessionOrphan {
		if rec.recordExt == nil || rec.session == "" {
			return errors.New("bgtask: ledger: an orphaned session must be named")
		}
		if _, taken := l.bySession[rec.session]; taken {
			return fmt.Errorf("bgtask: session %q is already indexed", rec.session)
		}
		return nil
	}
	if old.Status.Terminal() {
		return fmt.Errorf("%w: attempt %s is %s", errTerminalAttempt, old.ID, old.Status)
	}
	if !ref.isCurrent() {
		return fmt.Errorf("%w: attempt %s", errNotCurrent, old.ID)
	}
	if !canTransition(old.Status, rec.attempt.Status) {
		return fmt.Errorf("%w: %s → %s", errBadTransition, old.Status, rec.attempt.Status)
	}
	if rec.attempt.Number != old.Number || rec.attempt.Token != old.Token || rec.attempt.Model != old.Model {
		return fmt.Errorf("bgtask: ledger: attempt %s identity changed", old.ID)
	}
	if old.SessionID != "" && rec.attempt.SessionID != old.SessionID {
		return fmt.Errorf("bgtask: ledger: attempt %s is bound to session %s", old.ID, old.SessionID)
	}
	if rec.kind != recSessionBound && rec.attempt.SessionID != old.SessionID {
		return fmt.Errorf("bgtask: ledger: attempt %s: only a bind gives it a session", old.ID)
	}
	switch rec.kind {
	case recAttemptPending:
		if rec.attempt.Status != StatusPending || rec.attempt.Pending == "" {
			return fmt.Errorf("%w: a pending record must be pending with a reason", errBadTransition)
		}
	case recAttemptFinal:
		if !rec.attempt.Status.Terminal() || rec.attempt.CompletedAt.IsZero() {
			return fmt.Errorf("%w: a final record must be terminal with a completion time", errBadTransition)
		}
	case recSessionBound:
		if rec.attempt.Status != StatusRunning || old.SessionID != "" {
			return fmt.Errorf("%w: a bind must move an unbound attempt to running", errBadTransition)
		}
	}
	if rec.kind == recSessionBound {
		if rec.attempt.SessionID == "" {
			return errors.New("bgtask: ledger: bind with an empty session id")
		}
		if prev, taken := l.bySession[rec.attempt.SessionID]; taken && prev.attempt().ID != old.ID && !continues(e, prev, rec.attempt.SessionID) {
			return fmt.Errorf("bgtask: session %q already belongs to attempt %s", rec.attempt.SessionID, prev.attempt().ID)
		}
	}
	return nil
}

// continues reports whether e's first attempt may take session sid over
// from prev: sid is the session e continues (Spec.ContinueFrom), and prev
// is the ended task's attempt it belonged to.
func continues(e *entry, prev attemptRef, sid string) bool {
	return e.info.opt().resume == sid && prev.e.id == e.info.opt().continues && prev.e != e && prev.attempt().Status.Terminal()
}

// checkInvocation refuses an invocation record out of order: an admission
// must be the live task's next number, unanswered; an answer is filed once,
// for an admitted invocation.
func checkInvocation(e *entry, rec *record) error {
	if rec.inv == nil {
		return fmt.Errorf("%w: an invocation record must carry its invocation", errBadTransition)
	}
	admitted := 1
	if e.inv != nil {
		admitted = len(e.inv.list)
	}
	n := rec.inv.N
	if rec.kind == recInvocationAdmitted {
		if n != admitted+1 || rec.inv.Answer != nil || e.terminal() {
			return fmt.Errorf("%w: an invocation is admitted to a live task as number %d, unanswered", errBadTransition, admitted+1)
		}
		return nil
	}
	if rec.inv.Answer == nil || e.inv == nil || n < 1 || n > admitted || e.inv.list[n-1].Answer != nil {
		return fmt.Errorf("%w: an answer is filed once, for an admitted invocation", errBadTransition)
	}
	return nil
}

// open records a new task and returns it with the record of its first
// attempt, pending, which the caller commits at once. Ids are checked
// before anything is recorded, so a refused launch leaves no trace, and
// the first attempt's record cannot be refused.
func (l *ledger) open(info *taskInfo) (*entry, record, error) {
	if _, dup := l.tasks[info.id]; dup || info.id == "" {
		return nil, record{}, fmt.Errorf("bgtask: IDGenerator returned task id %q, which is empty or in use", info.id)
	}
	first, err := l.newAttempt(1, info.modelFor(1))
	if err != nil {
		return nil, record{}, err
	}
	e, err := l.apply(record{kind: recTaskLaunched, task: info.id, at: info.launchedAt, recordExt: &recordExt{spec: info}})
	if err != nil {
		return nil, record{}, err
	}
	return e, record{kind: recAttemptCreated, at: info.launchedAt, attempt: first}, nil
}

// launch is open with the first attempt written.
func (l *ledger) launch(info *taskInfo) (*entry, error) {
	e, first, err := l.open(info)
	if err != nil {
		return nil, err
	}
	return e, l.put(e, &first)
}

// newAttempt makes attempt number n, pending (awaiting session), with fresh
// ids that no attempt uses yet.
func (l *ledger) newAttempt(n int, model Model) (Attempt, error) {
	id, token, err := attemptIDs(l.ids)
	if err != nil {
		return Attempt{}, err
	}
	a := Attempt{
		ID:      id,
		Number:  n,
		Token:   token,
		Model:   model,
		Status:  StatusPending,
		Pending: PendingAwaitingSession,
	}
	if _, dup := l.byAttempt[a.ID]; dup || a.ID == "" {
		return Attempt{}, fmt.Errorf("bgtask: IDGenerator returned attempt id %q, which is empty or in use", a.ID)
	}
	if a.Token == "" {
		return Attempt{}, errors.New("bgtask: IDGenerator returned an empty run token")
	}
	return a, nil
}

// attemptIDs makes a new attempt's id and run token.
func attemptIDs(g IDGenerator) (id, token string, err error) {
	if u, ok := g.(*uuidIDs); ok {
		id, token = u.attemptIDs()
		return id, token, nil
	}
	if id, err = newID(g, IDAttempt); err == nil {
		token, err = newID(g, IDToken)
	}
	return id, token, err
}

// newID asks g (user code) for an id; a panic is an error that names it.
func newID(g IDGenerator, kind IDKind) (id string, err error) {
	defer func() {
		if r := recover(); r != nil {
			id, err = "", fmt.Errorf("bgtask: IDGenerator panicked making a %s id: %s", kind, panicText(r))
		}
	}()
	return g.NewID(kind), nil
}

// The record builders make the record of one change from the attempt's
// latest version, without writing it: Manager.commit writes what they
// make, and derives what follows. The write helpers below (setPending,
// bindSession, orphanSession, finalize, scheduleRetry) build and write in
// one step, for the ledger's own tests and for a replay.

// pendingRecord says why the current pending attempt waits now.
func (l *ledger) pendingRecord(e *entry, attemptID string, reason PendingReason, at time.Time) (record, error) {
	_, a, err := l.version(e, attemptID)
	a.Status = StatusPending
	a.Pending = reason
	return record{kind: recAttemptPending, at: at, attempt: a}, err
}

// bindRecord binds sessionID to exactly attemptID, which must be the
// current attempt and pending; the attempt runs from at.
func (l *ledger) bindRecord(e *entry, attemptID, sessionID string, at time.Time) (record, error) {
	_, a, err := l.version(e, attemptID)
	a.SessionID = sessionID
	a.Status = StatusRunning
	a.Pending = ""
	a.StartedAt = at
	return record{kind: recSessionBound, at: at, attempt: a}, err
}

// orphanRecord indexes a session that was created for attemptID after that
// attempt stopped being current, so its events resolve (and are stale).
func (l *ledger) orphanRecord(e *entry, attemptID, sessionID string, at time.Time) (record, error) {
	_, a, err := l.version(e, attemptID)
	return record{kind: recSessionOrphan, at: at, attempt: a, recordExt: &recordExt{session: sessionID}}, err
}

// finalRecord moves attemptID to a terminal status, with the evidence its
// run reported. errText is recorded for error, result for completed.
func (l *ledger) finalRecord(e *entry, attemptID string, status Status, errText, result string, at time.Time) (record, error) {
	if !status.Terminal() {
		return record{}, fmt.Errorf("%w: finalize to %s", errBadTransition, status)
	}
	_, a, err := l.version(e, attemptID)
	a.Status = status
	a.Pending = ""
	a.Error = errText
	a.Result = result
	a.CompletedAt = at
	rec := record{kind: recAttemptFinal, at: at, attempt: a}
	rec.evidence, _ = e.reported(a.Token)
	return rec, err
}

// retryRecords end the current attempt as error with errText and create
// the next attempt, pending on the next model, which becomes current: the
// final record, the retry record (carrying the failed attempt's final
// version) and the new attempt's, in the order the timeline relies on. The
// next attempt's ids are made first, so a refusal leaves nothing to write.
func (l *ledger) retryRecords(e *entry, errText string, at time.Time) ([3]record, error) {
	n := e.count() + 1
	next, err := l.newAttempt(n, e.info.modelFor(n))
	if err != nil {
		return [3]record{}, err
	}
	final, err := l.finalRecord(e, e.cur().ID, StatusError, errText, "", at)
	if err != nil {
		return [3]record{}, err
	}
	return [3]record{
		final,
		{kind: recRetryScheduled, at: at, attempt: final.attempt}, // its Error says why
		{kind: recAttemptCreated, at: at, attempt: next},
	}, nil
}

// put writes rec, which names an attempt of e (or a new one), resolving
// the attempt it rewrites.
func (l *ledger) put(e *entry, rec *record) error {
	var ref attemptRef
	switch rec.kind {
	case recAttemptPending, recSessionBound, recAttemptFinal, recSessionOrphan, recStopRequested, recStopWithdrawn:
		if e.current >= 0 && e.cur().ID == rec.attempt.ID {
			ref = attemptRef{e: e, index: e.current} // the usual case: no lookup
			break
		}
		var ok bool
		if ref, ok = l.attemptOf(rec.attempt.ID); !ok || ref.e != e {
			return fmt.Errorf("bgtask: ledger: unknown attempt %q", rec.attempt.ID)
		}
	}
	return l.write(e, ref, rec)
}

// build writes what a builder made, unless it refused.
func (l *ledger) build(e *entry) func(record, error) error {
	return func(rec record, err error) error {
		if err != nil {
			return err
		}
		return l.put(e, &rec)
	}
}

func (l *ledger) setPending(e *entry, attemptID string, reason PendingReason, at time.Time) error {
	return l.build(e)(l.pendingRecord(e, attemptID, reason, at))
}

func (l *ledger) bindSession(e *entry, attemptID, sessionID string, at time.Time) error {
	return l.build(e)(l.bindRecord(e, attemptID, sessionID, at))
}

func (l *ledger) finalize(e *entry, attemptID string, status Status, errText, result string, at time.Time) error {
	return l.build(e)(l.finalRecord(e, attemptID, status, errText, result, at))
}

// scheduleRetry writes retryRecords and returns the failed and the next
// attempt.
func (l *ledger) scheduleRetry(e *entry, errText string, at time.Time) (failed, next Attempt, err error) {
	recs, err := l.retryRecords(e, errText, at)
	if err != nil {
		return Attempt{}, Attempt{}, err
	}
	for i := range recs {
		if err := l.put(e, &recs[i]); err != nil {
			return Attempt{}, Attempt{}, err
		}
	}
	return recs[1].attempt, recs[2].attempt, nil
}

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

// version resolves attemptID of e and returns a copy of its latest version
// for a helper to modify; write checks the result.
func (l *ledger) version(e *entry, attemptID string) (attemptRef, Attempt, error) {
	ref, ok := l.attemptOf(attemptID)
	if !ok || ref.e != e {
		return attemptRef{}, Attempt{}, fmt.Errorf("bgtask: ledger: unknown attempt %q", attemptID)
	}
	return ref, *ref.attempt(), nil
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
		Revision:         e.revision,
		LaunchedAt:       e.info.launchedAt,
		Metadata:         maps.Clone(e.info.metadata),
		Activity:         e.liveActivity(),
	}
	if t.Activity != ActivityNone && e.hot != nil && e.seen.out.token == cur.Token {
		t.Progress = e.seen.out.progress
	}
	t.Key, t.ContinuedFrom = e.info.opt().key, e.info.opt().continues
	t.Prompt, t.Root, t.Depth = e.info.prompt, e.info.root, e.info.depth
	if l := e.loc; l != nil {
		if l.valueTok == cur.Token {
			t.Value = l.value
		}
		if l.errTok == cur.Token {
			t.Err = l.err
		}
	}
	if e.inv != nil {
		t.Invocations = e.inv.clone()
	}
	if e.terminal() {
		o := e.outcome
		if o == nil {
			var ev *evidence
			if x := e.ev(); x != (evidence{}) {
				ev = &x
			}
			o = outcomeOf(t, ev)
			if e.info.opt().prior != "" {
				o.withPrior(t.ID, e.info.opt().continues, e.info.opt().prior)
			}
			if e.cold == "" { // a frozen task keeps no outcome: it is computed at each read
				e.outcome = o
			}
		}
		t.Outcome = o.clone()
	}
	return t
}

// activity is what the current run does now: process-local, and only while
// it runs.
func (e *entry) liveActivity() Activity {
	if e.state != StatusRunning {
		return ActivityNone
	}
	return e.activity
}

// replayLedger rebuilds a ledger from committed records, in sequence
// order, with no host and no Manager: what a restart from a journal does.
// It returns the notifications the records say were produced.
func replayLedger(recs []record) (*ledger, []*notice, error) {
	l := newLedger(nil)
	var notes []*notice
	for _, rec := range recs {
		if rec.kind == recNotifyProduced {
			notes = append(notes, rec.notice)
		}
		if _, err := l.replayOne(rec); err != nil {
			return nil, nil, fmt.Errorf("bgtask: replay: record %d (%s): %w", rec.seq, rec.kind, err)
		}
	}
	return l, notes, nil
}

// recordAll makes l keep a copy of every record it commits, for
// checkReplay. Call it before the ledger is used.
func (l *ledger) recordAll() {
	l.keepLog = true
}

// checkReplay replays the records l committed (recordAll) into a fresh
// ledger and reports the first difference: every task, its attempts,
// outcome, envelope and timeline (as JSON; activity, process-local, left
// out), every closure record, and the text of every notification produced,
// rendered again from the replayed ledger. The caller holds what guards l.
func checkReplay(l *ledger) error {
	if !l.keepLog {
		return errors.New("bgtask: replay: the ledger kept no records (recordAll)")
	}
	// Through the journal's encoding and back: what a restart replays.
	recs := make([]record, len(l.log))
	for i := range l.log {
		enc, err := encodeRecord(&l.log[i])
		if err != nil {
			return err
		}
		if recs[i], err = decodeRecord(enc); err != nil {
			return err
		}
	}
	r, notes, err := replayLedger(recs)
	if err != nil {
		return err
	}
	if len(r.tasks) != len(l.tasks) {
		return fmt.Errorf("bgtask: replay: %d tasks, want %d", len(r.tasks), len(l.tasks))
	}
	for id, e := range l.tasks {
		re := r.tasks[id]
		if re == nil {
			return fmt.Errorf("bgtask: replay: task %s missing", id)
		}
		want, got := e.project(), re.project()
		want.Activity = ""
		if err := sameJSON("task "+id, want, got); err != nil {
			return err
		}
		if Timeline(want) != Timeline(got) {
			return fmt.Errorf("bgtask: replay: task %s: timeline differs", id)
		}
	}
	if len(r.closures) != len(l.closures) {
		return fmt.Errorf("bgtask: replay: %d closure records, want %d", len(r.closures), len(l.closures))
	}
	for i := range l.closures {
		if err := sameJSON("closure record", l.closures[i].closure, r.closures[i].closure); err != nil {
			return err
		}
	}
	for _, n := range notes {
		text, err := r.render(n)
		if err != nil {
			return err
		}
		if text != n.text {
			return fmt.Errorf("bgtask: replay: notification %d (%s): text differs:\n%s\nwant:\n%s", n.seq, n.kind, text, n.text)
		}
	}
	return nil
}

// render renders notification n again from what l holds.
func (l *ledger) render(n *notice) (string, error) {
	switch n.kind {
	case NotifyAllComplete:
		tasks := make([]Task, 0, len(n.tasks))
		for _, id := range n.tasks {
			e := l.tasks[id]
			if e == nil {
				return "", fmt.Errorf("bgtask: replay: notification %d names unknown task %s", n.seq, id)
			}
			tasks = append(tasks, e.project())
		}
		return allCompleteText(n.parent, tasks), nil
	case NotifyBranchClosed:
		for _, c := range l.closures {
			if c.seq == n.closure {
				return branchClosedText(*c.closure), nil
			}
		}
		return "", fmt.Errorf("bgtask: replay: notification %d names no closure record", n.seq)
	}
	ref, ok := l.attemptOf(n.attempt)
	if !ok {
		return "", fmt.Errorf("bgtask: replay: notification %d names unknown attempt %s", n.seq, n.attempt)
	}
	switch n.kind {
	case NotifyRetryScheduled:
		if ref.index == 0 {
			return "", fmt.Errorf("bgtask: replay: retry notification %d for a first attempt", n.seq)
		}
		return retryScheduledText(ref.e.atts()[ref.index-1], *ref.attempt()), nil
	case NotifyRetrySessionReady:
		return retrySessionReadyText(*ref.attempt()), nil
	case NotifyFinalSummary:
		return finalSummaryText(ref.e.project()), nil
	case NotifyAnswer:
		if iv := ref.e.inv; iv != nil && n.invocation >= 1 && n.invocation <= len(iv.list) && iv.list[n.invocation-1].Answer != nil {
			return answerText(ref.e.id, ref.e.info.description, *iv.list[n.invocation-1].Answer), nil
		}
		return "", fmt.Errorf("bgtask: replay: answer notification %d names no answered invocation %d", n.seq, n.invocation)
	}
	return "", fmt.Errorf("bgtask: replay: notification %d of unknown kind %q", n.seq, n.kind)
}

// sameJSON reports whether want and got marshal alike.
func sameJSON(what string, want, got any) error {
	w, err := json.Marshal(want)
	if err != nil {
		return err
	}
	g, err := json.Marshal(got)
	if err != nil {
		return err
	}
	if !bytes.Equal(w, g) {
		return fmt.Errorf("bgtask: replay: %s differs:\n got %s\nwant %s", what, g, w)
	}
	return nil
}

// recordAll makes m keep every record it commits (tests: checkReplay).
func (m *Manager) recordAll() {
	m.mu.Lock()
	defer m.unlock()
	m.led.recordAll()
}

// checkReplay is checkReplay on m's ledger, under its lock.
func (m *Manager) checkReplay() error {
	m.mu.Lock()
	defer m.unlock()
	return checkReplay(m.led)
}

// commit is the one way a change enters the ledger. It writes recs to e,
// in order (a refused record is logged as the bug it is, and ends the
// batch: the records before it stand), and derives from what was written —
// never from the caller — everything that follows: waiters wake, the run's
// slot and queue place are settled, the change is published, a retry's
// notifications are produced, a bound run's stall watch starts, and, when
// the task has just become terminal, its final summary, its done signal and
// the end of its parent's round. It reports whether every record was
// written. m.mu is held.
func (m *Manager) commit(e *entry, recs ...record) bool {
	was := e.current >= 0 && e.terminal()
	n := 0
	for i := range recs {
		if err := m.led.put(e, &recs[i]); err != nil {
			m.ledgerBug(e, err)
			break
		}
		n++
	}
	m.follow(e, was, recs[:n], n == len(recs))
	return n == len(recs)
}

// commitBuilt commits what a record builder made, unless it refused (a bug,
// logged). m.mu is held.
func (m *Manager) commitBuilt(e *entry, rec record, err error) bool {
	if err != nil {
		m.ledgerBug(e, err)
		return false
	}
	return m.commit(e, rec)
}

// follow derives what follows the records just written to e (wasTerminal:
// whether e was terminal before them; whole: the batch was written whole —
// a retry is announced only then, when its new attempt exists). m.mu is
// held.
func (m *Manager) follow(e *entry, wasTerminal bool, recs []record, whole bool) {
	visible := false
	for i := range recs {
		switch recs[i].kind {
		case recStopRequested, recSessionOrphan: // no projection a reader sees changes
		default:
			visible = true
		}
	}
	if !visible {
		return
	}
	m.touched(e)
	for i := range recs {
		switch rec := &recs[i]; rec.kind {
		case recRetryScheduled:
			if whole && m.cfg.notifier != nil { // the new attempt is current by now
				m.notify(e, NotifyRetryScheduled, retryScheduledText(rec.attempt, *e.cur()))
			}
			m.retried(e, rec.attempt)
		case recAttemptFinal:
			if m.cfg.metrics != nil && !rec.attempt.StartedAt.IsZero() {
				t, a := e.project(), rec.attempt
				m.measure(func(mt Metrics) { mt.AttemptEnded(t, a, a.CompletedAt.Sub(a.StartedAt)) })
			}
		case recSessionBound:
			m.started(e, rec.attempt)
			e.seen.lastEvent = rec.attempt.StartedAt
			if rec.attempt.Number > 1 && m.cfg.notifier != nil {
				m.notify(e, NotifyRetrySessionReady, retrySessionReadyText(rec.attempt))
			}
			if m.cfg.stallTimeout > 0 {
				m.watchStall(e, rec.attempt)
			}
			if e.info.opt().attemptTimeout > 0 {
				m.armDeadline(e, rec.attempt)
			}
		}
	}
	for i := range recs {
		if recs[i].kind == recAttemptFinal { // the run a prompt call in flight serves has ended
			if lane := m.calls.prompts[e]; lane != nil && lane.stopCall != nil {
				lane.stopCall()
			}
		}
	}
	if !wasTerminal && e.terminal() {
		m.ended(e)
	}
}

// touched wakes everyone waiting on a change of e, settles its run's slot
// and queue place, and publishes its state. m.mu is held.
func (m *Manager) touched(e *entry) {
	e.rt.sig.Change()
	m.signal()
	m.settleRun(e)
	m.publish(e)
}

// ended follows e becoming terminal: its final summary, its done signal,
// and the end of its parent's round. m.mu is held.
func (m *Manager) ended(e *entry) {
	m.endedLine(e)
	m.answerAtEnd(e)
	if lane := m.calls.prompts[e]; lane != nil && lane.users == 0 {
		delete(m.calls.prompts, e) // else the last Extend waiting on it does
	}
	if m.cfg.notifier != nil {
		m.notify(e, NotifyFinalSummary, finalSummaryText(e.project()))
	}
	e.rt.sig.End()
	m.roundEnded(e)
	l := m.led
	l.liveEnded(e)
	m.wakeFanout(e.info.parent)
	if loc := e.loc; loc != nil {
		if loc.stopWait != nil {
			loc.stopWait() // Spec.CancelWithCaller: nothing left to cancel
			loc.stopWait = nil
		}
		loc.values = nil // no call of the task is made any more: let the caller's context go
	}
	l.ended = append(l.ended, e)
	if e.notesOut == 0 {
		m.taskSettled(e)
	}
	m.sweep()
}

// Lifecycle milestones: a line at info level and a measurement each.

// launched tells of new task e. m.mu is held.
func (m *Manager) launched(e *entry) {
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "bgtask: task launched", slog.String("task", e.id), slog.String("attempt", e.cur().ID), slog.String("parent", e.info.parent),
			slog.String("models", fmt.Sprint(e.info.models)), slog.Int("depth", e.info.depth))
	}
	if m.cfg.metrics != nil {
		t, live := e.project(), m.liveTasks()
		m.measure(func(mt Metrics) { mt.TaskLaunched(t); mt.LiveTasks(live) })
	}
}

// started tells of attempt a of e, whose session now runs. m.mu is held.
func (m *Manager) started(e *entry, a Attempt) {
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "bgtask: attempt started", slog.String("task", e.id), slog.String("attempt", a.ID),
			slog.String("session", a.SessionID), slog.Int("number", a.Number), slog.String("model", a.Model.String()))
	}
	if m.cfg.metrics != nil {
		t := e.project()
		m.measure(func(mt Metrics) { mt.AttemptStarted(t, a) })
	}
}

// retried tells of failed attempt a of e failing over. m.mu is held.
func (m *Manager) retried(e *entry, a Attempt) {
	if !m.cfg.logInfo && m.cfg.metrics == nil {
		return
	}
	reason := reasonOf(errors.New(a.Error)) // our own error: no user code runs
	if out := e.seen.out; out.token == a.Token && out.reason != "" {
		reason = out.reason
	}
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "bgtask: retry scheduled", slog.String("task", e.id), slog.String("attempt", a.ID),
			slog.String("session", a.SessionID), slog.String("model", a.Model.String()), slog.String("next_model", e.cur().Model.String()),
			slog.String("reason", string(reason)), slog.String("err", a.Error))
	}
	if m.cfg.metrics != nil {
		t := e.project()
		m.measure(func(mt Metrics) { mt.RetryScheduled(t, a, reason) })
	}
}

// endedLine tells of e's end, with its outcome. m.mu is held.
func (m *Manager) endedLine(e *entry) {
	if !m.cfg.logInfo && m.cfg.metrics == nil {
		return
	}
	t := e.project()
	o, cur := t.Outcome, t.Current()
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "bgtask: task ended", slog.String("task", e.id), slog.String("attempt", cur.ID),
			slog.String("session", cur.SessionID), slog.String("status", string(t.Status)), slog.String("outcome", string(o.State)),
			slog.String("reason", string(o.Reason)), slog.Int("attempts", len(t.Attempts)))
	}
	if m.cfg.metrics != nil {
		live := m.liveTasks() - 1 // e counts as ended from here on
		m.measure(func(mt Metrics) {
			mt.TaskEnded(t, o.State, o.Reason, t.CompletedAt.Sub(t.LaunchedAt))
			mt.LiveTasks(live)
		})
	}
}

// liveTasks counts the live tasks. m.mu is held.
func (m *Manager) liveTasks() int { return len(m.led.tasks) - len(m.led.ended) }

// queueDepth reports key's queue, after it changed. m.mu is held.
func (m *Manager) queueDepth(key string) {
	if m.cfg.metrics != nil {
		n := m.calls.pool.Queued(key)
		m.measure(func(mt Metrics) { mt.QueueDepth(key, n) })
	}
}

// Retention.

// DefaultMaxEnded is how many ended tasks a Manager keeps by default.
const DefaultMaxEnded = 10_000

// maxTombstones bounds the ids of forgotten tasks a Manager remembers as
// forgotten (ErrForgotten); an older one is then unknown.
const maxTombstones = 100_000

// sweepBudget bounds the ended tasks one sweep looks at: a sweep costs
// O(1), whatever the backlog.
const sweepBudget = 64

// sweep forgets the oldest ended tasks past the retention bounds
// (WithRetention), skipping those that must stay: a task whose parent
// session has live tasks, or whose notifications are not all delivered.
// m.mu is held.
func (m *Manager) sweep() {
	r, l := m.cfg.retention, m.led
	if r.MaxEnded < 0 && r.MaxAge <= 0 {
		return
	}
	var now time.Time
	if r.MaxAge > 0 {
		now = m.now()
	}
	kept, i := 0, 0
	for ; i < len(l.ended) && i < sweepBudget; i++ {
		e := l.ended[i]
		over := r.MaxEnded >= 0 && len(l.ended)-(i-kept) > r.MaxEnded
		old := r.MaxAge > 0 && now.Sub(e.cur().CompletedAt) > r.MaxAge
		if !over && !old {
			break
		}
		if l.liveBy[e.info.parent] > 0 || e.notesOut > 0 || len(m.closures.active) > 0 || l.launchedLive(e) {
			l.ended[kept] = e // it must stay: looked at again next time
			kept++
			continue
		}
		m.forget(e)
	}
	if gone := i - kept; gone > 0 {
		// The looked-at prefix is now kept[:kept] and gone slots: close
		// them, moving the few kept ones up rather than the long rest down.
		copy(l.ended[gone:i], l.ended[:kept])
		clear(l.ended[:gone])
		l.ended = l.ended[gone:]
	}
}

// forget takes ended task e out of memory: its indexes, its place in
// launch order and under its parent, its undelivered notifications; its
// id is kept as a tombstone. m.mu is held.
func (m *Manager) forget(e *entry) {
	l := m.led
	delete(l.tasks, e.id)
	e.eachAttempt(func(_ int, a *Attempt) { delete(l.byAttempt, a.ID) })
	e.eachSession(func(s string) bool {
		if ref, ok := l.bySession[s]; ok && ref.e == e {
			delete(l.bySession, s)
		}
		return true
	})
	if k := e.info.opt().key; k != "" && l.byKey[k] == e {
		delete(l.byKey, k)
	}
	l.unindex(e)
	m.order = without(m.order, e)
	lost := m.notes.lost[:0]
	for _, n := range m.notes.lost {
		if n.TaskID != e.id {
			lost = append(lost, n)
		}
	}
	clear(m.notes.lost[len(lost):])
	m.notes.lost = lost
	l.tombs[e.id] = struct{}{}
	l.tombOrder = append(l.tombOrder, e.id)
	if len(l.tombOrder) > maxTombstones {
		delete(l.tombs, l.tombOrder[0])
		l.tombOrder[0] = ""
		l.tombOrder = l.tombOrder[1:]
	}
	m.led.forgotten++
	if l := m.led; m.cfg.journal != nil && !l.compactQueued && l.compactDue() {
		l.compactQueued = m.goLater(m.maybeCompact)
	}
}

// Freezing: a task that settled (ended, its notifications all out) is
// kept compact for as long as retention keeps it. Its attempts, sessions
// and evidence are written into one string (cold); the indexes are keyed
// by substrings of it, so that the ids' own allocations go; its hot part
// goes back to the ledger; its outcome is no longer cached. Reads decode
// it (cur, atts, sessionList, ev) without allocating a string; a record
// for a frozen task thaws it first (write).

// maxSpareHot bounds the hot parts the ledger keeps for reuse.
const maxSpareHot = 256

// newHot is a hot part for a task being launched.
func (l *ledger) newHot() *hot {
	if n := len(l.spareHot); n > 0 {
		h := l.spareHot[n-1]
		l.spareHot[n-1] = nil
		l.spareHot = l.spareHot[:n-1]
		return h
	}
	return new(hot)
}

// chain is the ledger's own copy of a launch's model chain: the latest
// launch's when it is the same (chains are never written to), else a
// clone, kept for the next.
func (l *ledger) chain(models []Model) []Model {
	if !slices.Equal(models, l.lastChain) || len(models) == 0 {
		l.lastChain = slices.Clone(models)
	}
	return l.lastChain
}

// cloneAttempts is a copy of e's attempts, for a projection.
func cloneAttempts(e *entry) []Attempt {
	if e.cold != "" {
		return e.atts() // a new slice already
	}
	return slices.Clone(e.attempts)
}

// Zones a time in cold may have: what freeze keeps exactly.
const (
	coldZero uint64 = iota // the zero time
	coldUTC
	coldLocal
)

// freezable reports whether e may be frozen now: it is settled, and
// nothing in flight (an abort, a start, a slot, a held turn end, an
// answer lane) can read its hot part again. m.mu is held.
func (m *Manager) freezable(e *entry) bool {
	return e.hot != nil && e.cold == "" && e.terminal() && e.notesOut == 0 && e.rt.abort == nil && !e.rt.starting() &&
		e.slot == (slotHold{}) && e.gate == nil && m.calls.prompts[e] == nil && m.led.tasks[e.id] == e
}

// freezeBudget bounds the settled tasks one unlock looks at (freezeSome):
// one that cannot be frozen yet is looked at again later. freezeLag is
// how many settled tasks stay warm, the latest: a task is read most just
// as it ends (Wait, its final summary, a parent's look), and a warm read
// decodes nothing.
const (
	freezeBudget = 16
	freezeLag    = 64
)

// freezeSome freezes the oldest settled tasks past the latest freezeLag
// that may be frozen now, up to budget of them; with budget -1, every
// settled task that may be. The others wait at the back. It runs as a
// lock's holder is done with every entry (unlock), never under a caller
// that still reads one. m.mu is held.
func (m *Manager) freezeSome(budget int) (frozen int) {
	l := m.led
	n := len(l.warm)
	if budget >= 0 {
		n = min(n-freezeLag, budget)
	}
	if n <= 0 {
		return 0
	}
	for _, e := range l.warm[:n] {
		switch {
		case e.cold != "" || l.tasks[e.id] != e: // frozen meanwhile, or forgotten
		case m.freezable(e):
			if l.freeze(e) {
				frozen++
			} // else it holds what cold cannot keep (a time in another zone): warm for good, never looked at again
		case e.terminal() && e.hot != nil && e.cold == "":
			l.warm = append(l.warm, e) // not yet: looked at again
		}
	}
	clear(l.warm[:n])
	l.warm = l.warm[n:]
	if len(l.warm) == 0 {
		l.warm = nil
	}
	return frozen
}

// freezeReplayed freezes the settled tasks a restart replayed, a batch at
// a time under the lock, on a goroutine of the Manager's: Open does not
// wait for it (a replay of 1M records is a third faster for it), and
// inputs go on between batches. It makes one pass over what was queued
// when it began (a task that cannot be frozen yet is left to the unlocks).
func (m *Manager) freezeReplayed() {
	m.mu.Lock()
	passes := (len(m.led.warm) + freezeBatch - 1) / freezeBatch
	_ = m.unlock()
	for range passes {
		m.mu.Lock()
		left := len(m.led.warm) > freezeLag
		if left {
			m.freezeSome(freezeBatch)
		}
		_ = m.unlock()
		if !left {
			return
		}
	}
}

// freezeBatch is how many tasks freezeReplayed freezes per hold of the
// lock: about a millisecond's work.
const freezeBatch = 512

// freeze makes settled task e cold (see Freezing), and reports whether it
// did: not if e holds what cold cannot keep exactly (a time in a zone
// other than UTC and Local). m.mu is held.
func (l *ledger) freeze(e *entry) bool {
	atts := e.attempts
	w := codec.Writer{B: l.coldBuf[:0]}
	w.Uint(uint64(len(atts)))
	for i := range atts {
		if !putColdAttempt(&w, e.info, &atts[i]) {
			return false
		}
	}
	w.Uint(uint64(len(e.sessions)))
	for _, s := range e.sessions {
		j := slices.IndexFunc(atts, func(a Attempt) bool { return a.SessionID == s })
		if w.Uint(uint64(j + 1)); j < 0 {
			w.String(s)
		}
	}
	ev := e.evidence
	w.String(ev.output)
	w.String(string(ev.finish))
	w.Bool(ev.noText)
	w.String(string(ev.reason))
	w.String(ev.notice)
	if cap(w.B) <= 4<<10 {
		l.coldBuf = w.B // the scratch buffer, for the next
	}
	cold := string(w.B)
	if !coldMatches(cold, e, atts) {
		return false // cannot happen: what is frozen reads back exactly, or it is not frozen
	}
	e.cold = cold
	l.rekey(e) // the same keys, now substrings of cold: the ids' own strings go
	if loc := e.loc; loc != nil && len(loc.onDone) == 0 && loc.stopWait == nil && loc.values == nil &&
		loc.valueTok != atts[e.current].Token && loc.errTok != atts[e.current].Token {
		e.loc = nil // it keeps nothing a read of the task gives
	}
	e.attempts, e.sessions, e.outcome = nil, nil, nil
	*e.hot = hot{}
	if len(l.spareHot) < maxSpareHot {
		l.spareHot = append(l.spareHot, e.hot)
	}
	e.hot = nil
	return true
}

// coldMatches reports whether cold reads back as e's attempts (atts),
// sessions and evidence, exactly.
func coldMatches(cold string, e *entry, atts []Attempt) bool {
	r := coldReader{codec.StrReader{S: cold}}
	if r.Uint() != uint64(len(atts)) {
		return false
	}
	for i := range atts {
		if r.attempt(e) != atts[i] {
			return false
		}
	}
	if r.Uint() != uint64(len(e.sessions)) {
		return false
	}
	for _, s := range e.sessions {
		got := ""
		if j := r.Uint(); j == 0 {
			got = r.String()
		} else if int(j) <= len(atts) {
			got = atts[j-1].SessionID
		}
		if got != s {
			return false
		}
	}
	return r.evidence() == e.evidence && r.Err() == nil && r.S == ""
}

// thaw makes frozen task e whole again, for a record about to be written
// to it; it is frozen again once it may be (warm). m.mu is held.
func (l *ledger) thaw(e *entry) {
	atts, sessions, ev := e.atts(), e.sessionList(), e.ev()
	e.hot = l.newHot()
	e.evidence = ev
	if len(atts) == 1 {
		e.first[0] = atts[0]
		atts = e.first[:1]
	}
	e.attempts, e.sessions, e.cold = atts, slices.Clone(sessions), ""
	l.rekey(e) // keyed by the thawed copies (substrings of the old cold, which stays until the task is frozen again)
	l.warm = append(l.warm, e)
}

// rekey points e's index entries at the strings e holds now (a frozen
// task's: substrings of cold), so that no index keeps other copies of
// them alive. Map assignment replaces an equal key. m.mu is held.
func (l *ledger) rekey(e *entry) {
	if e.cold == "" {
		for i := range e.attempts {
			l.byAttempt[e.attempts[i].ID] = e
		}
	} else {
		r := e.coldReader()
		for range r.Uint() {
			id, _ := r.skim()
			l.byAttempt[id] = e
		}
	}
	e.eachSession(func(s string) bool {
		if ref, ok := l.bySession[s]; ok && ref.e == e {
			l.bySession[s] = ref
		}
		return true
	})
}

// putColdAttempt writes a to w, its model as its place in info's chain.
// It reports false for a time cold cannot keep exactly.
func putColdAttempt(w *codec.Writer, info *taskInfo, a *Attempt) bool {
	w.String(a.ID)
	w.String(a.Token)
	w.String(a.SessionID)
	k := slices.Index(info.models, a.Model)
	if w.Uint(uint64(k + 1)); k < 0 {
		w.String(a.Model.Provider)
		w.String(a.Model.ID)
		w.String(a.Model.Variant)
	}
	w.Uint(uint64(a.Number))
	putColdWord(w, string(a.Status))
	putColdWord(w, string(a.Pending))
	w.String(a.Error)
	w.String(a.Result)
	return putColdTime(w, a.StartedAt) && putColdTime(w, a.CompletedAt)
}

// coldWords are the statuses and pending reasons, which cold writes as
// their place in this list (a word not in it: 0, then the word).
var coldWords = [...]string{"",
	string(StatusPending), string(StatusRunning), string(StatusCompleted), string(StatusError), string(StatusCancelled), string(StatusInterrupt),
	string(PendingQueued), string(PendingAwaitingSession), string(PendingSessionFailed), string(PendingRetryDelay)}

func putColdWord(w *codec.Writer, s string) {
	if k := slices.Index(coldWords[:], s); k >= 0 {
		w.Uint(uint64(k + 1))
		return
	}
	w.Uint(0)
	w.String(s)
}

func (r *coldReader) word() string {
	k := r.Uint()
	switch {
	case k == 0:
		return r.String()
	case k <= uint64(len(coldWords)):
		return coldWords[k-1]
	}
	return ""
}

func putColdTime(w *codec.Writer, t time.Time) bool {
	zone := coldZero
	switch {
	case t.IsZero():
		w.Uint(zone)
		return true
	case t != t.Round(0): // a monotonic reading: not what write keeps
		return false
	case t.Location() == time.UTC:
		zone = coldUTC
	case t.Location() == time.Local:
		zone = coldLocal
	default:
		return false
	}
	w.Uint(zone)
	w.Int(t.Unix())
	w.Uint(uint64(t.Nanosecond()))
	return true
}

// coldReader reads a frozen task's cold string.
type coldReader struct{ codec.StrReader }

func (e *entry) coldReader() coldReader { return coldReader{codec.StrReader{S: e.cold}} }

// attempts reads e's attempts (their count first).
func (r *coldReader) attempts(e *entry) []Attempt {
	out := make([]Attempt, r.Uint())
	for i := range out {
		out[i] = r.attempt(e)
	}
	return out
}

// skim reads the next attempt's id and session, and skips the rest of it.
func (r *coldReader) skim() (id, session string) {
	id, _, session = r.String(), r.String(), r.String()
	if r.Uint() == 0 { // a model of its own
		_, _, _ = r.String(), r.String(), r.String()
	}
	r.Uint()
	_, _, _, _ = r.word(), r.word(), r.String(), r.String()
	for range 2 {
		if r.Uint() != coldZero {
			r.Int()
			r.Uint()
		}
	}
	return id, session
}

// attempt reads the next attempt of e.
func (r *coldReader) attempt(e *entry) Attempt {
	a := Attempt{ID: r.String(), Token: r.String(), SessionID: r.String()}
	if k := r.Uint(); k == 0 {
		a.Model = Model{Provider: r.String(), ID: r.String(), Variant: r.String()}
	} else if int(k) <= len(e.info.models) {
		a.Model = e.info.models[k-1]
	}
	a.Number = int(r.Uint())
	a.Status, a.Pending, a.Error, a.Result = Status(r.word()), PendingReason(r.word()), r.String(), r.String()
	a.StartedAt, a.CompletedAt = r.time(), r.time()
	return a
}

func (r *coldReader) time() time.Time {
	zone := r.Uint()
	if zone == coldZero {
		return time.Time{}
	}
	t := time.Unix(r.Int(), int64(r.Uint())) // in time.Local
	if zone == coldUTC {
		t = t.UTC()
	}
	return t
}

// sessions reads the sessions, after atts (the attempts, read).
func (r *coldReader) sessions(atts []Attempt) []string {
	n := r.Uint()
	if n == 0 {
		return nil
	}
	out := make([]string, 0, n)
	for range n {
		if j := r.Uint(); j == 0 {
			out = append(out, r.String())
		} else if int(j) <= len(atts) {
			out = append(out, atts[j-1].SessionID)
		}
	}
	return out
}

// evidence reads the evidence, after the sessions.
func (r *coldReader) evidence() evidence {
	return evidence{output: r.String(), finish: FinishReason(r.String()), noText: r.Bool(), reason: Reason(r.String()), notice: r.String()}
}

// without is s less its first e (searched from the front: what is
// forgotten is mostly the oldest). It moves the shorter side of s over
// the gap, so taking out the oldest costs nothing however long s is.
func without(s []*entry, e *entry) []*entry {
	i := slices.Index(s, e)
	switch {
	case i < 0:
		return s
	case i < len(s)/2:
		copy(s[1:i+1], s[:i])
		s[0] = nil
		return s[1:]
	default:
		copy(s[i:], s[i+1:])
		s[len(s)-1] = nil
		return s[:len(s)-1]
	}
}

// Durability.
//
// A Journal keeps the records a Manager commits, so that a restart is a
// replay. The Manager hands it every batch of records committed under its
// lock, in commit order, and runs nothing the batch describes — no host
// call, no notification — until the batch is durable.

// Record is one ledger record as a Journal stores it: the fields a journal
// may index or condition an append on, and the record itself, encoded.
type Record struct {
	Seq    uint64 // strictly increasing across the ledger
	Kind   string // e.g. "task_launched", "session_bound", "attempt_finalized"
	TaskID string // "" for a manager-wide record
	// AttemptID and Token name the attempt (run) the record concerns, if
	// any: what a journal shared by several processes conditions an append
	// on (the task's current attempt and token).
	AttemptID, Token string
	// SessionID is the attempt's child session, if it has one: with
	// Kind "session_bound", the session the record binds to AttemptID,
	// which a journal shared by several processes keeps unique. Like the
	// fields above it is a copy of what Data holds: a journal need not
	// store it, the Manager reads the record from Data.
	SessionID string
	// ParentSessionID is, with Kind "task_launched", the session that
	// launched the task: what a journal shared by several processes needs
	// to find a branch's tasks and fence it (another copy of Data's).
	ParentSessionID string
	Data            []byte // the whole record; a journal stores and returns it as is
}

// Journal persists a Manager's ledger records (WithJournal).
//
// A batch is the unit of atomicity: every record of one Append is durable,
// and replayed, together or not at all — a crash may lose a whole batch
// (the last ones appended), never part of one, and never one without
// those appended before it. The Manager hands a journal everything one
// commit decided as one batch (a launch with its first attempt, a retry
// with the attempt it chose, an end with its notifications), so a replay
// never sees half a decision. The file journal frames its batches
// (internal/wal); pgledger writes each in one transaction. Recovery still
// derives what is owed from the state it replays (see Open), but a journal
// that breaks this rule may make it announce an outcome the live Manager
// would not have reached.
type Journal interface {
	// Append queues a batch of records after every batch appended before
	// it and returns at once: the Manager calls it in commit order, one
	// call at a time, while commits behind it wait, so it must not wait for
	// I/O. The batch's Wait returns once it is durable (all of it), or
	// with why it is not; after an error the Manager stops (fail-stop) and
	// a restart recovers from what is durable.
	Append(batch []Record) Commit
	// Replay calls fn with every durable record, in order. A journal
	// that waits on I/O it can cancel implements ContextReplayer too.
	Replay(fn func(Record) error) error
	// Compact replaces the journal's records with keep (in order), as one
	// atomic step.
	Compact(keep []Record) error
	// Close releases the journal.
	Close() error
}

// ContextReplayer is a Journal whose replay a context can end: Open calls
// ReplayContext with its own context instead of Replay, so a journal whose
// storage stalls (a database, a network) cannot hold Open past its
// deadline. It returns ctx's error, or one that wraps it, once ctx ends;
// New replays with context.Background().
type ContextReplayer interface {
	ReplayContext(ctx context.Context, fn func(Record) error) error
}

// Commit is a batch appended to a Journal on its way to durable storage.
type Commit interface {
	// Wait returns once the batch is durable, or with the error that kept
	// it from being.
	Wait() error
}

// recordFormat is the version byte that starts every encoded record.
// Format 2 added evidence's notice, an invocation, and a spec's key;
// format 3 a spec's deadlines and its place in its tree. Records of older
// formats are still read.
const recordFormat = 3

// encodeRecord is rec as a Journal stores it (internal/codec: uvarints,
// length-prefixed strings, times with their zone offset).
func encodeRecord(rec *record) (Record, error) {
	r, _, err := encodeInto(make([]byte, 0, 160), rec)
	return r, err
}

// encodeInto appends rec, encoded, to b: the Record's Data is what it
// appended (capped, so that appending to it never writes into b), and b
// is returned grown, for the next record of a batch.
func encodeInto(b []byte, rec *record) (Record, []byte, error) {
	start := len(b)
	w := codec.Writer{B: b}
	w.B = append(w.B, recordFormat)
	w.Uint(rec.seq)
	w.Uint(uint64(rec.kind))
	w.String(rec.task)
	w.Time(rec.at)
	a := &rec.attempt
	w.Bool(a.ID != "")
	if a.ID != "" {
		for _, f := range [...]string{a.ID, a.Token, a.SessionID, a.Model.Provider, a.Model.ID, a.Model.Variant, string(a.Status), string(a.Pending), a.Error, a.Result} {
			w.String(f)
		}
		w.Uint(uint64(a.Number))
		w.Time(a.StartedAt)
		w.Time(a.CompletedAt)
	}
	ev := rec.evidence
	w.Bool(ev != (evidence{}))
	if ev != (evidence{}) {
		w.String(ev.output)
		w.String(string(ev.finish))
		w.Bool(ev.noText)
		w.String(string(ev.reason))
		w.String(ev.notice)
	}
	w.Bool(rec.recordExt != nil || rec.inv != nil)
	if x := rec.recordExt; x != nil || rec.inv != nil {
		if x == nil {
			x = &noExt
		}
		if err := encodeExt(&w, x, rec.inv); err != nil {
			return Record{}, b, fmt.Errorf("bgtask: encoding record %d (%s): %w", rec.seq, rec.kind, err)
		}
	}
	return recordOf(rec, w.B[start:len(w.B):len(w.B)]), w.B, nil
}

// recordOf is rec as a Journal sees it, with data its encoding.
func recordOf(rec *record, data []byte) Record {
	a := &rec.attempt
	out := Record{Seq: rec.seq, Kind: rec.kind.String(), TaskID: rec.task, AttemptID: a.ID, Token: a.Token, SessionID: a.SessionID, Data: data}
	if rec.recordExt != nil && rec.spec != nil {
		out.ParentSessionID = rec.spec.parent
	}
	return out
}

// encodeExt writes the part of a record only some kinds carry.
func encodeExt(w *codec.Writer, x *recordExt, inv *Invocation) error {
	w.Bool(x.spec != nil)
	if ti := x.spec; ti != nil {
		for _, f := range [...]string{ti.id, ti.parent, ti.description, ti.agent, ti.prompt} {
			w.String(f)
		}
		w.Uint(uint64(len(ti.models)))
		for _, m := range ti.models {
			w.String(m.Provider)
			w.String(m.ID)
			w.String(m.Variant)
		}
		w.Uint(uint64(ti.maxAttempts))
		w.Uint(uint64(len(ti.metadata)))
		for k, v := range ti.metadata {
			w.String(k)
			w.String(v)
		}
		w.Time(ti.launchedAt)
	}
	w.String(x.session)
	w.String(x.note)
	w.String(string(x.stop))
	if err := writeJSON(w, x.closure != nil, x.closure); err != nil { // rare, and a public type: its JSON shape
		return err
	}
	w.Bool(x.notice != nil)
	if n := x.notice; n != nil {
		w.String(n.id)
		w.Uint(n.seq)
		for _, f := range [...]string{string(n.kind), n.parent, n.text, n.attempt} {
			w.String(f)
		}
		w.Uint(uint64(len(n.tasks)))
		for _, t := range n.tasks {
			w.String(t)
		}
		w.Uint(n.closure)
	}
	w.Uint(x.epoch)
	w.Uint(x.opened)
	// Format 2 on: the invocation, then the spec's key.
	if err := writeJSON(w, inv != nil, inv); err != nil {
		return err
	}
	key := ""
	if x.spec != nil {
		key = x.spec.opt().key
	}
	w.String(key)
	noteInv := 0
	if x.notice != nil {
		noteInv = x.notice.invocation
	}
	w.Uint(uint64(noteInv))
	var cont [3]string
	if ti := x.spec; ti != nil {
		cont = [3]string{ti.opt().continues, ti.opt().resume, ti.opt().prior}
	}
	for _, f := range cont {
		w.String(f)
	}
	// Format 3 on: the spec's deadlines.
	var timeouts [2]time.Duration
	retry := false
	if ti := x.spec; ti != nil {
		timeouts, retry = [2]time.Duration{ti.opt().timeout, ti.opt().attemptTimeout}, ti.opt().retryOnTimeout
	}
	for _, d := range timeouts {
		w.Uint(uint64(d))
	}
	w.Bool(retry)
	root, depth := "", 0
	if ti := x.spec; ti != nil {
		root, depth = ti.root, ti.depth
	}
	w.String(root)
	w.Uint(uint64(depth))
	return nil
}

// writeJSON writes whether v is present and, if it is, its JSON.
func writeJSON(w *codec.Writer, present bool, v any) error {
	w.Bool(present)
	if !present {
		return nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	w.String(string(b))
	return nil
}

// readJSON reads what writeJSON wrote into v, and reports whether it was
// present.
func readJSON(d *codec.Reader, v any) (bool, error) {
	if !d.Bool() {
		return false, nil
	}
	return true, json.Unmarshal([]byte(d.String()), v)
}

// decodeRecord is the record a Journal returned.
func decodeRecord(r Record) (record, error) { return decodeData(r.Data, r.Seq, nil) }

// recordError is why a replay refused a record: the record, as far as it
// could be read (its sequence and kind), where the journal keeps it (a
// file journal's segment and offset, once located), and the cause.
type recordError struct {
	seq  uint64
	kind recordKind // 0: not known
	// decoding: the record could not be decoded (else it was refused).
	decoding bool
	at       wal.Location // the zero Location: not located
	err      error
}

func (e *recordError) Error() string {
	var b strings.Builder
	b.WriteString("bgtask: journal")
	if e.at != (wal.Location{}) {
		b.WriteString(" " + e.at.String())
	}
	b.WriteString(": ")
	if e.decoding {
		b.WriteString("decoding ")
	}
	kind := "kind unknown"
	if e.kind != 0 {
		kind = e.kind.String()
	}
	fmt.Fprintf(&b, "record %d (%s): %v", e.seq, kind, e.err)
	return b.String()
}

func (e *recordError) Unwrap() error { return e.err }

// decodeData is the record data encodes; seq names it in an error if the
// record's own cannot be read.
func decodeData(data []byte, seq uint64, words *codec.Words) (record, error) {
	if len(data) == 0 || data[0] == 0 || data[0] > recordFormat {
		return record{}, &recordError{seq: seq, decoding: true, err: fmt.Errorf("not a record of format 1 to %d", recordFormat)}
	}
	format, d := data[0], codec.Reader{B: data[1:], Words: words}
	rec := record{seq: d.Uint(), kind: recordKind(d.Uint()), task: d.String(), at: d.Time()}
	bad := func(err error) (record, error) {
		re := &recordError{seq: rec.seq, kind: rec.kind, decoding: true, err: err}
		if re.seq == 0 {
			re.seq = seq
		}
		if int(re.kind) >= len(recordKindNames) {
			re.kind = 0
		}
		return record{}, re
	}
	if d.Bool() {
		var f [10]string
		for i := range f {
			if i >= 3 && i < 8 { // the model and the statuses: words a replay reads again and again
				f[i] = d.Word()
			} else {
				f[i] = d.String()
			}
		}
		rec.attempt = Attempt{ID: f[0], Token: f[1], SessionID: f[2], Model: Model{Provider: f[3], ID: f[4], Variant: f[5]},
			Status: Status(f[6]), Pending: PendingReason(f[7]), Error: f[8], Result: f[9], Number: int(d.Uint())}
		rec.attempt.StartedAt, rec.attempt.CompletedAt = d.Time(), d.Time()
	}
	if d.Bool() {
		rec.evidence = evidence{output: d.String(), finish: FinishReason(d.Word()), noText: d.Bool(), reason: Reason(d.Word())}
		if format >= 2 {
			rec.evidence.notice = d.String()
		}
	}
	if d.Bool() {
		x, inv, err := decodeExt(&d, format)
		if err != nil {
			return bad(err)
		}
		if rec.inv = inv; *x != noExt {
			rec.recordExt = x
		}
		if x.spec != nil && x.spec.id == rec.task {
			x.spec.id = rec.task // one string for the task's id, as a live launch has
		}
	}
	if err := d.Err(); err != nil {
		return bad(err)
	}
	if int(rec.kind) >= len(recordKindNames) || recordKindNames[rec.kind] == "" {
		return bad(fmt.Errorf("unknown kind %d", rec.kind))
	}
	return rec, nil
}

// decodeExt reads what encodeExt wrote, in a record of format.
func decodeExt(d *codec.Reader, format byte) (_ *recordExt, inv *Invocation, _ error) {
	x := &recordExt{}
	if d.Bool() {
		ti := &taskInfo{id: d.String(), parent: d.Word(), description: d.String(), agent: d.Word(), prompt: d.String()}
		for n := d.Uint(); n > 0 && d.Err() == nil; n-- {
			ti.models = append(ti.models, Model{Provider: d.Word(), ID: d.Word(), Variant: d.Word()})
		}
		ti.maxAttempts = int(d.Uint())
		for n := d.Uint(); n > 0 && d.Err() == nil; n-- {
			if ti.metadata == nil {
				ti.metadata = make(map[string]string)
			}
			k := d.String()
			ti.metadata[k] = d.String()
		}
		ti.launchedAt = d.Time()
		x.spec = ti
	}
	x.session, x.note, x.stop = d.String(), d.String(), Status(d.String())
	var cr ClosureRecord
	if ok, err := readJSON(d, &cr); err != nil {
		return nil, nil, fmt.Errorf("closure: %w", err)
	} else if ok {
		x.closure = &cr
	}
	if d.Bool() {
		n := &notice{id: d.String(), seq: d.Uint(), kind: NotificationKind(d.String()), parent: d.String(), text: d.String(), attempt: d.String()}
		for k := d.Uint(); k > 0 && d.Err() == nil; k-- {
			n.tasks = append(n.tasks, d.String())
		}
		n.closure = d.Uint()
		x.notice = n
	}
	x.epoch, x.opened = d.Uint(), d.Uint()
	if format >= 2 {
		var in Invocation
		if ok, err := readJSON(d, &in); err != nil {
			return nil, nil, fmt.Errorf("invocation: %w", err)
		} else if ok {
			inv = &in
		}
		if key := d.String(); x.spec != nil && key != "" {
			x.spec.extra().key = key
		}
		if inv := int(d.Uint()); x.notice != nil {
			x.notice.invocation = inv
		}
		if c, r, p := d.String(), d.String(), d.String(); x.spec != nil && c+r+p != "" {
			o := x.spec.extra()
			o.continues, o.resume, o.prior = c, r, p
		}
	}
	if format >= 3 {
		if t, at, retry := time.Duration(d.Uint()), time.Duration(d.Uint()), d.Bool(); x.spec != nil && (t != 0 || at != 0 || retry) {
			o := x.spec.extra()
			o.timeout, o.attemptTimeout, o.retryOnTimeout = t, at, retry
		}
		if root, depth := d.String(), int(d.Uint()); x.spec != nil {
			x.spec.root, x.spec.depth = root, depth
		}
	}
	return x, inv, nil
}

// encodeAll encodes recs, in order.
func encodeAll(recs []record) ([]Record, error) {
	batch := make([]Record, 0, len(recs))
	buf := make([]byte, 0, recordGuess*len(recs)) // one allocation for the batch's Data, mostly
	for i := range recs {
		r, b, err := encodeInto(buf, &recs[i])
		if err != nil {
			return nil, err
		}
		batch, buf = append(batch, r), b
	}
	return batch, nil
}

// recordGuess is about what an encoded record takes (most are attempt
// records): what a batch's buffer is sized for.
const recordGuess = 192

// recovery is what a replay found that a restart must act on.
type recovery struct {
	started map[string]bool        // attempts whose StartSession was asked for (they may have a session)
	notes   map[uint64]*notice     // notifications produced and not delivered, by Notification.Seq
	pending chan struct{}          // one token per recovery effect still out
	left    int                    // recovery effects queued
	closing map[uint64]openClosure // closures in progress at the crash, by opening record
	lost    []*notice              // notifications given up before the restart, in that order

	// What recovery derives is owed from the state the records left, not
	// only from the records themselves (owed): a journal that did not keep
	// a batch whole may hold an end without its announcement.
	retry     map[*entry]bool // tasks whose durable retry_scheduled has no next attempt
	finals    map[string]bool // tasks with a final summary produced
	roundTold map[string]bool // tasks listed in an all_complete produced
	// launchSeq is the sequence of each task's launch record (kept with a
	// Notifier only: rounds are rebuilt from it). An ended task's end is
	// the sequence of its latest record (entry.seq): its final record, or
	// a later one that changed nothing it announced.
	launchSeq map[*entry]uint64
	// told: what ended up to this sequence was told (a compaction's point:
	// it waits until nothing is out). silent: the lives that had no
	// Notifier, from their epoch record to the next: what ended in them
	// was never to be told.
	told   uint64
	silent [][2]uint64
}

// epochNote is the note of this life's epoch record: whether it tells
// anyone (a Notifier), and extra.
func (m *Manager) epochNote(extra string) string {
	switch {
	case m.cfg.notifier != nil:
		return extra
	case extra != "":
		return epochSilent + ", " + extra
	}
	return epochSilent
}

// owed reports whether a task or round that ended at seq is owed its
// announcement (it ended after the last point where all was told, in a
// life that had a Notifier).
func (rv *recovery) owed(seq uint64) bool {
	if seq <= rv.told {
		return false
	}
	for _, r := range rv.silent {
		if seq > r[0] && (r[1] == 0 || seq < r[1]) {
			return false
		}
	}
	return true
}

// Notes on an epoch record: the life it begins has no Notifier; the
// records before it are a compaction's, made when nothing was out.
const (
	epochSilent    = "no notifier"
	epochCompacted = "compacted"
)

// openClosure is a closure in progress: its root session, or its task.
type openClosure struct{ root, task string }

// restore replays the journal into m's empty ledger: every task, attempt,
// closure record and notification as committed, and the epoch of the last
// process life. It touches nothing outside the Manager. ctx bounds a
// ContextReplayer's replay. m.mu is held.
func (m *Manager) restore(ctx context.Context) (*recovery, error) {
	rv := &recovery{started: make(map[string]bool), notes: make(map[uint64]*notice), closing: make(map[uint64]openClosure),
		retry: make(map[*entry]bool), finals: make(map[string]bool), roundTold: make(map[string]bool),
	}
	if m.cfg.notifier != nil {
		rv.launchSeq = make(map[*entry]uint64)
	}
	var lastEpoch uint64
	step := m.replayInto(rv, &lastEpoch)
	err := guardJournal("Replay", func() error {
		if fj, ok := m.cfg.journal.(*fileJournal); ok {
			payloads := fj.l.Records()
			m.presize(payloads)
			if at, err := replayPayloads(payloads, step); err != nil {
				return fj.placed(at, payloads[at], err)
			}
			return nil
		}
		fn := func(r Record) error {
			rec, err := decodeRecord(r)
			if err != nil {
				return err
			}
			return step(rec)
		}
		if cr, ok := m.cfg.journal.(ContextReplayer); ok {
			return cr.ReplayContext(ctx, fn)
		}
		return m.cfg.journal.Replay(fn)
	})
	if err != nil {
		return nil, err
	}
	m.changes.epoch = lastEpoch + 1
	return rv, m.afterReplay(rv)
}

// replayInto is restore's step for one replayed record.
func (m *Manager) replayInto(rv *recovery, lastEpoch *uint64) func(record) error {
	l := m.led
	return func(rec record) error {
		switch rec.kind {
		case recNotifyProduced, recNotifyDelivered:
			if rec.recordExt == nil || rec.notice == nil {
				return &recordError{seq: rec.seq, kind: rec.kind, err: errors.New("it has no notification")}
			}
			if rec.notice.seq >= m.notes.seq && rec.notice.id != "" {
				m.notes.lastID = rec.notice.id
			}
			m.notes.seq = max(m.notes.seq, rec.notice.seq) // a delivery too: a compaction keeps the last as its mark
			if rec.kind == recNotifyProduced {
				rv.notes[rec.notice.seq] = rec.notice
				switch rec.notice.kind {
				case NotifyFinalSummary:
					rv.finals[rec.task] = true
				case NotifyAllComplete:
					for _, id := range rec.notice.tasks {
						rv.roundTold[id] = true
					}
				}
			} else {
				if n := rv.notes[rec.notice.seq]; n != nil && strings.HasPrefix(rec.note, "given up") {
					rv.lost = append(rv.lost, n) // Undelivered outlives the process
				}
				delete(rv.notes, rec.notice.seq)
			}
		case recStartRequested:
			rv.started[rec.attempt.ID] = true
		case recClosureOpened:
			if rec.recordExt != nil {
				rv.closing[rec.seq] = openClosure{root: rec.session, task: rec.note}
			}
		case recBranchClosed, recClosureDropped:
			if rec.recordExt != nil {
				delete(rv.closing, rec.opened)
			}
		case recEpoch:
			if rec.recordExt != nil {
				*lastEpoch = max(*lastEpoch, rec.epoch)
				if n := len(rv.silent); n > 0 && rv.silent[n-1][1] == 0 {
					rv.silent[n-1][1] = rec.seq // the silent life before it ends here
				}
				if strings.Contains(rec.note, epochCompacted) {
					rv.told = rec.seq
				}
				if strings.Contains(rec.note, epochSilent) {
					rv.silent = append(rv.silent, [2]uint64{rec.seq, 0})
				}
			}
		}
		if g, ok := m.cfg.ids.(*seqIDs); ok && (rec.kind == recTaskLaunched || rec.kind == recAttemptCreated || rec.kind == recNotifyProduced || rec.kind == recNotifyDelivered) {
			g.skipPast(&rec) // where an id is made
		}
		e, err := l.replayOne(rec)
		if err != nil {
			return &recordError{seq: rec.seq, kind: rec.kind, err: err}
		}
		if e != nil {
			switch rec.kind {
			case recTaskLaunched:
				m.order = append(m.order, e)
				if rv.launchSeq != nil {
					rv.launchSeq[e] = rec.seq
				}
			case recRetryScheduled:
				rv.retry[e] = true
			case recAttemptCreated:
				delete(rv.retry, e)
			}
		}
		return nil
	}
}

// afterReplay counts what ended before the restart as ended, and moves
// sequential ids past the journal's. m.mu is held.
func (m *Manager) afterReplay(rv *recovery) error {
	l := m.led
	kept := m.order[:0]
	for _, e := range m.order {
		if e.count() == 0 {
			// Launched, and its first attempt never became durable: a
			// journal that did not keep the launch's batch whole. The
			// Launch never returned it, so it never happened.
			l.drop(e)
			if l.byKey[e.info.opt().key] == e {
				delete(l.byKey, e.info.opt().key)
			}
			m.logLocked(slog.LevelWarn, "bgtask: the journal holds a launch without its first attempt (its commit was not kept whole): the task is dropped", slog.String("task", e.id))
			continue
		}
		kept = append(kept, e)
		if e.terminal() && !rv.retry[e] { // a durable retry runs again (reconcile)
			l.liveEnded(e)
			l.ended = append(l.ended, e)
		}
	}
	clear(m.order[len(kept):])
	m.order = kept
	return nil
}

// guardJournal calls a Journal method (user code): a panic is an error
// that names it.
func guardJournal(what string, f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("bgtask: Journal.%s panicked: %s", what, panicText(r))
		}
	}()
	return f()
}

// skipPast moves g's counters past every id a replayed record holds
// (tasks, attempts, run tokens, notifications), so that a Manager reopened
// on a journal never makes an id twice.
func (s *seqIDs) skipPast(rec *record) {
	bump := func(c *atomic.Uint64, kind IDKind, id string) {
		prefix := string(kind) + "-"
		if n, err := strconv.ParseUint(strings.TrimPrefix(id, prefix), 10, 64); err == nil && strings.HasPrefix(id, prefix) && n > c.Load() {
			c.Store(n)
		}
	}
	bump(&s.task, IDTask, rec.task)
	bump(&s.attempt, IDAttempt, rec.attempt.ID)
	bump(&s.run, IDToken, rec.attempt.Token)
	if rec.recordExt != nil && rec.notice != nil {
		bump(&s.note, IDNotification, rec.notice.id)
	}
}

// FileJournalOption configures OpenFileJournal.
type FileJournalOption func(*wal.Options)

// SyncEachCommit makes every commit its own fsync. Default: group commit —
// commits that arrive while an fsync is in progress share the next one.
func SyncEachCommit() FileJournalOption { return func(o *wal.Options) { o.SyncEach = true } }

// SegmentSize starts a new segment file once the current one holds n
// bytes. Default: 64 MiB.
func SegmentSize(n int64) FileJournalOption { return func(o *wal.Options) { o.SegmentBytes = n } }

// OpenFileJournal opens (or creates) a journal in dir, the embedded
// default for durability: segment files of length-prefixed, CRC-32C-checked
// records, fsync'd by group commit (see internal/wal). One process at a
// time: a second opener of dir gets an error saying it is in use. A torn
// last record (a crash mid-write) is cut off and reported when the Manager
// opens (a warning); a bad checksum anywhere else is an error naming the
// file and offset, and the journal refuses to open. So is, when a Manager
// opens it, a record that cannot be decoded or that the ledger refuses
// (one bgtask did not write): the error names its file, its offset and
// its kind.
func OpenFileJournal(dir string, opts ...FileJournalOption) (Journal, error) {
	if blank(dir) {
		return nil, fmt.Errorf("%w: OpenFileJournal with no directory", ErrInvalidArgument)
	}
	var o wal.Options
	for _, f := range opts {
		f(&o)
	}
	l, err := wal.Open(dir, o)
	if err != nil {
		return nil, err
	}
	return &fileJournal{l: l}, nil
}

// fileJournal is a Journal over an internal/wal log. A record's payload
// is a zero byte and its Data (the Record's other fields are copies of
// what Data holds); a payload that starts with anything else is one
// written before that, packed as packRecord did (its fields, then Data),
// and is still read. The Manager hands a fileJournal its records as they
// are (appendRecs, compactRecs, replayRecs): encoded once, straight into
// the log's payloads.
type fileJournal struct{ l *wal.Log }

// dataMark starts a payload that holds a record's Data alone.
const dataMark = 0

func (j *fileJournal) Append(batch []Record) Commit {
	return j.l.Append(payloadsOf(batch))
}

// payloadsOf is batch as the log stores it, in one buffer.
func payloadsOf(batch []Record) [][]byte {
	n := 0
	for i := range batch {
		n += 1 + len(batch[i].Data)
	}
	buf := make([]byte, 0, n)
	payloads := make([][]byte, len(batch))
	for i := range batch {
		s := len(buf)
		buf = append(append(buf, dataMark), batch[i].Data...)
		payloads[i] = buf[s:len(buf):len(buf)]
	}
	return payloads
}

// encodePayloads is recs as the log stores them, encoded into one buffer.
func encodePayloads(recs []record) ([][]byte, error) {
	buf := make([]byte, 0, (recordGuess+1)*len(recs))
	payloads := make([][]byte, len(recs))
	for i := range recs {
		s := len(buf)
		_, b, err := encodeInto(append(buf, dataMark), &recs[i])
		if err != nil {
			return nil, err
		}
		buf, payloads[i] = b, b[s:len(b):len(b)]
	}
	return payloads, nil
}

// appendRecs is Append of recs, encoded.
func (j *fileJournal) appendRecs(recs []record) Commit {
	payloads, err := encodePayloads(recs)
	if err != nil {
		return failedCommit{err}
	}
	return j.l.Append(payloads)
}

// compactRecs is Compact to recs, encoded.
func (j *fileJournal) compactRecs(recs []record) error {
	payloads, err := encodePayloads(recs)
	if err != nil {
		return err
	}
	return j.l.Compact(payloads)
}

// packRecord is r as the file journal stored it before payloads held
// Data alone: its fields, each a uvarint length (or value) and bytes,
// then its Data. Only tests write it now, to show it is still read.
func packRecord(r *Record) []byte {
	b := make([]byte, 0, binary.MaxVarintLen64+4*binary.MaxVarintLen32+len(r.Kind)+len(r.TaskID)+len(r.AttemptID)+len(r.Token)+len(r.Data))
	b = binary.AppendUvarint(b, r.Seq)
	for _, f := range [...]string{r.Kind, r.TaskID, r.AttemptID, r.Token} {
		b = binary.AppendUvarint(b, uint64(len(f)))
		b = append(b, f...)
	}
	return append(b, r.Data...)
}

// unpackRecord is the record payload p holds, decoded: with its Record
// fields (for a Journal's caller) and as the ledger reads it.
func unpackRecord(p []byte) (Record, record, error) {
	if len(p) > 0 && p[0] == dataMark {
		rec, err := decodeData(p[1:], 0, nil)
		if err != nil {
			return Record{}, record{}, err
		}
		return recordOf(&rec, p[1:]), rec, nil
	}
	var r Record
	seq, n := binary.Uvarint(p)
	if n <= 0 {
		return r, record{}, &recordError{decoding: true, err: errors.New("a record with no sequence")}
	}
	r.Seq, p = seq, p[n:]
	var fs [4]string
	for i := range fs {
		l, n := binary.Uvarint(p)
		if n <= 0 || uint64(len(p)-n) < l {
			return r, record{}, &recordError{seq: seq, decoding: true, err: errors.New("a record cut short")}
		}
		fs[i], p = string(p[n:n+int(l)]), p[n+int(l):]
	}
	r.Kind, r.TaskID, r.AttemptID, r.Token, r.Data = fs[0], fs[1], fs[2], fs[3], p
	rec, err := decodeRecord(r)
	if err != nil {
		return r, rec, err
	}
	return recordOf(&rec, r.Data), rec, nil // with the fields it did not keep
}

// kindOf peeks at the kind of the record payload p holds, without
// decoding it (0 if it cannot tell: an old payload, or a damaged one).
func kindOf(p []byte) recordKind {
	if len(p) < 3 || p[0] != dataMark {
		return 0
	}
	d := codec.Reader{B: p[2:]} // past the mark and the format
	d.Uint()                    // the sequence
	k := d.Uint()
	if d.Err() != nil || k > 255 {
		return 0
	}
	return recordKind(k)
}

// peek reads the sequence and kind of the record payload p holds, as far
// as they can be read, to name it in an error (0 for what cannot be).
func peek(p []byte) (seq uint64, kind recordKind) {
	if len(p) > 0 && p[0] != dataMark { // packed as packRecord did
		seq, _ = binary.Uvarint(p)
		return seq, 0
	}
	if len(p) < 3 {
		return 0, 0
	}
	d := codec.Reader{B: p[2:]}
	seq = d.Uint()
	if kind = kindOf(p); int(kind) >= len(recordKindNames) || recordKindNames[kind] == "" {
		kind = 0
	}
	return seq, kind
}

// placed is err, what a replay met at the i-th record the log read (whose
// payload is p), with where that record lies in the journal's files:
// a *recordError.
func (j *fileJournal) placed(i int, p []byte, err error) error {
	loc, _ := j.l.Locate(i)
	return placeAt(loc, p, err)
}

// placeAt is err, what a replay met at the record p at loc, as a
// *recordError that names loc.
func placeAt(loc wal.Location, p []byte, err error) error {
	var re *recordError
	if !errors.As(err, &re) {
		re = &recordError{err: err}
	}
	if re.seq == 0 && re.kind == 0 {
		re.seq, re.kind = peek(p)
	}
	re.at = loc
	return re
}

// presize makes the ledger's indexes as big as the records about to be
// replayed need (a count of their kinds), so that a replay does not grow
// them step by step. m.mu is held.
func (m *Manager) presize(payloads [][]byte) {
	var n [256]int
	for _, p := range payloads {
		n[kindOf(p)]++
	}
	l := m.led
	if len(l.tasks) > 0 || n[recTaskLaunched] == 0 {
		return
	}
	tasks, attempts, sessions := n[recTaskLaunched], n[recAttemptCreated], n[recSessionBound]+n[recSessionOrphan]
	l.tasks = make(map[string]*entry, tasks)
	l.byAttempt = make(map[string]*entry, attempts)
	l.bySession = make(map[string]attemptRef, sessions)
	m.order = make([]*entry, 0, tasks)
}

// unpackData is the record payload p holds, as the ledger reads it: a
// payload of Data alone is decoded without making its Record (its words
// kept in words, if set: see codec.Words).
func unpackData(p []byte, words *codec.Words) (record, error) {
	if len(p) > 0 && p[0] == dataMark {
		return decodeData(p[1:], 0, words)
	}
	_, rec, err := unpackRecord(p)
	return rec, err
}

// Replay calls fn with each record, in order. An error, fn's or the
// decoding's, names the record's file and offset.
func (j *fileJournal) Replay(fn func(Record) error) error {
	for i, p := range j.l.Records() {
		r, _, err := unpackRecord(p)
		if err == nil {
			err = fn(r)
		}
		if err != nil {
			return j.placed(i, p, err)
		}
	}
	return nil
}

// replayPayloads hands fn each record of payloads (the file journal's,
// read at its open) as the ledger reads it, in order; if the decoding or
// fn fails, or panics, it returns the error and the index of the record
// (so that the caller can say where it lies). The records are decoded on
// a goroutine of its own, a chunk ahead of fn, which applies them: a
// replay is half decoding, and a machine has more than one core. The
// goroutine ends before replayPayloads returns, also when fn fails.
func replayPayloads(payloads [][]byte, fn func(record) error) (at int, err error) {
	if len(payloads) <= replayChunk {
		err = guardDecode(func() error { return decodeChunk(payloads, &codec.Words{}, &at, fn) })
		return at, err
	}
	type chunk struct {
		recs []record
		err  error
		at   int // the index of the record err is about
	}
	out, free, stop := make(chan chunk, 2), make(chan []record, 3), make(chan struct{})
	for range cap(free) {
		free <- make([]record, 0, replayChunk)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(out)
		words := &codec.Words{}
		for i := 0; i < len(payloads); i += replayChunk {
			var recs []record
			select {
			case recs = <-free:
			case <-stop:
				return
			}
			var c chunk
			c.err = guardDecode(func() error {
				return decodeChunk(payloads[i:min(i+replayChunk, len(payloads))], words, &c.at, func(rec record) error {
					recs = append(recs, rec)
					return nil
				})
			})
			c.recs, c.at = recs, i+c.at
			select {
			case out <- c:
			case <-stop:
				return
			}
			if c.err != nil {
				return
			}
		}
	}()
	defer func() { close(stop); <-done }()
	at = 0 // the index of the record being applied
	err = guardDecode(func() error {
		for c := range out {
			for i := range c.recs {
				if err := fn(c.recs[i]); err != nil {
					return err
				}
				at++
			}
			if c.err != nil {
				at = c.at
				return c.err
			}
			clear(c.recs) // what they point to is the ledger's now, or garbage
			free <- c.recs[:0]
		}
		return nil
	})
	return at, err
}

// replayChunk is how many records replayPayloads decodes at a time.
const replayChunk = 2048

// decodeChunk hands fn each record of payloads, decoded; *at is the index
// of the record being decoded or handed, where it stops if either fails.
func decodeChunk(payloads [][]byte, words *codec.Words, at *int, fn func(record) error) error {
	for i, p := range payloads {
		*at = i
		rec, err := unpackData(p, words)
		if err != nil {
			return err
		}
		if err := fn(rec); err != nil {
			return err
		}
	}
	return nil
}

// guardDecode runs f, a decoding or a replay, with a panic made its
// error: the decoder reads what a disk held (a panic is a bug, and Open
// fails rather than the process).
func guardDecode(f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("a record that cannot be read: panic: %s", panicText(r))
		}
	}()
	return f()
}

func (j *fileJournal) Compact(keep []Record) error {
	return j.l.Compact(payloadsOf(keep))
}

func (j *fileJournal) Close() error { return j.l.Close() }

// TornTail names the torn record the journal cut off when it opened, or
// "".
func (j *fileJournal) TornTail() string {
	if t := j.l.Torn(); t != nil {
		return fmt.Sprintf("%s at offset %d (%d bytes)", t.File, t.Offset, t.Bytes)
	}
	return ""
}

// Compaction.

// compactEvery is how many tasks must at least have been forgotten since
// the last compaction before the journal is compacted again.
const compactEvery = 1000

// compactDue says the journal is worth compacting: at least compactEvery
// tasks, and at least as many as are kept, were forgotten since the last
// compaction. So a compaction rewrites no more than it drops, and its cost
// per forgotten task stays constant however many tasks retention keeps.
func (l *ledger) compactDue() bool {
	return l.forgotten-l.compactedAt >= max(compactEvery, uint64(len(l.tasks)))
}

// snapshotRecords is the ledger as records, for a compacted journal: the
// records that rebuild exactly the tasks in memory (their spec, each
// attempt's versions as far as a replay needs them, sessions, stops),
// the closure records kept, and the epoch. Nothing forgotten is in them.
// Notifications are left out: compaction waits until none is out.
// m.mu is held.
func (m *Manager) snapshotRecords() []record {
	var out []record
	seq := uint64(0)
	add := func(r record) {
		seq++
		r.seq = seq
		out = append(out, r)
	}
	for _, e := range m.order {
		ti := e.info
		add(record{kind: recTaskLaunched, task: e.id, at: ti.launchedAt, recordExt: &recordExt{spec: ti}})
		atts := e.atts()
		bound := make(map[string]bool, len(atts))
		for i, a := range atts {
			created := Attempt{ID: a.ID, Number: a.Number, Token: a.Token, Model: a.Model, Status: StatusPending, Pending: PendingAwaitingSession}
			add(record{kind: recAttemptCreated, task: e.id, at: ti.launchedAt, attempt: created})
			if a.SessionID != "" {
				run := created
				run.Status, run.Pending, run.SessionID, run.StartedAt = StatusRunning, "", a.SessionID, a.StartedAt
				add(record{kind: recSessionBound, task: e.id, at: a.StartedAt, attempt: run})
				bound[a.SessionID] = true
			}
			if i == e.current && e.inv != nil { // while the task is live, as they were made
				for _, r := range e.inv.records(e.id) {
					add(r)
				}
			}
			switch {
			case a.Status.Terminal():
				fin := record{kind: recAttemptFinal, task: e.id, at: a.CompletedAt, attempt: a}
				if i == e.current {
					fin.evidence = e.ev()
				}
				add(fin)
			case a.Status == StatusPending && a.Pending != PendingAwaitingSession:
				add(record{kind: recAttemptPending, task: e.id, at: ti.launchedAt, attempt: a})
			}
		}
		for _, s := range e.sessionList() {
			if !bound[s] {
				if ref, ok := m.led.bySession[s]; ok && ref.e == e {
					add(record{kind: recSessionOrphan, task: e.id, at: ti.launchedAt, attempt: *ref.attempt(), recordExt: &recordExt{session: s}})
				}
			}
		}
		if e.stop != "" {
			add(record{kind: recStopRequested, task: e.id, at: ti.launchedAt, attempt: *e.cur(), recordExt: &recordExt{stop: e.stop, note: "restored"}})
		}
	}
	for _, c := range m.led.closures {
		add(c)
	}
	if m.notes.seq > 0 {
		// No notification is out, so none is kept; the numbering goes on
		// from the last one after a restart (Notification.Seq, and IDs a
		// sequential generator makes): a delivery record is its mark.
		add(record{kind: recNotifyDelivered, at: m.now(), recordExt: &recordExt{note: "kept by the compaction as the last notification made", notice: &notice{seq: m.notes.seq, id: m.notes.lastID}}})
	}
	add(record{kind: recEpoch, recordExt: &recordExt{epoch: m.changes.epoch, note: m.epochNote(epochCompacted)}})
	return out
}

// maybeCompact compacts the journal once enough tasks were forgotten and
// no notification is out (their records would be needed again): from the
// shell, never under m.mu.
func (m *Manager) maybeCompact() {
	j := m.cfg.journal
	if j == nil {
		return
	}
	m.mu.Lock()
	m.led.compactQueued = false
	due := m.led.compactDue() && m.notes.lanes.Pending() == 0 && m.led.notesOut == 0
	if !due {
		m.mu.Unlock()
		return
	}
	recs := m.snapshotRecords()
	m.led.compactedAt = m.led.forgotten
	// The order lock is taken before m.mu is released, as a commit takes
	// it: a batch committed before the snapshot is appended before the
	// swap (and the snapshot holds what it did); one committed after it
	// waits, and is appended after the compacted records. The records are
	// values: they are encoded under the order lock alone, as a commit's.
	m.out.order.Lock()
	m.mu.Unlock()
	var err error
	if fj, ok := j.(*fileJournal); ok {
		err = fj.compactRecs(recs)
	} else {
		var batch []Record
		if batch, err = encodeAll(recs); err == nil {
			err = guardJournal("Compact", func() error { return j.Compact(batch) })
		}
	}
	m.out.order.Unlock()
	if err != nil {
		m.poison(err)
	}
}

// Looking inside a file journal.

// JournalView is what a file journal holds, as ReadFileJournal read it.
type JournalView struct {
	// Tasks are the tasks its records describe, in launch order, as a
	// replay projects them (process-local fields empty).
	Tasks []Task
	// Records are its records, in sequence order, each with what it changed.
	Records []RecordView
	// Closures are the branch closures it recorded, in order.
	Closures []ClosureRecord
	// Torn says where a torn last record was found ("" if none): a crash
	// mid-write, or a write in progress. It is left as it is.
	Torn string
}

// RecordView is one journal record as ReadFileJournal shows it.
type RecordView struct {
	// Seq is the record's sequence number; Kind its kind ("session_bound").
	Seq  uint64 `json:"seq"`
	Kind string `json:"kind"`
	// TaskID and AttemptID name what it is about ("" for a manager-wide
	// record).
	TaskID    string `json:"taskID,omitempty"`
	AttemptID string `json:"attemptID,omitempty"`
	// At is when it was committed.
	At time.Time `json:"at"`
	// Change says, in a line, what the record changed.
	Change string `json:"change"`
}

// ReadFileJournal reads the file journal in dir without opening it: no
// lock is taken and no byte is changed, so it works on a journal whose
// writer is still running (it sees what was written so far) and on one a
// crash left (a torn tail is reported in Torn, not cut off). A corrupt
// record before the tail, or one that cannot be read or replayed, is an
// error naming the file and offset (and the record's kind).
func ReadFileJournal(dir string) (v JournalView, err error) {
	defer func() { // a journal bgtask did not write must not crash the reader
		if r := recover(); r != nil {
			v, err = JournalView{}, fmt.Errorf("bgtask: journal %s cannot be read: %s", dir, panicText(r))
		}
	}()
	payloads, torn, err := wal.ReadOnly(dir, wal.Options{})
	if err != nil {
		return JournalView{}, err
	}
	if torn != nil {
		v.Torn = fmt.Sprintf("%s at offset %d (%d bytes)", torn.File, torn.Offset, torn.Bytes)
	}
	recs := make([]record, 0, len(payloads))
	words := &codec.Words{}
	l := newLedger(nil)
	// A journal bgtask did not write must not crash the reader: at is the
	// record being read, if it does.
	at := 0
	err = guardDecode(func() error {
		for i, p := range payloads {
			at = i
			rec, err := unpackData(p, words)
			if err != nil {
				return err
			}
			recs = append(recs, rec)
			v.Records = append(v.Records, RecordView{Seq: rec.seq, Kind: rec.kind.String(), TaskID: rec.task, AttemptID: rec.attempt.ID, At: rec.at, Change: describe(&rec)})
			if _, err := l.replayOne(rec); err != nil {
				return &recordError{seq: rec.seq, kind: rec.kind, err: err}
			}
		}
		return nil
	})
	if err != nil {
		loc, _ := wal.Locate(dir, wal.Options{}, at)
		return JournalView{}, placeAt(loc, payloads[at], err)
	}
	for _, rec := range recs {
		if rec.kind == recTaskLaunched {
			// A launch without its first attempt (a journal that did not
			// keep its commit whole) never happened: Open drops it too.
			if e := l.tasks[rec.task]; e != nil && e.count() > 0 {
				v.Tasks = append(v.Tasks, e.project())
			}
		}
	}
	for _, c := range l.closures {
		v.Closures = append(v.Closures, c.closure.clone())
	}
	return v, nil
}

// describe says in a line what rec changed. A record that lacks what its
// kind carries (a journal not written by bgtask) is named by its kind.
func describe(rec *record) string {
	a := &rec.attempt
	x := rec.recordExt
	if x == nil {
		x = &noExt
	}
	switch {
	case rec.kind == recTaskLaunched && x.spec == nil,
		(rec.kind == recNotifyProduced || rec.kind == recNotifyDelivered) && x.notice == nil,
		rec.kind == recBranchClosed && x.closure == nil,
		(rec.kind == recInvocationAdmitted || rec.kind == recAnswerFiled) && rec.inv == nil,
		rec.kind == recAnswerFiled && rec.inv.Answer == nil:
		return rec.kind.String() + " (incomplete)"
	}
	n := "attempt " + strconv.Itoa(a.Number)
	switch rec.kind {
	case recTaskLaunched:
		return fmt.Sprintf("launched under %s on %v", x.spec.parent, x.spec.models)
	case recAttemptCreated:
		return n + " created on " + a.Model.String()
	case recAttemptPending:
		return n + " pending: " + string(a.Pending)
	case recStartRequested:
		return "StartSession asked for " + n
	case recSessionBound:
		return n + " running in session " + a.SessionID
	case recAttemptFinal:
		s := n + " " + string(a.Status)
		if a.Error != "" {
			s += ": " + textbound.OneLine(a.Error, 120)
		}
		return s
	case recRetryScheduled:
		return "retry scheduled after " + n + " failed"
	case recSessionOrphan:
		return "session " + x.session + " of superseded " + n + " orphaned (aborted)"
	case recStopRequested:
		return "stop requested by " + x.note + ": it ends " + string(x.stop)
	case recStopWithdrawn:
		return "stop withdrawn, the abort failed: " + textbound.OneLine(x.note, 120)
	case recAbortRequested:
		return "AbortSession asked for session " + a.SessionID
	case recNotifyProduced:
		return fmt.Sprintf("notification %d (%s) for %s produced", x.notice.seq, x.notice.kind, x.notice.parent)
	case recNotifyDelivered:
		if x.note != "" {
			return fmt.Sprintf("notification %d %s", x.notice.seq, x.note)
		}
		return fmt.Sprintf("notification %d delivered", x.notice.seq)
	case recBranchClosed:
		c := x.closure
		return fmt.Sprintf("closure of %q recorded: %d stopped, %d failed", c.SessionID, len(c.Stopped), len(c.Failed))
	case recClosureOpened:
		return "closure opened: its fence is up"
	case recClosureDropped:
		return "closure ended with nothing to record"
	case recEpoch:
		return "process life " + strconv.FormatUint(x.epoch, 10) + " began"
	case recInvocationAdmitted:
		return fmt.Sprintf("invocation %d admitted: %s", rec.inv.N, textbound.OneLine(rec.inv.Prompt, 80))
	case recAnswerFiled:
		return fmt.Sprintf("invocation %d answered (%s)", rec.inv.N, rec.inv.Answer.Status)
	}
	return rec.kind.String()
}
