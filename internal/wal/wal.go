// Package wal is bgtask's file journal: an append-only log of records in
// segment files, each record length-prefixed and CRC-32C-checked.
//
// Layout: a directory holds a LOCK file (one process at a time, by flock)
// and segments named seg-<n>.log, replayed in order of n. A record on disk
// is a 12-byte header — the payload's length (its top bit marks a
// compaction's base, the next one says that more records of its batch
// follow), the CRC-32C (Castagnoli) of those four bytes, and the CRC-32C
// of the payload, all little-endian uint32 — then the payload.
//
// Commits: a batch (one Append: for bgtask, one commit) is read whole or
// not at all. Every record of a batch but its last carries the flag that
// says its batch goes on; a batch is written into one segment. Recovery
// reads a batch only once it has read its last record: a segment whose
// records end inside a batch (the crash kept the first units of a round,
// or a damaged record cut it) is cut where that batch began, as a torn
// record is — in the last segment a torn tail (Torn.Offset is where the
// batch began), in any other segment corruption. A record with neither
// flag is a batch of its own, so a journal written before batches were
// framed reads exactly as before.
// The header's own checksum tells a damaged length from a write cut short.
// A header of zeros is never a record (the CRC-32C of four zero bytes is
// not zero): it is where the records of a segment end.
//
// Preallocation (the default; Options.NoPrealloc turns it off): a segment
// keeps zeroed space ahead of where its next record goes — its logical
// size, the end of its last record, is not its physical size. The space is
// made of real zero bytes (not fallocate, whose unwritten extents cost a
// metadata commit when first written), added in chunks of 1 MiB (of the
// segment size, in 4 KiB pages, if that is smaller) at the physical end,
// and made durable before a record is written into it; and a record is
// only written where at least one durable zero byte follows it. So the
// file's size never changes under records being written, and a
// preallocated segment that a crash interrupts ends in a zero byte. A
// round overwrites zeros in place, and its fdatasync has no file size, so
// no metadata, to commit: about half the cost of an append and fsync
// (measured here: 5 KiB and fdatasync ~70–95 µs, appended and fsynced
// ~100–200 µs). But the pages of such a write
// reach the disk in any order: a crash can keep any subset of the pages
// last written. So a round is written in units of at most W = 256 KiB,
// whole records each (a record longer than W in W-byte pieces, with no
// other record in its last one), each unit made durable before the next
// is written, and its batches complete only when the last one is: a crash
// leaves at most one unit partly written, and only zeros after it. A full
// segment is truncated to its records when the next one is started (not
// durably: a crash that undoes the cut leaves zeros, a clean end). Without
// preallocation a round is appended at the end of the file, one write and
// one fdatasync, and every file is exactly its records (Open truncates a
// zero tail of the last segment away).
//
// Durability: Append queues a batch and returns at once. A batch's Wait
// takes the writer's turn (there is no writer goroutine): it writes every
// batch queued so far and makes them durable with one fdatasync (group
// commit), or, with SyncEach, one per batch, while the other waiters wait
// for their batch or for the turn. A commit alone thus costs one write and
// one fdatasync with no hand-off between goroutines (fdatasync on Linux,
// fsync elsewhere; either makes the data and the file's size durable).
// Wait returns once the batch is durable, or with the error that stopped
// the log: after a write or fsync error the log refuses every later append
// (fail-stop), since what is on disk can no longer be known.
//
// Recovery: at Open, a segment is read record by record up to the first
// bytes, at offset off, that are not a whole record with good checksums.
//
//   - If the file ends at off or holds only zeros from there on, that is
//     the segment's clean end (preallocated space), in any segment: no
//     torn tail, nothing reported.
//   - Otherwise, in a segment before the last, it is corruption.
//   - If a complete, checksummed record follows it, it is corruption
//     unless a lost sector of the unit in flight explains it (the rules
//     are in corrupt.go: "Corruption is not a torn write").
//   - Else, in the last segment, the damaged record is the torn tail of a write
//     a crash interrupted if it is cut short by the end of the file, or
//     ends where the file ends (with a header whose own checksum fails:
//     if the file ends within that header, or where the length it gives
//     would end the record) — the rule for segments written without
//     preallocation, kept as it was — or if the file ends in a zero byte
//     (as a preallocated segment that a crash interrupted does) and every
//     byte from off+max(W, n) on is zero, n being the record's length with
//     its header when its header's checksum holds (0 when it does not: the
//     length is not to be trusted). Why: the unit a crash interrupted
//     starts at or before off (what came before it was durable) and
//     nothing after it was written. It is at most W long, unless it is a
//     later piece of a record longer than W: then that record's header was
//     in an earlier, durable unit, so the length is known, and the piece
//     ends with the record.
//   - Anything else is corruption: Open fails with a *Corrupt naming the
//     file, the offset and the complete records that follow, and never
//     skips it; with Options.Repair it cuts there instead, keeping a copy.
//     So is a good header whose length is over MaxRecord, which no write
//     leaves.
//
// A batch the damaged record (or the segment's clean end) leaves
// incomplete goes with it: off moves back to where that batch began.
//
// A torn tail is cut off: Open truncates the file at off, so every record
// after it goes too (the crash may have kept a later page of the unit and
// lost an earlier one), makes the cut durable before anything is written
// after it (new zeros are added as appends need them, so stale bytes can
// never be read after a later crash), and reports it (Torn: Offset is off,
// Bytes is what the cut removed, from off to the file's physical end,
// preallocated zeros included). ReadOnly applies the same rules, reports
// the same Torn, and changes nothing. A segment that ends in a non-zero
// byte was written without preallocation (or cut since at its torn tail,
// or full): it reads exactly as before preallocation existed. (One that
// was written without it but ends in a zero byte — its last payload does,
// or its last record is empty — gets the window rule too: corruption
// within W of its end may then pass for a torn tail.)
//
// Compaction rewrites what the caller keeps into a new segment that starts
// with a base marker (followed by its zeroed space, before its one
// fdatasync), and renames it into place: the rename is the commit point.
// At Open, segments older than the newest base are ignored (and removed),
// so a crash at any point of a compaction leaves either the old log or the
// new one, never both.
package wal

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

const (
	headerSize = 12
	// MaxRecord bounds one record's payload: a longer length in a header
	// is corruption, never an allocation.
	MaxRecord = 64 << 20
	// baseFlag, in a header's length, marks a compaction's base: a record
	// with no payload before which everything is replaced.
	baseFlag = 1 << 31
	// moreFlag, in a header's length, says that the record is not the last
	// of its batch: the batch's next record follows it. A batch (a commit)
	// is read whole or not at all (see the package doc, "Commits").
	moreFlag = 1 << 30
	// flags are the bits of a header's length field that are not length.
	flags = baseFlag | moreFlag

	// unitBytes (W in the package doc) bounds what one write and sync
	// covers in a preallocated segment, and so how far past a damaged
	// record a torn write can have left bytes. It is part of the format:
	// the reader assumes it. 256 KiB keeps the window in which corruption
	// near the end of the last segment passes for a torn tail small (the
	// old layout's was the last record), and costs one more sync per 256
	// KiB only to a round of more than 256 KiB, whose write takes long
	// enough for that to matter little (measured here: 512 KiB and one
	// fdatasync ~0.35 ms, two units ~0.46 ms; a round of 5 KB ~0.07 ms).
	unitBytes = 256 << 10
	// growBytes is the chunk of zeros an extension adds (the segment size,
	// in pages, if that is smaller). An extension is a metadata commit
	// (the file grows) and a write of its zeros: 1 MiB makes that once per
	// 1 MiB of records (some 200 rounds of 5 KB), bounds the latency it
	// adds to the round that pays it to about a millisecond (measured
	// here: 1.0–1.1 ms for 1 MiB of zeros and its fdatasync), and wastes
	// at most 1 MiB at the end of the last segment (1/64 of a default
	// segment; full segments are truncated).
	growBytes = 1 << 20
	pageSize  = 4 << 10
)

// zeros is what an extension writes, a piece at a time, and what allZero
// compares with. Never written to.
var zeros [64 << 10]byte

// ErrLocked: another process (or another Log in this one) has the
// directory open.
var ErrLocked = errors.New("the journal directory is in use by another process")

// ErrClosed: the log was closed.
var ErrClosed = errors.New("the journal is closed")

// Options tune a Log.
type Options struct {
	// SyncEach makes every batch its own fsync. Default: group commit.
	SyncEach bool
	// SegmentBytes starts a new segment once the current one is this big.
	// Default 64 MiB.
	SegmentBytes int64
	// FS is the file system; nil: the operating system's. Tests inject
	// faults through it.
	FS FS
	// NoPrealloc turns preallocation off (see the package doc): records
	// are appended at the end of the file, which is exactly its records.
	// Default (false): segments keep durable zeros ahead of the next
	// record, and a round overwrites them without changing the file size.
	NoPrealloc bool
	// Repair, if set, repairs a corrupt journal at Open (see Corrupt):
	// Open calls it with what the cut drops and where the copy goes,
	// before it writes anything; if it returns nil, Open keeps a copy of
	// what it cuts, cuts, and opens what is left; if it returns an error,
	// Open fails with it and changes nothing. ReadOnly ignores it.
	Repair func(*Corrupt) error
}

// FS is what a Log needs of a file system.
type FS interface {
	OpenFile(name string, flag int, perm os.FileMode) (File, error)
	Rename(oldpath, newpath string) error
	Remove(name string) error
	ReadDir(name string) ([]os.DirEntry, error)
	MkdirAll(path string, perm os.FileMode) error
	// SyncDir makes a rename or a new file in dir durable.
	SyncDir(dir string) error
}

// File is an open file. Records are written with Write at the file's
// offset (the logical end); preallocated zeros with WriteAt at the
// physical end. A File that also has a method SyncData() error (as
// fdatasync) is synced with it; an *os.File with fdatasync on Linux;
// any other with Sync.
type File interface {
	io.Reader
	io.Writer
	io.WriterAt
	io.Closer
	Sync() error
	Truncate(size int64) error
	Seek(offset int64, whence int) (int64, error)
	Fd() uintptr
}

type osFS struct{}

func (osFS) OpenFile(name string, flag int, perm os.FileMode) (File, error) {
	return os.OpenFile(name, flag, perm)
}
func (osFS) Rename(a, b string) error                     { return os.Rename(a, b) }
func (osFS) Remove(name string) error                     { return os.Remove(name) }
func (osFS) ReadDir(name string) ([]os.DirEntry, error)   { return os.ReadDir(name) }
func (osFS) MkdirAll(path string, perm os.FileMode) error { return os.MkdirAll(path, perm) }
func (osFS) SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// syncData makes what was written to f durable: with its SyncData method
// if it has one, with fdatasync if it is an *os.File, else with Sync.
// Directory syncs and the lock file do not come here.
func syncData(f File) error {
	switch f := f.(type) {
	case interface{ SyncData() error }:
		return f.SyncData()
	case *os.File:
		return fdatasync(f)
	}
	return f.Sync()
}

// Log is an open journal directory.
type Log struct {
	dir  string
	opts Options
	fs   FS
	lock File

	mu     sync.Mutex // guards queue, err, closed, records
	queue  []*Batch   // appended, not yet taken by a writer
	err    error      // what stopped the log: every later append fails with it
	closed bool
	// turn is the writer's role (group commit without a goroutine of its
	// own): a waiter that takes it writes everything queued, syncs once
	// (once per unit for a round of more than one), and gives it back;
	// the others wait for their batch or for the turn.
	turn chan struct{}

	wmu     sync.Mutex // held while writing: guards seg, segN, segSize, segPhys, segHidden, unit, buf
	buf     *bufio.Writer
	seg     File  // the segment appended to
	segN    int   // its number
	segSize int64 // its logical size: where the next record goes
	// segPhys is its physical size with preallocation: [segSize,
	// segPhys) is zeros, durable ones (Open makes what it read durable,
	// zeroAhead what it adds). Without preallocation it is not kept up.
	segPhys int64
	// segHidden: seg is a compaction's new segment, which no reader sees
	// before it is complete and durable, so it needs no units.
	segHidden bool
	unit      int64 // bytes written in the unit in progress (preallocation)

	records [][]byte // what Open found, handed to Replay once
	torn    *Torn
}

// Torn describes a torn tail Open truncated (or ReadOnly found).
type Torn struct {
	File   string
	Offset int64 // where the cut record began; the file now ends there
	// Bytes is how many bytes were cut: from Offset to the file's
	// physical end, preallocated zeros after the torn write included.
	Bytes int64
}

// Batch is a queued append.
type Batch struct {
	l        *Log // nil: completed when made
	payloads [][]byte
	base     bool // its nil payloads are base markers (Compact's own)
	done     chan struct{}
	err      error
}

// Wait returns once the batch is durable, or with the error that kept it
// from being. The first waiter writes: it takes the writer's turn, writes
// every batch queued by then and syncs once (for more than a unit's worth,
// once per unit); batches appended meanwhile are written, together, by the
// next waiter to take the turn. So a commit alone costs its caller one
// write and one sync, and no hand-off to another goroutine.
func (b *Batch) Wait() error {
	if l := b.l; l != nil {
		for {
			select {
			case <-b.done:
				return b.err
			case l.turn <- struct{}{}:
				l.round()
				<-l.turn
			}
		}
	}
	<-b.done
	return b.err
}

// WaitContext is Wait until ctx ends: it reports true, with Wait's result,
// once the batch is durable (or failed), or false once ctx ended first.
// Then the batch may or may not become durable: it is still queued or
// being written, and some waiter must still call Wait, or nothing may
// write it (there is no writer of its own).
func (b *Batch) WaitContext(ctx context.Context) (done bool, err error) {
	l := b.l
	if l == nil {
		<-b.done
		return true, b.err
	}
	for {
		select {
		case <-b.done:
			return true, b.err
		case l.turn <- struct{}{}:
			l.round()
			<-l.turn
		case <-ctx.Done():
			select {
			case <-b.done:
				return true, b.err
			default:
				return false, nil
			}
		}
	}
}

// Open opens (or creates) the journal in dir, reads it, and truncates a
// torn tail. It fails if another process has it open, or if a record
// before the tail is corrupt.
func Open(dir string, opts Options) (*Log, error) {
	fs := opts.FS
	if fs == nil {
		fs = osFS{}
	}
	if opts.SegmentBytes <= 0 {
		opts.SegmentBytes = 64 << 20
	}
	if err := fs.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	lock, err := fs.OpenFile(filepath.Join(dir, "LOCK"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("journal %s: %w", dir, ErrLocked)
		}
		return nil, fmt.Errorf("journal %s: lock: %w", dir, err)
	}
	l := &Log{dir: dir, opts: opts, fs: fs, lock: lock, turn: make(chan struct{}, 1)}
	if err := l.load(); err != nil {
		l.unlock()
		return nil, err
	}
	return l, nil
}

func (l *Log) unlock() {
	_ = syscall.Flock(int(l.lock.Fd()), syscall.LOCK_UN)
	_ = l.lock.Close()
}

// segments lists the segment numbers in dir, in order.
func (l *Log) segments() ([]int, error) { return segmentsIn(l.fs, l.dir) }

// segmentsIn lists the segment numbers in dir, in order.
func segmentsIn(fs FS, dir string) ([]int, error) {
	ents, err := fs.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("journal: %w", err)
	}
	var ns []int
	for _, e := range ents {
		name := e.Name()
		if !strings.HasPrefix(name, "seg-") || !strings.HasSuffix(name, ".log") {
			continue
		}
		n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(name, "seg-"), ".log"))
		if err != nil {
			continue
		}
		ns = append(ns, n)
	}
	sort.Ints(ns)
	return ns, nil
}

func segName(n int) string { return fmt.Sprintf("seg-%016d.log", n) }

// seg is one segment as read: the records it holds, the offset after
// its last whole record (its logical size), its physical size, and its
// torn tail, if any.
type seg struct {
	n    int
	recs [][]byte
	end  int64
	size int64
	torn *Torn
}

// readSegments reads every segment in order and returns those that count:
// from the last compaction base on (the segments before it were replaced).
// It changes nothing; ns is every segment found.
func (l *Log) readSegments() (segs []seg, ns []int, err error) {
	if ns, err = l.segments(); err != nil {
		return nil, nil, err
	}
	for i := 0; i < len(ns); i++ {
		n := ns[i]
		s, err := l.read(n, i == len(ns)-1)
		var c *Corrupt
		if errors.As(err, &c) {
			// A later segment that begins with a compaction's base
			// replaces this one: its damage no longer counts.
			if j := slices.IndexFunc(ns[i+1:], l.startsBase); j >= 0 {
				segs, i = segs[:0], i+j
				continue
			}
			if err := l.laterDamage(c, ns[i+1:]); err != nil {
				return nil, nil, err
			}
			c.Copy = copyDir(l.fs, l.dir)
			return nil, nil, c
		}
		if err != nil {
			return nil, nil, err
		}
		if len(s.recs) > 0 && s.recs[0] == nil { // a compaction's base: what came before is replaced
			segs = segs[:0]
			s.recs = s.recs[1:]
		}
		segs = append(segs, s)
	}
	return segs, ns, nil
}

// load reads every segment from the newest base on, truncates a torn tail,
// and opens the last segment for appending.
func (l *Log) load() error {
	segs, ns, err := l.readSegments()
	var c *Corrupt
	if errors.As(err, &c) && l.opts.Repair != nil {
		if err := l.opts.Repair(c); err != nil {
			return err
		}
		if err := l.repair(c); err != nil {
			return err
		}
		segs, ns, err = l.readSegments()
	}
	if err != nil {
		return err
	}
	for _, n := range ns { // drop segments a finished compaction replaced
		if len(segs) > 0 && n < segs[0].n {
			_ = l.fs.Remove(filepath.Join(l.dir, segName(n)))
		}
	}
	for _, s := range segs {
		l.records = append(l.records, s.recs...)
	}
	last := seg{n: 1}
	if len(segs) > 0 {
		last = segs[len(segs)-1]
		l.torn = last.torn
	}
	n, size, phys := last.n, last.end, last.size
	f, err := l.fs.OpenFile(filepath.Join(l.dir, segName(n)), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fmt.Errorf("journal: %w", err)
	}
	fail := func(err error) error {
		f.Close()
		return fmt.Errorf("journal: %w", err)
	}
	// A torn tail is cut; so is a clean zero tail without preallocation,
	// to keep the file exactly its records.
	if phys > size && (l.torn != nil || l.opts.NoPrealloc) {
		if err := f.Truncate(size); err != nil {
			return fail(fmt.Errorf("truncating the tail of %s: %w", segName(n), err))
		}
		phys = size
	}
	// What Open read is durable from here on (and the cut too): a process
	// that crashed may have left its last writes, zeros or records, in
	// the page cache only, and the records are about to be replayed and
	// the zeros written into.
	if err := syncData(f); err != nil {
		return fail(err)
	}
	if _, err := f.Seek(size, io.SeekStart); err != nil {
		return fail(err)
	}
	if len(segs) == 0 {
		if err := l.fs.SyncDir(l.dir); err != nil {
			return fail(err)
		}
	}
	l.seg, l.segN, l.segSize, l.segPhys = f, n, size, phys
	return nil
}

// ReadOnly reads the journal in dir as Open would, without taking its lock
// and without changing a byte: for looking inside a journal whose writer
// may still be running, or that a crash left (a torn tail is reported,
// not truncated; a clean zero tail is no torn tail). A segment a running
// compaction removes meanwhile makes it read again, a few times.
func ReadOnly(dir string, opts Options) (recs [][]byte, torn *Torn, err error) {
	fs := opts.FS
	if fs == nil {
		fs = osFS{}
	}
	l := &Log{dir: dir, opts: opts, fs: fs}
	var c *Corrupt
	for try := 0; ; try++ {
		recs, torn, err = l.readAll()
		// A running writer may be overtaken mid-page (its round read up to
		// a point, zeros, then its later records): read again, a few
		// times, before calling that corruption.
		if err == nil || try == 3 || !errors.Is(err, os.ErrNotExist) && !errors.As(err, &c) {
			return recs, torn, err
		}
	}
}

// Read reads the log's records as ReadOnly reads its directory, while
// the log is open: what was written so far (a torn tail is left out).
func (l *Log) Read() ([][]byte, error) {
	recs, _, err := ReadOnly(l.dir, l.opts)
	return recs, err
}

// readAll reads the records as load does, changing nothing.
func (l *Log) readAll() (recs [][]byte, torn *Torn, err error) {
	segs, _, err := l.readSegments()
	if err != nil {
		return nil, nil, err
	}
	for _, s := range segs {
		recs, torn = append(recs, s.recs...), s.torn
	}
	return recs, torn, nil
}

// read reads segment n by the rules of the package doc; a base marker is
// returned as a nil payload, and only what follows the last one in the
// segment is returned after it.
func (l *Log) read(n int, last bool) (s seg, err error) {
	name := filepath.Join(l.dir, segName(n))
	f, err := l.fs.OpenFile(name, os.O_RDONLY, 0)
	if err != nil {
		return seg{}, fmt.Errorf("journal: %w", err)
	}
	defer f.Close()
	data, err := readWhole(f)
	if err != nil {
		return seg{}, fmt.Errorf("journal: reading %s: %w", name, err)
	}
	s.n, s.size = n, int64(len(data))
	off := int64(0)
	// The batch being read: where it began (offset, and index in s.recs),
	// and whether its last record read says more of it follows.
	var open bool
	var batchOff int64
	batchIdx := 0
	for off < s.size {
		payload, field, end, bad := record(data, off)
		if bad != nil {
			if allZero(data[off:]) {
				break // the clean end: preallocated space
			}
			follow := completeFrom(data, scanFrom(off, bad))
			if last && (len(follow) == 0 && tornTail(data, off, bad) || len(follow) > 0 && tornUnit(data, off, bad, follow)) {
				s.torn = &Torn{File: name, Offset: off, Bytes: s.size - off}
				break
			}
			cut, idx := off, len(s.recs)
			if open {
				cut, idx = batchOff, batchIdx
			}
			return seg{}, corruptAt(name, off, bad.why, cut, s.recs, idx, follow)
		}
		if !open {
			batchOff, batchIdx = off, len(s.recs)
		}
		if field&baseFlag != 0 {
			s.recs, batchIdx = [][]byte{nil}, 0 // a base: what came before it is replaced
		} else {
			s.recs = append(s.recs, payload)
		}
		open = field&moreFlag != 0
		off = end
	}
	if open {
		// The segment ends inside a batch: the crash kept the first of
		// its records and lost the rest. The batch is cut as a torn
		// record is: none of it was durable, so none of it happened.
		if !last {
			return seg{}, corruptAt(name, batchOff, "a commit that does not end before the segment does", batchOff, s.recs, batchIdx, nil)
		}
		s.recs = s.recs[:batchIdx]
		s.torn = &Torn{File: name, Offset: batchOff, Bytes: s.size - batchOff}
		off = batchOff
	}
	s.end = off
	return s, nil
}

// damage is why the bytes at an offset are not a whole record.
type damage struct {
	why string
	// atEnd: the record is cut short by the end of the file, or ends
	// where the file ends: a torn tail by the rule for segments written
	// without preallocation.
	atEnd bool
	// span is the record's length with its header when its header's
	// checksum holds, else 0 (unknown).
	span int64
	// never: no write leaves this (a good header over the limit), so it
	// is corruption wherever it is.
	never bool
}

// record reads the record at off: its payload, its header's length field
// (whose flags say whether it is a base marker, and whether its batch goes
// on), and where it ends; or, if it is not a whole record with good
// checksums, what is wrong with it.
func record(data []byte, off int64) (payload []byte, field uint32, end int64, bad *damage) {
	size := int64(len(data))
	if size-off < headerSize {
		return nil, 0, 0, &damage{why: "short header", atEnd: true}
	}
	hdr := data[off : off+headerSize]
	field = binary.LittleEndian.Uint32(hdr)
	length := int64(field &^ flags)
	end = off + headerSize + length
	if crc32.Checksum(hdr[:4], castagnoli) != binary.LittleEndian.Uint32(hdr[4:]) {
		// The length is not to be trusted; by the old rule the record is
		// the torn tail only if, as written, it is the one that ends the
		// segment.
		return nil, 0, 0, &damage{why: "header checksum mismatch", atEnd: off+headerSize == size || end == size}
	}
	span := headerSize + length
	switch {
	case length > MaxRecord:
		return nil, 0, 0, &damage{why: "record length over the limit", never: true}
	case end > size:
		return nil, 0, 0, &damage{why: "record cut short", atEnd: true, span: span}
	}
	payload = data[off+headerSize : end]
	if crc32.Checksum(payload, castagnoli) != binary.LittleEndian.Uint32(hdr[8:]) {
		return nil, 0, 0, &damage{why: "checksum mismatch", atEnd: end == size, span: span}
	}
	return payload, field, end, nil
}

// tornTail reports whether the damaged record at off in the last segment
// (data, with some non-zero byte from off on) is the tail of a write a
// crash interrupted, by the rules of the package doc.
func tornTail(data []byte, off int64, bad *damage) bool {
	size := int64(len(data))
	switch {
	case bad.never:
		return false
	case bad.atEnd:
		return true
	case data[size-1] != 0:
		return false // not preallocated: only a record at the end is torn
	}
	// The unit in flight began at or before off and ended by off+W, or,
	// if it was a piece of a record longer than W, by that record's end;
	// nothing after it was written.
	limit := off + max(unitBytes, bad.span)
	return limit >= size || allZero(data[limit:])
}

// allZero reports whether b is all zeros, a block at a time (the zero
// tail of a segment is up to a chunk long, read at every Open).
func allZero(b []byte) bool {
	for len(b) > 0 {
		n := min(len(b), len(zeros))
		if !bytes.Equal(b[:n], zeros[:n]) {
			return false
		}
		b = b[n:]
	}
	return true
}

// Torn reports the torn tail Open truncated, or nil.
func (l *Log) Torn() *Torn { return l.torn }

// Records returns, once, the payloads Open read, in order.
func (l *Log) Records() [][]byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.records
	l.records = nil
	return r
}

// Append queues payloads as one batch, after every batch appended before
// it. It does no I/O: the batch is written by the first Wait on it or on a
// later batch, by Compact, or by Close.
func (l *Log) Append(payloads [][]byte) *Batch {
	b := &Batch{l: l, payloads: payloads, done: make(chan struct{})}
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.closed:
		b.err = ErrClosed
	case l.err != nil:
		b.err = l.err
	}
	if b.err != nil {
		close(b.done)
		return b
	}
	l.queue = append(l.queue, b)
	return b
}

// round writes what is queued (with SyncEach, its first batch only) and
// makes it durable (one sync, or one per unit: see write), then completes
// those batches. It takes the write lock
// before it takes batches off the queue, so Compact (which holds that
// lock) sees every batch either written or still queued. After an error
// nothing more is written: what is queued fails with it. The caller holds
// the turn.
func (l *Log) round() {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	l.mu.Lock()
	batches := l.queue
	if l.opts.SyncEach && len(batches) > 0 {
		batches = batches[:1]
	}
	l.queue = l.queue[len(batches):]
	err := l.err
	l.mu.Unlock()
	if len(batches) == 0 {
		return
	}
	if err == nil {
		if err = l.write(batches, true); err != nil {
			l.fail(err)
		}
	}
	complete(batches, err)
}

// complete ends batches with err (nil: durable).
func complete(batches []*Batch, err error) {
	for _, b := range batches {
		b.err = err
		close(b.done)
	}
}

// write writes batches at the current segment's logical end and makes
// them durable: with preallocation, in units of at most unitBytes, each
// synced before the next is written (see the package doc); else, or in a
// compaction's new segment, with one sync. With rotate, a full segment is
// followed by a new one. l.wmu is held.
func (l *Log) write(batches []*Batch, rotate bool) error {
	if l.buf == nil {
		l.buf = bufio.NewWriterSize(l.seg, 64<<10)
	}
	l.buf.Reset(l.seg)
	l.unit = 0 // what came before is durable
	units := !l.opts.NoPrealloc && !l.segHidden
	var hdr [headerSize]byte
	for _, b := range batches {
		for i, p := range b.payloads {
			if len(p) > MaxRecord {
				return fmt.Errorf("journal: a record of %d bytes is over the limit of %d", len(p), MaxRecord)
			}
			field := uint32(len(p))
			if p == nil && b.base {
				field |= baseFlag
			}
			if i < len(b.payloads)-1 && !b.base {
				field |= moreFlag // its batch goes on: a commit is read whole or not at all
			}
			binary.LittleEndian.PutUint32(hdr[:], field)
			binary.LittleEndian.PutUint32(hdr[4:], crc32.Checksum(hdr[:4], castagnoli))
			binary.LittleEndian.PutUint32(hdr[8:], crc32.Checksum(p, castagnoli))
			size := int64(headerSize + len(p))
			if units && l.unit > 0 && l.unit+size > unitBytes {
				if err := l.endUnit(); err != nil { // records are not split across units
					return err
				}
			}
			if err := l.put(hdr[:], units); err != nil {
				return err
			}
			if err := l.put(p, units); err != nil {
				return err
			}
			if units && size > unitBytes {
				l.unit = unitBytes // a longer record has its last unit to itself
			}
		}
	}
	if l.segHidden && !l.opts.NoPrealloc {
		// No one reads a compaction's new segment before its sync: its
		// zeros go after its records, not under them first.
		l.segPhys = max(l.segPhys, l.segSize)
		if err := l.zeroAhead(l.segSize); err != nil {
			return err
		}
	}
	if err := l.endUnit(); err != nil {
		return err
	}
	if rotate && l.segSize >= l.opts.SegmentBytes {
		return l.rotate(l.segN + 1)
	}
	return nil
}

// put writes b at the logical end (through l.buf). With units, it ends
// the unit in progress when it is full, splits b at unit boundaries, and
// makes sure zeros lie ahead of what it writes. l.wmu is held.
func (l *Log) put(b []byte, units bool) error {
	for len(b) > 0 {
		k := int64(len(b))
		if units {
			if l.unit == unitBytes {
				if err := l.endUnit(); err != nil {
					return err
				}
			}
			k = min(k, unitBytes-l.unit)
			if err := l.zeroAhead(l.segSize + k); err != nil {
				return err
			}
		}
		if _, err := l.buf.Write(b[:k]); err != nil {
			return fmt.Errorf("journal: write: %w", err)
		}
		l.segSize += k
		l.unit += k
		b = b[k:]
	}
	return nil
}

// zeroAhead makes sure the bytes before end can be written over zeros
// with one zero byte still after them: if not, it writes zeros at the
// physical end, to the first chunk boundary past end, and (but in a
// compaction's new segment) makes them durable before anything is
// written into them, so that a crash never changes the file's size under
// records and a preallocated segment always ends in a zero byte. Without
// preallocation it does nothing. l.wmu is held.
func (l *Log) zeroAhead(end int64) error {
	if l.opts.NoPrealloc || end < l.segPhys {
		return nil
	}
	grow := (min(growBytes, l.opts.SegmentBytes) + pageSize - 1) / pageSize * pageSize
	to := (end/grow + 1) * grow // whole chunks: the zeros end on a page boundary
	for off := l.segPhys; off < to; {
		n := min(to-off, int64(len(zeros)))
		if _, err := l.seg.WriteAt(zeros[:n], off); err != nil {
			return fmt.Errorf("journal: preallocating: %w", err)
		}
		off += n
	}
	if !l.segHidden {
		if err := syncData(l.seg); err != nil {
			return fmt.Errorf("journal: fsync: %w", err)
		}
	}
	l.segPhys = to
	return nil
}

// endUnit writes out what l.buf holds and makes the segment durable.
// l.wmu is held.
func (l *Log) endUnit() error {
	if err := l.buf.Flush(); err != nil {
		return fmt.Errorf("journal: write: %w", err)
	}
	if err := syncData(l.seg); err != nil {
		return fmt.Errorf("journal: fsync: %w", err)
	}
	l.unit = 0
	return nil
}

// rotate starts segment n for the appends that follow.
func (l *Log) rotate(n int) error {
	f, err := l.fs.OpenFile(filepath.Join(l.dir, segName(n)), os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o644)
	if err != nil {
		return fmt.Errorf("journal: new segment: %w", err)
	}
	if err := l.fs.SyncDir(l.dir); err != nil {
		f.Close()
		return fmt.Errorf("journal: new segment: %w", err)
	}
	// The full segment keeps only its records: its zeros will never be
	// written into. The cut need not be durable, nor succeed: zeros left
	// after the records are a clean end.
	if l.segPhys > l.segSize {
		_ = l.seg.Truncate(l.segSize)
	}
	_ = l.seg.Close()
	l.seg, l.segN, l.segSize, l.segPhys = f, n, 0, 0
	return nil
}

// Compact replaces the log with keep: the payloads to keep, in order,
// read and filtered by the caller. What was appended before it is written
// first; appends made meanwhile wait and are written after the compacted
// records. The swap is atomic: a crash leaves the old log or the new one.
func (l *Log) Compact(keep [][]byte) error {
	l.wmu.Lock() // the writer pauses
	defer l.wmu.Unlock()
	l.mu.Lock()
	if l.closed || l.err != nil {
		err := l.err
		if l.closed {
			err = ErrClosed
		}
		l.mu.Unlock()
		return err
	}
	pending := l.queue
	l.queue = nil
	l.mu.Unlock()
	if len(pending) > 0 {
		err := l.write(pending, true)
		complete(pending, err)
		if err != nil {
			l.fail(err)
			return err
		}
	}
	n := l.segN + 1
	tmp := filepath.Join(l.dir, segName(n)+".tmp")
	f, err := l.fs.OpenFile(tmp, os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o644)
	if err != nil {
		return fmt.Errorf("journal: compaction: %w", err)
	}
	old, oldN, oldSize, oldPhys := l.seg, l.segN, l.segSize, l.segPhys
	l.seg, l.segN, l.segSize, l.segPhys, l.segHidden = f, n, 0, 0, true
	err = l.write([]*Batch{{payloads: based(keep), base: true}}, false)
	l.segHidden = false // from the rename on, it is the segment appended to
	if err == nil {
		err = l.fs.Rename(tmp, filepath.Join(l.dir, segName(n)))
		if err == nil {
			if err = l.fs.SyncDir(l.dir); err != nil { // the commit point
				// Renamed, but whether it is durable is unknown: which log
				// a restart sees is unknown too, so nothing more may be
				// appended (fail-stop).
				_ = old.Close()
				err = fmt.Errorf("journal: compaction: %w", err)
				l.fail(err)
				return err
			}
		}
	}
	if err != nil {
		_ = f.Close()
		_ = l.fs.Remove(tmp)
		l.seg, l.segN, l.segSize, l.segPhys = old, oldN, oldSize, oldPhys
		return fmt.Errorf("journal: compaction: %w", err)
	}
	_ = old.Close()
	if ns, err := l.segments(); err == nil {
		for _, m := range ns {
			if m < n {
				_ = l.fs.Remove(filepath.Join(l.dir, segName(m)))
			}
		}
	}
	if l.segSize >= l.opts.SegmentBytes {
		if err := l.rotate(n + 1); err != nil {
			l.fail(err)
			return err
		}
	}
	return nil
}

// based is a compaction's payloads: the base marker, then keep.
func based(keep [][]byte) [][]byte {
	ps := make([][]byte, 0, len(keep)+1)
	ps = append(ps, nil) // the base marker
	for _, p := range keep {
		if p == nil {
			p = []byte{} // an empty record, not a marker
		}
		ps = append(ps, p)
	}
	return ps
}

func (l *Log) fail(err error) {
	l.mu.Lock()
	if l.err == nil {
		l.err = err
	}
	l.mu.Unlock()
}

// Close writes what is queued and releases the directory. Appends after
// it fail with ErrClosed.
func (l *Log) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	l.mu.Unlock()
	l.wmu.Lock() // a round or a compaction in flight ends first
	l.mu.Lock()
	pending, werr := l.queue, l.err
	l.queue = nil
	l.mu.Unlock()
	if len(pending) > 0 {
		if werr == nil {
			if werr = l.write(pending, false); werr != nil {
				l.fail(werr)
			}
		}
		complete(pending, werr)
	}
	err := l.seg.Close()
	l.wmu.Unlock()
	l.unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return l.err
	}
	return err
}
