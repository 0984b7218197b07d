package bgtask

import (
	"context"
	"fmt"
	"slices"
)

// Task returns a snapshot of the task with that id, or an error wrapping
// ErrForgotten for a task forgotten under the retention rule, or
// ErrUnknownTask.
func (m *Manager) Task(id string) (Task, error) {
	m.mu.Lock()
	defer m.unlock()
	e := m.led.tasks[id]
	if e == nil {
		return Task{}, m.missing(id)
	}
	return e.project(), nil
}

// missing is the error for an id no task in memory has. m.mu is held.
func (m *Manager) missing(id string) error {
	if _, ok := m.led.tombs[id]; ok {
		return fmt.Errorf("%w: %q", ErrForgotten, id)
	}
	return fmt.Errorf("%w: %q", ErrUnknownTask, id)
}

// Query selects tasks for a paged read (Manager.Tasks).
type Query struct {
	Parent string // only tasks launched from this session; "": any
	Root   string // only tasks of the tree under this session (Task.Root), at any depth; "": any
	// Statuses, if set, keeps tasks in any of these statuses; none: any.
	// A value that is no status is ErrInvalidArgument.
	Statuses []Status
	// Metadata keeps tasks whose Spec.Metadata has every one of these
	// key/value pairs.
	Metadata map[string]string
	// After is the cursor of the previous page (Page.Next); "": from the
	// first task launched.
	After string
	Limit int // at most this many tasks: 1..1000; 0: 100
}

// Page is one page of tasks, in launch order.
type Page struct {
	// Tasks are the page's tasks, in launch order.
	Tasks []Task
	Next  string // the cursor of the next page; "" when this is the last
}

// Tasks returns the tasks q selects, one page at a time (at most q.Limit,
// 100 by default; Page.Next is the cursor of the next), copying only that
// page under the lock. A query by Parent, Root or Metadata reads an index
// of the tasks it names (the smallest of them), not every task. For every
// task in memory at once, with the change sequence it was taken at, use
// Snapshot.
func (m *Manager) Tasks(q Query) (Page, error) {
	limit, err := q.limit()
	if err != nil {
		return Page{}, err
	}
	m.mu.Lock()
	defer m.unlock()
	from := m.candidates(&q)
	start := 0
	if q.After != "" {
		e := m.led.tasks[q.After]
		if e == nil {
			return Page{}, fmt.Errorf("%w: cursor: %w", ErrInvalidArgument, m.missing(q.After))
		}
		start = slices.Index(from, e) + 1
		if start == 0 {
			return Page{}, fmt.Errorf("%w: cursor %q is not a task of this query", ErrInvalidArgument, q.After)
		}
	}
	var p Page
	for i := start; i < len(from); i++ {
		e := from[i]
		if !q.matches(e) {
			continue
		}
		if len(p.Tasks) == limit {
			p.Next = p.Tasks[len(p.Tasks)-1].ID
			break
		}
		p.Tasks = append(p.Tasks, e.project())
	}
	return p, nil
}

// limit is q's page size, or what is wrong with q: a Limit out of
// range, or a status that is none (it would select nothing, silently).
func (q *Query) limit() (int, error) {
	for _, s := range q.Statuses {
		if !s.Live() && !s.Terminal() {
			return 0, fmt.Errorf("%w: Query.Statuses: %q is no status (pending, running, completed, error, cancelled, interrupt)", ErrInvalidArgument, s)
		}
	}
	switch {
	case q.Limit == 0:
		return 100, nil
	case q.Limit < 0 || q.Limit > 1000:
		return 0, fmt.Errorf("%w: Query.Limit %d is not in 1..1000", ErrInvalidArgument, q.Limit)
	}
	return q.Limit, nil
}

// Select returns the page q selects from tasks, taken in the order given
// (a Snapshot's: launch order): what Manager.Tasks does over the tasks a
// Manager holds, for tasks held elsewhere — a mirror, a fleet's view.
// Its errors are those of Manager.Tasks: a Limit out of range, a cursor
// that names none of tasks (ErrInvalidArgument, with ErrUnknownTask).
func (q Query) Select(tasks []Task) (Page, error) {
	limit, err := q.limit()
	if err != nil {
		return Page{}, err
	}
	start := 0
	if q.After != "" {
		start = 1 + slices.IndexFunc(tasks, func(t Task) bool { return t.ID == q.After })
		if start == 0 {
			return Page{}, fmt.Errorf("%w: cursor: %w: %q", ErrInvalidArgument, ErrUnknownTask, q.After)
		}
	}
	var p Page
	for _, t := range tasks[start:] {
		if !q.selects(t.ParentSessionID, t.Root, t.Status, t.Metadata) {
			continue
		}
		if len(p.Tasks) == limit {
			p.Next = p.Tasks[len(p.Tasks)-1].ID
			break
		}
		p.Tasks = append(p.Tasks, t)
	}
	return p, nil
}

// candidates returns the tasks q can select from, in launch order: the
// smallest index q names, or every task. m.mu is held.
func (m *Manager) candidates(q *Query) []*entry {
	from, l := m.order, m.led
	pick := func(c []*entry) { // an index with none of the tasks is the smallest
		if len(c) < len(from) {
			from = c
		}
	}
	if q.Parent != "" {
		pick(l.byParent[q.Parent])
	}
	if q.Root != "" {
		pick(l.byRoot[q.Root])
	}
	for k, v := range q.Metadata {
		pick(l.byMeta[metaKey(k, v)])
	}
	return from
}

// matches reports whether q selects e. m.mu is held.
func (q *Query) matches(e *entry) bool {
	return q.selects(e.info.parent, e.info.root, e.cur().Status, e.info.metadata)
}

// selects reports whether q selects a task of that parent, root, status
// and metadata.
func (q *Query) selects(parent, root string, status Status, metadata map[string]string) bool {
	switch {
	case q.Parent != "" && parent != q.Parent:
		return false
	case q.Root != "" && root != q.Root:
		return false
	case len(q.Statuses) > 0 && !slices.Contains(q.Statuses, status):
		return false
	}
	for k, v := range q.Metadata {
		if got, ok := metadata[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// Wait blocks until the task is terminal and returns its snapshot, or
// returns ctx's error first — or ErrJournal once the journal failed (the
// Manager records nothing more, so the task will not end here). With a
// journal, it returns once the end is durable: what Wait reports, a
// restart replays.
func (m *Manager) Wait(ctx context.Context, id string) (Task, error) {
	ctx = orBackground(ctx)
	m.mu.Lock()
	e := m.led.tasks[id]
	if e == nil {
		err := m.missing(id)
		m.unlock()
		return Task{}, err
	}
	done := e.waitDone()
	m.unlock()
	if err := m.await(ctx, done); err != nil {
		return Task{}, err
	}
	m.mu.Lock()
	defer m.unlock()
	t := e.project()
	if err := m.settle(ctx, e.seq); err != nil {
		return Task{}, err
	}
	return t, nil
}

// WaitParent blocks until every task launched from parentSessionID has
// ended — also those launched while it waits — and returns their
// snapshots in launch order, or returns ctx's error first. A parent with
// no task returns at once, with none. (Tasks forgotten under retention
// are not returned.)
func (m *Manager) WaitParent(ctx context.Context, parentSessionID string) ([]Task, error) {
	ctx = orBackground(ctx)
	if blank(parentSessionID) {
		return nil, fmt.Errorf("%w: WaitParent with no session", ErrInvalidArgument)
	}
	for {
		m.mu.Lock()
		var live *entry
		for _, e := range m.led.byParent[parentSessionID] {
			if !e.terminal() {
				live = e
				break
			}
		}
		if live == nil {
			kids := m.led.byParent[parentSessionID]
			out := make([]Task, len(kids))
			var upTo uint64
			for i, e := range kids {
				out[i] = e.project()
				upTo = max(upTo, e.seq)
			}
			err := m.settle(ctx, max(upTo, 1))
			m.unlock()
			if err != nil {
				return nil, err
			}
			return out, nil
		}
		done := live.waitDone()
		m.unlock()
		if err := m.await(ctx, done); err != nil {
			return nil, err
		}
	}
}

// waitDone returns a channel closed when e is terminal: made only for a
// waiter. m.mu is held.
func (e *entry) waitDone() <-chan struct{} { return e.rt.sig.Done(e.terminal()) }

// waitChange returns a channel closed at e's next change. m.mu is held.
func (e *entry) waitChange() <-chan struct{} {
	return e.rt.sig.Changed()
}

// waitAny returns a channel closed at the next change of any task. m.mu is
// held.
func (m *Manager) waitAny() <-chan struct{} {
	if m.changes.anyChange == nil {
		m.changes.anyChange = make(chan struct{})
	}
	return m.changes.anyChange
}
