// Package mirror keeps a client-side copy of a bgtask Manager's tasks in
// sync from complete snapshots and partial changes, in whatever order they
// arrive.
//
// The rules: a change older than what the mirror holds for a task is
// ignored; a snapshot entry older than a change already applied does not
// overwrite it; a task absent from a complete snapshot is removed unless it
// changed after the snapshot's sequence, and a change or snapshot older than
// a complete snapshot already applied cannot bring it back; a complete
// snapshot replaces a task whole, so an Activity it omits is cleared. A
// snapshot or change from a later Manager process (a larger Epoch) replaces
// everything held from the earlier one — its sequences start again, and the
// old process's activity is not the truth any more; one from an earlier
// process is ignored.
package mirror

import (
	"context"
	"slices"
	"sync"

	"github.com/bgtask/bgtask"
)

// Mirror is a client's copy of a Manager's tasks. The zero value is an
// empty mirror, ready to use; it is safe for concurrent use.
type Mirror struct {
	mu      sync.Mutex // guards everything below
	epoch   uint64     // the Manager process the state is from
	floor   uint64     // the newest complete snapshot applied, in that epoch
	tasks   map[string]held
	changed chan struct{} // closed at the next apply; nil while nobody waits
}

type held struct {
	task bgtask.Task
	seq  uint64 // the change (or snapshot) sequence this version is from
}

// ApplySnapshot applies a complete snapshot.
func (m *Mirror) ApplySnapshot(s bgtask.Snapshot) {
	m.mu.Lock()
	defer m.mu.Unlock()
	defer m.wake()
	if !m.epochOK(s.Epoch) || s.Seq < m.floor {
		return // from an earlier process, or older than a snapshot applied
	}
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

// ApplyChange applies one change; it reports whether it was newer than
// what the mirror held.
func (m *Mirror) ApplyChange(c bgtask.Change) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	defer m.wake()
	if !m.epochOK(c.Epoch) {
		return false
	}
	cur, ok := m.tasks[c.Task.ID]
	if (ok && cur.seq >= c.Seq) || (!ok && c.Seq <= m.floor) {
		return false // older than what is held, or than a complete snapshot without it
	}
	m.tasks[c.Task.ID] = held{task: c.Task, seq: c.Seq}
	return true
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

// Task returns one mirrored task.
func (m *Mirror) Task(id string) (bgtask.Task, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	h, ok := m.tasks[id]
	return h.task, ok
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

// epochOK adopts a later epoch (dropping what an earlier process said) and
// reports whether epoch is current. m.mu is held.
func (m *Mirror) epochOK(epoch uint64) bool {
	if m.tasks == nil {
		m.tasks = make(map[string]held)
	}
	switch {
	case epoch < m.epoch:
		return false
	case epoch > m.epoch:
		m.epoch, m.floor = epoch, 0
		clear(m.tasks)
	}
	return true
}
