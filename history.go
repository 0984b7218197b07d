package bgtask

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/bgtask/bgtask/internal/codec"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/bgtask/bgtask/internal/textbound"
)

// A task's history, as an operator reads it: the detail page, the command
// line and a fleet's view read it through Manager.History.

// progressKept is how many of a task's latest lines of progress the
// Manager keeps for its history, while the task is live (in memory, never
// journaled; they go when the task settles and is frozen).
const progressKept = 16

// progressLine is a line of progress a task's run reported, and when.
type progressLine struct {
	at      time.Time
	attempt string
	text    string
}

// kindProgress is the Kind of a RecordView that is a line of progress (in
// Change) a run reported: the Manager keeps the latest of each live task
// in memory for its history (Manager.History); no journal holds them.
const kindProgress = "progress"

// History is what happened to task id, oldest first, each step a line an
// operator reads (RecordView.Change) with when it happened:
//
//   - with a journal that can read a task's records back (the file
//     journal, pgledger's: Journal.Replay says how), its durable records —
//     its launch, each attempt, start, binding, usage, end and retry, its
//     stops and its notifications — with the process lives (epochs) and
//     its parent session's records between its first and its last;
//   - otherwise what the Manager holds of it: its launch, each attempt's
//     creation, start and end, and its stop;
//
// and, either way, the latest lines of progress its runs reported
// (Kind "progress"; the last 16, in memory, until the task settles). A task
// the Manager no longer holds has the history its journal still holds;
// one it never held, or forgot with no record left, is ErrUnknownTask
// (ErrForgotten). ctx bounds the journal's read.
func (m *Manager) History(ctx context.Context, id string) ([]RecordView, error) {
	ctx = orBackground(ctx)
	if blank(id) {
		return nil, fmt.Errorf("%w: History of a blank task id", ErrInvalidArgument)
	}
	m.mu.Lock()
	e := m.led.tasks[id]
	var t Task
	var lines []progressLine
	var missing error
	if e != nil {
		t = e.project()
		if e.loc != nil {
			lines = slices.Clone(e.loc.lines)
		}
	} else {
		missing = m.missing(id)
	}
	m.unlock()

	var out []RecordView
	if r, ok := m.cfg.journal.(taskReader); ok {
		var recs []Record
		err := guardJournal("TaskRecords", func() (err error) {
			recs, err = r.TaskRecords(ctx, id)
			return err
		})
		if err != nil {
			return nil, fmt.Errorf("reading the records of task %q: %w", id, err)
		}
		if out, err = historyOf(recs, id); err != nil {
			return nil, err
		}
	}
	switch {
	case out == nil && e == nil:
		return nil, missing
	case out == nil:
		out = heldHistory(&t)
	}
	for _, l := range lines {
		out = append(out, RecordView{Kind: kindProgress, TaskID: id, AttemptID: l.attempt, At: l.at, Change: l.text})
	}
	slices.SortStableFunc(out, func(a, b RecordView) int { return a.At.Compare(b.At) })
	return out, nil
}

// historyOf is recs (a journal's records of task id: TaskRecords) as the
// history shows them: the task's own, each process life's epoch, and the
// records about its parent session; nil if none is the task's. A record
// that cannot be decoded is an error that names it.
func historyOf(recs []Record, id string) ([]RecordView, error) {
	views := make([]RecordView, 0, len(recs))
	words := &codec.Words{}
	parent := ""
	for i := range recs {
		rec, err := decodeData(recs[i].Data, recs[i].Seq, words)
		if err != nil {
			return nil, fmt.Errorf("the record %d (%s) of task %q: %w", recs[i].Seq, recs[i].Kind, id, err)
		}
		if rec.kind == recTaskLaunched && rec.task == id {
			parent = parentOf(&rec)
		}
		views = append(views, recordView(&rec))
	}
	return taskViews(views, id, parent), nil
}

// taskViews keeps of views (in order) those that tell task id's history:
// its own, the epochs, and the records of its parent session; nil if
// none is its own.
func taskViews(views []RecordView, id, parent string) []RecordView {
	var out []RecordView
	own := false
	for _, r := range views {
		if tells(r, id, parent) {
			own = own || r.TaskID == id
			out = append(out, r)
		}
	}
	if !own {
		return nil
	}
	return out
}

// heldHistory is t's history as the Manager holds it, with no journal to
// read back: its launch, each attempt's creation, start and end, and its
// stop.
func heldHistory(t *Task) []RecordView {
	v := func(kind, attempt string, at time.Time, change string) RecordView {
		return RecordView{Kind: kind, TaskID: t.ID, AttemptID: attempt, At: at, Change: change}
	}
	out := []RecordView{v("task_launched", "", t.LaunchedAt, "launched under "+t.ParentSessionID)}
	for _, a := range t.Attempts {
		n := "attempt " + strconv.Itoa(a.Number)
		created := cmp.Or(a.StartedAt, t.LaunchedAt)
		out = append(out, v("attempt_created", a.ID, created, n+" created on "+a.Model.String()))
		if a.SessionID != "" {
			out = append(out, v("session_bound", a.ID, created, n+" running in session "+a.SessionID))
		}
		if a.Status.Terminal() {
			s := n + " " + string(a.Status)
			if a.Error != "" {
				s += ": " + textbound.OneLine(a.Error, 120)
			}
			out = append(out, v("attempt_finalized", a.ID, cmp.Or(a.CompletedAt, created), s))
		}
	}
	if t.Stop != nil {
		out = append(out, v("stop_requested", t.CurrentAttemptID, t.CompletedAt, "stopped: "+t.Stop.String()))
	}
	return out
}

// keepProgress keeps p as a line of e's history (History), the latest
// progressKept. m.mu is held.
func (m *Manager) keepProgress(e *entry, p string) {
	l := e.keep()
	if len(l.lines) == progressKept {
		l.lines = append(l.lines[:0], l.lines[1:]...)
	}
	l.lines = append(l.lines, progressLine{at: m.now(), attempt: e.cur().ID, text: p})
}

func init() {
	fleet.History = func(recs any, id string) (any, error) {
		v, err := historyOf(recs.([]Record), id)
		return v, err
	}
}
