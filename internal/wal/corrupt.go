package wal

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// Corruption is not a torn write. A crash can damage only the unit that
// was being written, and only by losing some of its pages (they read as
// the zeros that were there before, see "Preallocation"); nothing after
// that unit was written. So a damaged record followed by a complete,
// checksummed record is a torn tail only when all of these hold; else it
// is corruption, and Open refuses with a *Corrupt:
//
//   - the segment is the last one, preallocated (it ends in a zero byte),
//     and the damaged record is no piece of a record longer than a unit
//     (a long record has its last unit to itself, so nothing complete can
//     follow its torn piece);
//   - every complete record found after it ends within a unit (W) of
//     where the damaged record begins, and nothing but zeros lies past
//     that unit;
//   - a lost sector explains the damage: a whole 512-byte sector between
//     the damaged record's start and the first complete record after it
//     reads as zeros; or the sector holding the record's start reads as
//     zeros from that start on, over more of its header than a real
//     header can hold as zeros (5 bytes or more: a header's length field
//     and its checksum are never all zero), or over bytes of its length
//     field that, put back, make its header's checksum hold.
//
// A flipped byte, a sector written with the wrong bytes, anything but a
// run of zeros, fails the last test; a damaged record that nothing
// complete follows is judged by the rules of the package doc ("Recovery").
// Records after damage are found by scanning every offset for a header
// whose checksum holds and a payload whose checksum holds; a record with
// a good header is skipped whole.

// sectorBytes is the smallest unit a disk writes whole: a crash loses a
// sector (or a page, of several) or keeps it, never part of one.
const sectorBytes = 512

// Corrupt is the error Open and ReadOnly return for damage no crash
// explains. It says where, and what a repair (Options.Repair) would drop.
type Corrupt struct {
	File   string // the segment holding the damage
	Offset int64  // where the damaged record begins
	Why    string // what is wrong with it
	// Cut is where a repair truncates File: where the commit (batch) the
	// damaged record belongs to begins, so every complete commit before
	// it is kept whole.
	Cut int64
	// Dropped are the complete records a repair drops, in order: those of
	// File from Cut on, then those of every later segment. (A compaction
	// base is not a record of the caller's and is not among them.)
	Dropped [][]byte
	// Later are the segments after File, which a repair sets aside whole.
	Later []string
	// Copy is the directory a repair keeps what it cuts in: File's bytes
	// from Cut on, and Later. Open sets it before calling Options.Repair.
	Copy string
}

func (c *Corrupt) Error() string {
	return fmt.Sprintf("journal: %s at offset %d: %s, with complete records after it: refusing to start (the journal is corrupt; a repair cutting at offset %d drops %d complete records)", c.File, c.Offset, c.Why, c.Cut, len(c.Dropped))
}

// found is a complete record a scan found past damage.
type found struct {
	off, end int64
	payload  []byte
	base     bool
}

// completeFrom finds every complete, checksummed record in data from
// offset from on: at each offset a header whose checksum holds and a
// payload whose checksum holds; a record found is skipped whole.
func completeFrom(data []byte, from int64) []found {
	var out []found
	size := int64(len(data))
	for p := from; p+headerSize <= size; {
		// Every header holds a non-zero byte among its first 8 (a zero
		// length field's checksum is not zero): skip runs of zeros.
		if data[p] == 0 {
			nz := p + 1
			for nz < size && data[nz] == 0 {
				nz++
			}
			if nz == size {
				break
			}
			if nz-7 > p {
				p = nz - 7 // a header may begin with zeros (a length of 256)
				continue
			}
		}
		payload, field, end, bad := record(data, p)
		if bad != nil {
			p++
			continue
		}
		out = append(out, found{off: p, end: end, payload: payload, base: field&baseFlag != 0})
		p = end
	}
	return out
}

// scanFrom is where records past the damaged record at off may begin:
// past its end when its header's checksum holds (its length is true), else
// the next byte.
func scanFrom(off int64, bad *damage) int64 {
	if bad.span > 0 {
		return off + bad.span
	}
	return off + 1
}

// tornUnit reports whether the damaged record at off, in the last segment,
// with the complete records follow after it (at least one), is the unit a
// crash interrupted, by the rules above.
func tornUnit(data []byte, off int64, bad *damage, follow []found) bool {
	size := int64(len(data))
	if bad.never || bad.span > unitBytes || data[size-1] != 0 {
		return false
	}
	limit := off + unitBytes
	if follow[len(follow)-1].end > limit || (limit < size && !allZero(data[limit:])) {
		return false
	}
	first := follow[0].off
	// A lost sector may hold the first bytes of the first complete record
	// after it, when they are zeros anyway (a length of 256).
	for s := off / sectorBytes * sectorBytes; s < first; s += sectorBytes {
		lo := max(s, off)
		if !allZero(data[lo:min(s+sectorBytes, size)]) {
			continue
		}
		if s >= off {
			return true // a whole sector of zeros
		}
		// The sector holds the record's start, zeros from there on: k
		// bytes of its header.
		k := s + sectorBytes - off
		if bad.span > 0 {
			continue // a good header: its zeros are its own, not the damage
		}
		if k >= 5 || lengthLost(data, off, k, first) {
			return true
		}
	}
	return false
}

// lengthLost reports whether the first k (≤ 4) bytes of the header at off
// — zeros, its checksum failing — could have been lost: some length
// field, with those bytes put back, makes the header's checksum hold, for
// a record that ends by first (where the next complete record begins).
func lengthLost(data []byte, off, k, first int64) bool {
	hdr := data[off : off+headerSize]
	want := binary.LittleEndian.Uint32(hdr[4:])
	var field [4]byte
	for _, flag := range []uint32{0, moreFlag} {
		for n := int64(0); off+headerSize+n <= first && n <= MaxRecord; n++ {
			binary.LittleEndian.PutUint32(field[:], uint32(n)|flag)
			if string(field[k:]) != string(hdr[k:4]) {
				continue
			}
			if crc32.Checksum(field[:], castagnoli) == want {
				return true
			}
		}
	}
	return false
}

// corruptAt is the *Corrupt for the damaged record at off in segment name:
// the commit it cuts begins at cut, at index idx of recs (the segment's
// records read so far), and follow are the complete records after it.
func corruptAt(name string, off int64, why string, cut int64, recs [][]byte, idx int, follow []found) *Corrupt {
	c := &Corrupt{File: name, Offset: off, Why: why, Cut: cut}
	for _, p := range recs[idx:] {
		if p != nil {
			c.Dropped = append(c.Dropped, p)
		}
	}
	for _, f := range follow {
		if !f.base {
			c.Dropped = append(c.Dropped, f.payload)
		}
	}
	return c
}

// laterDamage adds to c what the segments after its own hold: every
// complete record in them is dropped with the cut.
func (l *Log) laterDamage(c *Corrupt, later []int) error {
	for _, m := range later {
		name := filepath.Join(l.dir, segName(m))
		data, err := readFile(l.fs, name)
		if err != nil {
			return fmt.Errorf("journal: reading %s: %w", name, err)
		}
		c.Later = append(c.Later, name)
		for _, f := range completeFrom(data, 0) {
			if !f.base {
				c.Dropped = append(c.Dropped, f.payload)
			}
		}
	}
	return nil
}

// startsBase reports whether segment n begins with a compaction's base:
// a finished compaction, which replaces every segment before it.
func (l *Log) startsBase(n int) bool {
	data, err := readFile(l.fs, filepath.Join(l.dir, segName(n)))
	if err != nil {
		return false
	}
	_, field, _, bad := record(data, 0)
	return bad == nil && field&baseFlag != 0
}

// repair cuts the journal at c, after Options.Repair agreed: it keeps
// File's bytes from Cut on, and every later segment, in c.Copy (made
// durable first), then truncates File at Cut and makes that durable. A
// crash at any point leaves a journal that reads as before the repair or
// as after it, or whose damage a repair finds again: the later segments
// are set aside (last first) before the cut, so no cut segment is ever
// followed by the records it was cut from.
func (l *Log) repair(c *Corrupt) error {
	fail := func(err error) error { return fmt.Errorf("journal: repairing %s: %w", c.File, err) }
	if err := l.fs.MkdirAll(c.Copy, 0o755); err != nil {
		return fail(err)
	}
	data, err := readFile(l.fs, c.File)
	if err != nil {
		return fail(err)
	}
	keep := filepath.Join(c.Copy, filepath.Base(c.File)+".from-"+strconv.FormatInt(c.Cut, 10))
	f, err := l.fs.OpenFile(keep, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return fail(err)
	}
	_, err = f.Write(data[c.Cut:])
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fail(err)
	}
	for i := len(c.Later) - 1; i >= 0; i-- {
		if err := l.fs.Rename(c.Later[i], filepath.Join(c.Copy, filepath.Base(c.Later[i]))); err != nil {
			return fail(err)
		}
	}
	if err := l.fs.SyncDir(c.Copy); err != nil {
		return fail(err)
	}
	if err := l.fs.SyncDir(l.dir); err != nil {
		return fail(err)
	}
	seg, err := l.fs.OpenFile(c.File, os.O_RDWR, 0)
	if err != nil {
		return fail(err)
	}
	err = seg.Truncate(c.Cut)
	if err == nil {
		err = syncData(seg)
	}
	if cerr := seg.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fail(err)
	}
	return nil
}

// copyDir names the directory a repair of dir keeps what it cuts in: new,
// named for the time (cut-<UTC time>, a number after it if taken).
func copyDir(fs FS, dir string) string {
	base := "cut-" + time.Now().UTC().Format("20060102T150405Z")
	taken := map[string]bool{}
	if ents, err := fs.ReadDir(dir); err == nil {
		for _, e := range ents {
			taken[e.Name()] = true
		}
	}
	name := base
	for i := 2; taken[name]; i++ {
		name = base + "-" + strconv.Itoa(i)
	}
	return filepath.Join(dir, name)
}
