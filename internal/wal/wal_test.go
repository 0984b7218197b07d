package wal_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask/internal/wal"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// headerSize is the on-disk record header of the package doc: a
// little-endian uint32 length, the CRC-32C of those 4 bytes, and the
// CRC-32C of the payload, 4 bytes each.
const headerSize = 12

// open opens dir and makes sure the Log is closed when the test ends
// (Close is idempotent, so tests may also Close it themselves).
func open(t *testing.T, dir string, opts wal.Options) *wal.Log {
	t.Helper()
	l, err := wal.Open(dir, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// reopen opens dir with the operating system's FS, takes its records and
// closes it again.
func reopen(t *testing.T, dir string) [][]byte {
	t.Helper()
	l, err := wal.Open(dir, wal.Options{})
	require.NoError(t, err)
	recs := l.Records()
	require.NoError(t, l.Close())
	return recs
}

// appendEach appends every payload as its own batch and waits for it.
func appendEach(t *testing.T, l *wal.Log, payloads ...[]byte) {
	t.Helper()
	for i, p := range payloads {
		require.NoError(t, l.Append([][]byte{p}).Wait(), "payload %d", i)
	}
}

// recs makes n payloads prefix-0, prefix-1, ...
func recs(prefix string, n int) [][]byte {
	out := make([][]byte, n)
	for i := range out {
		out[i] = fmt.Appendf(nil, "%s-%d", prefix, i)
	}
	return out
}

func concat(parts ...[][]byte) [][]byte {
	var out [][]byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// equalRecords compares payload lists, treating nil and empty payloads
// (and nil and empty lists) alike, and prints them readably.
func equalRecords(t *testing.T, want, got [][]byte, msgAndArgs ...any) bool {
	t.Helper()
	return assert.Equal(t, strs(want), strs(got), msgAndArgs...)
}

func strs(ps [][]byte) []string {
	out := make([]string, len(ps))
	for i, p := range ps {
		out[i] = string(p)
	}
	return out
}

// segments lists dir's segment files (seg-<n>.log) in order of n.
func segments(t *testing.T, dir string) []string {
	t.Helper()
	names, err := wal.SegmentFiles(dir)
	require.NoError(t, err)
	return names
}

// lastSegment is the path of dir's last segment.
func lastSegment(t *testing.T, dir string) string {
	t.Helper()
	segs := segments(t, dir)
	require.NotEmpty(t, segs)
	return filepath.Join(dir, segs[len(segs)-1])
}

// offsets are where each payload's record starts in a segment holding
// exactly these payloads, and the offset after the last one.
func offsets(payloads [][]byte) []int64 {
	out := make([]int64, len(payloads)+1)
	for i, p := range payloads {
		out[i+1] = out[i] + headerSize + int64(len(p))
	}
	return out
}

// encode is payloads as a segment holds them: each a header (length,
// CRC-32C of the length, CRC-32C of the payload) and the payload.
func encode(payloads [][]byte) []byte {
	var batches [][][]byte
	for _, p := range payloads {
		batches = append(batches, [][]byte{p})
	}
	return encodeBatches(batches...)
}

// encodeBatches is batches as a segment holds them: each record a header
// (length, CRC-32C of the length, CRC-32C of the payload) and the payload,
// the length of every record but the last of its batch with the flag that
// says its batch goes on (bit 30).
func encodeBatches(batches ...[][]byte) []byte {
	var out []byte
	castagnoli := crc32.MakeTable(crc32.Castagnoli)
	for _, b := range batches {
		for i, p := range b {
			field := uint32(len(p))
			if i < len(b)-1 {
				field |= 1 << 30
			}
			out = binary.LittleEndian.AppendUint32(out, field)
			out = binary.LittleEndian.AppendUint32(out, crc32.Checksum(out[len(out)-4:], castagnoli))
			out = binary.LittleEndian.AppendUint32(out, crc32.Checksum(p, castagnoli))
			out = append(out, p...)
		}
	}
	return out
}

func allZero(b []byte) bool { return bytes.Count(b, []byte{0}) == len(b) }

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	return data
}

// logicalEnd walks a segment's headers to where its records end: the
// file's end, or a header of zeros (preallocated space).
func logicalEnd(t *testing.T, path string) int64 {
	t.Helper()
	data := readFile(t, path)
	var off int64
	for off+headerSize <= int64(len(data)) && !allZero(data[off:off+headerSize]) {
		off += headerSize + int64(binary.LittleEndian.Uint32(data[off:])&^(3<<30)) // less the base and batch flags
	}
	require.LessOrEqual(t, off, int64(len(data)))
	return off
}

// layouts are the two ways a segment is written: with zeroed space ahead
// of the next record (the default), and exactly its records.
var layouts = []struct {
	name     string
	prealloc bool
}{{"preallocated", true}, {"old layout", false}}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	return fi.Size()
}

func TestRoundTripSequentialBatches(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, wal.Options{})
	assert.Empty(t, l.Records(), "a new journal has no records")
	assert.Nil(t, l.Torn())

	batches := [][][]byte{
		{[]byte("a")},
		{[]byte("b"), []byte("c"), []byte("d")},
		{[]byte("e")},
		{[]byte("f"), []byte("g")},
	}
	var want [][]byte
	for _, b := range batches {
		require.NoError(t, l.Append(b).Wait())
		want = append(want, b...)
	}
	require.NoError(t, l.Close())

	l = open(t, dir, wal.Options{})
	assert.Nil(t, l.Torn())
	equalRecords(t, want, l.Records())
	assert.Empty(t, l.Records(), "Records hands the records over once")
	require.NoError(t, l.Close())

	// A third open still sees them: Records consumed nothing on disk.
	equalRecords(t, want, reopen(t, dir))
}

func TestRoundTripEmptyAndLargePayloads(t *testing.T) {
	big := make([]byte, 1<<20+13) // longer than a unit: written in pieces
	for i := range big {
		big[i] = byte(i*7 + i>>9)
	}
	want := [][]byte{{}, []byte("x"), big, {}, {}, []byte("after"), nil}
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) {
			dir := t.TempDir()
			l := open(t, dir, wal.Options{NoPrealloc: !lay.prealloc})
			require.NoError(t, l.Append(want[:3]).Wait())
			appendEach(t, l, want[3:]...)
			require.NoError(t, l.Close())

			got := reopen(t, dir)
			require.Len(t, got, len(want))
			for i := range want {
				assert.True(t, bytes.Equal(want[i], got[i]), "payload %d: %d bytes, want %d", i, len(got[i]), len(want[i]))
			}
			end := offsets(want)[len(want)]
			data := readFile(t, lastSegment(t, dir))
			require.GreaterOrEqual(t, int64(len(data)), end)
			assert.True(t, bytes.Equal(encodeBatches(want[:3], want[3:4], want[4:5], want[5:6], want[6:]), data[:end]), "the records: %d-byte headers and the payloads", headerSize)
			if lay.prealloc {
				assert.Greater(t, int64(len(data)), end, "zeroed space follows the records")
				assert.True(t, allZero(data[end:]), "only zeros after the records")
			} else {
				assert.Equal(t, end, int64(len(data)), "the segment is exactly the records")
			}
		})
	}
}

func TestRoundTripConcurrentAppends(t *testing.T) {
	const goroutines, perG = 8, 40
	dir := t.TempDir()
	l := open(t, dir, wal.Options{})

	var wg sync.WaitGroup
	errs := make(chan error, 2*goroutines*perG) // every batch once, some twice
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var pending []*wal.Batch
			for i := range perG {
				p := fmt.Appendf(nil, "g%d-%d", g, i)
				if i%3 == 0 { // some batches of two, some waited at once
					pending = append(pending, l.Append([][]byte{p, fmt.Appendf(nil, "g%d-%d+", g, i)}))
				} else {
					pending = append(pending, l.Append([][]byte{p}))
				}
				if i%5 == 0 {
					errs <- pending[len(pending)-1].Wait()
				}
			}
			for _, b := range pending {
				errs <- b.Wait()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, l.Close())

	got := reopen(t, dir)
	seen := map[string]int{}
	perGoroutine := make([][]string, goroutines)
	for _, p := range got {
		s := string(p)
		seen[s]++
		var g int
		_, err := fmt.Sscanf(s, "g%d-", &g)
		require.NoError(t, err, s)
		perGoroutine[g] = append(perGoroutine[g], s)
	}
	for g := range goroutines {
		var want []string
		for i := range perG {
			want = append(want, fmt.Sprintf("g%d-%d", g, i))
			if i%3 == 0 {
				want = append(want, fmt.Sprintf("g%d-%d+", g, i))
			}
		}
		assert.Equal(t, want, perGoroutine[g], "goroutine %d's records, in its append order", g)
	}
	for s, n := range seen {
		assert.Equal(t, 1, n, "%q is replayed exactly once", s)
	}
}

// TestGroupCommit: batches queued while an fsync is in flight are made
// durable together, with fewer fsyncs than batches.
func TestGroupCommit(t *testing.T) {
	const n = 20
	fs := &faultFS{}
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs})

	g := newGate()
	fs.set(func(fs *faultFS) {
		fs.onSync = func(string) error { _, err := g.hold(); return err }
	})
	before := fs.syncCount()
	first := waiting(l.Append([][]byte{[]byte("first")}))
	<-g.entered // the first waiter is inside the fsync

	var wg sync.WaitGroup
	batches := make([]*wal.Batch, n-1)
	for i := range batches {
		wg.Add(1)
		go func() {
			defer wg.Done()
			batches[i] = l.Append([][]byte{fmt.Appendf(nil, "r%d", i)})
		}()
	}
	wg.Wait() // all queued behind the fsync in flight
	g.release <- nil
	require.NoError(t, <-first)
	for _, b := range batches {
		require.NoError(t, b.Wait())
	}
	syncs := fs.syncCount() - before
	assert.Less(t, syncs, n, "%d batches, %d fsyncs: group commit shares fsyncs", n, syncs)
	assert.GreaterOrEqual(t, syncs, 1)
	require.NoError(t, l.Close())
	assert.Len(t, reopen(t, dir), n)
}

// TestSyncEach: with SyncEach every batch gets its own fsync, even when
// they are queued together.
func TestSyncEach(t *testing.T) {
	const n = 12
	fs := &faultFS{}
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs, SyncEach: true})

	g := newGate()
	fs.set(func(fs *faultFS) {
		fs.onSync = func(string) error { _, err := g.hold(); return err }
	})
	before := fs.syncCount()
	first := waiting(l.Append([][]byte{[]byte("first")}))
	<-g.entered
	var wg sync.WaitGroup
	batches := make([]*wal.Batch, n-1)
	for i := range batches {
		wg.Add(1)
		go func() {
			defer wg.Done()
			batches[i] = l.Append([][]byte{fmt.Appendf(nil, "r%d", i), []byte("second of batch")})
		}()
	}
	wg.Wait()
	g.release <- nil
	require.NoError(t, <-first)
	for _, b := range batches {
		require.NoError(t, b.Wait())
	}
	assert.GreaterOrEqual(t, fs.syncCount()-before, n, "one fsync per batch")
	require.NoError(t, l.Close())
	assert.Len(t, reopen(t, dir), 1+2*(n-1))
}

func TestLock(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, wal.Options{})
	appendEach(t, l, []byte("one"))

	l2, err := wal.Open(dir, wal.Options{})
	require.ErrorIs(t, err, wal.ErrLocked)
	assert.Nil(t, l2)

	// The failed Open took nothing from the first Log.
	appendEach(t, l, []byte("two"))
	require.NoError(t, l.Close())

	l2 = open(t, dir, wal.Options{})
	equalRecords(t, [][]byte{[]byte("one"), []byte("two")}, l2.Records())

	// And a third, while the second is open, is refused again.
	_, err = wal.Open(dir, wal.Options{})
	require.ErrorIs(t, err, wal.ErrLocked)
	require.NoError(t, l2.Close())
}

func TestAppendAfterClose(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, wal.Options{})
	b := l.Append([][]byte{[]byte("queued before close")})
	require.NoError(t, l.Close())
	require.NoError(t, b.Wait(), "Close writes what is queued")
	require.ErrorIs(t, l.Append([][]byte{[]byte("late")}).Wait(), wal.ErrClosed)
	require.NoError(t, l.Close(), "a second Close is harmless")
	equalRecords(t, [][]byte{[]byte("queued before close")}, reopen(t, dir))
}

func TestSegments(t *testing.T) {
	const segBytes = 200
	dir := t.TempDir()
	l := open(t, dir, wal.Options{SegmentBytes: segBytes})
	want := recs("segment-record-with-some-length", 60)
	appendEach(t, l, want[:40]...)
	require.NoError(t, l.Append(want[40:]).Wait()) // one big batch too
	require.NoError(t, l.Close())

	segs := segments(t, dir)
	require.Greater(t, len(segs), 3, "%d records of ~40 bytes in 200-byte segments", len(want))
	for _, s := range segs[:len(segs)-1] {
		assert.GreaterOrEqual(t, fileSize(t, filepath.Join(dir, s)), int64(segBytes),
			"%s: a segment is only left once full", s)
	}

	// Reopen with small segments, append more, reopen again.
	l = open(t, dir, wal.Options{SegmentBytes: segBytes})
	equalRecords(t, want, l.Records())
	more := recs("more", 20)
	appendEach(t, l, more...)
	require.NoError(t, l.Close())
	equalRecords(t, concat(want, more), reopen(t, dir))
	assert.Greater(t, len(segments(t, dir)), len(segs))
}

// TestFailStopPersistent: once a write or an fsync fails, that batch and
// every later one fail.
func TestFailStopPersistent(t *testing.T) {
	for _, tc := range []struct {
		name string
		arm  func(fs *faultFS)
	}{
		{"sync", func(fs *faultFS) { fs.onSync = func(string) error { return errInjected } }},
		{"write", func(fs *faultFS) {
			fs.onWrite = func(string, *os.File, []byte) (int, error) { return 0, errInjected }
		}},
		{"short write", func(fs *faultFS) {
			fs.onWrite = func(_ string, f *os.File, p []byte) (int, error) {
				n, _ := f.Write(p[:len(p)/2])
				return n, errInjected
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := &faultFS{}
			dir := t.TempDir()
			l := open(t, dir, wal.Options{FS: fs})
			good := recs("good", 3)
			appendEach(t, l, good...)

			fs.set(tc.arm)
			err := l.Append([][]byte{[]byte("doomed")}).Wait()
			require.ErrorIs(t, err, errInjected, "the failing batch's Wait reports the fault")

			fs.set(func(fs *faultFS) { fs.onSync, fs.onWrite = nil, nil }) // the disk "recovers"
			for i := range 3 {
				require.Error(t, l.Append([][]byte{fmt.Appendf(nil, "later-%d", i)}).Wait(),
					"fail-stop: an append after the fault fails even though the disk works again")
			}
			assert.Error(t, l.Compact(nil), "nor does a compaction run after the fault")
			assert.Error(t, l.Close(), "Close reports what stopped the log")

			// What was acknowledged survives; "doomed" may or may not (it
			// was never acknowledged), nothing after it is there.
			got := reopen(t, dir)
			require.GreaterOrEqual(t, len(got), len(good))
			equalRecords(t, good, got[:len(good)])
			for _, p := range got[len(good):] {
				assert.Equal(t, "doomed", string(p))
			}
		})
	}
}

// TestFailStopQueuedBehindFault: batches already queued when a write or an
// fsync fails are refused too — even if the fault was transient — since
// what is on disk after the failed one is unknown.
func TestFailStopQueuedBehindFault(t *testing.T) {
	for _, tc := range []struct {
		name string
		arm  func(fs *faultFS, g *gate)
	}{
		{"sync", func(fs *faultFS, g *gate) {
			fs.onSync = func(string) error {
				if held, err := g.hold(); held {
					return err
				}
				return nil
			}
		}},
		{"short write", func(fs *faultFS, g *gate) {
			fs.onWrite = func(_ string, f *os.File, p []byte) (int, error) {
				if held, err := g.hold(); held {
					n, _ := f.Write(p[:headerSize+5]) // into doomed-1's payload
					return n, err
				}
				return f.Write(p)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := &faultFS{}
			dir := t.TempDir()
			l := open(t, dir, wal.Options{FS: fs})
			good := recs("good", 3)
			appendEach(t, l, good...)

			g := newGate()
			fs.set(func(fs *faultFS) { tc.arm(fs, g) })
			doomed := waiting(l.Append([][]byte{[]byte("doomed-1"), []byte("doomed-2")}))
			<-g.entered // the waiter is inside the failing call
			queued := l.Append([][]byte{[]byte("queued")})
			g.release <- errInjected // only this one call fails

			require.ErrorIs(t, <-doomed, errInjected)
			assert.Error(t, queued.Wait(), "a batch queued behind the failed one must not be acknowledged")
			assert.Error(t, l.Append([][]byte{[]byte("later")}).Wait())
			_ = l.Close()

			// The journal still opens (a failed write can only leave a torn
			// tail), with every acknowledged record and nothing after
			// the fault.
			l2, err := wal.Open(dir, wal.Options{})
			require.NoError(t, err, "after a transient fault the journal must still open")
			got := l2.Records()
			require.NoError(t, l2.Close())
			require.GreaterOrEqual(t, len(got), len(good))
			equalRecords(t, good, got[:len(good)])
			for _, p := range got[len(good):] {
				assert.Contains(t, []string{"doomed-1", "doomed-2"}, string(p), "nothing queued behind the fault is on disk")
			}
		})
	}
}

func TestOversizedRecordFails(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, wal.Options{})
	appendEach(t, l, []byte("ok"))
	err := l.Append([][]byte{make([]byte, wal.MaxRecord+1)}).Wait()
	require.Error(t, err)
	assert.False(t, errors.Is(err, wal.ErrClosed))
	_ = l.Close()
	equalRecords(t, [][]byte{[]byte("ok")}, reopen(t, dir))
}
