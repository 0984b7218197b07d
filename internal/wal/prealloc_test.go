package wal_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// A header of zeros can never be a record: the header's checksum is that
// of its four length bytes, and the CRC-32C of four zero bytes is not zero.
// So zeros after the last record are always where the records end.
func TestZeroHeaderIsNeverARecord(t *testing.T) {
	assert.NotZero(t, crc32.Checksum(make([]byte, 4), crc32.MakeTable(crc32.Castagnoli)))
}

// preallocated writes payloads (one batch each) to a new preallocated
// journal in dir and returns its segment's path and logical end, checking
// the layout: the records, then zeros.
func preallocated(t *testing.T, dir string, payloads [][]byte) (seg string, end int64) {
	t.Helper()
	writeJournal(t, dir, wal.Options{}, payloads)
	seg = lastSegment(t, dir)
	end = offsets(payloads)[len(payloads)]
	data := readFile(t, seg)
	require.Greater(t, int64(len(data)), end, "zeroed space follows the records")
	require.True(t, bytes.Equal(encode(payloads), data[:end]))
	require.True(t, allZero(data[end:]))
	return seg, end
}

func TestCleanZeroTail(t *testing.T) {
	payloads := recs("record", 5)
	dir := t.TempDir()
	seg, end := preallocated(t, dir, payloads)
	before := readFile(t, seg)

	got, torn, err := wal.ReadOnly(dir, wal.Options{})
	require.NoError(t, err)
	assert.Nil(t, torn, "ReadOnly: a zero tail is no torn tail")
	equalRecords(t, payloads, got)
	assert.Equal(t, before, readFile(t, seg), "ReadOnly changes nothing")

	l := open(t, dir, wal.Options{})
	assert.Nil(t, l.Torn(), "Open: a zero tail is no torn tail")
	equalRecords(t, payloads, l.Records())
	require.NoError(t, l.Close())
	assert.Equal(t, before, readFile(t, seg), "Open keeps the zeros for the next appends")

	t.Run("in a segment before the last", func(t *testing.T) {
		dir := t.TempDir()
		writeJournal(t, dir, wal.Options{SegmentBytes: 100}, recs("rotated-record", 8))
		segs := segments(t, dir)
		require.Greater(t, len(segs), 2)
		first := filepath.Join(dir, segs[0])
		f, err := os.OpenFile(first, os.O_APPEND|os.O_WRONLY, 0)
		require.NoError(t, err)
		_, err = f.Write(make([]byte, 3*pageSize+5))
		require.NoError(t, err)
		require.NoError(t, f.Close())
		l := open(t, dir, wal.Options{})
		assert.Nil(t, l.Torn())
		equalRecords(t, recs("rotated-record", 8), l.Records())
	})

	t.Run("without preallocation the zeros are cut, unreported", func(t *testing.T) {
		l := open(t, dir, wal.Options{NoPrealloc: true})
		assert.Nil(t, l.Torn())
		equalRecords(t, payloads, l.Records())
		assert.Equal(t, end, fileSize(t, seg), "the old layout: exactly the records")
		appendEach(t, l, []byte("appended"))
		require.NoError(t, l.Close())
		assert.Equal(t, end+headerSize+8, fileSize(t, seg))
		equalRecords(t, concat(payloads, [][]byte{[]byte("appended")}), reopen(t, dir))
	})
}

// TestTornUnit: a crash during a round over preallocated space keeps any
// subset of the pages the round wrote, the others still zero. The first
// damaged record is the torn tail: it and everything after it (whole
// records too) is cut, the cut is reported, and appends after it read
// back after another reopen.
func TestTornUnit(t *testing.T) {
	acked := recs("acknowledged", 7)
	dir := t.TempDir()
	seg, end := preallocated(t, dir, acked)
	durable := readFile(t, seg)

	// The round in flight: records over several pages, one of them all
	// zeros (what a crash loses of it is what was there anyway).
	var round [][]byte
	for i := range 9 {
		round = append(round, bytes.Repeat([]byte{byte('a' + i)}, 1500+i*7))
	}
	round = append(round[:4], append([][]byte{make([]byte, 5000), {}}, round[4:]...)...)
	written := bytes.Clone(durable)
	copy(written[end:], encode(round))
	roundOffs := offsets(round)

	for seed := range uint64(40) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 3))
			img := tornImage(durable, written, &crashModel{size: func() bool { return true }, page: func(int) bool { return rng.IntN(2) == 0 }})
			require.Len(t, img, len(durable), "no size change: the round overwrote zeros")
			whole := 0 // the round's records the crash left whole
			for whole < len(round) && bytes.Equal(written[end+roundOffs[whole]:end+roundOffs[whole+1]], img[end+roundOffs[whole]:end+roundOffs[whole+1]]) {
				whole++
			}
			cut := end + roundOffs[whole]
			want := concat(acked, round[:whole])

			dir := t.TempDir()
			path := filepath.Join(dir, filepath.Base(seg))
			require.NoError(t, os.WriteFile(path, img, 0o644))
			got, torn, err := wal.ReadOnly(dir, wal.Options{})
			require.NoError(t, err)
			equalRecords(t, want, got)
			assert.Equal(t, img, readFile(t, path), "ReadOnly changes nothing")
			if allZero(img[cut:]) {
				assert.Nil(t, torn, "only zeros after the whole records: nothing torn")
				equalRecords(t, want, reopen(t, dir))
				return
			}
			if assert.NotNil(t, torn) {
				assert.Equal(t, cut, torn.Offset)
				assert.Equal(t, int64(len(img))-cut, torn.Bytes, "to the physical end")
			}
			checkTorn(t, dir, path, cut, want)
		})
	}
}

// writeAt writes p at off in path.
func writeAt(t *testing.T, path string, p []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteAt(p, off)
	require.NoError(t, err)
	require.NoError(t, f.Close())
}

// TestTornUnitWindow: in a preallocated last segment a damaged record is
// a torn tail only if nothing but zeros lies a unit (W) past its start,
// or, for a record longer than W whose header checks, past its end: no
// torn write reaches further. Non-zero bytes further on are corruption,
// named by file and offset, and Open changes nothing.
func TestTornUnitWindow(t *testing.T) {
	const w = wal.UnitBytes
	acked := recs("acknowledged", 3)
	orig := t.TempDir()
	seg, end := preallocated(t, orig, acked)
	name := filepath.Base(seg)
	long := bytes.Repeat([]byte("L"), w+100<<10) // a record of its own units
	longRec := encode([][]byte{long})
	span := int64(len(longRec))
	overLimit := binary.LittleEndian.AppendUint32(nil, wal.MaxRecord+1)
	overLimit = binary.LittleEndian.AppendUint32(overLimit, crc32.Checksum(overLimit, crc32.MakeTable(crc32.Castagnoli)))

	for _, tc := range []struct {
		name  string
		write func(path string)
		torn  bool
	}{
		{"a stray byte within a unit of the end", func(p string) { writeAt(t, p, []byte{1}, end+w-10) }, true},
		{"a stray byte past a unit from the end", func(p string) { writeAt(t, p, []byte{1}, end+w+10) }, false},
		{"a record cut short, then a byte past a unit", func(p string) {
			writeAt(t, p, encode([][]byte{[]byte("cut short")})[:15], end)
			writeAt(t, p, []byte{1}, end+w+10)
		}, false},
		{"a long record with a page lost", func(p string) {
			writeAt(t, p, longRec, end)
			writeAt(t, p, make([]byte, pageSize), end+w/2)
		}, true},
		{"a long record with its header lost, the rest within a unit", func(p string) {
			writeAt(t, p, longRec[headerSize:w-pageSize], end+headerSize)
		}, true},
		{"a long record with its header lost, written past a unit", func(p string) {
			writeAt(t, p, longRec[headerSize:], end+headerSize)
		}, false},
		{"a long record with a page lost, a byte past its end", func(p string) {
			writeAt(t, p, longRec, end)
			writeAt(t, p, make([]byte, pageSize), end+w/2)
			writeAt(t, p, []byte{1}, end+span+10)
		}, false},
		{"a good header over the limit", func(p string) { writeAt(t, p, overLimit, end) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			copyDir(t, orig, dir)
			path := filepath.Join(dir, name)
			tc.write(path)
			if tc.torn {
				checkTorn(t, dir, path, end, acked)
				return
			}
			_, _, err := wal.ReadOnly(dir, wal.Options{})
			assert.Error(t, err, "ReadOnly finds the corruption too")
			checkCorrupt(t, dir, path, end)
		})
	}
}

// TestPreallocatedSegments: rotation and compaction keep the rule — the
// segment appended to has zeroed space after its records, grown in
// chunks; a full one is cut to its records when the next one starts; a
// compaction's new segment has its zeros before it is renamed in.
func TestPreallocatedSegments(t *testing.T) {
	const segBytes = 64 << 10
	dir := t.TempDir()
	opts := wal.Options{SegmentBytes: segBytes}
	l := open(t, dir, opts)
	orig := recs("a-record-of-some-length-"+string(bytes.Repeat([]byte("x"), 2000)), 100)
	for i := 0; i < len(orig); i += 4 {
		require.NoError(t, l.Append(orig[i:min(i+4, len(orig))]).Wait())
	}
	segs := segments(t, dir)
	require.Greater(t, len(segs), 2)
	for _, s := range segs[:len(segs)-1] {
		path := filepath.Join(dir, s)
		assert.Equal(t, logicalEnd(t, path), fileSize(t, path), "%s: a full segment is exactly its records", s)
		assert.GreaterOrEqual(t, fileSize(t, path), int64(segBytes))
	}
	checkZeroTail := func(what string) {
		last := lastSegment(t, dir)
		end, size := logicalEnd(t, last), fileSize(t, last)
		assert.Greater(t, size, end, "%s: zeros after the records", what)
		assert.Zero(t, size%segBytes, "%s: grown in chunks (of the segment size, being under %d)", what, wal.GrowBytes)
		assert.True(t, allZero(readFile(t, last)[end:]), what)
	}
	checkZeroTail("after rotations")

	keep := [][]byte{orig[3], orig[50], {}, orig[99]}
	require.NoError(t, l.Compact(keep))
	require.Len(t, segments(t, dir), 1)
	assert.Empty(t, tmpFiles(t, dir))
	checkZeroTail("after the compaction")
	after := recs("after", 5)
	appendEach(t, l, after...)
	checkZeroTail("after appends to the compacted segment")
	require.NoError(t, l.Close())

	got, torn, err := wal.ReadOnly(dir, wal.Options{})
	require.NoError(t, err)
	assert.Nil(t, torn)
	equalRecords(t, concat(keep, after), got)
	equalRecords(t, concat(keep, after), reopen(t, dir))
}

// crashInRound appends first to a new journal in dir, then round as one
// batch, and at the k-th sync during the round that has data to make
// durable (1: the first) copies what a crash by model leaves into a new
// directory, which it returns.
func crashInRound(t *testing.T, dir string, opts wal.Options, first []byte, round [][]byte, k int, model *crashModel) string {
	t.Helper()
	fs := &faultFS{}
	fs.trackDurability()
	opts.FS = fs
	l := open(t, dir, opts)
	appendEach(t, l, first)
	crashed, seen := t.TempDir(), 0
	fs.set(func(fs *faultFS) {
		// On this goroutine: Wait below writes the round.
		fs.onSync = func(name string) error {
			if fs.unsynced(name) {
				if seen++; seen == k {
					fs.crash(t, dir, crashed, model)
				}
			}
			return nil
		}
	})
	require.NoError(t, l.Append(round).Wait())
	require.NoError(t, l.Close())
	require.GreaterOrEqual(t, seen, k, "the round had %d syncs", seen)
	equalRecords(t, concat([][]byte{first}, round), reopen(t, dir))
	return crashed
}

// checkTornAt opens a crashed journal that must hold records and a torn
// tail at off.
func checkTornAt(t *testing.T, crashed string, records [][]byte, off int64) {
	t.Helper()
	l, err := wal.Open(crashed, wal.Options{})
	require.NoError(t, err, "a torn tail, not corruption")
	equalRecords(t, records, l.Records())
	if torn := l.Torn(); assert.NotNil(t, torn) {
		assert.Equal(t, off, torn.Offset)
	}
	require.NoError(t, l.Close())
}

// TestCrashRoundAtChunkBoundary: a round that ends at, or runs past, the
// end of the zeroed space. The zeros it needs are durable before its
// records are written (so a crash cannot undo the file's growth under
// them), and a zero byte always follows them: a crash that keeps the
// round's last page and loses its first (and loses any size change not
// synced) leaves a torn tail, never what reads as corruption.
func TestCrashRoundAtChunkBoundary(t *testing.T) {
	const segBytes = 64 << 10 // so the zeros grow in chunks of 64 KiB
	first := []byte("first")
	e0 := int64(headerSize + len(first))
	for _, tc := range []struct {
		name  string
		round [][]byte
	}{
		{"ending at it", [][]byte{make([]byte, 30000), bytes.Repeat([]byte("r"), segBytes-int(e0)-30000-2*headerSize)}},
		{"running past it", [][]byte{make([]byte, 30000), bytes.Repeat([]byte("r"), 50000)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.round[0][0] = 1 // the first page of the round is not all zeros
			dir := t.TempDir()
			crashed := crashInRound(t, dir, wal.Options{SegmentBytes: segBytes}, first, tc.round, 1, &crashModel{
				size: func() bool { return false },
				page: func(i int) bool { return i > 0 },
			})
			data := readFile(t, lastSegment(t, crashed))
			require.Zero(t, data[len(data)-1], "the file ends in a zero byte")
			checkTornAt(t, crashed, [][]byte{first}, e0)
		})
	}
}

// TestCrashInLongRecord: a record longer than a unit is written in pieces
// of a unit each, synced in turn, and no other record shares its last
// piece: a crash in that piece that loses one of its pages and keeps the
// others leaves nothing past the record's end, so the damaged record is a
// torn tail, not corruption.
func TestCrashInLongRecord(t *testing.T) {
	first := []byte("first")
	e0 := int64(headerSize + len(first))
	long := bytes.Repeat([]byte("L"), wal.UnitBytes+3*pageSize)
	round := [][]byte{long, bytes.Repeat([]byte("s"), pageSize), bytes.Repeat([]byte("t"), pageSize)}
	lost := int((e0+wal.UnitBytes)/pageSize + 1) // a page wholly in the last piece
	crashed := crashInRound(t, t.TempDir(), wal.Options{}, first, round, 2, &crashModel{
		size: func() bool { return false },
		page: func(i int) bool { return i != lost },
	})
	checkTornAt(t, crashed, [][]byte{first}, e0)
}
