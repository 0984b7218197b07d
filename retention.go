package bgtask

import (
	"slices"
	"time"

	"github.com/bgtask/bgtask/internal/codec"
)

// Freezing: a task that settled (ended, its notifications all out) is
// kept compact for as long as retention keeps it. Its attempts, sessions
// and evidence are written into one string (cold); the indexes are keyed
// by substrings of it, so that the ids' own allocations go; its hot part
// goes back to the ledger; its outcome is no longer cached. Reads decode
// it (cur, atts, sessionList, ev) without allocating a string; a record
// for a frozen task thaws it first (write).

// defaultMaxEnded is how many ended tasks a Manager keeps by default.
const defaultMaxEnded = 10_000

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
		if l.liveBy[e.info.parent] > 0 || e.notesOut > 0 || len(m.closures.active) > 0 || l.launchedLive(e) || e.pinned() {
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
	l.budgetForgot(e)
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
	w.String(ev.budget)
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
	return evidence{output: r.String(), finish: r.String(), noText: r.Bool(), reason: Reason(r.String()), notice: r.String(), budget: r.String()}
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
