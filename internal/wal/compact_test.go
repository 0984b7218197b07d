package wal_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

func tmpFiles(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	var out []string
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".tmp") {
			out = append(out, e.Name())
		}
	}
	return out
}

func disjoint(a, b []string) bool {
	for _, x := range a {
		for _, y := range b {
			if x == y {
				return false
			}
		}
	}
	return true
}

func TestCompact(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts wal.Options
	}{
		{"one segment", wal.Options{}},
		{"many segments", wal.Options{SegmentBytes: 200}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			l := open(t, dir, tc.opts)
			orig := recs("original-record", 30)
			appendEach(t, l, orig...)
			old := segments(t, dir)

			keep := [][]byte{orig[1], orig[7], {}, orig[29]}
			require.NoError(t, l.Compact(keep))
			now := segments(t, dir)
			assert.NotEmpty(t, now)
			assert.True(t, disjoint(old, now), "old segments %v are removed, now %v", old, now)
			assert.Empty(t, tmpFiles(t, dir))

			after := recs("after-compaction", 12)
			appendEach(t, l, after...)
			require.NoError(t, l.Close())

			want := concat(keep, after)
			equalRecords(t, want, reopen(t, dir))
			equalRecords(t, want, reopen(t, dir), "stable over reopens")

			// Compacting again, to nothing, and appending.
			l = open(t, dir, tc.opts)
			equalRecords(t, want, l.Records())
			require.NoError(t, l.Compact(nil))
			appendEach(t, l, []byte("last"))
			require.NoError(t, l.Close())
			equalRecords(t, [][]byte{[]byte("last")}, reopen(t, dir))
		})
	}
}

// TestCompactAppendsMeanwhile: an append made while the compaction is
// writing waits and lands after the compacted records.
func TestCompactAppendsMeanwhile(t *testing.T) {
	fs := &faultFS{}
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs})
	orig := recs("orig", 5)
	appendEach(t, l, orig...)

	g := newGate()
	fs.set(func(fs *faultFS) {
		fs.onSync = func(name string) error {
			if strings.HasSuffix(name, ".tmp") {
				_, err := g.hold()
				return err
			}
			return nil
		}
	})
	keep := orig[3:]
	compacted := make(chan error, 1)
	go func() { compacted <- l.Compact(keep) }()
	<-g.entered // the compaction is fsyncing its new segment
	meanwhile := l.Append([][]byte{[]byte("meanwhile")})
	g.release <- nil
	require.NoError(t, <-compacted)
	require.NoError(t, meanwhile.Wait())
	require.NoError(t, l.Close())
	equalRecords(t, concat(keep, [][]byte{[]byte("meanwhile")}), reopen(t, dir))
}

// TestCompactFailsBeforeCommit: if writing or renaming the new segment
// fails, Compact reports it, leaves no temporary file, and the journal is
// the original one (plus whatever is appended and acknowledged after).
func TestCompactFailsBeforeCommit(t *testing.T) {
	for _, tc := range []struct {
		name string
		arm  func(fs *faultFS)
	}{
		{"rename", func(fs *faultFS) {
			fs.onRename = func(string, string) error { return errInjected }
		}},
		{"fsync of the new segment", func(fs *faultFS) {
			fs.onSync = func(name string) error {
				if strings.HasSuffix(name, ".tmp") {
					return errInjected
				}
				return nil
			}
		}},
		{"write of the new segment", func(fs *faultFS) {
			fs.onWrite = func(name string, f *os.File, p []byte) (int, error) {
				if strings.HasSuffix(name, ".tmp") {
					return 0, errInjected
				}
				return f.Write(p)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := &faultFS{}
			dir := t.TempDir()
			l := open(t, dir, wal.Options{FS: fs, SegmentBytes: 300})
			orig := recs("original", 25)
			appendEach(t, l, orig...)

			fs.set(tc.arm)
			require.ErrorIs(t, l.Compact(orig[:2]), errInjected)
			assert.Empty(t, tmpFiles(t, dir), "the failed compaction's temporary file is removed")
			fs.set((*faultFS).clear)

			extra := []byte("appended after the failed compaction")
			err := l.Append([][]byte{extra}).Wait()
			_ = l.Close()

			want := orig
			if err == nil { // acknowledged, so it must be there
				want = concat(orig, [][]byte{extra})
			}
			equalRecords(t, want, reopen(t, dir), "the original journal")
		})
	}
}

// TestCompactSyncDirFails: the directory fsync that commits the rename
// fails, so whether the rename is durable is unknown. Compact reports the
// error; a reopen then finds the old log or the new one (as after a crash
// at that point), never a mix — and never without a record that was
// acknowledged after the failed Compact: whatever the Log accepts after
// it must survive.
func TestCompactSyncDirFails(t *testing.T) {
	fs := &faultFS{}
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs})
	orig := recs("original", 6)
	appendEach(t, l, orig...)

	fs.set(func(fs *faultFS) { fs.onSyncDir = func(string) error { return errInjected } })
	keep := orig[:1]
	require.ErrorIs(t, l.Compact(keep), errInjected)
	fs.set(func(fs *faultFS) { fs.onSyncDir = nil })
	assert.Empty(t, tmpFiles(t, dir))

	extra := []byte("appended after the failed compaction")
	var acked [][]byte
	if l.Append([][]byte{extra}).Wait() == nil {
		acked = [][]byte{extra}
	}
	_ = l.Close()

	got := strs(reopen(t, dir))
	assert.Contains(t, [][]string{strs(concat(orig, acked)), strs(concat(keep, acked))}, got,
		"the old log or the compacted one, with every acknowledged append (acknowledged: %q)", strs(acked))
}

// TestCompactLeftoverTmp: a crash after the new segment was written but
// before the rename leaves a temporary file; Open ignores it.
func TestCompactLeftoverTmp(t *testing.T) {
	fs := &faultFS{}
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs})
	orig := recs("original", 6)
	appendEach(t, l, orig...)
	fs.set(func(fs *faultFS) {
		fs.onRename = func(string, string) error { return errInjected }
		fs.onRemove = func(string) error { return errInjected } // the "crash" keeps the .tmp
	})
	require.Error(t, l.Compact(orig[4:]))
	require.NotEmpty(t, tmpFiles(t, dir), "the simulated crash left the new segment unrenamed")
	_ = l.Close()

	equalRecords(t, orig, reopen(t, dir), "before the rename the old log stands")

	// And the next compaction, with the leftover still there, works.
	l = open(t, dir, wal.Options{})
	require.NoError(t, l.Compact(orig[5:]))
	require.NoError(t, l.Close())
	equalRecords(t, orig[5:], reopen(t, dir))
}

// TestCompactCrashBeforeOldSegmentsRemoved: the rename committed the
// compaction, but the old segments are still there (a crash, or failed
// removes). The base marker makes Open ignore (and remove) them: exactly
// the compacted records, no duplicates.
func TestCompactCrashBeforeOldSegmentsRemoved(t *testing.T) {
	t.Run("removes fail", func(t *testing.T) {
		fs := &faultFS{}
		dir := t.TempDir()
		opts := wal.Options{FS: fs, SegmentBytes: 200}
		l := open(t, dir, opts)
		orig := recs("original-record", 30)
		appendEach(t, l, orig...)
		old := segments(t, dir)
		require.Greater(t, len(old), 1)

		fs.set(func(fs *faultFS) { fs.onRemove = func(string) error { return errInjected } })
		keep := [][]byte{orig[0], orig[2], orig[4]}
		require.NoError(t, l.Compact(keep), "the compaction committed at the rename")
		for _, s := range old {
			require.FileExists(t, filepath.Join(dir, s), "the simulation kept the old segments")
		}
		after := recs("after", 3)
		appendEach(t, l, after...)
		require.NoError(t, l.Close())

		want := concat(keep, after)
		equalRecords(t, want, reopen(t, dir))
		now := segments(t, dir)
		assert.True(t, disjoint(old, now), "Open removed the replaced segments: old %v, now %v", old, now)
		equalRecords(t, want, reopen(t, dir))
	})

	t.Run("old segments copied back", func(t *testing.T) {
		dir := t.TempDir()
		opts := wal.Options{SegmentBytes: 200}
		l := open(t, dir, opts)
		orig := recs("original-record", 30)
		appendEach(t, l, orig...)
		saved := map[string][]byte{}
		for _, s := range segments(t, dir) {
			data, err := os.ReadFile(filepath.Join(dir, s))
			require.NoError(t, err)
			saved[s] = data
		}
		keep := orig[10:13]
		require.NoError(t, l.Compact(keep))
		require.NoError(t, l.Close())

		// The state a crash right after the rename leaves.
		for s, data := range saved {
			require.NoFileExists(t, filepath.Join(dir, s))
			require.NoError(t, os.WriteFile(filepath.Join(dir, s), data, 0o644))
		}
		equalRecords(t, keep, reopen(t, dir), "exactly the compacted records")
		for s := range saved {
			assert.NoFileExists(t, filepath.Join(dir, s), "Open removed the replaced segment")
		}
		equalRecords(t, keep, reopen(t, dir))
	})
}

// TestPayloadLikeBaseMarker: payloads are opaque bytes. One that happens
// to equal the compaction's base marker (wal.go's in-band "\x00bgtask-wal-
// base"), appended as the first record of a segment, must round-trip like
// any other, and must not make Open drop the segments before it.
func TestPayloadLikeBaseMarker(t *testing.T) {
	marker := []byte("\x00bgtask-wal-base")
	opts := wal.Options{SegmentBytes: 64}
	dir := t.TempDir()
	l := open(t, dir, opts)
	before := recs("a-record-filling-a-segment", 2)
	appendEach(t, l, before...) // 36 bytes each: two fill a segment
	require.Len(t, segments(t, dir), 2)
	require.Zero(t, fileSize(t, lastSegment(t, dir)), "the next record starts a segment")
	appendEach(t, l, marker, []byte("after"))
	require.NoError(t, l.Close())

	equalRecords(t, concat(before, [][]byte{marker, []byte("after")}), reopen(t, dir))
}
