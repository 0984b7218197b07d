package bgtask

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/bgtask/bgtask/internal/codec"
	"github.com/bgtask/bgtask/internal/wal"
)

// A corrupt file journal, and its repair.
//
// A crash can damage only the write it interrupted, the journal's last: a
// damaged record that nothing complete follows is a torn tail, cut off
// when the journal opens. A damaged record that complete, checksummed
// records follow (in its segment or a later one) is corruption (a flipped
// byte, a bad sector, a stray write): dropping what follows would lose
// durable records, so OpenFileJournal and ReadFileJournal refuse it with a
// *CorruptError, and only an explicit repair cuts it.

// CorruptError is ErrCorrupt with where the damage is and what a repair
// drops.
type CorruptError struct {
	// Segment is the segment file holding the damaged record; Offset is
	// where that record begins in it, and Why what is wrong with it.
	Segment string `json:"segment"`
	Offset  int64  `json:"offset"`
	Why     string `json:"why"`
	// Cut is where a repair truncates Segment: where the commit the
	// damaged record belongs to begins, so that every commit before it
	// stays whole.
	Cut int64 `json:"cut"`
	// Dropped are the complete records a repair drops, in order: the rest
	// of Segment from Cut on (the damaged commit's records before the
	// damage too), then every later segment's. Tasks are the tasks they
	// name, in order of first appearance.
	Dropped []RecordView `json:"dropped"`
	Tasks   []string     `json:"tasks"`
	// Later are the segments after Segment, which a repair sets aside.
	Later []string `json:"later,omitempty"`
	// Copy is the directory a repair keeps what it cuts in (Segment's
	// bytes from Cut on, and Later), inside the journal's directory.
	Copy string `json:"copy"`
}

func (e *CorruptError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "the journal is corrupt: %s at offset %d (%s), with complete records after it; a repair (bgtask repair %s, or WithRepair) cuts it at offset %d and drops %d complete records of %d tasks",
		e.Segment, e.Offset, e.Why, filepath.Dir(e.Segment), e.Cut, len(e.Dropped), len(e.Tasks))
	if len(e.Tasks) > 0 {
		const show = 8
		b.WriteString(" (" + strings.Join(e.Tasks[:min(show, len(e.Tasks))], ", "))
		if len(e.Tasks) > show {
			fmt.Fprintf(&b, " and %d more", len(e.Tasks)-show)
		}
		b.WriteString(")")
	}
	b.WriteString(", keeping a copy")
	return b.String()
}

// Is makes a *CorruptError match ErrCorrupt.
func (e *CorruptError) Is(target error) bool { return target == ErrCorrupt }

// WithRepair makes OpenFileJournal repair a corrupt journal instead of
// refusing it. It calls confirm with what the repair drops and where it
// keeps them, before it writes anything. If confirm returns nil, it keeps
// a copy of what it cuts (Copy: the damaged segment's bytes from the cut
// on, and every later segment), truncates the damaged segment at the
// start of the commit the damage is in, and opens what is left; if it
// returns an error (or panics), OpenFileJournal changes nothing and fails
// with an error that matches both ErrCorrupt (a *CorruptError) and
// confirm's. A journal with no corruption opens as without the option. A
// repair drops durable records: call it knowingly (bgtask repair DIR
// shows first what it would drop).
func WithRepair(confirm func(*CorruptError) error) FileJournalOption {
	return fileOption(func(o *wal.Options) error {
		if confirm == nil {
			return fmt.Errorf("%w: WithRepair with no function", ErrInvalidArgument)
		}
		o.Repair = func(c *wal.Corrupt) error {
			ce := corruptOf(c)
			if err := confirmed(confirm, ce); err != nil {
				return &notRepaired{ce, err}
			}
			return nil
		}
		return nil
	})
}

// confirmed is confirm's answer on ce; a panic in it is an error.
func confirmed(confirm func(*CorruptError) error, ce *CorruptError) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("WithRepair's function panicked: %s", panicText(r))
		}
	}()
	return confirm(ce)
}

// notRepaired is a corrupt journal that WithRepair's function declined
// to repair: it matches ErrCorrupt (and is a *CorruptError) and the
// function's error both.
type notRepaired struct {
	corrupt *CorruptError
	err     error
}

func (e *notRepaired) Error() string {
	return e.corrupt.Error() + "; not repaired: " + safeText(e.err)
}

func (e *notRepaired) Unwrap() []error { return []error{e.corrupt, e.err} }

// corruptError is err as the root reports it: a *wal.Corrupt becomes a
// *CorruptError with its records decoded; anything else is err.
func corruptError(err error) error {
	var c *wal.Corrupt
	if !errors.As(err, &c) {
		return err
	}
	return corruptOf(c)
}

// corruptOf is c with its records decoded.
func corruptOf(c *wal.Corrupt) *CorruptError {
	e := &CorruptError{Segment: c.File, Offset: c.Offset, Why: c.Why, Cut: c.Cut, Later: c.Later, Copy: c.Copy}
	words := &codec.Words{}
	seen := map[string]bool{}
	for _, p := range c.Dropped {
		var v RecordView
		_ = guardDecode(func() error {
			rec, err := unpackData(p, words)
			if err != nil {
				v = RecordView{Kind: "unreadable", Change: "cannot be decoded: " + err.Error()}
				return nil
			}
			v = recordView(&rec)
			return nil
		})
		if v.Kind == "" {
			v = RecordView{Kind: "unreadable", Change: "cannot be decoded"}
		}
		e.Dropped = append(e.Dropped, v)
		if v.TaskID != "" && !seen[v.TaskID] {
			seen[v.TaskID] = true
			e.Tasks = append(e.Tasks, v.TaskID)
		}
	}
	return e
}
