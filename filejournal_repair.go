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
	Segment string
	Offset  int64
	Why     string
	// Cut is where a repair truncates Segment: where the commit the
	// damaged record belongs to begins, so that every commit before it
	// stays whole.
	Cut int64
	// Dropped are the complete records a repair drops, in order: the rest
	// of Segment from Cut on, then every later segment's. Tasks are the
	// tasks they name, in order of first appearance.
	Dropped []RecordView
	Tasks   []string
	// Later are the segments after Segment, which a repair sets aside.
	Later []string
	// Copy is the directory a repair keeps what it cuts in (Segment's
	// bytes from Cut on, and Later), inside the journal's directory.
	Copy string
}

func (e *CorruptError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "the journal is corrupt: %s at offset %d (%s): ", e.Segment, e.Offset, e.Why)
	switch {
	case len(e.Dropped) == 0:
		b.WriteString("no complete record after it")
	default:
		fmt.Fprintf(&b, "%d complete records of %d tasks after it", len(e.Dropped), len(e.Tasks))
		if len(e.Tasks) > 0 {
			const show = 8
			b.WriteString(" (" + strings.Join(e.Tasks[:min(show, len(e.Tasks))], ", "))
			if len(e.Tasks) > show {
				fmt.Fprintf(&b, " and %d more", len(e.Tasks)-show)
			}
			b.WriteString(")")
		}
	}
	fmt.Fprintf(&b, "; a repair (bgtask repair %s, or WithRepair) cuts it off at offset %d, keeping a copy", filepath.Dir(e.Segment), e.Cut)
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
// returns an error, OpenFileJournal fails with that error and changes
// nothing. A journal with no corruption opens as without the option. A
// repair drops durable records: call it knowingly (bgtask repair DIR
// shows first what it would drop).
func WithRepair(confirm func(*CorruptError) error) FileJournalOption {
	return fileOption(func(o *wal.Options) error {
		if confirm == nil {
			return fmt.Errorf("%w: WithRepair with no function", ErrInvalidArgument)
		}
		o.Repair = func(c *wal.Corrupt) (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("WithRepair's function panicked: %s", panicText(r))
				}
			}()
			return confirm(corruptOf(c))
		}
		return nil
	})
}

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
