package bgtask

import (
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask/internal/codec"
	"github.com/bgtask/bgtask/internal/textbound"
	"github.com/bgtask/bgtask/internal/wal"
)

// Looking inside a file journal: what an operator tool reads.

// JournalView is what a file journal holds, as ReadFileJournal read it.
type JournalView struct {
	// Tasks are the tasks its records describe, in launch order, as a
	// replay projects them (process-local fields empty).
	Tasks []Task
	// Records are its records, in sequence order, each with what it
	// changed: a task's, and the manager-wide ones (TaskID "") — each
	// process life's epoch, which marks a restart, and a parent's
	// notifications (all_complete), closures.
	Records []RecordView
	// Closures are the branch closures it recorded, in order.
	Closures []ClosureReport
	// Torn says where a torn last record was found ("" if none): a crash
	// mid-write, or a write in progress. It is left as it is.
	Torn string
}

// RecordView is one journal record as ReadFileJournal shows it.
type RecordView struct {
	// Seq is the record's sequence number; Kind its kind ("session_bound";
	// "progress" for a line of progress a run reported, which
	// Manager.History adds from memory: no journal holds one, and its Seq
	// is 0).
	Seq  uint64 `json:"seq"`
	Kind string `json:"kind"`
	// TaskID and AttemptID name what it is about ("" for a manager-wide
	// record: an epoch, a parent's all_complete, a closure of a session).
	TaskID    string `json:"taskID,omitempty"`
	AttemptID string `json:"attemptID,omitempty"`
	// ParentSessionID is the parent session the record names, when it
	// names one: a launch's parent, a notification's, a closure's root
	// session.
	ParentSessionID string `json:"parentSessionID,omitempty"`
	// At is when it was committed.
	At time.Time `json:"at"`
	// Change says, in a line, what the record changed.
	Change string `json:"change"`
}

// ReadFileJournal reads the file journal in dir without opening it: no
// lock is taken and no byte is changed, so it works on a journal whose
// writer is still running (it sees what was written so far) and on one a
// crash left (a torn tail is reported in Torn, not cut off). A corrupt
// journal (a damaged record that complete records follow) is a
// *CorruptError (ErrCorrupt); a record that cannot be read or replayed is
// an error naming the file and offset (and the record's kind). A dir that
// does not exist, or holds no journal segment (seg-<n>.log), is an error
// that matches fs.ErrNotExist: it is no journal, not an empty one.
func ReadFileJournal(dir string) (v JournalView, err error) {
	if err := isJournal(dir); err != nil {
		return JournalView{}, err
	}
	defer func() { // a journal bgtask did not write must not crash the reader
		if r := recover(); r != nil {
			v, err = JournalView{}, fmt.Errorf("journal %s cannot be read: %s", dir, panicText(r))
		}
	}()
	payloads, torn, err := wal.ReadOnly(dir, wal.Options{})
	if err != nil {
		return JournalView{}, corruptError(err)
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
			v.Records = append(v.Records, recordView(&rec))
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

// RecordsOf are t's records, and the epochs and parent-level records of
// its parent session from its first record to its last (to the journal's
// end while it is live): what happened to it, restarts included. t is one
// of v.Tasks (or a task of the same id).
func (v JournalView) RecordsOf(t Task) []RecordView {
	recs := v.Records
	first, last := -1, -1
	for i, r := range recs {
		if r.TaskID == t.ID {
			if first < 0 {
				first = i
			}
			last = i
		}
	}
	if first < 0 {
		return nil
	}
	if !t.Status.Terminal() {
		last = len(recs) - 1
	}
	var out []RecordView
	for _, r := range recs[first : last+1] {
		if tells(r, t.ID, t.ParentSessionID) {
			out = append(out, r)
		}
	}
	return out
}

// tells reports whether r tells of task id, launched under parent: it
// is the task's, a process life's epoch, or about its parent session.
func tells(r RecordView, id, parent string) bool {
	return r.TaskID == id || (r.TaskID == "" && (r.Kind == "epoch" || (r.ParentSessionID != "" && r.ParentSessionID == parent)))
}

// recordView is rec as an operator reads it.
func recordView(rec *record) RecordView {
	return RecordView{Seq: rec.seq, Kind: rec.kind.String(), TaskID: rec.task, AttemptID: rec.attempt.ID,
		ParentSessionID: parentOf(rec), At: rec.at, Change: describe(rec)}
}

// isJournal says why dir is not a file journal, if it is not: it does not
// exist, is not a directory, or holds no segment. A journal, even an empty
// one, has a segment from its first open on.
func isJournal(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("%s is not a journal: %w", dir, err)
	}
	for _, e := range ents {
		n := e.Name()
		if num, ok := strings.CutPrefix(n, "seg-"); ok && strings.HasSuffix(num, ".log") {
			if _, err := strconv.Atoi(strings.TrimSuffix(num, ".log")); err == nil {
				return nil
			}
		}
	}
	return notJournal("" + dir + " is not a journal: it holds no journal segment (seg-<n>.log)")
}

// notJournal is a directory with no journal in it: it matches
// fs.ErrNotExist, as a directory that does not exist does.
type notJournal string

func (e notJournal) Error() string        { return string(e) }
func (e notJournal) Is(target error) bool { return target == fs.ErrNotExist }

// parentOf is the parent session rec names ("" if none).
func parentOf(rec *record) string {
	x := rec.recordExt
	switch {
	case x == nil:
		return ""
	case rec.kind == recTaskLaunched && x.spec != nil:
		return x.spec.parent
	case (rec.kind == recNotifyProduced || rec.kind == recNotifyDelivered) && x.notice != nil:
		return x.notice.parent
	case rec.kind == recBranchClosed && x.closure != nil:
		return x.closure.SessionID
	case rec.kind == recClosureOpened:
		return x.session
	}
	return ""
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
		rec.kind == recAnswerFiled && rec.inv.Answer == nil,
		rec.kind == recModelSkipped && x.skip == nil,
		rec.kind == recCooldownBegan && x.cool == nil,
		rec.kind == recUsage && rec.usage == nil:
		return rec.kind.String() + " (incomplete)"
	}
	n := "attempt " + strconv.Itoa(a.Number)
	switch rec.kind {
	case recTaskLaunched:
		s := fmt.Sprintf("launched under %s on %v", x.spec.parent, x.spec.models)
		if b := x.spec.opt().budget; b != nil {
			s += fmt.Sprintf(", granted a budget of %d tokens, cost %s, %d requests, %d spawns (0: no limit)", b.Tokens, b.Cost, b.Requests, b.Spawns)
		}
		return s
	case recUsage:
		if rec.usage.attempt == "" {
			return fmt.Sprintf("its budget carries what forgotten tasks used: %s, %d spawned", rec.usage.u, rec.usage.spawned)
		}
		return "attempt " + rec.usage.attempt + " used " + rec.usage.u.String()
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
		note, actor, _ := strings.Cut(x.note, noteActor)
		if actor != "" {
			note += " (" + actor + ")"
		}
		return "stop requested by " + note + ": it ends " + string(x.stop)
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
		if x.session != "" {
			return fmt.Sprintf("closure of %q opened: its fence is up", x.session)
		}
		return "closure opened: its fence is up"
	case recClosureDropped:
		return "closure ended with nothing to record"
	case recEpoch:
		life := "process life " + strconv.FormatUint(x.epoch, 10)
		s := life + " began: the process started (or restarted) here"
		if strings.Contains(x.note, epochCompacted) {
			s = "the journal was compacted here; " + life + " goes on"
		}
		if strings.Contains(x.note, epochSilent) {
			s += " (" + epochSilent + ")"
		}
		return s
	case recInvocationAdmitted:
		return fmt.Sprintf("invocation %d admitted: %s", rec.inv.N, textbound.OneLine(rec.inv.Prompt, 80))
	case recAnswerFiled:
		return fmt.Sprintf("invocation %d answered (%s)", rec.inv.N, rec.inv.Answer.Status)
	case recModelSkipped:
		sk := x.skip
		s := n + " skipped " + sk.Model.String() + ", cooling (" + textbound.OneLine(sk.Why, 80)
		if !sk.Until.IsZero() {
			s += " until " + sk.Until.UTC().Format(time.RFC3339)
		}
		return s + "): it runs on " + a.Model.String()
	case recHealthReset:
		return "health of " + textbound.OneLine(x.note, 80) + " reset by hand: its cooldown ended"
	case recCooldownBegan:
		c := x.cool
		return fmt.Sprintf("%s cooling (%s, %d in a row) until %s", textbound.OneLine(c.Key, 80), textbound.OneLine(c.Why, 40), c.inARow, c.Until.UTC().Format(time.RFC3339))
	}
	return rec.kind.String()
}
