// Package mirror keeps a client-side copy of a bgtask Manager's tasks in
// sync from complete snapshots and partial changes, in whatever order they
// arrive.
//
// Within one epoch (one Manager process life) sequences order everything: a
// change older than what the mirror holds for a task is ignored; a snapshot
// entry older than a change already applied does not overwrite it; a task
// absent from a complete snapshot is removed unless it changed after the
// snapshot's sequence, and a change or snapshot older than a complete
// snapshot already applied cannot bring it back; a complete snapshot
// replaces a task whole, so an Activity it omits is cleared.
//
// Epochs name process lives; they are not ordered. A Manager takes its epoch
// from the wall clock, so a restarted process whose clock is behind has a
// smaller one. The mirror holds one epoch at a time. A snapshot from a
// different epoch, whether its number is larger or smaller, replaces
// everything held: the new process's sequences start again, and the old
// process's activity is not the truth any more. A zero Mirror holds no epoch
// yet: the first snapshot or change applied sets it.
//
// A change from an epoch other than the mirror's is not applied, but it is
// not lost either: after a restart the new process's changes can reach the
// mirror before its snapshot (a client that subscribes first and then
// fetches a snapshot sees exactly that), and some may be newer than the
// snapshot. So the mirror keeps the changes of the latest foreign epoch it
// has seen, at most MaxPending of them. When a snapshot of that epoch is
// applied, the kept changes newer than the snapshot's sequence are applied
// after it, in sequence order, by the rules above; the older ones are
// covered by the snapshot. A change from yet another epoch discards the kept
// ones and is kept instead, and so does a snapshot of yet another epoch: the
// process they came from is not the one followed. Past MaxPending the oldest
// kept change (the smallest sequence) is dropped. The changes of the epoch
// the mirror last switched away from are ignored from the switch on: they
// are neither applied nor kept, so a slow old process cannot displace the
// changes of the next one.
//
// Because the mirror cannot tell which of two epochs is the later one, apply
// snapshots only from the process you follow now: a delayed snapshot from a
// process that has since restarted would take the mirror back to it.
package mirror

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/bgtask/bgtask"
)

// MaxPending bounds the changes a Mirror keeps from an epoch whose snapshot
// it has not applied yet. Past it the oldest kept change (the smallest
// sequence) is dropped, so a snapshot of that epoch taken before the
// newest MaxPending changes were made may miss what the dropped ones said,
// until the next change to the same task or the next snapshot.
const MaxPending = 4096

// Mirror is a client's copy of a Manager's tasks. The zero value is an
// empty mirror holding no epoch yet, ready to use; it is safe for
// concurrent use.
type Mirror struct {
	mu       sync.Mutex // guards everything below
	hasEpoch bool       // epoch is set: a snapshot or change was applied
	epoch    uint64     // the Manager process life the state is from
	floor    uint64     // the newest complete snapshot applied, in that epoch
	tasks    map[string]held
	changed  chan struct{} // closed at the next apply; nil while nobody waits

	hasLeft bool   // left is set: a snapshot switched the mirror's epoch
	left    uint64 // the epoch the mirror last switched away from

	// pending holds changes from pendingEpoch, an epoch other than the
	// mirror's (and than left), for its snapshot: sorted by Seq, ties in
	// arrival order, at most MaxPending. pendingEpoch means nothing while
	// pending is empty.
	pending      []bgtask.Change
	pendingEpoch uint64
}

type held struct {
	task bgtask.Task
	seq  uint64 // the change (or snapshot) sequence this version is from
}

// ApplySnapshot applies a complete snapshot. A snapshot from the mirror's
// epoch is applied by sequence, as the package doc says, and ignored if it
// is older than a complete snapshot already applied. A snapshot from any
// other epoch, larger or smaller, replaces everything the mirror holds and
// makes its epoch the mirror's; the changes kept from that epoch (see
// ApplyChange) newer than the snapshot are then applied, in sequence order,
// as ApplyChange would apply them, and changes kept from any other epoch
// are discarded.
func (m *Mirror) ApplySnapshot(s bgtask.Snapshot) {
	m.mu.Lock()
	defer m.mu.Unlock()
	defer m.wake()
	if m.hasEpoch && s.Epoch == m.epoch {
		if s.Seq < m.floor {
			return // older than a snapshot applied
		}
		m.applySnapshot(s)
		return
	}
	// Another process life: what the mirror holds is over, and what came
	// early from this one is news unless the snapshot covers it.
	var replay []bgtask.Change
	if len(m.pending) > 0 && m.pendingEpoch == s.Epoch {
		replay = m.pending
	}
	m.pending = nil
	if m.hasEpoch {
		m.hasLeft, m.left = true, m.epoch
	}
	m.adopt(s.Epoch)
	m.applySnapshot(s)
	for _, c := range replay {
		if c.Seq > s.Seq {
			m.applyChange(c)
		}
	}
}

// applySnapshot applies s, from the mirror's epoch and not older than
// floor. m.mu is held.
func (m *Mirror) applySnapshot(s bgtask.Snapshot) {
	m.floor = s.Seq
	present := make(map[string]bool, len(s.Tasks))
	for _, t := range s.Tasks {
		present[t.ID] = true
		if cur, ok := m.tasks[t.ID]; ok && cur.seq > s.Seq {
			continue // a newer change already applied wins
		}
		m.tasks[t.ID] = held{task: t, seq: s.Seq}
	}
	for id, cur := range m.tasks {
		if !present[id] && cur.seq <= s.Seq {
			delete(m.tasks, id) // the snapshot is complete: it is gone
		}
	}
}

// ApplyChange applies one change and reports whether it did, now. It does
// not when the change is not newer than what the mirror holds for the task,
// or than a complete snapshot applied without the task; nor when the change
// is from an epoch other than the mirror's. Such a change is kept, not
// applied, for a snapshot of its epoch, which applies it then if it is
// newer than the snapshot (see the package doc and ApplySnapshot); kept
// changes of a previous foreign epoch are discarded for it, and a change
// from the epoch the mirror last switched away from is not kept at all. A
// zero Mirror takes the change's epoch and applies it.
func (m *Mirror) ApplyChange(c bgtask.Change) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	defer m.wake()
	switch {
	case !m.hasEpoch:
		m.adopt(c.Epoch)
	case c.Epoch != m.epoch:
		m.keep(c) // another process life: wait for its snapshot
		return false
	}
	return m.applyChange(c)
}

// applyChange applies c, from the mirror's epoch, by sequence. m.mu is
// held.
func (m *Mirror) applyChange(c bgtask.Change) bool {
	cur, ok := m.tasks[c.Task.ID]
	if (ok && cur.seq >= c.Seq) || (!ok && c.Seq <= m.floor) {
		return false // older than what is held, or than a complete snapshot without it
	}
	m.tasks[c.Task.ID] = held{task: c.Task, seq: c.Seq}
	return true
}

// keep holds c, from an epoch other than the mirror's, for that epoch's
// snapshot. m.mu is held.
func (m *Mirror) keep(c bgtask.Change) {
	if m.hasLeft && c.Epoch == m.left {
		return // the process the mirror left: over
	}
	if len(m.pending) > 0 && m.pendingEpoch != c.Epoch {
		m.pending = nil // yet another process life: the previous one's wait is over
	}
	m.pendingEpoch = c.Epoch
	if n := len(m.pending); n == 0 || m.pending[n-1].Seq <= c.Seq {
		m.pending = append(m.pending, c) // the usual case: in order
	} else {
		i, _ := slices.BinarySearchFunc(m.pending, c.Seq, func(p bgtask.Change, seq uint64) int {
			if p.Seq <= seq {
				return -1 // insert after equal sequences: arrival order
			}
			return 1
		})
		m.pending = slices.Insert(m.pending, i, c)
	}
	if len(m.pending) > MaxPending {
		m.pending[0] = bgtask.Change{} // let the dropped task go
		m.pending = m.pending[1:]
	}
}

// Tasks returns the mirrored tasks, ordered by launch time then id.
func (m *Mirror) Tasks() []bgtask.Task {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]bgtask.Task, 0, len(m.tasks))
	for _, h := range m.tasks {
		out = append(out, h.task)
	}
	slices.SortFunc(out, func(a, b bgtask.Task) int {
		if c := a.LaunchedAt.Compare(b.LaunchedAt); c != 0 {
			return c
		}
		switch {
		case a.ID < b.ID:
			return -1
		case a.ID > b.ID:
			return 1
		}
		return 0
	})
	return out
}

// Task returns one mirrored task, or an error wrapping
// bgtask.ErrUnknownTask when the mirror holds none with that id (as
// Manager.Task answers).
func (m *Mirror) Task(id string) (bgtask.Task, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	h, ok := m.tasks[id]
	if !ok {
		return bgtask.Task{}, fmt.Errorf("%w: %q", bgtask.ErrUnknownTask, id)
	}
	return h.task, nil
}

// wake releases Wait. m.mu is held.
func (m *Mirror) wake() {
	if m.changed != nil {
		close(m.changed)
		m.changed = nil
	}
}

// Wait blocks until cond holds for the mirrored tasks (it is checked now and
// after every apply), or ctx ends.
func (m *Mirror) Wait(ctx context.Context, cond func(tasks []bgtask.Task) bool) error {
	for {
		m.mu.Lock()
		if m.changed == nil {
			m.changed = make(chan struct{})
		}
		ch := m.changed
		m.mu.Unlock()
		if cond(m.Tasks()) {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// adopt makes epoch the mirror's and drops everything held from another.
// m.mu is held.
func (m *Mirror) adopt(epoch uint64) {
	m.hasEpoch, m.epoch, m.floor = true, epoch, 0
	if m.tasks == nil {
		m.tasks = make(map[string]held)
	}
	clear(m.tasks)
}
