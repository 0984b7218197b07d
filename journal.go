package bgtask

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/bgtask/bgtask/internal/codec"
	"github.com/bgtask/bgtask/internal/wal"
)

// Durability.
//
// A Journal keeps the records a Manager commits, so that a restart is a
// replay. The Manager hands it every batch of records committed under its
// lock, in commit order, and runs nothing the batch describes — no host
// call, no notification — until the batch is durable.

// Record is one ledger record as a Journal stores it: the fields a journal
// may index or condition an append on, and the record itself, encoded.
type Record struct {
	Seq    uint64 // strictly increasing across the ledger
	Kind   string // e.g. "task_launched", "session_bound", "attempt_finalized"
	TaskID string // "" for a manager-wide record
	// AttemptID and Token name the attempt (run) the record concerns, if
	// any: what a journal shared by several processes conditions an append
	// on (the task's current attempt and token).
	AttemptID, Token string
	// SessionID is the attempt's child session, if it has one: with
	// Kind "session_bound", the session the record binds to AttemptID,
	// which a journal shared by several processes keeps unique. Like the
	// fields above it is a copy of what Data holds: a journal need not
	// store it, the Manager reads the record from Data.
	SessionID string
	// ParentSessionID is, with Kind "task_launched", the session that
	// launched the task: what a journal shared by several processes needs
	// to find a branch's tasks and fence it (another copy of Data's).
	ParentSessionID string
	// Usage is, with Kind "usage", what the attempt (AttemptID) used: what
	// a journal shared by several processes sums into the budgets of the
	// task's tree (another copy of Data's); nil otherwise.
	Usage *Usage
	Data  []byte // the whole record; a journal stores and returns it as is

	note *Notification // fleet.NoteOf: kind notification_produced, delivered with the commit
}

// Journal persists a Manager's ledger records (WithJournal).
//
// A batch is the unit of atomicity: every record of one Append is durable,
// and replayed, together or not at all — a crash may lose a whole batch
// (the last ones appended), never part of one, and never one without
// those appended before it. The Manager hands a journal everything one
// commit decided as one batch (a launch with its first attempt, a retry
// with the attempt it chose, an end with its notifications), so a replay
// never sees half a decision. The file journal frames its batches
// (internal/wal); pgledger writes each in one transaction. Recovery still
// derives what is owed from the state it replays (see Open), but a journal
// that breaks this rule may make it announce an outcome the live Manager
// would not have reached.
type Journal interface {
	// Append queues a batch of records after every batch appended before
	// it and returns at once: the Manager calls it in commit order, one
	// call at a time, while commits behind it wait, so it must not wait for
	// I/O. The batch's Wait returns once it is durable (all of it), or
	// with why it is not; after an error the Manager stops (fail-stop) and
	// a restart recovers from what is durable.
	Append(batch []Record) Commit
	// Replay calls fn with every durable record, in order. A journal
	// that waits on I/O it can cancel also has a method
	// ReplayContext(ctx context.Context, fn func(Record) error) error:
	// Open calls it with its own context instead of Replay, so a journal
	// whose storage stalls (a database, a network) cannot hold Open past
	// its deadline; it returns ctx's error, or one that wraps it, once
	// ctx ends.
	Replay(fn func(Record) error) error
	// A journal that can read one task's records back also has a method
	// TaskRecords(ctx context.Context, taskID string) ([]Record, error):
	// the task's durable records, in order, with the records of no task
	// (TaskID "") that lie between its first and its last; none (and no
	// error) for a task it holds no record of. Manager.History reads a
	// task's history from it. The file journal has it, and pgledger's.
	//
	// Compact replaces the journal's records with keep (in order), as one
	// atomic step.
	Compact(keep []Record) error
	// Close releases the journal.
	Close() error
}

// taskReader is a Journal that reads one task's records back (see
// Journal.Replay).
type taskReader interface {
	TaskRecords(ctx context.Context, taskID string) ([]Record, error)
}

// contextReplayer is a Journal whose replay a context can end (see
// Journal.Replay).
type contextReplayer interface {
	ReplayContext(ctx context.Context, fn func(Record) error) error
}

// Commit is a batch appended to a Journal on its way to durable storage.
type Commit interface {
	// Wait returns once the batch is durable, or with the error that kept
	// it from being.
	Wait() error
}

// guardJournal calls a Journal method (user code): a panic is an error
// that names it.
func guardJournal(what string, f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("the journal's %s panicked: %s", what, panicText(r))
		}
	}()
	return f()
}

// FileJournalOption configures OpenFileJournal: WithSyncEachCommit,
// WithSegmentSize, WithRepair.
type FileJournalOption interface{ applyFile(*wal.Options) error }

type fileOption func(*wal.Options) error

func (f fileOption) applyFile(o *wal.Options) error { return f(o) }

// WithSyncEachCommit makes every commit its own fsync. Default: group
// commit — commits that arrive while an fsync is in progress share the
// next one.
func WithSyncEachCommit() FileJournalOption {
	return fileOption(func(o *wal.Options) error { o.SyncEach = true; return nil })
}

// WithSegmentSize starts a new segment file once the current one holds n
// bytes. Default (and for n ≤ 0): 64 MiB.
func WithSegmentSize(n int64) FileJournalOption {
	return fileOption(func(o *wal.Options) error { o.SegmentBytes = n; return nil })
}

// OpenFileJournal opens (or creates) a journal in dir, the embedded
// default for durability: segment files of length-prefixed, CRC-32C-checked
// records, fsync'd by group commit (see internal/wal). One process at a
// time: a second opener of dir gets an error saying it is in use. A torn
// last record (a crash mid-write: a damaged record that nothing complete
// follows) is cut off and reported when the Manager opens (a warning); a
// damaged record that complete records follow is corruption, which no
// crash leaves: the journal refuses to open with a *CorruptError
// (ErrCorrupt) naming the segment, the offset, and the records and tasks
// that follow, unless WithRepair is given. So is, when a Manager
// opens it, a record that cannot be decoded or that the ledger refuses
// (one bgtask did not write): the error names its file, its offset and
// its kind.
func OpenFileJournal(dir string, opts ...FileJournalOption) (Journal, error) {
	if blank(dir) {
		return nil, fmt.Errorf("%w: OpenFileJournal with no directory", ErrInvalidArgument)
	}
	var o wal.Options
	for _, f := range opts {
		if f != nil {
			if err := f.applyFile(&o); err != nil {
				return nil, err
			}
		}
	}
	l, err := wal.Open(dir, o)
	if err != nil {
		return nil, corruptError(err)
	}
	return &fileJournal{l: l}, nil
}

// fileJournal is a Journal over an internal/wal log. A record's payload
// is a zero byte and its Data (the Record's other fields are copies of
// what Data holds); a payload that starts with anything else is one
// written before that, packed as packRecord did (its fields, then Data),
// and is still read. The Manager hands a fileJournal its records as they
// are (appendRecs, compactRecs, replayRecs): encoded once, straight into
// the log's payloads.
type fileJournal struct{ l *wal.Log }

// dataMark starts a payload that holds a record's Data alone.
const dataMark = 0

func (j *fileJournal) Append(batch []Record) Commit {
	return j.l.Append(payloadsOf(batch))
}

// payloadsOf is batch as the log stores it, in one buffer.
func payloadsOf(batch []Record) [][]byte {
	n := 0
	for i := range batch {
		n += 1 + len(batch[i].Data)
	}
	buf := make([]byte, 0, n)
	payloads := make([][]byte, len(batch))
	for i := range batch {
		s := len(buf)
		buf = append(append(buf, dataMark), batch[i].Data...)
		payloads[i] = buf[s:len(buf):len(buf)]
	}
	return payloads
}

// encodePayloads is recs as the log stores them, encoded into one buffer.
func encodePayloads(recs []record) ([][]byte, error) {
	buf := make([]byte, 0, (recordGuess+1)*len(recs))
	payloads := make([][]byte, len(recs))
	for i := range recs {
		s := len(buf)
		_, b, err := encodeInto(append(buf, dataMark), &recs[i])
		if err != nil {
			return nil, err
		}
		buf, payloads[i] = b, b[s:len(b):len(b)]
	}
	return payloads, nil
}

// appendRecs is Append of recs, encoded.
func (j *fileJournal) appendRecs(recs []record) Commit {
	payloads, err := encodePayloads(recs)
	if err != nil {
		return failedCommit{err}
	}
	return j.l.Append(payloads)
}

// compactRecs is Compact to recs, encoded.
func (j *fileJournal) compactRecs(recs []record) error {
	payloads, err := encodePayloads(recs)
	if err != nil {
		return err
	}
	return j.l.Compact(payloads)
}

// packRecord is r as the file journal stored it before payloads held
// Data alone: its fields, each a uvarint length (or value) and bytes,
// then its Data. Only tests write it now, to show it is still read.
func packRecord(r *Record) []byte {
	b := make([]byte, 0, binary.MaxVarintLen64+4*binary.MaxVarintLen32+len(r.Kind)+len(r.TaskID)+len(r.AttemptID)+len(r.Token)+len(r.Data))
	b = binary.AppendUvarint(b, r.Seq)
	for _, f := range [...]string{r.Kind, r.TaskID, r.AttemptID, r.Token} {
		b = binary.AppendUvarint(b, uint64(len(f)))
		b = append(b, f...)
	}
	return append(b, r.Data...)
}

// unpackRecord is the record payload p holds, decoded: with its Record
// fields (for a Journal's caller) and as the ledger reads it.
func unpackRecord(p []byte) (Record, record, error) {
	if len(p) > 0 && p[0] == dataMark {
		rec, err := decodeData(p[1:], 0, nil)
		if err != nil {
			return Record{}, record{}, err
		}
		return recordOf(&rec, p[1:]), rec, nil
	}
	var r Record
	seq, n := binary.Uvarint(p)
	if n <= 0 {
		return r, record{}, &recordError{decoding: true, err: errors.New("a record with no sequence")}
	}
	r.Seq, p = seq, p[n:]
	var fs [4]string
	for i := range fs {
		l, n := binary.Uvarint(p)
		if n <= 0 || uint64(len(p)-n) < l {
			return r, record{}, &recordError{seq: seq, decoding: true, err: errors.New("a record cut short")}
		}
		fs[i], p = string(p[n:n+int(l)]), p[n+int(l):]
	}
	r.Kind, r.TaskID, r.AttemptID, r.Token, r.Data = fs[0], fs[1], fs[2], fs[3], p
	rec, err := decodeRecord(r)
	if err != nil {
		return r, rec, err
	}
	return recordOf(&rec, r.Data), rec, nil // with the fields it did not keep
}

// kindOf peeks at the kind of the record payload p holds, without
// decoding it (0 if it cannot tell: an old payload, or a damaged one).
func kindOf(p []byte) recordKind {
	if len(p) < 3 || p[0] != dataMark {
		return 0
	}
	d := codec.Reader{B: p[2:]} // past the mark and the format
	d.Uint()                    // the sequence
	k := d.Uint()
	if d.Err() != nil || k > 255 {
		return 0
	}
	return recordKind(k)
}

// peek reads the sequence and kind of the record payload p holds, as far
// as they can be read, to name it in an error (0 for what cannot be).
func peek(p []byte) (seq uint64, kind recordKind) {
	if len(p) > 0 && p[0] != dataMark { // packed as packRecord did
		seq, _ = binary.Uvarint(p)
		return seq, 0
	}
	if len(p) < 3 {
		return 0, 0
	}
	d := codec.Reader{B: p[2:]}
	seq = d.Uint()
	if kind = kindOf(p); int(kind) >= len(recordKindNames) || recordKindNames[kind] == "" {
		kind = 0
	}
	return seq, kind
}

// placed is err, what a replay met at the i-th record the log read (whose
// payload is p), with where that record lies in the journal's files:
// a *recordError.
func (j *fileJournal) placed(i int, p []byte, err error) error {
	loc, _ := j.l.Locate(i)
	return placeAt(loc, p, err)
}

// placeAt is err, what a replay met at the record p at loc, as a
// *recordError that names loc.
func placeAt(loc wal.Location, p []byte, err error) error {
	var re *recordError
	if !errors.As(err, &re) {
		re = &recordError{err: err}
	}
	if re.seq == 0 && re.kind == 0 {
		re.seq, re.kind = peek(p)
	}
	re.at = loc
	return re
}

// unpackData is the record payload p holds, as the ledger reads it: a
// payload of Data alone is decoded without making its Record (its words
// kept in words, if set: see codec.Words).
func unpackData(p []byte, words *codec.Words) (record, error) {
	if len(p) > 0 && p[0] == dataMark {
		return decodeData(p[1:], 0, words)
	}
	_, rec, err := unpackRecord(p)
	return rec, err
}

// Replay calls fn with each record, in order. An error, fn's or the
// decoding's, names the record's file and offset.
func (j *fileJournal) Replay(fn func(Record) error) error {
	for i, p := range j.l.Records() {
		r, _, err := unpackRecord(p)
		if err == nil {
			err = fn(r)
		}
		if err != nil {
			return j.placed(i, p, err)
		}
	}
	return nil
}

// replayPayloads hands fn each record of payloads (the file journal's,
// read at its open) as the ledger reads it, in order; if the decoding or
// fn fails, or panics, it returns the error and the index of the record
// (so that the caller can say where it lies). The records are decoded on
// a goroutine of its own, a chunk ahead of fn, which applies them: a
// replay is half decoding, and a machine has more than one core. The
// goroutine ends before replayPayloads returns, also when fn fails.
func replayPayloads(payloads [][]byte, fn func(record) error) (at int, err error) {
	if len(payloads) <= replayChunk {
		err = guardDecode(func() error { return decodeChunk(payloads, &codec.Words{}, &at, fn) })
		return at, err
	}
	type chunk struct {
		recs []record
		err  error
		at   int // the index of the record err is about
	}
	out, free, stop := make(chan chunk, 2), make(chan []record, 3), make(chan struct{})
	for range cap(free) {
		free <- make([]record, 0, replayChunk)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(out)
		words := &codec.Words{}
		for i := 0; i < len(payloads); i += replayChunk {
			var recs []record
			select {
			case recs = <-free:
			case <-stop:
				return
			}
			var c chunk
			c.err = guardDecode(func() error {
				return decodeChunk(payloads[i:min(i+replayChunk, len(payloads))], words, &c.at, func(rec record) error {
					recs = append(recs, rec)
					return nil
				})
			})
			c.recs, c.at = recs, i+c.at
			select {
			case out <- c:
			case <-stop:
				return
			}
			if c.err != nil {
				return
			}
		}
	}()
	defer func() { close(stop); <-done }()
	at = 0 // the index of the record being applied
	err = guardDecode(func() error {
		for c := range out {
			for i := range c.recs {
				if err := fn(c.recs[i]); err != nil {
					return err
				}
				at++
			}
			if c.err != nil {
				at = c.at
				return c.err
			}
			clear(c.recs) // what they point to is the ledger's now, or garbage
			free <- c.recs[:0]
		}
		return nil
	})
	return at, err
}

// replayChunk is how many records replayPayloads decodes at a time.
const replayChunk = 2048

// decodeChunk hands fn each record of payloads, decoded; *at is the index
// of the record being decoded or handed, where it stops if either fails.
func decodeChunk(payloads [][]byte, words *codec.Words, at *int, fn func(record) error) error {
	for i, p := range payloads {
		*at = i
		rec, err := unpackData(p, words)
		if err != nil {
			return err
		}
		if err := fn(rec); err != nil {
			return err
		}
	}
	return nil
}

// guardDecode runs f, a decoding or a replay, with a panic made its
// error: the decoder reads what a disk held (a panic is a bug, and Open
// fails rather than the process).
func guardDecode(f func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("a record that cannot be read: panic: %s", panicText(r))
		}
	}()
	return f()
}

// TaskRecords reads the log as it is on disk (what was written so far)
// and returns the records of task id, with the records of no task
// between its first and its last (Journal.Replay).
func (j *fileJournal) TaskRecords(ctx context.Context, id string) ([]Record, error) {
	payloads, err := j.l.Read()
	if err != nil {
		return nil, corruptError(err)
	}
	var out []Record
	last := -1 // in out: the task's last record
	for i, p := range payloads {
		if i%1024 == 0 && ctx.Err() != nil {
			return nil, ctx.Err()
		}
		r, _, err := unpackRecord(p)
		if err != nil {
			return nil, j.placed(i, p, err)
		}
		switch {
		case r.TaskID == id:
			out = append(out, r)
			last = len(out) - 1
		case r.TaskID == "" && last >= 0:
			out = append(out, r)
		}
	}
	return out[:last+1], nil
}

func (j *fileJournal) Compact(keep []Record) error {
	return j.l.Compact(payloadsOf(keep))
}

func (j *fileJournal) Close() error { return j.l.Close() }

// TornTail names the torn record the journal cut off when it opened, or
// "".
func (j *fileJournal) TornTail() string {
	if t := j.l.Torn(); t != nil {
		return fmt.Sprintf("%s at offset %d (%d bytes)", t.File, t.Offset, t.Bytes)
	}
	return ""
}

// compactEvery is how many tasks must at least have been forgotten since
// the last compaction before the journal is compacted again.
const compactEvery = 1000

// compactDue says the journal is worth compacting: at least compactEvery
// tasks, and at least as many as are kept, were forgotten since the last
// compaction. So a compaction rewrites no more than it drops, and its cost
// per forgotten task stays constant however many tasks retention keeps.
func (l *ledger) compactDue() bool {
	return l.forgotten-l.compactedAt >= max(compactEvery, uint64(len(l.tasks)))
}
