package wal

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Location is where a record lies on disk: its segment file and the offset
// of its header in it.
type Location struct {
	File   string
	Offset int64
}

func (loc Location) String() string { return fmt.Sprintf("%s at offset %d", loc.File, loc.Offset) }

// Locate says where the i-th of the records Records returned lies. A log
// keeps no offset per record (a replay of millions would pay for them):
// only an error in a record asks, and Locate reads the segments again, by
// the rules Open read them with, to answer. ok is false if there is no
// such record (the files changed since Open).
func (l *Log) Locate(i int) (loc Location, ok bool) { return locate(l.fs, l.dir, i) }

// Locate is Log.Locate for the records ReadOnly read in dir: a writer
// that appended or compacted meanwhile may make its answer wrong, or not
// ok.
func Locate(dir string, opts Options, i int) (loc Location, ok bool) {
	fs := opts.FS
	if fs == nil {
		fs = osFS{}
	}
	return locate(fs, dir, i)
}

// locate walks the segments in dir as read does: record by record up to
// the first that is not whole, a compaction's base replacing everything
// before it, a commit the segment's records end inside left out.
func locate(fs FS, dir string, i int) (Location, bool) {
	if i < 0 {
		return Location{}, false
	}
	ns, err := segmentsIn(fs, dir)
	if err != nil {
		return Location{}, false
	}
	// offs are the offsets of the records that count so far, by segment.
	type run struct {
		name string
		offs []int64
	}
	var runs []run
	for _, n := range ns {
		name := filepath.Join(dir, segName(n))
		data, err := readFile(fs, name)
		if err != nil {
			return Location{}, false
		}
		r := run{name: name}
		open := false // the batch read so far goes on
		batch := 0    // where in r.offs it began
		for off := int64(0); off < int64(len(data)); {
			_, field, end, bad := record(data, off)
			if bad != nil {
				break // the clean end, a torn tail, or what Open refused
			}
			if !open {
				batch = len(r.offs)
			}
			if field&baseFlag != 0 {
				runs, r.offs, batch = nil, r.offs[:0], 0 // a base: what came before it is replaced
			} else {
				r.offs = append(r.offs, off)
			}
			open = field&moreFlag != 0
			off = end
		}
		if open {
			r.offs = r.offs[:batch] // a commit cut short: it never happened
		}
		runs = append(runs, r)
	}
	for _, r := range runs {
		if i < len(r.offs) {
			return Location{File: r.name, Offset: r.offs[i]}, true
		}
		i -= len(r.offs)
	}
	return Location{}, false
}

// readFile reads the file name whole.
func readFile(fs FS, name string) ([]byte, error) {
	f, err := fs.OpenFile(name, os.O_RDONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return readWhole(f)
}

// readWhole reads f from its start to its end into a buffer of its size
// (io.ReadAll would grow one by doubling: for a preallocated segment,
// megabytes of zeros copied a dozen times).
func readWhole(f File) ([]byte, error) {
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil || size < 0 { // a file that cannot say its size: read it as it comes
		return io.ReadAll(f)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	buf := bytes.NewBuffer(make([]byte, 0, size+bytes.MinRead))
	_, err = buf.ReadFrom(f)
	return buf.Bytes(), err
}
