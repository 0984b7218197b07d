package wal_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// writeJournal appends payloads (one batch each) to a new journal in dir
// and closes it.
func writeJournal(t *testing.T, dir string, opts wal.Options, payloads [][]byte) {
	t.Helper()
	l := open(t, dir, opts)
	appendEach(t, l, payloads...)
	require.NoError(t, l.Close())
}

func copyDir(t *testing.T, from, to string) {
	t.Helper()
	ents, err := os.ReadDir(from)
	require.NoError(t, err)
	for _, e := range ents {
		data, err := os.ReadFile(filepath.Join(from, e.Name()))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(to, e.Name()), data, 0o644))
	}
}

func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Less(t, off, int64(len(data)))
	data[off] ^= 0xff
	require.NoError(t, os.WriteFile(path, data, 0o644))
}

// checkTorn opens dir after its last record (starting at start in seg) was
// damaged, and checks the doc's torn-tail recovery: Open succeeds, reports
// the cut at start, returns the records before it, and the file ends at
// start; appends after it replay after them.
func checkTorn(t *testing.T, dir, seg string, start int64, before [][]byte) {
	t.Helper()
	damaged := fileSize(t, seg)
	l, err := wal.Open(dir, wal.Options{})
	require.NoError(t, err, "a torn tail is not corruption")
	torn := l.Torn()
	if assert.NotNil(t, torn, "Open reports the torn tail") {
		assert.Equal(t, filepath.Base(seg), filepath.Base(torn.File))
		assert.Equal(t, start, torn.Offset, "the torn record began at %d", start)
		assert.Equal(t, damaged-start, torn.Bytes, "bytes cut")
	}
	equalRecords(t, before, l.Records())
	assert.Equal(t, start, fileSize(t, seg), "the file is truncated to where the torn record began")

	after := recs("after", 2)
	appendEach(t, l, after...)
	require.NoError(t, l.Close())

	l, err = wal.Open(dir, wal.Options{})
	require.NoError(t, err)
	assert.Nil(t, l.Torn(), "the tail was truncated once, for good")
	equalRecords(t, concat(before, after), l.Records())
	require.NoError(t, l.Close())
}

// tear leaves in path what a crash leaves of a record at [start, end)
// whose bytes from cut on were lost: without preallocation the file ends
// at cut; with it, the bytes from cut to end are the zeros that were there.
func tear(t *testing.T, path string, cut, end int64, prealloc bool) {
	t.Helper()
	if !prealloc {
		require.NoError(t, os.Truncate(path, cut))
		return
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteAt(make([]byte, end-cut), cut)
	require.NoError(t, err)
	require.NoError(t, f.Close())
}

func TestTornTailTruncatedAtEveryOffset(t *testing.T) {
	payloads := [][]byte{[]byte("first"), {}, []byte("third record"), []byte("the last record, torn by the crash")}
	k := len(payloads)
	offs := offsets(payloads)
	start, end := offs[k-1], offs[k]

	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) {
			orig := t.TempDir()
			writeJournal(t, orig, wal.Options{NoPrealloc: !lay.prealloc}, payloads)
			seg := filepath.Base(lastSegment(t, orig))
			require.Equal(t, end, logicalEnd(t, filepath.Join(orig, seg)))
			if !lay.prealloc {
				require.Equal(t, end, fileSize(t, filepath.Join(orig, seg)))
			}

			for cut := start + 1; cut < end; cut++ { // inside the header and the payload
				t.Run(fmt.Sprintf("cut=%d", cut), func(t *testing.T) {
					dir := t.TempDir()
					copyDir(t, orig, dir)
					path := filepath.Join(dir, seg)
					tear(t, path, cut, end, lay.prealloc)
					checkTorn(t, dir, path, start, payloads[:k-1])
				})
			}

			t.Run("cut at the record boundary", func(t *testing.T) {
				dir := t.TempDir()
				copyDir(t, orig, dir)
				tear(t, filepath.Join(dir, seg), start, end, lay.prealloc)
				l := open(t, dir, wal.Options{})
				assert.Nil(t, l.Torn(), "a whole number of records is no torn tail")
				equalRecords(t, payloads[:k-1], l.Records())
				require.NoError(t, l.Close())
			})
		})
	}
}

func TestTornTailChecksumMismatch(t *testing.T) {
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) { testTornTailChecksumMismatch(t, wal.Options{NoPrealloc: !lay.prealloc}) })
	}
}

func testTornTailChecksumMismatch(t *testing.T, opts wal.Options) {
	payloads := recs("record", 5)
	k := len(payloads)
	offs := offsets(payloads)
	start, end := offs[k-1], offs[k]

	orig := t.TempDir()
	writeJournal(t, orig, opts, payloads)
	seg := filepath.Base(lastSegment(t, orig))

	// Every payload byte and every checksum byte of the last record.
	for off := start + 4; off < end; off++ {
		t.Run(fmt.Sprintf("flip=%d", off), func(t *testing.T) {
			dir := t.TempDir()
			copyDir(t, orig, dir)
			path := filepath.Join(dir, seg)
			flipByte(t, path, off)
			checkTorn(t, dir, path, start, payloads[:k-1])
		})
	}
	t.Run("payload overwritten", func(t *testing.T) {
		dir := t.TempDir()
		copyDir(t, orig, dir)
		path := filepath.Join(dir, seg)
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		require.NoError(t, err)
		_, err = f.WriteAt(make([]byte, end-start-headerSize), start+headerSize)
		require.NoError(t, err)
		require.NoError(t, f.Close())
		checkTorn(t, dir, path, start, payloads[:k-1])
	})
}

func TestTornTailInLastOfSeveralSegments(t *testing.T) {
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) {
			opts := wal.Options{SegmentBytes: 200, NoPrealloc: !lay.prealloc}
			dir := t.TempDir()
			payloads := recs("several-segments-record", 40)
			writeJournal(t, dir, opts, payloads)
			segs := segments(t, dir)
			require.Greater(t, len(segs), 2)

			// Whatever the last segment holds, append one more record to it
			// with a known size and cut that.
			last := filepath.Join(dir, segs[len(segs)-1])
			start := logicalEnd(t, last)
			l := open(t, dir, opts)
			require.Len(t, l.Records(), len(payloads))
			extra := []byte("the torn one")
			appendEach(t, l, extra)
			require.NoError(t, l.Close())
			require.Equal(t, segs, segments(t, dir), "the extra record stays in the last segment")
			tear(t, last, start+headerSize+3, start+headerSize+int64(len(extra)), lay.prealloc)
			checkTorn(t, dir, last, start, payloads)
		})
	}
}

// offsetIn reports whether msg names offset off as a number of its own.
func offsetIn(msg string, off int64) bool {
	return regexp.MustCompile(`(^|\D)` + strconv.FormatInt(off, 10) + `(\D|$)`).MatchString(msg)
}

// checkCorrupt opens dir after a byte at off in seg was damaged: Open fails
// naming the file and the offset of the damaged record, and leaves the
// file alone.
func checkCorrupt(t *testing.T, dir, seg string, recStart int64) {
	t.Helper()
	size := fileSize(t, seg)
	l, err := wal.Open(dir, wal.Options{})
	if !assert.Error(t, err, "corruption before the tail must fail Open, never be skipped") {
		t.Logf("records returned: %q, torn: %+v", strs(l.Records()), l.Torn())
		_ = l.Close()
		return
	}
	assert.Nil(t, l, "no Log, so no records")
	assert.Contains(t, err.Error(), filepath.Base(seg), "the error names the file")
	assert.True(t, offsetIn(err.Error(), recStart), "the error names offset %d: %v", recStart, err)
	assert.Equal(t, size, fileSize(t, seg), "a corrupt journal is not truncated")

	// And it keeps failing: nothing was "repaired" away.
	_, err = wal.Open(dir, wal.Options{})
	assert.Error(t, err)
}

// corruptible writes payloads to a new journal in a temporary directory
// for a test to damage, and returns it and its (only) segment's name.
// Preallocated, it appends records of filler after them, more than a
// unit's worth: a damaged record is then no torn tail, since no torn
// write reaches that far past it (corruption within a unit of the end of
// the last segment passes for a torn tail: TestTornUnitWindow).
func corruptible(t *testing.T, payloads [][]byte, prealloc bool) (dir, seg string) {
	t.Helper()
	dir = t.TempDir()
	if prealloc {
		for _, c := range "fgh" {
			payloads = concat(payloads, [][]byte{bytes.Repeat([]byte{byte(c)}, wal.UnitBytes/2)})
		}
	}
	writeJournal(t, dir, wal.Options{NoPrealloc: !prealloc}, payloads)
	segs := segments(t, dir)
	require.Len(t, segs, 1)
	return dir, segs[0]
}

func TestCorruptionIsAnError(t *testing.T) {
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) { testCorruptionIsAnError(t, lay.prealloc) })
	}
}

func testCorruptionIsAnError(t *testing.T, prealloc bool) {
	payloads := [][]byte{[]byte("first record"), []byte("second record"), []byte("third"), []byte("last")}
	offs := offsets(payloads)
	orig, seg := corruptible(t, payloads, prealloc)

	for _, tc := range []struct {
		name     string
		rec      int   // the damaged record
		inRecord int64 // the damaged byte's offset inside it
	}{
		{"first record, checksum", 0, 4},
		{"first record, payload start", 0, headerSize},
		{"first record, payload end", 0, headerSize + int64(len(payloads[0])) - 1},
		{"second record, checksum", 1, 7},
		{"second record, payload", 1, headerSize + 3},
		{"second to last record, payload", 2, headerSize + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			copyDir(t, orig, dir)
			path := filepath.Join(dir, seg)
			flipByte(t, path, offs[tc.rec]+tc.inRecord)
			checkCorrupt(t, dir, path, offs[tc.rec])
		})
	}

	t.Run("short record before the tail", func(t *testing.T) {
		// The second record's length grows by one: its payload now runs
		// into the third record's header, and the checksum fails there.
		dir := t.TempDir()
		copyDir(t, orig, dir)
		path := filepath.Join(dir, seg)
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		data[offs[1]]++
		require.NoError(t, os.WriteFile(path, data, 0o644))
		checkCorrupt(t, dir, path, offs[1])
	})
}

// TestCorruptLengthFieldIsNotTorn: a damaged length field in a record that
// whole records follow is corruption too — the record is not "cut short
// at the end of the last segment", so Open must not truncate it and every
// record after it away.
func TestCorruptLengthFieldIsNotTorn(t *testing.T) {
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) { testCorruptLengthFieldIsNotTorn(t, lay.prealloc) })
	}
}

func testCorruptLengthFieldIsNotTorn(t *testing.T, prealloc bool) {
	payloads := [][]byte{[]byte("first record"), []byte("second record"), []byte("third"), []byte("last")}
	orig, seg := corruptible(t, payloads, prealloc)
	for b := range int64(4) {
		t.Run(fmt.Sprintf("length byte %d", b), func(t *testing.T) {
			dir := t.TempDir()
			copyDir(t, orig, dir)
			path := filepath.Join(dir, seg)
			flipByte(t, path, b)
			checkCorrupt(t, dir, path, 0)
		})
	}
}

func TestCorruptionInEarlierSegment(t *testing.T) {
	opts := wal.Options{SegmentBytes: 200}
	payloads := recs("earlier-segment-record", 40)
	orig := t.TempDir()
	writeJournal(t, orig, opts, payloads)
	segs := segments(t, orig)
	require.Greater(t, len(segs), 2)

	// The records of the first segment, from the front.
	firstSize := fileSize(t, filepath.Join(orig, segs[0]))
	var inFirst []int64 // record starts in segs[0]
	for _, o := range offsets(payloads) {
		if o >= firstSize {
			break
		}
		inFirst = append(inFirst, o)
	}
	require.Greater(t, len(inFirst), 1)
	lastStart := inFirst[len(inFirst)-1]

	for _, tc := range []struct {
		name  string
		seg   int
		start int64
		off   int64
	}{
		{"first record of the first segment", 0, 0, headerSize + 2},
		{"last record of the first segment", 0, lastStart, lastStart + headerSize + 1},
		{"checksum of the last record of a middle segment", len(segs) / 2, -1, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			copyDir(t, orig, dir)
			path := filepath.Join(dir, segs[tc.seg])
			start, off := tc.start, tc.off
			if start < 0 { // the last record of that segment
				start = lastRecordStart(t, path)
				off += start
			}
			flipByte(t, path, off)
			checkCorrupt(t, dir, path, start)
		})
	}

	t.Run("earlier segment cut short", func(t *testing.T) {
		dir := t.TempDir()
		copyDir(t, orig, dir)
		path := filepath.Join(dir, segs[0])
		require.NoError(t, os.Truncate(path, lastStart+headerSize+1))
		checkCorrupt(t, dir, path, lastStart)
	})
}

// lastRecordStart walks a segment's headers to its last record.
func lastRecordStart(t *testing.T, path string) int64 {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	var off, last int64
	for off < int64(len(data)) {
		last = off
		length := int64(data[off]) | int64(data[off+1])<<8 | int64(data[off+2])<<16 | int64(data[off+3])<<24
		off += headerSize + length
	}
	require.Equal(t, int64(len(data)), off)
	return last
}
