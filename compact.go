package bgtask

import (
	"maps"
	"slices"
	"time"
)

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

// snapshotRecords is the ledger as records, for a compacted journal: the
// records that rebuild exactly the tasks in memory (their spec, each
// attempt's versions as far as a replay needs them, sessions, stops),
// the closure records kept, the cooldowns not over, and the epoch. Nothing forgotten is in them.
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
		if a := e.acct; a != nil && a.bud != nil && a.bud.owner == e && (!a.bud.forgot.IsZero() || a.bud.forgotSpawned > 0) {
			// What the tasks retention forgot had added to its budget.
			add(record{kind: recUsage, task: e.id, at: ti.launchedAt, usage: &usageRec{u: a.bud.forgot, spawned: a.bud.forgotSpawned}})
		}
		atts := e.atts()
		bound := make(map[string]bool, len(atts))
		skips := e.skips
		for i, a := range atts {
			created := Attempt{ID: a.ID, Number: a.Number, Token: a.Token, Model: a.Model, Status: StatusPending, Pending: PendingAwaitingSession}
			var mine []Skip // the skips that moved it: made on the first model skipped, then moved as they did
			for len(skips) > 0 && skips[0].Attempt == a.Number {
				mine, skips = append(mine, skips[0]), skips[1:]
			}
			if len(mine) > 0 {
				created.Model = mine[0].Model
			}
			add(record{kind: recAttemptCreated, task: e.id, at: ti.launchedAt, attempt: created})
			for j, sk := range mine {
				moved := created
				moved.Model = a.Model
				if j+1 < len(mine) {
					moved.Model = mine[j+1].Model
				}
				sk := sk
				add(record{kind: recModelSkipped, task: e.id, at: sk.At, attempt: moved, recordExt: &recordExt{skip: &sk}})
				created = moved
			}
			if a.SessionID != "" {
				run := created
				run.Status, run.Pending, run.SessionID, run.StartedAt = StatusRunning, "", a.SessionID, a.StartedAt
				add(record{kind: recSessionBound, task: e.id, at: a.StartedAt, attempt: run})
				bound[a.SessionID] = true
			}
			if u := e.acct; u != nil && i < len(u.byAttempt) && !u.byAttempt[i].IsZero() { // what it used, summed
				add(record{kind: recUsage, task: e.id, at: ti.launchedAt, usage: &usageRec{attempt: a.ID, u: u.byAttempt[i]}})
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
				at := ti.launchedAt
				if a.Pending == PendingCooldown && i == e.current && e.rt.coolSince != 0 {
					at = time.Unix(0, e.rt.coolSince) // when its wait began: MaxWait counts from there
				}
				add(record{kind: recAttemptPending, task: e.id, at: at, attempt: a})
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
			add(record{kind: recStopRequested, task: e.id, at: ti.launchedAt, attempt: *e.cur(), recordExt: &recordExt{stop: e.stop, note: e.stopBy}}) // who asked: Task.Stop
		}
	}
	for _, c := range m.led.closures {
		add(c)
	}
	now := m.now()
	for _, key := range slices.Sorted(maps.Keys(m.led.cools)) { // the cooldowns not over
		if c := m.led.cools[key]; now.Before(c.Until) {
			add(record{kind: recCooldownBegan, at: c.Since, recordExt: &recordExt{cool: &c}})
		} else {
			delete(m.led.cools, key)
		}
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
