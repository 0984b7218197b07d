package wal_test

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// A batch longer than a unit is written in more than one unit, each synced
// before the next: a crash between them keeps the first unit's records of
// the batch and loses the rest. The batch is one commit: Open (and
// ReadOnly) read none of it, and report it torn from where it began.
func TestABatchCutBetweenItsUnitsIsReadAsNothing(t *testing.T) {
	before := [][]byte{[]byte("durable-1"), []byte("durable-2")}
	big := [][]byte{bytes.Repeat([]byte("a"), 100<<10), bytes.Repeat([]byte("b"), 100<<10), bytes.Repeat([]byte("c"), 100<<10)}
	start := offsets(before)[len(before)]
	// The first unit of the batch holds its first two records (the third
	// does not fit in 256 KiB with them): the crash keeps exactly those.
	budget := start + 2*(headerSize+100<<10)
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) {
			dir := t.TempDir()
			l := open(t, dir, wal.Options{FS: &faultFS{onWrite: dropAfter(budget)}, NoPrealloc: !lay.prealloc})
			appendEach(t, l, before...)
			require.NoError(t, l.Append(big).Wait())
			require.NoError(t, l.Close())
			seg := lastSegment(t, dir)
			data := readFile(t, seg)
			require.True(t, bytes.Equal(encodeBatches(before[:1], before[1:], big)[:budget], data[:budget]), "the crash kept the batch's first unit")

			recs, torn, err := wal.ReadOnly(dir, wal.Options{})
			require.NoError(t, err)
			equalRecords(t, before, recs, "ReadOnly reads none of the cut batch")
			if assert.NotNil(t, torn) {
				assert.Equal(t, start, torn.Offset, "torn from where the batch began")
			}

			l2, err := wal.Open(dir, wal.Options{NoPrealloc: !lay.prealloc})
			require.NoError(t, err)
			equalRecords(t, before, l2.Records(), "Open reads none of the cut batch")
			if assert.NotNil(t, l2.Torn()) {
				assert.Equal(t, start, l2.Torn().Offset)
				assert.Equal(t, int64(len(data))-start, l2.Torn().Bytes)
			}
			assert.Equal(t, start, fileSize(t, seg), "the batch's records are cut off")
			appendEach(t, l2, []byte("after"))
			require.NoError(t, l2.Close())
			equalRecords(t, concat(before, [][]byte{[]byte("after")}), reopen(t, dir))
		})
	}
}

// A whole batch, its last record written, is read whole.
func TestAWholeBatchIsReadWhole(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, wal.Options{})
	batch := [][]byte{[]byte("one"), {}, []byte("three")}
	require.NoError(t, l.Append(batch).Wait())
	require.NoError(t, l.Close())
	l2, err := wal.Open(dir, wal.Options{})
	require.NoError(t, err)
	defer l2.Close()
	equalRecords(t, batch, l2.Records())
	assert.Nil(t, l2.Torn())
	data := readFile(t, lastSegment(t, dir))
	assert.True(t, bytes.Equal(encodeBatches(batch), data[:offsets(batch)[3]]), "each record but the batch's last says its batch goes on")
}

// A segment before the last never ends inside a batch (a batch is written
// into one segment, and the next segment is started after it): one that
// does is corruption, not a torn tail.
func TestABatchCutInASegmentBeforeTheLastIsCorruption(t *testing.T) {
	dir := t.TempDir()
	first := encodeBatches([][]byte{[]byte("x"), []byte("y")})
	first = first[:offsets([][]byte{[]byte("x")})[1]] // its second record is missing
	require.NoError(t, os.WriteFile(filepath.Join(dir, "seg-0000000000000001.log"), first, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "seg-0000000000000002.log"), encode([][]byte{[]byte("z")}), 0o644))
	_, err := wal.Open(dir, wal.Options{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "seg-0000000000000001.log at offset 0")
	assert.Contains(t, err.Error(), "commit")
	_, _, err = wal.ReadOnly(dir, wal.Options{})
	assert.Error(t, err, "ReadOnly refuses it too")
}

// A journal written before batches were framed holds every record as its
// own commit (no record says its batch goes on): it reads as it always did.
func TestAJournalWrittenBeforeFramingReadsAsBefore(t *testing.T) {
	dir := t.TempDir()
	old := [][]byte{[]byte("launched"), []byte("attempt"), []byte("bound")}
	require.NoError(t, os.WriteFile(filepath.Join(dir, "seg-0000000000000001.log"), encode(old), 0o644))
	l, err := wal.Open(dir, wal.Options{})
	require.NoError(t, err)
	equalRecords(t, old, l.Records())
	assert.Nil(t, l.Torn())
	require.NoError(t, l.Append([][]byte{[]byte("new-1"), []byte("new-2")}).Wait())
	require.NoError(t, l.Close())
	equalRecords(t, concat(old, [][]byte{[]byte("new-1"), []byte("new-2")}), reopen(t, dir))
}

// WaitContext returns once its context ends, with the batch not yet
// durable (a sync held, as a disk that stalls holds it); the batch stays
// queued or in flight, and a later Wait sees it durable.
func TestWaitContextKeepsToItsContext(t *testing.T) {
	fs := &faultFS{}
	dir := t.TempDir()
	l := open(t, dir, wal.Options{FS: fs})
	g := newGate()
	fs.set(func(fs *faultFS) {
		fs.onSync = func(name string) error {
			_, err := g.hold()
			return err
		}
	})
	first := l.Append([][]byte{[]byte("first")})
	firstDone := waiting(first) // its writer holds the turn, in a held sync
	<-g.entered
	second := l.Append([][]byte{[]byte("second")})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done, err := second.WaitContext(ctx)
	assert.False(t, done, "the context ended before the batch was durable")
	assert.NoError(t, err)
	g.release <- nil
	require.NoError(t, <-firstDone)
	done, err = second.WaitContext(context.Background())
	assert.True(t, done)
	require.NoError(t, err, "a later wait writes it and sees it durable")
	require.NoError(t, l.Close())
	equalRecords(t, [][]byte{[]byte("first"), []byte("second")}, reopen(t, dir))
}
