package bgtask

import (
	"fmt"
	"strconv"
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
	// Records are its records, in sequence order, each with what it changed.
	Records []RecordView
	// ClosureRecords are the branch closures it recorded, in order.
	ClosureRecords []ClosureRecord
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
		v.ClosureRecords = append(v.ClosureRecords, c.closure.clone())
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
