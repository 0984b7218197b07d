// Package wal is bgtask's file journal: an append-only log of records in
// segment files, each record length-prefixed and CRC-32C-checked.
//
// Layout: a directory holds a LOCK file (one process at a time, by flock)
// and segments named seg-<n>.log, replayed in order of n. A record on disk
// is a 12-byte header — the payload's length (its top bit marks a
// compaction's base), the CRC-32C (Castagnoli) of those four bytes, and
// the CRC-32C of the payload, all little-endian uint32 — then the payload.
// The header's own checksum tells a damaged length from a write cut short.
//
// Durability: Append queues a batch and returns at once. A batch's Wait
// takes the writer's turn (there is no writer goroutine): it writes every
// batch queued so far and makes them durable with one fsync (group
// commit), or, with SyncEach, one fsync per batch, while the other waiters
// wait for their batch or for the turn. A commit alone thus costs one
// write and one fsync with no hand-off between goroutines. Wait returns
// once the batch is durable, or with the error that stopped the log: after
// a write or fsync error the log refuses every later append (fail-stop),
// since what is on disk can no longer be known.
//
// Recovery: at Open, a torn last record — a header or payload cut short at
// the end of the last segment, a checksum mismatch in the record that ends
// the last segment, or a tail of zeros (what some file systems leave after
// a crash) — is the tail of a write the crash interrupted: it is truncated
// away, and Open reports it (Torn). A bad checksum or a short record
// anywhere else is corruption: Open fails with an error naming the file and
// the offset, and never skips it.
//
// Compaction rewrites what the caller keeps into a new segment that starts
// with a base marker, and renames it into place: the rename is the commit
// point. At Open, segments older than the newest base are ignored (and
// removed), so a crash at any point of a compaction leaves either the old
// log or the new one, never both.
package wal

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
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
)

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

// File is an open file.
type File interface {
	io.Reader
	io.Writer
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
	// own): a waiter that takes it writes everything queued, fsyncs once,
	// and gives it back; the others wait for their batch or for the turn.
	turn chan struct{}

	wmu     sync.Mutex // held while writing: guards seg, segN, segSize, buf
	buf     *bufio.Writer
	seg     File  // the segment appended to
	segN    int   // its number
	segSize int64 // its size

	records [][]byte // what Open found, handed to Replay once
	torn    *Torn
}

// Torn describes a torn tail Open truncated.
type Torn struct {
	File   string
	Offset int64 // where the cut record began; the file now ends there
	Bytes  int64 // how many bytes were cut
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
// every batch queued by then and fsyncs once; batches appended meanwhile
// are written, together, by the next waiter to take the turn. So a commit
// alone costs its caller one write and one fsync, and no hand-off to
// another goroutine.
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
		return nil, fmt.Errorf("bgtask: journal: %w", err)
	}
	lock, err := fs.OpenFile(filepath.Join(dir, "LOCK"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("bgtask: journal: %w", err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("bgtask: journal %s: %w", dir, ErrLocked)
		}
		return nil, fmt.Errorf("bgtask: journal %s: lock: %w", dir, err)
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
		return nil, fmt.Errorf("bgtask: journal: %w", err)
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

// load reads every segment from the newest base on, truncates a torn tail,
// and opens the last segment for appending.
// seg is one segment as read: the records it holds, the offset after
// its last whole record, and its torn tail, if any.
type seg struct {
	n    int
	recs [][]byte
	end  int64
	torn *Torn
}

// readSegments reads every segment in order and returns those that count:
// from the last compaction base on (the segments before it were replaced).
// It changes nothing; ns is every segment found.
func (l *Log) readSegments() (segs []seg, ns []int, err error) {
	if ns, err = l.segments(); err != nil {
		return nil, nil, err
	}
	for i, n := range ns {
		recs, end, torn, err := l.read(n, i == len(ns)-1)
		if err != nil {
			return nil, nil, err
		}
		if len(recs) > 0 && recs[0] == nil { // a compaction's base: what came before is replaced
			segs = segs[:0]
			recs = recs[1:]
		}
		segs = append(segs, seg{n: n, recs: recs, end: end, torn: torn})
	}
	return segs, ns, nil
}

func (l *Log) load() error {
	segs, ns, err := l.readSegments()
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
	n := 1
	var size int64
	if len(segs) > 0 {
		last := segs[len(segs)-1]
		n, size = last.n, last.end
		l.torn = last.torn
	}
	f, err := l.fs.OpenFile(filepath.Join(l.dir, segName(n)), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fmt.Errorf("bgtask: journal: %w", err)
	}
	if l.torn != nil {
		if err := f.Truncate(size); err != nil {
			f.Close()
			return fmt.Errorf("bgtask: journal: truncating the torn tail of %s: %w", segName(n), err)
		}
		if err := f.Sync(); err != nil {
			f.Close()
			return fmt.Errorf("bgtask: journal: %w", err)
		}
	}
	if _, err := f.Seek(size, io.SeekStart); err != nil {
		f.Close()
		return fmt.Errorf("bgtask: journal: %w", err)
	}
	if len(segs) == 0 {
		if err := l.fs.SyncDir(l.dir); err != nil {
			f.Close()
			return fmt.Errorf("bgtask: journal: %w", err)
		}
	}
	l.seg, l.segN, l.segSize = f, n, size
	return nil
}

// ReadOnly reads the journal in dir as Open would, without taking its lock
// and without changing a byte: for looking inside a journal whose writer
// may still be running, or that a crash left (a torn tail is reported,
// not truncated). A segment a running compaction removes meanwhile makes
// it read again, a few times.
func ReadOnly(dir string, opts Options) (recs [][]byte, torn *Torn, err error) {
	fs := opts.FS
	if fs == nil {
		fs = osFS{}
	}
	l := &Log{dir: dir, opts: opts, fs: fs}
	for try := 0; ; try++ {
		recs, torn, err = l.readAll()
		if err == nil || try == 3 || !errors.Is(err, os.ErrNotExist) {
			return recs, torn, err
		}
	}
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

// read reads segment n; a base marker is returned as a nil payload, and
// only what follows the last one in the segment is returned after it. In
// the last segment a cut-short, mismatching or zero-filled final record is
// a torn tail; anywhere else it is corruption.
func (l *Log) read(n int, last bool) (recs [][]byte, end int64, torn *Torn, err error) {
	name := filepath.Join(l.dir, segName(n))
	f, err := l.fs.OpenFile(name, os.O_RDONLY, 0)
	if err != nil {
		return nil, 0, nil, fmt.Errorf("bgtask: journal: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(f)
	if err != nil {
		return nil, 0, nil, fmt.Errorf("bgtask: journal: reading %s: %w", name, err)
	}
	off, size := int64(0), int64(len(data))
	cut := func(why string, tail bool) ([][]byte, int64, *Torn, error) {
		if last && (tail || allZero(data[off:])) {
			return recs, off, &Torn{File: name, Offset: off, Bytes: size - off}, nil
		}
		return nil, 0, nil, fmt.Errorf("bgtask: journal: %s at offset %d: %s: refusing to start (the journal is corrupt)", name, off, why)
	}
	for off < size {
		if size-off < headerSize {
			return cut("short header", true)
		}
		hdr := data[off : off+headerSize]
		field := binary.LittleEndian.Uint32(hdr)
		length := int64(field &^ baseFlag)
		recEnd := off + headerSize + length
		if crc32.Checksum(hdr[:4], castagnoli) != binary.LittleEndian.Uint32(hdr[4:]) {
			// The length is not to be trusted; the record is the torn tail
			// only if, as written, it is the one that ends the segment.
			return cut("header checksum mismatch", off+headerSize == size || recEnd == size)
		}
		switch {
		case length > MaxRecord:
			return cut("record length over the limit", false)
		case recEnd > size:
			return cut("record cut short", true)
		}
		payload := data[off+headerSize : recEnd]
		if crc32.Checksum(payload, castagnoli) != binary.LittleEndian.Uint32(hdr[8:]) {
			return cut("checksum mismatch", recEnd == size)
		}
		if field&baseFlag != 0 {
			recs = [][]byte{nil} // a base: what came before it is replaced
		} else {
			recs = append(recs, payload)
		}
		off = recEnd
	}
	return recs, off, nil, nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
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
// fsyncs once, then completes those batches. It takes the write lock
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

// write writes batches to the current segment and fsyncs it once; with
// rotate, a full segment is followed by a new one. l.wmu is held.
func (l *Log) write(batches []*Batch, rotate bool) error {
	if l.buf == nil {
		l.buf = bufio.NewWriterSize(l.seg, 64<<10)
	}
	w := l.buf
	w.Reset(l.seg)
	var hdr [headerSize]byte
	for _, b := range batches {
		for _, p := range b.payloads {
			if len(p) > MaxRecord {
				return fmt.Errorf("bgtask: journal: a record of %d bytes is over the limit of %d", len(p), MaxRecord)
			}
			field := uint32(len(p))
			if p == nil && b.base {
				field |= baseFlag
			}
			binary.LittleEndian.PutUint32(hdr[:], field)
			binary.LittleEndian.PutUint32(hdr[4:], crc32.Checksum(hdr[:4], castagnoli))
			binary.LittleEndian.PutUint32(hdr[8:], crc32.Checksum(p, castagnoli))
			if _, err := w.Write(hdr[:]); err != nil {
				return fmt.Errorf("bgtask: journal: write: %w", err)
			}
			if _, err := w.Write(p); err != nil {
				return fmt.Errorf("bgtask: journal: write: %w", err)
			}
			l.segSize += int64(headerSize + len(p))
		}
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("bgtask: journal: write: %w", err)
	}
	if err := l.seg.Sync(); err != nil {
		return fmt.Errorf("bgtask: journal: fsync: %w", err)
	}
	if rotate && l.segSize >= l.opts.SegmentBytes {
		return l.rotate(l.segN + 1)
	}
	return nil
}

// rotate starts segment n for the appends that follow.
func (l *Log) rotate(n int) error {
	f, err := l.fs.OpenFile(filepath.Join(l.dir, segName(n)), os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o644)
	if err != nil {
		return fmt.Errorf("bgtask: journal: new segment: %w", err)
	}
	if err := l.fs.SyncDir(l.dir); err != nil {
		f.Close()
		return fmt.Errorf("bgtask: journal: new segment: %w", err)
	}
	_ = l.seg.Close()
	l.seg, l.segN, l.segSize = f, n, 0
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
		return fmt.Errorf("bgtask: journal: compaction: %w", err)
	}
	old, oldN, oldSize := l.seg, l.segN, l.segSize
	l.seg, l.segN, l.segSize = f, n, 0
	ps := make([][]byte, 0, len(keep)+1)
	ps = append(ps, nil) // the base marker
	for _, p := range keep {
		if p == nil {
			p = []byte{} // an empty record, not a marker
		}
		ps = append(ps, p)
	}
	err = l.write([]*Batch{{payloads: ps, base: true}}, false)
	if err == nil {
		err = l.fs.Rename(tmp, filepath.Join(l.dir, segName(n)))
		if err == nil {
			if err = l.fs.SyncDir(l.dir); err != nil { // the commit point
				// Renamed, but whether it is durable is unknown: which log
				// a restart sees is unknown too, so nothing more may be
				// appended (fail-stop).
				_ = old.Close()
				err = fmt.Errorf("bgtask: journal: compaction: %w", err)
				l.fail(err)
				return err
			}
		}
	}
	if err != nil {
		_ = f.Close()
		_ = l.fs.Remove(tmp)
		l.seg, l.segN, l.segSize = old, oldN, oldSize
		return fmt.Errorf("bgtask: journal: compaction: %w", err)
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
