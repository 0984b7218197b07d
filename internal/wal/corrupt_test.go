package wal_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// The report of the issue that made the rule: in a journal of a few KB,
// well within a unit of its end, one byte flipped in the middle. Complete
// records follow it, so it is corruption, not a torn tail: Open refuses,
// names the segment and the offset, lists the records that follow, and
// changes nothing. (It used to cut them with a warning.)
func TestAFlippedByteBeforeCompleteRecordsIsCorruption(t *testing.T) {
	for _, prealloc := range []bool{true, false} {
		t.Run(fmt.Sprintf("prealloc=%v", prealloc), func(t *testing.T) {
			payloads := recs("a completed task's record", 60)
			dir := t.TempDir()
			writeJournal(t, dir, wal.Options{NoPrealloc: !prealloc}, payloads)
			seg := lastSegment(t, dir)
			offs := offsets(payloads)
			k := 25
			flipByte(t, seg, offs[k]+headerSize+3)
			before := readFile(t, seg)

			for _, read := range []func() error{
				func() error { _, _, err := wal.ReadOnly(dir, wal.Options{}); return err },
				func() error { l, err := wal.Open(dir, wal.Options{}); closeIf(l); return err },
			} {
				err := read()
				var c *wal.Corrupt
				require.ErrorAs(t, err, &c)
				assert.Equal(t, seg, c.File)
				assert.Equal(t, offs[k], c.Offset)
				assert.Equal(t, offs[k], c.Cut, "a batch of its own: the cut is where it begins")
				equalRecords(t, payloads[k+1:], c.Dropped, "every complete record after it")
				assert.Contains(t, err.Error(), fmt.Sprintf("at offset %d", offs[k]))
				assert.Contains(t, err.Error(), "drops 34 complete records")
				assert.Equal(t, before, readFile(t, seg), "nothing changed")
			}
		})
	}
}

// paths are names in dir.
func paths(dir string, names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = filepath.Join(dir, n)
	}
	return out
}

func closeIf(l *wal.Log) {
	if l != nil {
		_ = l.Close()
	}
}

// A record damaged inside a batch: the cut is where its batch begins, and
// the batch's complete records before the damage are listed as dropped.
// Damage in a segment before the last lists the later segments' records
// too, and names the segments.
func TestCorruptionListsItsBatchAndTheLaterSegments(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, wal.Options{SegmentBytes: 300})
	first := [][]byte{[]byte("one"), []byte("two"), []byte("three")}
	require.NoError(t, l.Append(first).Wait())
	batch := [][]byte{[]byte("b-one"), []byte("b-two"), []byte("b-three")}
	require.NoError(t, l.Append(batch).Wait())
	later := recs("later", 40)
	appendEach(t, l, later...)
	require.NoError(t, l.Close())
	segs := paths(dir, segments(t, dir))
	require.Greater(t, len(segs), 2)

	cut := offsets(first)[3]
	bad := cut + offsets(batch)[2] // "b-three"
	flipByte(t, segs[0], bad+headerSize)
	_, err := wal.Open(dir, wal.Options{})
	var c *wal.Corrupt
	require.ErrorAs(t, err, &c)
	assert.Equal(t, bad, c.Offset)
	assert.Equal(t, cut, c.Cut, "the cut keeps every whole commit before the damaged one")
	rest := readRecords(t, segs[0])[len(first)+len(batch):]
	for _, s := range segs[1:] {
		rest = append(rest, readRecords(t, s)...)
	}
	equalRecords(t, concat(batch[:2], rest), c.Dropped)
	assert.Equal(t, segs[1:], c.Later)
}

// readRecords walks a segment's records by their headers.
func readRecords(t *testing.T, seg string) [][]byte {
	t.Helper()
	data := readFile(t, seg)
	var out [][]byte
	for off := 0; off+headerSize <= len(data) && !allZero(data[off:off+headerSize]); {
		n := int(binary.LittleEndian.Uint32(data[off:]) &^ (3 << 30))
		out = append(out, data[off+headerSize:off+headerSize+n])
		off += headerSize + n
	}
	return out
}

// A torn write loses sectors, which read as zeros; complete records of the
// same unit may survive after them. A lost sector that holds only the
// first bytes of a record's header — its length field, gone to zeros —
// explains the damage when putting some length back makes the header's
// checksum hold; the same zeros in a header that was written so (a
// length whose low byte is zero) do not explain damage elsewhere in the
// record: that is corruption.
func TestZerosAtAHeadersStartAreATearOnlyIfTheyCouldBeOne(t *testing.T) {
	// Records laid out so that record 1's header begins 1 byte before a
	// sector boundary, and its length's low byte is zero (256 bytes).
	pad := bytes.Repeat([]byte("p"), 512-1-headerSize)
	rec1 := bytes.Repeat([]byte("x"), 256)
	payloads := [][]byte{pad, rec1, []byte("after one"), []byte("after two")}
	offs := offsets(payloads)
	require.Equal(t, int64(511), offs[1])

	t.Run("the length lost to a torn sector", func(t *testing.T) {
		dir := t.TempDir()
		writeJournal(t, dir, wal.Options{}, [][]byte{pad})
		seg := lastSegment(t, dir)
		// The round in flight wrote records 1-3; the crash lost the
		// sector holding record 1's first byte... which was zero anyway,
		// so make its length 257 instead: a lost byte that mattered.
		rec1 := bytes.Repeat([]byte("x"), 257)
		round := encode([][]byte{rec1, []byte("after one"), []byte("after two")})
		round[0] = 0 // the lost sector's byte of it
		writeAt(t, seg, round, offs[1])
		checkTorn(t, dir, seg, offs[1], [][]byte{pad})
	})
	t.Run("the same zeros written so, a payload byte flipped", func(t *testing.T) {
		dir := t.TempDir()
		writeJournal(t, dir, wal.Options{}, payloads)
		seg := lastSegment(t, dir)
		require.Zero(t, readFile(t, seg)[offs[1]], "the length's low byte is zero")
		flipByte(t, seg, offs[1]+headerSize+100)
		_, err := wal.Open(dir, wal.Options{})
		var c *wal.Corrupt
		require.ErrorAs(t, err, &c)
		assert.Equal(t, offs[1], c.Offset)
		equalRecords(t, payloads[2:], c.Dropped)
	})
	t.Run("a whole sector of zeros in a long record", func(t *testing.T) {
		long := bytes.Repeat([]byte("L"), 3000)
		dir := t.TempDir()
		writeJournal(t, dir, wal.Options{}, [][]byte{[]byte("acked")})
		seg := lastSegment(t, dir)
		e0 := int64(headerSize + len("acked"))
		round := encode([][]byte{long, []byte("kept")})
		s := int64(1024) // a sector wholly inside long: [1024, 1536)
		clear(round[s-e0 : s-e0+512])
		writeAt(t, seg, round, e0)
		checkTorn(t, dir, seg, e0, [][]byte{[]byte("acked")})
	})
	t.Run("a byte flipped in a long record", func(t *testing.T) {
		long := bytes.Repeat([]byte("L"), 3000)
		dir := t.TempDir()
		writeJournal(t, dir, wal.Options{}, [][]byte{[]byte("acked"), long, []byte("kept")})
		seg := lastSegment(t, dir)
		e0 := int64(headerSize + len("acked"))
		flipByte(t, seg, e0+headerSize+1500)
		_, err := wal.Open(dir, wal.Options{})
		var c *wal.Corrupt
		require.ErrorAs(t, err, &c)
		equalRecords(t, [][]byte{[]byte("kept")}, c.Dropped)
	})
}

// Damage in a segment that a finished compaction replaced (its base is in
// a later segment; the crash came before the old segments were removed)
// does not count: the journal opens with the compacted records.
func TestDamageACompactionReplacedDoesNotCount(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, wal.Options{})
	appendEach(t, l, recs("old", 10)...)
	require.NoError(t, l.Close())
	old := paths(dir, segments(t, dir))
	require.Len(t, old, 1)
	saved := readFile(t, old[0])

	l = open(t, dir, wal.Options{})
	l.Records()
	keep := recs("kept", 3)
	require.NoError(t, l.Compact(keep))
	require.NoError(t, l.Close())
	// The old segment back, as a crash before its removal leaves it, and
	// damaged.
	saved[headerSize+2] ^= 0xff
	require.NoError(t, os.WriteFile(old[0], saved, 0o644))
	require.Greater(t, len(segments(t, dir)), 1)
	equalRecords(t, keep, reopen(t, dir))
}

// A repair that crashes at any of its steps leaves a journal that a repair
// finds again (refused the same way until then), or one already repaired:
// never the cut segment followed by the records it was cut from.
func TestRepairCrashAtEveryStep(t *testing.T) {
	orig := t.TempDir()
	l := open(t, orig, wal.Options{SegmentBytes: 300})
	payloads := recs("record", 80)
	appendEach(t, l, payloads...)
	require.NoError(t, l.Close())
	segs := paths(orig, segments(t, orig))
	require.Greater(t, len(segs), 3)
	first := readRecords(t, segs[0])
	k := len(first) / 2
	flipByte(t, segs[0], offsets(first)[k]+headerSize)
	kept := first[:k]
	// What a repair cuts is kept: the damaged segment's bytes from the
	// cut on, and every later segment whole, each in some cut-* copy.
	cut := offsets(first)[k]
	aside := map[string][]byte{filepath.Base(segs[0]) + ".from-" + strconv.FormatInt(cut, 10): readFile(t, segs[0])[cut:]}
	for _, l := range segs[1:] {
		aside[filepath.Base(l)] = readFile(t, l)
	}
	keptAside := func(dir string, step int) {
		t.Helper()
		for name, data := range aside {
			copies, err := filepath.Glob(filepath.Join(dir, "cut-*", name))
			require.NoError(t, err)
			found := false
			for _, c := range copies {
				found = found || bytes.Equal(readFile(t, c), data)
			}
			assert.True(t, found, "step %d: %s is kept whole in a copy (%v)", step, name, copies)
		}
	}

	agree := func(*wal.Corrupt) error { return nil }
	for step := 1; ; step++ {
		dir := t.TempDir()
		copyDir(t, orig, dir)
		fs := &faultFS{}
		fs.trackDurability()
		crashed := t.TempDir()
		n := 0
		crash := func() error {
			n++
			if n == step {
				fs.snapshot(t, dir, crashed)
				return errInjected
			}
			return nil
		}
		fs.set(func(fs *faultFS) {
			fs.onRename = func(a, b string) error {
				if err := crash(); err != nil {
					return err
				}
				return fs.rename(a, b)
			}
			fs.onSyncDir = func(string) error { return crash() }
			fs.onSync = func(string) error { return crash() }
			fs.onWrite = func(_ string, f *os.File, p []byte) (int, error) {
				if err := crash(); err != nil {
					return 0, err
				}
				return f.Write(p)
			}
		})
		l, err := wal.Open(dir, wal.Options{FS: fs, Repair: agree})
		if err == nil {
			// No step left to crash at: the repair ran through.
			equalRecords(t, kept, l.Records())
			require.NoError(t, l.Close())
			keptAside(dir, step)
			require.Greater(t, step, 3, "the repair has steps")
			return
		}
		require.ErrorIs(t, err, errInjected, "step %d", step)
		// What the crash left: refused as before, or already repaired.
		_, _, rerr := wal.ReadOnly(crashed, wal.Options{})
		var c *wal.Corrupt
		if errors.As(rerr, &c) {
			assert.Equal(t, filepath.Join(crashed, filepath.Base(segs[0])), c.File, "step %d", step)
		} else {
			require.NoError(t, rerr, "step %d", step)
		}
		l, err = wal.Open(crashed, wal.Options{Repair: agree})
		require.NoError(t, err, "step %d: a repair after the crash", step)
		equalRecords(t, kept, l.Records(), "step %d", step)
		require.NoError(t, l.Close())
		keptAside(crashed, step)
	}
}

// A record whose length is a multiple of 256 begins with a zero byte: the
// scan past damage finds it too. A flip before one must be refused, with
// it listed, never cut as a torn tail (the reviewer's reproducer).
func TestARecordBeginningWithAZeroByteStillFollows(t *testing.T) {
	for _, n := range []int{0, 256, 512, 4096} {
		t.Run(fmt.Sprintf("len=%d", n), func(t *testing.T) {
			payloads := [][]byte{[]byte("a"), []byte("b"), []byte("c"), bytes.Repeat([]byte("z"), n)}
			dir := t.TempDir()
			writeJournal(t, dir, wal.Options{}, payloads)
			seg := lastSegment(t, dir)
			offs := offsets(payloads)
			flipByte(t, seg, offs[2]+headerSize)
			_, err := wal.Open(dir, wal.Options{})
			var c *wal.Corrupt
			require.ErrorAs(t, err, &c, "an acknowledged record follows")
			assert.Equal(t, offs[2], c.Offset)
			equalRecords(t, payloads[3:], c.Dropped)
		})
	}
}

// A crash: the round in flight begins at u, in the last sector of page 0;
// its record A ends at 4095, and B (a length of 256: its first byte is 0)
// begins at 4095. Page 0 is lost: [u, 4096) reads as zeros, B's one byte
// there was zero anyway, so B is complete, and C after it. A torn tail,
// not corruption: the lost sector holds B's first byte.
func TestALostSectorMayHoldTheFirstByteOfTheNextRecord(t *testing.T) {
	dir := t.TempDir()
	u := int64(3700)
	acked := [][]byte{bytes.Repeat([]byte("a"), int(u)-headerSize)}
	writeJournal(t, dir, wal.Options{}, acked)
	seg := lastSegment(t, dir)
	require.Equal(t, u, offsets(acked)[1])
	a := bytes.Repeat([]byte("A"), int(4095-u)-headerSize)
	round := encodeBatches([][]byte{a, bytes.Repeat([]byte("B"), 256), []byte("C")})
	require.Zero(t, round[4095-u])
	clear(round[:4096-u])
	writeAt(t, seg, round, u)
	checkTorn(t, dir, seg, u, acked)
}

// Zeros at a header's start explain its damage only if they could be the
// lost bytes of its length: a header one byte before a sector boundary
// whose length's low byte is 0, with its checksum's byte flipped, is
// corruption. And a NoPrealloc segment has no lost sectors: a zeroed one
// with complete records after it is corruption.
func TestZerosThatExplainNothingAreCorruption(t *testing.T) {
	pad := bytes.Repeat([]byte("p"), 512-1-headerSize)
	payloads := [][]byte{pad, bytes.Repeat([]byte("x"), 256), []byte("after one"), []byte("after two")}
	dir := t.TempDir()
	writeJournal(t, dir, wal.Options{}, payloads)
	flipByte(t, lastSegment(t, dir), offsets(payloads)[1]+5)
	_, err := wal.Open(dir, wal.Options{})
	var c *wal.Corrupt
	require.ErrorAs(t, err, &c)

	payloads = [][]byte{[]byte("acked"), bytes.Repeat([]byte("L"), 3000), []byte("kept")}
	dir = t.TempDir()
	writeJournal(t, dir, wal.Options{NoPrealloc: true}, payloads)
	writeAt(t, lastSegment(t, dir), make([]byte, 512), 1024)
	_, err = wal.Open(dir, wal.Options{NoPrealloc: true})
	require.ErrorAs(t, err, &c)
}
