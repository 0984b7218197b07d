package bgtask

import (
	"errors"
	"fmt"
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
	// cools are the cooldowns this ledger recorded (recCooldownBegan),
	// by key, less those reset (recHealthReset): a restart takes back
	// those not over, and a compaction keeps them.
	cools map[string]coolRec
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
	// crossings are the budget thresholds the records just written
	// reached, for the Manager to act on (budgetCrossed); a replay's are
	// dropped, acted on in their own life.
	crossings []crossing
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
	case recHealthReset, recCooldownBegan:
		if rec.recordExt == nil || (rec.kind == recCooldownBegan && (rec.cool == nil || rec.cool.Key == "")) {
			return nil, fmt.Errorf("ledger: a %s record must carry its cooldown", rec.kind)
		}
		l.recordCool(rec)
		return nil, nil
	case recBranchClosed:
		if rec.recordExt == nil || rec.closure == nil {
			return nil, errors.New("ledger: a closure record must carry its closure")
		}
		l.stamp(&rec)
		l.closures = append(l.closures, rec)
		return nil, nil
	case recSessionBound, recSessionOrphan:
		if err := l.checkTree(rec); err != nil {
			return nil, err
		}
	}
	e, err := l.apply(rec)
	l.crossings = nil // each threshold was acted on in its own life, in the commit that reached it
	return e, err
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
			return fmt.Errorf("ledger: session %q launched task %s, an ancestor of the task it would run (or itself)", sid, x.id)
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
	l.budgetLive(e, false) // it never was: its reservation goes back
	l.budgetForgot(e)
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
func (l *ledger) recordClosure(cr ClosureReport, task string, opened uint64) {
	rec := record{kind: recBranchClosed, task: task, at: cr.At, recordExt: &recordExt{closure: &cr, opened: opened}}
	l.stamp(&rec)
	l.closures = append(l.closures, rec)
}

// recordCool commits a cooldown begun, or a reset (its key is the note),
// and keeps what it says in cools.
func (l *ledger) recordCool(rec record) {
	if l.cools == nil {
		l.cools = make(map[string]coolRec)
	}
	if rec.kind == recCooldownBegan {
		l.cools[rec.cool.Key] = *rec.cool
	} else {
		delete(l.cools, rec.note)
	}
	l.stamp(&rec)
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
		return nil, errors.New("ledger: a record to resolve must name its task")
	}
	var e *entry
	if rec.kind == recTaskLaunched {
		if rec.recordExt == nil || rec.spec == nil || rec.spec.id != rec.task {
			return nil, errors.New("ledger: a launch record must carry its task's spec")
		}
		if err := rec.spec.check(); err != nil {
			return nil, err
		}
		if _, dup := l.tasks[rec.task]; dup {
			return nil, fmt.Errorf("task id %q is already in use", rec.task)
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
	if e.cold != "" && rec.kind != recUsage { // usage reads the attempts only: a frozen task stays so
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
	l.stamp(rec)              // handed to the tap (a journal, a test): memory keeps only the projection
	if rec.kind != recUsage { // usage changes no state: an ended task's end stays its final record (recovery's rounds read it)
		e.seq = rec.seq
	}
	switch rec.kind {
	case recTaskLaunched, recAttemptCreated, recSessionBound, recSessionOrphan:
		l.widened++
	}
	l.update(e, ref, rec)
	return nil
}

// update applies a checked record to e's projection and the indexes.
func (l *ledger) update(e *entry, ref attemptRef, rec *record) {
	switch rec.kind {
	case recTaskLaunched:
		l.linkBudget(e)
	case recUsage:
		l.countUsage(e, rec)
	case recAttemptCreated:
		if e.current >= 0 { // a retry: the task lives again
			defer l.budgetLive(e, true)
		}
		if len(e.attempts) == cap(e.attempts) && e.info.maxAttempts > len(e.attempts) {
			// Out of first's room: make room for every attempt the task may
			// make, once (for a few: MaxAttempts has no upper bound, and a
			// task that fails over that often grows as any slice does).
			e.attempts = append(make([]Attempt, 0, roomFor(e.info.maxAttempts)), e.attempts...)
		}
		e.attempts = append(e.attempts, rec.attempt)
		e.current = len(e.attempts) - 1
		e.state, e.activity = rec.attempt.Status, activityNone
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
			l.budgetRan(e)
		case recAttemptFinal:
			e.evidence = rec.evidence
			if ref.index == e.current {
				l.budgetLive(e, false)
			}
		}
		e.revision++
	case recSessionOrphan:
		l.indexSession(e, ref, rec.session)
	case recModelSkipped:
		e.attempts[ref.index] = rec.attempt
		sk := *rec.skip
		sk.At = rec.at.Round(0)
		e.skips = append(e.skips, sk)
		e.revision++
	case recStopRequested:
		e.stop, e.stopBy = rec.stop, rec.note
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
			return fmt.Errorf("attempt id %q is already in use", rec.attempt.ID)
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
	case recUsage:
		return checkUsage(l, e, rec)
	}
	return l.checkAttemptWrite(e, ref, rec)
}

// checkAttemptWrite refuses a record that rewrites an attempt (ref) the
// state machine does not allow: only the current attempt changes, along
// an allowed transition, keeping its identity and its session.
func (l *ledger) checkAttemptWrite(e *entry, ref attemptRef, rec *record) error {
	if ref.e != e || ref.attempt().ID != rec.attempt.ID {
		return fmt.Errorf("ledger: unknown attempt %q", rec.attempt.ID)
	}
	old := ref.attempt()
	if rec.kind == recModelSkipped {
		return checkSkip(e, ref, rec)
	}
	if rec.kind == recSessionOrphan {
		if rec.recordExt == nil || rec.session == "" {
			return errors.New("ledger: an orphaned session must be named")
		}
		if _, taken := l.bySession[rec.session]; taken {
			return fmt.Errorf("session %q is already indexed", rec.session)
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
		return fmt.Errorf("ledger: attempt %s identity changed", old.ID)
	}
	if old.SessionID != "" && rec.attempt.SessionID != old.SessionID {
		return fmt.Errorf("ledger: attempt %s is bound to session %s", old.ID, old.SessionID)
	}
	if rec.kind != recSessionBound && rec.attempt.SessionID != old.SessionID {
		return fmt.Errorf("ledger: attempt %s: only a bind gives it a session", old.ID)
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
		if rec.attempt.SessionID == "" {
			return errors.New("ledger: bind with an empty session id")
		}
		if prev, taken := l.bySession[rec.attempt.SessionID]; taken && prev.attempt().ID != old.ID && !continues(e, prev, rec.attempt.SessionID) {
			return fmt.Errorf("session %q already belongs to attempt %s", rec.attempt.SessionID, prev.attempt().ID)
		}
	}
	return nil
}

// checkSkip refuses a skip the chain does not allow: only the current
// attempt, pending and never started, moves from the model its place in
// the chain names (the one skipped) to the chain's next, keeping its
// identity.
func checkSkip(e *entry, ref attemptRef, rec *record) error {
	old, a := ref.attempt(), rec.attempt
	if rec.recordExt == nil || rec.skip == nil {
		return errors.New("ledger: a skip must name the model it skipped")
	}
	if !ref.isCurrent() || old.Status != StatusPending || old.SessionID != "" {
		return fmt.Errorf("%w: only the current attempt, pending with no session, skips a model", errBadTransition)
	}
	pos := e.chainPos(old.Number)
	if pos+1 >= len(e.info.models) || rec.skip.Model != old.Model || old.Model != e.info.models[pos] || a.Model != e.info.models[pos+1] || rec.skip.Attempt != old.Number {
		return fmt.Errorf("ledger: attempt %s: a skip moves it from its place in the chain to the next", old.ID)
	}
	a.Model = old.Model
	if a != *old {
		return fmt.Errorf("ledger: attempt %s: a skip changes its model only", old.ID)
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
