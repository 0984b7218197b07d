// Package codec is the compact binary encoding of bgtask's ledger records:
// uvarints, length-prefixed strings and times, written by a Writer and read
// back by a Reader that never panics on bad input (it remembers the first
// error and returns zero values from then on).
package codec

import (
	"encoding/binary"
	"errors"
	"time"
)

// ErrShort: the input ended inside a value, or a length was impossible.
var ErrShort = errors.New("codec: record cut short or malformed")

// Writer appends values to a buffer.
type Writer struct{ B []byte }

func (w *Writer) Uint(v uint64) { w.B = binary.AppendUvarint(w.B, v) }
func (w *Writer) Int(v int64)   { w.B = binary.AppendVarint(w.B, v) }

func (w *Writer) Bool(v bool) {
	if v {
		w.B = append(w.B, 1)
	} else {
		w.B = append(w.B, 0)
	}
}

func (w *Writer) String(s string) {
	w.Uint(uint64(len(s)))
	w.B = append(w.B, s...)
}

// Time writes t to the nanosecond with its zone offset (not its monotonic
// reading).
func (w *Writer) Time(t time.Time) {
	if t.IsZero() {
		w.Bool(false)
		return
	}
	w.Bool(true)
	_, off := t.Zone()
	w.Int(t.Unix())
	w.Uint(uint64(t.Nanosecond()))
	w.Int(int64(off))
}

// Reader reads values back; after the first error every read returns a
// zero value, and Err reports it.
type Reader struct {
	B []byte
	// Words, if set, is where Word keeps the strings it read.
	Words *Words
	err   error
}

// Words interns the short strings Reader.Word reads (at most maxWords of
// them), so that the many copies a replay reads of a model's name or a
// status share one string.
type Words struct{ m map[string]string }

const (
	maxWords   = 4096
	maxWordLen = 64
)

// Word reads a string as String does, the same as the last one of its
// bytes Words kept, if any.
func (r *Reader) Word() string {
	n := r.Uint()
	if r.err != nil || n > uint64(len(r.B)) {
		r.fail()
		return ""
	}
	b := r.B[:n]
	r.B = r.B[n:]
	w := r.Words
	if w == nil || n > maxWordLen {
		return string(b)
	}
	if s, ok := w.m[string(b)]; ok {
		return s
	}
	s := string(b)
	if w.m == nil {
		w.m = make(map[string]string)
	}
	if len(w.m) < maxWords {
		w.m[s] = s
	}
	return s
}

func (r *Reader) fail() { r.err, r.B = ErrShort, nil }

// Err is the first error met, or nil.
func (r *Reader) Err() error { return r.err }

func (r *Reader) Uint() uint64 {
	v, n := binary.Uvarint(r.B)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.B = r.B[n:]
	return v
}

func (r *Reader) Int() int64 {
	v, n := binary.Varint(r.B)
	if n <= 0 {
		r.fail()
		return 0
	}
	r.B = r.B[n:]
	return v
}

func (r *Reader) Bool() bool {
	if len(r.B) == 0 {
		r.fail()
		return false
	}
	v := r.B[0]
	r.B = r.B[1:]
	return v != 0
}

func (r *Reader) String() string {
	n := r.Uint()
	if r.err != nil || n > uint64(len(r.B)) {
		r.fail()
		return ""
	}
	s := string(r.B[:n])
	r.B = r.B[n:]
	return s
}

// Time reads a time written by Writer.Time: UTC for a zero offset, the
// local zone when its offset is local's at that instant, else a fixed
// zone (as parsing the time's RFC 3339 text would give).
func (r *Reader) Time() time.Time {
	if !r.Bool() {
		return time.Time{}
	}
	sec, nsec, off := r.Int(), r.Uint(), r.Int()
	if r.err != nil || nsec >= 1e9 {
		r.fail()
		return time.Time{}
	}
	t := time.Unix(sec, int64(nsec))
	switch {
	case off == 0:
		return t.UTC()
	case func() bool { _, lo := t.Zone(); return int64(lo) == off }():
		return t // time.Unix gives the local zone
	}
	return t.In(time.FixedZone("", int(off)))
}

// StrReader reads what a Writer wrote from a string. The strings it
// returns are substrings of S, so reading allocates nothing and they live
// as long as S does. Like Reader it never panics on bad input: after the
// first error every read returns a zero value, and Err reports it.
type StrReader struct {
	S   string
	err error
}

func (r *StrReader) fail() { r.err, r.S = ErrShort, "" }

// Err is the first error met, or nil.
func (r *StrReader) Err() error { return r.err }

func (r *StrReader) Uint() uint64 {
	var v uint64
	for i := 0; i < len(r.S) && i < binary.MaxVarintLen64; i++ {
		c := r.S[i]
		if c < 0x80 {
			if i == binary.MaxVarintLen64-1 && c > 1 {
				break // overflows 64 bits
			}
			r.S = r.S[i+1:]
			return v | uint64(c)<<(7*i)
		}
		v |= uint64(c&0x7f) << (7 * i)
	}
	r.fail()
	return 0
}

func (r *StrReader) Int() int64 {
	u := r.Uint()
	v := int64(u >> 1)
	if u&1 != 0 {
		v = ^v
	}
	return v
}

func (r *StrReader) Bool() bool {
	if len(r.S) == 0 {
		r.fail()
		return false
	}
	v := r.S[0]
	r.S = r.S[1:]
	return v != 0
}

func (r *StrReader) String() string {
	n := r.Uint()
	if r.err != nil || n > uint64(len(r.S)) {
		r.fail()
		return ""
	}
	s := r.S[:n]
	r.S = r.S[n:]
	return s
}
