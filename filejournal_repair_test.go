package bgtask

// A flipped byte is corruption or a torn tail, never silent loss: every
// image of a rich journal with one byte flipped either reads with every
// complete record intact, or is refused with a *CorruptError that names
// the damaged record and lists every complete record a cut would drop.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// flipRec is one record of a journal image, as the test finds it by
// walking the segments' headers (independently of the wal's reader).
type flipRec struct {
	seg        string // segment file name
	off, end   int
	batchStart int // index (into the image's records) of its batch's first record
	seq        uint64
	task       string
	base       bool
}

// flipImage is a journal directory's segment files and their records.
type flipImage struct {
	names []string          // segment names, in order
	files map[string][]byte // name → bytes
	recs  []flipRec
	ends  map[string]int // name → logical end (where its records end)
}

// richJournal writes the crash harness's taped first life (every record
// kind it makes) into a file journal: with compacted false, its steps
// before its compaction, in segments of 2,000 bytes, so that damage has
// whole segments after it too; with compacted true, every step, the
// compaction's base marker among them.
func richJournal(t *testing.T, compacted bool) flipImage {
	t.Helper()
	run := loadCrashTape(t)
	dir := t.TempDir()
	opts := wal.Options{SegmentBytes: 2000}
	tape := run.tape
	if compacted {
		opts.SegmentBytes = 64 << 10 // one segment, the base first (a larger one costs each read its zeros)
	} else {
		tape = tape[:slices.IndexFunc(tape, func(st tapeStep) bool { return st.compact })]
	}
	l, err := wal.Open(dir, opts)
	require.NoError(t, err)
	for _, st := range tape {
		if st.compact {
			require.NoError(t, l.Compact(payloadsOf(st.recs)))
		} else {
			require.NoError(t, l.Append(payloadsOf(st.recs)).Wait())
		}
	}
	require.NoError(t, l.Close())
	img := flipImage{files: map[string][]byte{}, ends: map[string]int{}}
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "seg-") {
			b, err := os.ReadFile(filepath.Join(dir, e.Name()))
			require.NoError(t, err)
			img.names = append(img.names, e.Name())
			img.files[e.Name()] = b
		}
	}
	sort.Strings(img.names)
	if !compacted {
		require.GreaterOrEqual(t, len(img.names), 3, "several segments")
	}
	for _, name := range img.names {
		b := img.files[name]
		off, open := 0, false
		for off+12 <= len(b) && !allZeroBytes(b[off:off+12]) {
			field := binary.LittleEndian.Uint32(b[off:])
			n := int(field &^ (3 << 30))
			r := flipRec{seg: name, off: off, end: off + 12 + n, batchStart: len(img.recs), base: field&(1<<31) != 0}
			if open {
				r.batchStart = img.recs[len(img.recs)-1].batchStart
			}
			if !r.base {
				rec, err := decodeData(b[off+13:r.end], 0, nil)
				require.NoError(t, err)
				r.seq, r.task = rec.seq, rec.task
			}
			img.recs = append(img.recs, r)
			open = field&(1<<30) != 0
			off = r.end
		}
		require.False(t, open, "%s ends inside a batch", name)
		img.ends[name] = off
	}
	kinds := map[recordKind]bool{}
	for _, name := range img.names {
		b := img.files[name]
		for _, r := range img.recs {
			if r.seg == name && !r.base {
				kinds[kindOf(b[r.off+12:r.end])] = true
			}
		}
	}
	if !compacted {
		require.GreaterOrEqual(t, len(kinds), 15, "a rich journal: many record kinds")
	} else {
		require.True(t, slices.ContainsFunc(img.recs, func(r flipRec) bool { return r.base }), "a compaction's base")
	}
	return img
}

func allZeroBytes(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// write writes img into a new directory, with the byte at pos of segment
// name flipped.
func (img flipImage) write(t *testing.T, name string, pos int) string {
	t.Helper()
	dir := t.TempDir()
	for _, n := range img.names {
		b := img.files[n]
		if n == name {
			b = slices.Clone(b)
			b[pos] ^= 0x5a
		}
		require.NoError(t, os.WriteFile(filepath.Join(dir, n), b, 0o644))
	}
	return dir
}

// flips are the positions flipped: with -crash.long every byte of every
// segment's records (and a sample of the zeros past them); else a byte of each field of every header, the first, middle
// and last bytes of every payload, and zeros past the last segment's records (just past
// them, and at its last byte).
func (img flipImage) flips() map[string][]int {
	out := map[string][]int{}
	for _, name := range img.names {
		b := img.files[name]
		if *crashLong {
			// every byte of the records and just past them, then the
			// zeros at a stride (and the last byte)
			end := img.ends[name]
			for p := range b {
				if p < end+64 || p%4093 == 0 || p == len(b)-1 {
					out[name] = append(out[name], p)
				}
			}
			continue
		}
		for _, r := range img.recs {
			if r.seg != name {
				continue
			}
			// the length field (its low byte, and the one with the
			// flags), the header's checksum, the payload's
			out[name] = append(out[name], r.off, r.off+3, r.off+5, r.off+10)
			if r.end > r.off+12 {
				out[name] = append(out[name], r.off+12, (r.off+12+r.end)/2, r.end-1)
			}
		}
		if end := img.ends[name]; end < len(b) {
			out[name] = append(out[name], end, end+1, len(b)-1)
		}
	}
	return out
}

// expect is what reading img with the byte at pos of name flipped owes:
// the records read if it opens (those before the damaged record's batch),
// the records a refusal must list as dropped (every complete record from
// that batch's start on, but the damaged one), and the damaged record
// (nil: the flip is in zeros past the records).
func (img flipImage) expect(name string, pos int) (kept, dropped []flipRec, bad *flipRec) {
	for i := range img.recs {
		r := img.recs[i]
		if r.seg == name && r.off <= pos && pos < r.end {
			bad = &img.recs[i]
			kept = img.recs[:r.batchStart]
			for j := r.batchStart; j < len(img.recs); j++ {
				if j != i {
					dropped = append(dropped, img.recs[j])
				}
			}
			return withoutBases(kept), withoutBases(dropped), bad
		}
	}
	return withoutBases(img.recs), nil, nil
}

func withoutBases(recs []flipRec) []flipRec {
	var out []flipRec
	for _, r := range recs {
		if !r.base {
			out = append(out, r)
		}
	}
	return out
}

// since are the records that count from the last compaction base on (the
// segments before it were replaced).
func since(recs []flipRec) []flipRec {
	for i := len(recs) - 1; i >= 0; i-- {
		if recs[i].base {
			return recs[i+1:]
		}
	}
	return recs
}

func seqsOf(recs []flipRec) []uint64 {
	out := []uint64{}
	for _, r := range recs {
		out = append(out, r.seq)
	}
	return out
}

func viewSeqs(views []RecordView) []uint64 {
	out := []uint64{}
	for _, v := range views {
		out = append(out, v.Seq)
	}
	return out
}

func TestEveryFlippedByteIsReadWholeOrRefused(t *testing.T) {
	for _, compacted := range []bool{false, true} {
		t.Run(fmt.Sprintf("compacted=%v", compacted), func(t *testing.T) { testFlips(t, richJournal(t, compacted)) })
	}
}

func testFlips(t *testing.T, img flipImage) {
	refused, torn, opened := 0, 0, 0
	// One directory, each flip made in place and undone after (reading
	// changes nothing): a file written per image costs more than the read.
	dir := img.write(t, "", 0)
	flip := func(name string, pos int) {
		f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR, 0)
		require.NoError(t, err)
		_, err = f.WriteAt([]byte{img.files[name][pos] ^ 0x5a}, int64(pos))
		require.NoError(t, err)
		require.NoError(t, f.Close())
	}
	unflip := func(name string, pos int) {
		f, err := os.OpenFile(filepath.Join(dir, name), os.O_RDWR, 0)
		require.NoError(t, err)
		_, err = f.WriteAt(img.files[name][pos:pos+1], int64(pos))
		require.NoError(t, err)
		require.NoError(t, f.Close())
	}
	for name, positions := range img.flips() {
		for _, pos := range positions {
			what := fmt.Sprintf("%s byte %d flipped", name, pos)
			flip(name, pos)
			kept, dropped, bad := img.expect(name, pos)
			v, err := ReadFileJournal(dir)
			unflip(name, pos)
			if err == nil {
				// It reads: every complete record is there, but those of
				// the damaged record's own batch, and none follows it.
				if bad != nil {
					require.Empty(t, recsAfter(img, bad), "%s: it opened, yet complete records follow the damaged one", what)
					torn++
				} else {
					opened++
				}
				require.Equal(t, seqsOf(since(kept)), viewSeqs(v.Records), "%s: the records read", what)
				continue
			}
			var ce *CorruptError
			require.ErrorAs(t, err, &ce, "%s: refused with a *CorruptError", what)
			require.ErrorIs(t, err, ErrCorrupt, what)
			refused++
			if bad == nil {
				// Zeros past the records with a stray byte that no torn
				// write leaves (the segment's last byte: it no longer
				// ends as a preallocated one does): refused, and no
				// complete record is at stake.
				require.Empty(t, ce.Dropped, what)
				continue
			}
			assert.Equal(t, filepath.Join(dir, name), ce.Segment, what)
			assert.Equal(t, int64(bad.off), ce.Offset, what)
			assert.Equal(t, int64(img.recs[bad.batchStart].off), ce.Cut, "%s: the cut is where the damaged batch begins", what)
			require.Equal(t, seqsOf(dropped), viewSeqs(ce.Dropped), "%s: every complete record the cut drops is listed", what)
			var tasks []string
			for _, r := range dropped {
				if r.task != "" && !slices.Contains(tasks, r.task) {
					tasks = append(tasks, r.task)
				}
			}
			assert.Equal(t, tasks, ce.Tasks, what)
			assert.Contains(t, ce.Error(), fmt.Sprintf("%s at offset %d", ce.Segment, bad.off), what)
		}
	}
	t.Logf("%d images refused as corrupt, %d read as a torn tail, %d read whole", refused, torn, opened)
	require.Positive(t, refused)
	require.Positive(t, torn, "a flip in the last record is a torn tail")
}

// recsAfter are the complete records after bad (a flip damages one).
func recsAfter(img flipImage, bad *flipRec) []flipRec {
	for i := range img.recs {
		if &img.recs[i] == bad {
			return withoutBases(img.recs[i+1:])
		}
	}
	return nil
}

// A corrupt journal is refused by OpenFileJournal with the same error,
// and nothing is changed; WithRepair reports before it writes, keeps a
// copy of what it cuts, and the journal then opens with every commit
// before the damage.
func TestRepairReportsBeforeItCutsAndKeepsACopy(t *testing.T) {
	img := richJournal(t, false)
	// Damage in the middle of the first segment that holds records after
	// the compaction: its later records and every later segment follow.
	var bad flipRec
	for _, r := range img.recs {
		if r.seg == img.names[len(img.names)/2] && r.batchStart > 0 {
			bad = r
			break
		}
	}
	require.NotEmpty(t, bad.seg)
	pos := bad.off + 20
	dir := img.write(t, bad.seg, pos)
	before := dirFiles(t, dir)
	kept, dropped, _ := img.expect(bad.seg, pos)

	_, err := OpenFileJournal(dir)
	var ce *CorruptError
	require.ErrorAs(t, err, &ce)
	require.NotEmpty(t, ce.Later, "whole segments follow")
	assert.Equal(t, before, dirFiles(t, dir), "a refusal changes nothing")

	// A confirm that says no: nothing changes either.
	no := errors.New("not now")
	_, err = OpenFileJournal(dir, WithRepair(func(*CorruptError) error { return no }))
	require.ErrorIs(t, err, no)
	require.ErrorIs(t, err, ErrCorrupt, "declined, the journal is still corrupt")
	var declined *CorruptError
	require.ErrorAs(t, err, &declined)
	assert.Equal(t, ce.Tasks, declined.Tasks)
	assert.Equal(t, before, dirFiles(t, dir), "a declined repair changes nothing")

	// A confirm that panics, or whose error panics when read, is an
	// error, not a crash, and nothing changes.
	_, err = OpenFileJournal(dir, WithRepair(func(*CorruptError) error { panic("boom") }))
	require.ErrorContains(t, err, "panicked")
	require.ErrorIs(t, err, ErrCorrupt)
	_, err = OpenFileJournal(dir, WithRepair(func(*CorruptError) error { return panicky{} }))
	require.ErrorIs(t, err, ErrCorrupt)
	assert.NotPanics(t, func() { _ = err.Error() })
	assert.Equal(t, before, dirFiles(t, dir))

	_, err = OpenFileJournal(dir, WithRepair(nil))
	require.ErrorIs(t, err, ErrInvalidArgument)

	var seen *CorruptError
	j, err := OpenFileJournal(dir, WithRepair(func(c *CorruptError) error {
		assert.Equal(t, before, dirFiles(t, dir), "the report comes before any write")
		seen = c
		return nil
	}))
	require.NoError(t, err)
	require.NotNil(t, seen)
	assert.Equal(t, seqsOf(dropped), viewSeqs(seen.Dropped), "the report lists every record it drops")
	assert.Equal(t, ce.Tasks, seen.Tasks)
	require.True(t, strings.HasPrefix(seen.Copy, dir+string(filepath.Separator)), "the copy is kept in the journal's directory: %s", seen.Copy)

	got := []uint64{}
	require.NoError(t, j.Replay(func(r Record) error { got = append(got, r.Seq); return nil }))
	require.NoError(t, j.Close())
	assert.Equal(t, seqsOf(since(kept)), got, "every commit before the damage is kept whole")

	// The copy: the damaged segment's bytes from the cut on, and every
	// later segment whole.
	orig := img.files[bad.seg]
	cut := img.recs[bad.batchStart].off
	b, err := os.ReadFile(filepath.Join(seen.Copy, fmt.Sprintf("%s.from-%d", bad.seg, cut)))
	require.NoError(t, err)
	want := slices.Clone(orig[cut:])
	want[pos-cut] ^= 0x5a
	assert.Equal(t, want, b, "the cut bytes are kept as they were")
	for _, later := range ce.Later {
		b, err := os.ReadFile(filepath.Join(seen.Copy, filepath.Base(later)))
		require.NoError(t, err)
		assert.Equal(t, img.files[filepath.Base(later)], b)
		_, err = os.Stat(later)
		assert.ErrorIs(t, err, os.ErrNotExist, "a later segment is set aside")
	}

	// It opens again as it is, and a Manager replays it.
	v, err := ReadFileJournal(dir)
	require.NoError(t, err)
	assert.Equal(t, seqsOf(since(kept)), viewSeqs(v.Records))
}

// dirFiles is what dir holds: every file's name and bytes, subdirectories
// included.
func dirFiles(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	require.NoError(t, filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() == "LOCK" {
			return err
		}
		b, err := os.ReadFile(p)
		out[p] = string(b)
		return err
	}))
	return out
}
