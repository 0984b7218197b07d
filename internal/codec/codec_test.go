package codec

import (
	"math"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestValuesRoundTrip(t *testing.T) {
	plus2 := time.FixedZone("", 2*3600)
	times := []time.Time{
		{},
		time.Date(2026, 12, 1, 12, 0, 0, 123456789, time.UTC),
		time.Date(1969, 7, 20, 20, 17, 0, 1, plus2),
		time.Unix(math.MaxInt32, 999_999_999).UTC(),
	}
	var w Writer
	w.Uint(0)
	w.Uint(math.MaxUint64)
	w.Int(math.MinInt64)
	w.Bool(true)
	w.String("")
	w.String("héllo\x00world")
	for _, tm := range times {
		w.Time(tm)
	}
	r := Reader{B: w.B}
	assert.Equal(t, uint64(0), r.Uint())
	assert.Equal(t, uint64(math.MaxUint64), r.Uint())
	assert.Equal(t, int64(math.MinInt64), r.Int())
	assert.True(t, r.Bool())
	assert.Equal(t, "", r.String())
	assert.Equal(t, "héllo\x00world", r.String())
	for _, want := range times {
		got := r.Time()
		assert.True(t, want.Equal(got), "%v != %v", want, got)
		wb, _ := want.MarshalJSON()
		gb, _ := got.MarshalJSON()
		assert.Equal(t, string(wb), string(gb), "the same RFC 3339 text, zone included")
	}
	require.NoError(t, r.Err())
	assert.Empty(t, r.B)
}

// Any input, cut anywhere or garbled, is an error: never a panic, never a
// huge allocation.
func TestBadInputIsAnErrorNeverAPanic(t *testing.T) {
	var w Writer
	w.String("a string that will be cut")
	w.Time(time.Now())
	for cut := range len(w.B) {
		r := Reader{B: w.B[:cut]}
		_ = r.String()
		_ = r.Time()
		assert.Error(t, r.Err(), "cut at %d", cut)
	}
	huge := Writer{}
	huge.Uint(math.MaxUint64) // a length no input has
	r := Reader{B: huge.B}
	assert.Equal(t, "", r.String())
	assert.ErrorIs(t, r.Err(), ErrShort)
	assert.Equal(t, uint64(0), r.Uint(), "after an error, zero values")
}

// A StrReader reads back what a Writer wrote, as a Reader does, returning
// substrings of its input; any cut of the input is an error, never a
// panic.
func TestStrReaderReadsWhatAWriterWrote(t *testing.T) {
	var w Writer
	ints := []int64{0, 1, -1, 63, -64, 1 << 40, -(1 << 62), math.MaxInt64, math.MinInt64}
	uints := []uint64{0, 1, 127, 128, 1 << 35, math.MaxUint64}
	for _, v := range ints {
		w.Int(v)
	}
	for _, v := range uints {
		w.Uint(v)
	}
	w.String("")
	w.String("héllo")
	w.Bool(true)
	w.Bool(false)
	s := string(w.B)
	r := StrReader{S: s}
	for _, v := range ints {
		assert.Equal(t, v, r.Int())
	}
	for _, v := range uints {
		assert.Equal(t, v, r.Uint())
	}
	assert.Equal(t, "", r.String())
	got := r.String()
	assert.Equal(t, "héllo", got)
	base, at := uintptr(unsafe.Pointer(unsafe.StringData(s))), uintptr(unsafe.Pointer(unsafe.StringData(got)))
	assert.True(t, at > base && at+uintptr(len(got)) <= base+uintptr(len(s)), "a substring of its input, not a copy")
	assert.True(t, r.Bool())
	assert.False(t, r.Bool())
	require.NoError(t, r.Err())
	assert.Empty(t, r.S)
	for cut := range len(s) {
		r := StrReader{S: s[:cut]}
		for range ints {
			r.Int()
		}
		for range uints {
			r.Uint()
		}
		_, _ = r.String(), r.String()
		r.Bool()
		r.Bool()
		assert.Error(t, r.Err(), "cut at %d", cut)
	}
	bad := StrReader{S: "\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f"} // over 64 bits
	bad.Uint()
	assert.Error(t, bad.Err())
}

// Word reads what String reads; with Words, a word read twice is one
// string, and a long string or one past the bound is read as String does.
func TestWordInternsShortStrings(t *testing.T) {
	var w Writer
	long := strings.Repeat("x", maxWordLen+1)
	for _, s := range []string{"openai", "openai", long, long, ""} {
		w.String(s)
	}
	r := Reader{B: w.B, Words: &Words{}}
	a, b := r.Word(), r.Word()
	assert.Equal(t, "openai", a)
	addr := func(s string) uintptr { return uintptr(unsafe.Pointer(unsafe.StringData(s))) }
	assert.Equal(t, addr(a), addr(b), "one string for the two")
	l1, l2 := r.Word(), r.Word()
	assert.Equal(t, long, l1)
	assert.NotEqual(t, addr(l1), addr(l2), "a long string is not kept")
	assert.Equal(t, "", r.Word())
	require.NoError(t, r.Err())
	plain := Reader{B: w.B}
	assert.Equal(t, "openai", plain.Word(), "no Words: a copy, as String")
	cut := Reader{B: w.B[:3], Words: &Words{}}
	cut.Word()
	assert.Error(t, cut.Err())
	full := &Words{}
	for i := range maxWords + 10 {
		var w Writer
		w.String(strconv.Itoa(i))
		(&Reader{B: w.B, Words: full}).Word()
	}
	assert.Len(t, full.m, maxWords, "bounded")
}
