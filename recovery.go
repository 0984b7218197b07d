package bgtask

import (
	"bytes"
	"context"
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
)

// Restart recovery: the journal replayed (Manager.restore), then what it
// says was live reconciled with the host (Manager.reconcile).

// recovery is what a replay found that a restart must act on.
type recovery struct {
	started map[string]bool // attempts whose StartSession was asked for (they may have a session)
	// coolSince is, for each attempt that waited for a cooldown, when it
	// began to (its first attempt_pending of reason cooldown): the wait's
	// MaxWait counts from there across a restart.
	coolSince map[string]time.Time
	notes     map[uint64]*notice     // notifications produced and not delivered, by Notification.Seq
	pending   chan struct{}          // one token per recovery effect still out
	left      int                    // recovery effects queued
	closing   map[uint64]openClosure // closures in progress at the crash, by opening record
	lost      []*notice              // notifications given up before the restart, in that order

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

	// restart: the journal held a previous life's records; counts is what
	// the recovery found and did (guarded by m.mu: answers land on other
	// goroutines), logged and measured once it is over (recovered).
	restart bool
	counts  RecoveryCounts
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
// contextReplayer's replay. m.mu is held.
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
		if cr, ok := m.cfg.journal.(contextReplayer); ok {
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
			m.replayNotice(rv, &rec)
		case recStartRequested:
			rv.started[rec.attempt.ID] = true
		case recAttemptPending:
			if rec.attempt.Pending == PendingCooldown {
				if rv.coolSince == nil {
					rv.coolSince = make(map[string]time.Time)
				}
				if _, ok := rv.coolSince[rec.attempt.ID]; !ok {
					rv.coolSince[rec.attempt.ID] = rec.at
				}
			}
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
				e.info.sessions = m.sessionsOf(e.info) // what this process's host can do, not the last one's
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

// replayNotice keeps what a replayed notification record says: a produced
// notification is owed until its delivery record comes (a given-up one is in
// Dropped().Undelivered again), and the notification sequence resumes past
// it. m.mu is held.
func (m *Manager) replayNotice(rv *recovery, rec *record) {
	if rec.notice.seq >= m.notes.seq && rec.notice.id != "" {
		m.notes.lastID = rec.notice.id
	}
	m.notes.seq = max(m.notes.seq, rec.notice.seq) // a delivery too: a compaction keeps the last as its mark
	if rec.kind == recNotifyDelivered {
		if n := rv.notes[rec.notice.seq]; n != nil && strings.HasPrefix(rec.note, "given up") {
			rv.lost = append(rv.lost, n) // Dropped().Undelivered outlives the process
		}
		delete(rv.notes, rec.notice.seq)
		return
	}
	rv.notes[rec.notice.seq] = rec.notice
	switch rec.notice.kind {
	case NotifyFinalSummary:
		rv.finals[rec.task] = true
	case NotifyAllComplete:
		for _, id := range rec.notice.tasks {
			rv.roundTold[id] = true
		}
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
			m.logLocked(slog.LevelWarn, "the journal holds a launch without its first attempt (its commit was not kept whole): the task is dropped", slog.String("task", e.id))
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

// skipPast moves g's counters past every id a replayed record holds
// (tasks, attempts, run tokens, notifications), so that a Manager reopened
// on a journal never makes an id twice.
func (s *seqIDs) skipPast(rec *record) {
	bump := func(c *atomic.Uint64, kind string, id string) {
		prefix := kind + "-"
		if n, err := strconv.ParseUint(strings.TrimPrefix(id, prefix), 10, 64); err == nil && strings.HasPrefix(id, prefix) && n > c.Load() {
			c.Store(n)
		}
	}
	bump(&s.task, idTask, rec.task)
	bump(&s.attempt, idAttempt, rec.attempt.ID)
	bump(&s.run, idToken, rec.attempt.Token)
	if rec.recordExt != nil && rec.notice != nil {
		bump(&s.note, idNotification, rec.notice.id)
	}
}

// lostAcrossRestart is the error of a run the host reported gone after a
// restart, or that no host could report on (StatusHost missing, FuncHost).
const lostAcrossRestart = "lost across restart"

// startOutcomeUnknown is the error of a run whose StartSession was asked
// for before a restart and whose session no host could find.
const startOutcomeUnknown = "start outcome unknown after restart"

// reconcile decides what each task that was live at the crash becomes,
// after restore: a run that may have a child is asked about (a recovery
// effect, with a StatusHost) or ends interrupt; a run that never asked
// for a child is admitted again; the notifications produced and not
// delivered are queued again first, in their order. m.mu is held.
func (m *Manager) reconcile(rv *recovery) {
	now := m.now()
	_, asks := m.hosts.main.(StatusHost)
	m.redeliverAll(rv)
	m.retryOwed(rv, now)
	m.roundsOwed(rv)
	n := &rv.counts
	n.Tasks = len(m.order)
	for _, e := range slices.Clone(m.order) { // an end here may forget an ended task (retention)
		if e.terminal() {
			continue
		}
		n.Live++
		a := *e.cur()
		switch {
		case e.info.inProcess && (e.stop == "" || a.Status == StatusRunning || rv.started[a.ID]):
			// Its own function (Spec.Run) died with the process, and no
			// host knows its session: never asked about, never started again.
			why := lostAcrossRestart
			if a.Status != StatusRunning && rv.started[a.ID] {
				why = startOutcomeUnknown
			}
			m.finalize(e, a.ID, StatusInterrupt, why, "", now)
			n.Interrupted++
			continue
		case a.Status == StatusRunning || rv.started[a.ID]:
			// It may have a child: only the host can say.
			if !asks {
				why := lostAcrossRestart
				if a.Status != StatusRunning {
					why = startOutcomeUnknown
				}
				m.finalize(e, a.ID, StatusInterrupt, why, "", now)
				n.Interrupted++
				continue
			}
			fx := effect{kind: fxRecover, e: e, run: runOfAttempt(a), rv: rv, stopped: e.stop != ""}
			if a.Status == StatusPending {
				// The question stands for the start whose answer was lost: a
				// stop asked meanwhile (a deadline that passed while nobody
				// ran) waits for it as for a start in flight, so that a
				// session the host finds is stopped through it, never left
				// running unknown.
				m.calls.startSeq++
				fx.seq = m.calls.startSeq
			}
			if m.effect(fx) {
				rv.left++
				if fx.seq != 0 {
					m.calls.inflight[fx.seq] = struct{}{}
					e.rt.startSeq = fx.seq
				}
			} else {
				m.finalize(e, a.ID, StatusInterrupt, lostAcrossRestart, "", now)
				n.Interrupted++
			}
		case e.stop != "":
			m.stopRun(e, now) // no child was ever asked for: it ends now
			n.Stopped++
		default:
			if at, ok := rv.coolSince[a.ID]; ok && m.calls.health != nil {
				e.rt.coolSince = at.UnixNano() // its wait for a cooldown goes on, from when it began
			}
			m.admit(e, a) // it never asked for a child: ask now
			n.Started++
		}
		if !e.terminal() && (e.stop == "" || e.stop == StatusError) && e.info.opt().timeout > 0 {
			m.armDeadline(e, Attempt{}) // due from the launch: at once if it passed meanwhile, or it was asked already
		}
	}
	rv.pending = make(chan struct{}, rv.left)
}

// redeliverAll queues again, in their order, the notifications produced
// before the restart and not delivered, and keeps those given up for
// Dropped().Undelivered. It comes before anything this life may tell a
// parent (an owed retry or round, a run that ends as it is taken back),
// whose notifications are later and must be delivered after. m.mu is held.
func (m *Manager) redeliverAll(rv *recovery) {
	n := &rv.counts
	for _, lost := range rv.lost {
		if len(m.notes.lost) < m.cfg.undeliveredLimit {
			m.notes.lost = append(m.notes.lost, m.noticeNotification(lost))
			n.Undelivered++
		}
	}
	for _, seq := range slices.Sorted(maps.Keys(rv.notes)) {
		if m.redeliver(rv.notes[seq]) {
			n.Redelivered++
		}
	}
}

// retryOwed starts the next attempt of each task whose retry was durable
// (retry_scheduled) while the attempt it chose was not: the retry was
// decided, so it goes on, and its parent is told as a live retry tells it.
// A task that cannot go on (no attempt left) ends as its records say.
// m.mu is held.
func (m *Manager) retryOwed(rv *recovery, now time.Time) {
	l := m.led
	for _, e := range m.order {
		if !rv.retry[e] {
			continue
		}
		failed, n := *e.cur(), e.count()+1
		if e.terminal() && failed.Status == StatusError && n <= e.info.maxAttempts {
			next, err := l.newAttempt(n, e.modelFor(n))
			if err == nil && m.commit(e, record{kind: recAttemptCreated, task: e.id, at: now, attempt: next}) {
				rv.counts.Retried++
				if m.cfg.notifier != nil {
					m.notify(e, NotifyRetryScheduled, retryScheduledText(failed, *e.cur()))
				}
				continue
			}
		}
		if e.terminal() { // counted ended as afterReplay counts the others
			l.liveEnded(e)
			l.ended = append(l.ended, e)
		}
	}
}

// roundsOwed rebuilds each parent's rounds from the records (a round: its
// tasks from a launch while the parent had none live until the last of
// them ended) and, with a Notifier, tells what is owed: each ended task
// whose final summary was never produced gets one, then each round whose
// tasks all ended and whose all_complete was never produced gets it. A
// round still live counts its ended tasks too, as it did before the
// restart. m.mu is held.
func (m *Manager) roundsOwed(rv *recovery) {
	if m.cfg.notifier == nil {
		return
	}
	for _, e := range m.order {
		if e.terminal() && !rv.finals[e.id] && rv.owed(e.seq) {
			m.answerAtEnd(e)
			m.notify(e, NotifyFinalSummary, finalSummaryText(e.project()))
			rv.counts.Owed++
		}
	}
	type group struct {
		tasks []*entry
		live  int
		end   uint64 // the last end of its ended tasks
	}
	byParent := make(map[string][]*group)
	var parents []string
	for _, e := range m.order {
		p := e.info.parent
		gs := byParent[p]
		if len(gs) == 0 {
			parents = append(parents, p)
		}
		if len(gs) == 0 || (gs[len(gs)-1].live == 0 && rv.launchSeq[e] > gs[len(gs)-1].end) {
			gs = append(gs, &group{})
			byParent[p] = gs
		}
		g := gs[len(gs)-1]
		g.tasks = append(g.tasks, e)
		if e.terminal() {
			g.end = max(g.end, e.seq)
		} else {
			g.live++
		}
	}
	for _, p := range parents {
		for _, g := range byParent[p] {
			if g.live > 0 {
				r := &round{parent: p, live: g.live, tasks: g.tasks}
				m.notes.rounds[p] = r
				for _, e := range g.tasks {
					if !e.terminal() {
						e.rt.round = r
					}
				}
				continue
			}
			told := false
			for _, e := range g.tasks {
				told = told || rv.roundTold[e.id]
			}
			if !told && rv.owed(g.end) {
				tasks := make([]Task, 0, len(g.tasks))
				for _, e := range g.tasks {
					tasks = append(tasks, e.project())
				}
				m.push(allComplete(p, tasks))
				rv.counts.Owed++
			}
		}
	}
}

// redeliver queues again a notification produced before a restart and
// not delivered, with its ID, sequence and text, and reports whether it
// did (not without a Notifier). m.mu is held.
func (m *Manager) redeliver(n *notice) bool {
	if m.cfg.notifier == nil || m.cfg.notesAtCommit { // delivered with its commit
		return false
	}
	m.queueNote(m.noticeNotification(n))
	return true
}

// noticeNotification is the notification a recorded notice was, its task
// snapshots taken now. m.mu is held.
func (m *Manager) noticeNotification(n *notice) Notification {
	out := Notification{ID: n.id, Seq: n.seq, Kind: n.kind, ParentSessionID: n.parent, Text: n.text, Invocation: n.invocation}
	if ref, ok := m.led.attemptOf(n.attempt); ok {
		out.TaskID, out.Task = ref.e.id, ref.e.project()
	}
	for _, id := range n.tasks {
		if e := m.led.tasks[id]; e != nil {
			out.Tasks = append(out.Tasks, e.project())
		}
	}
	return out
}

// recoverRun asks the host what became of run a of e after a restart (a
// recovery effect): the session it may have created (by attempt id, when
// it was never bound), and that session's state. The answer comes back as
// recoveredIn.
func (m *Manager) recoverRun(fx *effect) {
	e, a := fx.e, fx.run.attempt()
	defer func() { fx.rv.pending <- struct{}{} }()
	sh := m.hosts.main.(StatusHost)
	in := recoveredIn{e: e, a: a, sid: a.SessionID, stopAsked: fx.stopped, seq: fx.seq, rv: fx.rv}
	ctx := withRun(m.life.ctx, RunRef{TaskID: e.id, AttemptID: a.ID, Token: a.Token}, callStart)
	func() {
		defer func() {
			if r := recover(); r != nil {
				in.err = fmt.Errorf("StatusHost panicked: %s", panicText(r))
			}
		}()
		if in.sid == "" {
			req := SessionRequest{TaskID: e.id, AttemptID: a.ID, AttemptNumber: a.Number, Token: a.Token,
				ParentSessionID: e.info.parent, Model: a.Model, Agent: e.info.agent, Prompt: e.info.prompt}
			in.sid, in.err = sh.FindSession(ctx, req)
			if in.err != nil || in.sid == "" {
				return
			}
		}
		in.report, in.err = sh.SessionStatus(ctx, in.sid)
	}()
	if in.err != nil {
		in.text = safeText(in.err) // user code: before the lock
	}
	if in.report.State == SessionStateEnded && in.report.End.Kind == SessionError {
		err := in.report.End.Err
		if err == nil {
			err = errors.New("session error with no detail")
		}
		in.f = m.classify(err)
	}
	_ = m.step(&in)
}

// onRecovered decides what the host said of a run after a restart: alive,
// it runs on (re-adopted: bound if it was not, its stall watch armed, and
// stopped if a stop was asked); ended, it ends with that evidence; gone or
// unknown, it is interrupt — never cancelled, never completed without
// evidence. m.mu is held.
func (m *Manager) onRecovered(in *recoveredIn) {
	e, a := in.e, in.a
	if in.seq != 0 { // the start whose answer was lost has its answer now
		delete(m.calls.inflight, in.seq)
		if e.rt.startSeq == in.seq {
			e.rt.startSeq = 0
		}
		defer m.signal() // Shutdown and closures wait for starts to return
	}
	cur := e.cur()
	if cur.ID != a.ID || cur.Token != a.Token || cur.Status.Terminal() {
		if _, taken := m.led.bySession[in.sid]; in.sid != "" && in.report.State == SessionStateAlive && a.SessionID == "" && !taken {
			// Found for a run that ended meanwhile: indexed (its events are
			// stale) and stopped, never left running unknown.
			rec, err := m.led.orphanRecord(e, a.ID, in.sid, m.now())
			m.commitBuilt(e, rec, err)
			m.abortOrphan(e, a, in.sid)
		}
		in.endedMeanwhile(e)
		return
	}
	now := m.now()
	n := in.counts()
	switch {
	case in.err != nil:
		why := lostAcrossRestart + ": the host could not say what became of it: " + in.text
		m.finalize(e, a.ID, StatusInterrupt, why, "", now)
		n.Interrupted++
		return
	case in.sid == "" && e.stop != "":
		m.stopRun(e, now) // no child was ever made: the stop ends it now, as it ends a run that never started
		n.Stopped++
		return
	case in.sid == "":
		m.finalize(e, a.ID, StatusInterrupt, startOutcomeUnknown, "", now)
		n.Interrupted++
		return
	case in.report.State == SessionStateGone && e.stop != "" && !in.stopAsked:
		// A stop asked since the question (a deadline that passed while
		// nobody ran, a cancel) had its abort sent: that abort may be what
		// ended the session before the host was asked. The run is not
		// running, and it ends as the stop's confirmed abort ends it.
		if ref, ok := m.led.attemptOf(a.ID); ok {
			m.endStopped(ref, "", now)
		}
		n.Stopped++
		return
	case in.report.State == SessionStateGone || (in.report.State != SessionStateAlive && in.report.State != SessionStateEnded):
		m.finalize(e, a.ID, StatusInterrupt, lostAcrossRestart, "", now)
		n.Interrupted++
		return
	}
	m.readopt(in, now)
}

// counts is what the recovery asking counts (a scratch copy for an
// answer with no recovery: tests that decide one by hand).
func (in *recoveredIn) counts() *RecoveryCounts {
	if in.rv == nil {
		return new(RecoveryCounts)
	}
	return &in.rv.counts
}

// endedMeanwhile counts a run that ended, or was replaced, while the
// host's answer about it was outstanding — a deadline that passed across
// the restart, whose abort landed first: by how it ended. m.mu is held.
func (in *recoveredIn) endedMeanwhile(e *entry) {
	n := in.counts()
	status := e.cur().Status
	for _, a := range e.atts() {
		if a.ID == in.a.ID {
			status = a.Status
		}
	}
	switch {
	case status == StatusInterrupt:
		n.Interrupted++
	case e.stop != "":
		n.Stopped++
	default:
		n.Ended++
	}
}

// readopt takes back a current run whose session the host found alive or
// ended after a restart: a pending run is bound to it, a running one has
// its watches armed again; an ended session's last event is applied as if
// it arrived now, and a stop asked before the restart goes on. m.mu is
// held.
func (m *Manager) readopt(in *recoveredIn, now time.Time) {
	e, a := in.e, in.a
	n := in.counts()
	if e.cur().Status == StatusPending {
		if owner, taken := m.led.bySession[in.sid]; taken && owner.e != e {
			m.finalize(e, a.ID, StatusInterrupt, startOutcomeUnknown, "", now)
			n.Interrupted++
			return
		}
		if !m.bindRun(e, a.ID, in.sid, now) {
			// The ledger refused the session the host found (logged: one
			// of another run of the task, say): it cannot be taken back,
			// and the run is not left pending for a start that never answers.
			m.finalize(e, a.ID, StatusInterrupt, startOutcomeUnknown, "", now)
			n.Interrupted++
			return
		}
	} else {
		if m.cfg.stallTimeout > 0 {
			e.seen.lastEvent = now // it was silent while nobody listened
			m.watchStall(e, *e.cur())
		}
		if e.info.opt().attemptTimeout > 0 {
			m.armDeadline(e, *e.cur())
		}
	}
	if in.report.State == SessionStateEnded {
		ev := in.report.End
		if !ev.Kind.ends() {
			ev.Kind = SessionInterrupted // ended, but not said how: an interruption, not an answer
		}
		ev.SessionID, ev.AttemptID, ev.Token = in.sid, a.ID, a.Token
		o := observation{ev: ev, fail: in.f, classified: true}
		if who, err := m.observeLocked(&o); err != nil {
			m.rejectedLocked(ev, who, err)
		}
		n.Ended++
		return
	}
	n.Readopted++
	if e.stop != "" {
		m.stopRun(e, now) // a stop was asked before the restart: it goes on
	}
}

// toldNotice is a notification a replay met, and the text of a retry
// rendered as its record was met.
type toldNotice struct {
	*notice
	then string
}

// replayLedger rebuilds a ledger from committed records, in sequence
// order, with no host and no Manager: what a restart from a journal does.
// It returns the notifications the records say were produced.

func replayLedger(recs []record) (*ledger, []toldNotice, error) {
	l := newLedger(nil)
	var notes []toldNotice
	for _, rec := range recs {
		if rec.kind == recNotifyProduced {
			notes = append(notes, toldNotice{notice: rec.notice})
			if n := rec.notice; n.kind == NotifyRetryScheduled {
				// A retry is told as it was scheduled: the model its
				// attempt had then (a later skip, after a wait for a
				// cooldown or a slot, moves it; the session-ready
				// notification names the model it runs on).
				text, err := l.render(n)
				if err != nil {
					return nil, nil, err
				}
				notes[len(notes)-1].then = text
			}
		}
		if _, err := l.replayOne(rec); err != nil {
			return nil, nil, fmt.Errorf("replay: record %d (%s): %w", rec.seq, rec.kind, err)
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
		return errors.New("replay: the ledger kept no records (recordAll)")
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
		return fmt.Errorf("replay: %d tasks, want %d", len(r.tasks), len(l.tasks))
	}
	for id, e := range l.tasks {
		re := r.tasks[id]
		if re == nil {
			return fmt.Errorf("replay: task %s missing", id)
		}
		re.info.sessions = e.info.sessions // process-local: the replaying Manager's host sets it
		want, got := e.project(), re.project()
		want.Activity = ""
		if err := sameJSON("task "+id, want, got); err != nil {
			return err
		}
		if Timeline(want) != Timeline(got) {
			return fmt.Errorf("replay: task %s: timeline differs", id)
		}
	}
	if len(r.closures) != len(l.closures) {
		return fmt.Errorf("replay: %d closure records, want %d", len(r.closures), len(l.closures))
	}
	for i := range l.closures {
		if err := sameJSON("closure record", l.closures[i].closure, r.closures[i].closure); err != nil {
			return err
		}
	}
	for _, tn := range notes {
		n := tn.notice
		text, err := r.render(n)
		if tn.then != "" {
			text = tn.then
		}
		if err != nil {
			return err
		}
		if withoutUsage(text) != withoutUsage(n.text) { // the usage line is what was reported by then: late reports move it
			return fmt.Errorf("replay: notification %d (%s): text differs:\n%s\nwant:\n%s", n.seq, n.kind, text, n.text)
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
				return "", fmt.Errorf("replay: notification %d names unknown task %s", n.seq, id)
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
		return "", fmt.Errorf("replay: notification %d names no closure record", n.seq)
	}
	ref, ok := l.attemptOf(n.attempt)
	if !ok {
		return "", fmt.Errorf("replay: notification %d names unknown attempt %s", n.seq, n.attempt)
	}
	switch n.kind {
	case NotifyRetryScheduled:
		if ref.index == 0 {
			return "", fmt.Errorf("replay: retry notification %d for a first attempt", n.seq)
		}
		return retryScheduledText(ref.e.atts()[ref.index-1], *ref.attempt()), nil
	case NotifyRetrySessionReady:
		return retrySessionReadyText(*ref.attempt()), nil
	case NotifyFinalSummary:
		return finalSummaryText(ref.e.project()), nil
	case NotifyBudget:
		// Its figures are those of the moment it was made: what can be
		// checked again is whose budget it was.
		if s := ref.e.budgetState(); s == nil || !strings.HasPrefix(n.text, "[Budget] Task "+s.TaskID+": ") {
			return "", fmt.Errorf("replay: budget notification %d names no budget of task %s", n.seq, ref.e.id)
		}
		return n.text, nil
	case NotifyAnswer:
		if iv := ref.e.inv; iv != nil && n.invocation >= 1 && n.invocation <= len(iv.list) && iv.list[n.invocation-1].Answer != nil {
			return answerText(ref.e.id, ref.e.info.description, *iv.list[n.invocation-1].Answer), nil
		}
		return "", fmt.Errorf("replay: answer notification %d names no answered invocation %d", n.seq, n.invocation)
	}
	return "", fmt.Errorf("replay: notification %d of unknown kind %q", n.seq, n.kind)
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
		return fmt.Errorf("replay: %s differs:\n got %s\nwant %s", what, g, w)
	}
	return nil
}
