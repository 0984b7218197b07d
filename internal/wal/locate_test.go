package wal_test

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/wal"
)

// Locate finds every record Records returned where it lies — across
// segments, after a compaction's base, with a batch a crash cut short
// left out — and ReadOnly's records with the package function.
func TestLocateFindsEveryRecordOpenRead(t *testing.T) {
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) {
			dir := t.TempDir()
			opts := wal.Options{SegmentBytes: 200, NoPrealloc: !lay.prealloc}
			l := open(t, dir, opts)
			appendEach(t, l, recs("old", 30)...) // several segments, replaced by the compaction
			require.NoError(t, l.Compact(recs("kept", 12)))
			for i := range 10 {
				require.NoError(t, l.Append(recs("batch"+string(rune('a'+i)), 3)).Wait())
			}
			require.NoError(t, l.Close())
			// A batch the crash cut short: its first record only, in the
			// last segment, where the next record goes.
			last := lastSegment(t, dir)
			cut := encodeBatches([][]byte{[]byte("lost-0"), []byte("lost-1")})
			f, err := os.OpenFile(last, os.O_WRONLY, 0)
			require.NoError(t, err)
			_, err = f.WriteAt(cut[:headerSize+6], logicalEnd(t, last))
			require.NoError(t, err)
			require.NoError(t, f.Close())

			check := func(payloads [][]byte, locate func(i int) (wal.Location, bool)) {
				t.Helper()
				require.Len(t, payloads, 12+30)
				for i, p := range payloads {
					loc, ok := locate(i)
					require.True(t, ok, "record %d", i)
					data := readFile(t, loc.File)
					field := binary.LittleEndian.Uint32(data[loc.Offset:])
					n := int64(field &^ (3 << 30))
					assert.Equal(t, string(p), string(data[loc.Offset+headerSize:loc.Offset+headerSize+n]), "record %d at %s", i, loc)
				}
				_, ok := locate(len(payloads))
				assert.False(t, ok, "no record past the last")
				_, ok = locate(-1)
				assert.False(t, ok)
			}
			ro, torn, err := wal.ReadOnly(dir, opts)
			require.NoError(t, err)
			require.NotNil(t, torn, "the cut batch is a torn tail")
			check(ro, func(i int) (wal.Location, bool) { return wal.Locate(dir, opts, i) })

			l = open(t, dir, opts)
			check(l.Records(), l.Locate)
			loc, ok := l.Locate(0)
			require.True(t, ok)
			assert.Equal(t, filepath.Dir(loc.File), dir)
			assert.Contains(t, loc.String(), "seg-")
			assert.Contains(t, loc.String(), " at offset ")
		})
	}
}
