package slab

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestPointersStayValidAsTheListGrows(t *testing.T) {
	var l List[int]
	const n = 3*maxChunk + 7 // several full chunks and a partial one
	ptrs := make([]*int, 0, n)
	for i := range n {
		ptrs = append(ptrs, l.Push(i))
	}
	require.Equal(t, n, l.Len())
	for i, p := range ptrs {
		require.Equal(t, i, *p, "element %d moved or was overwritten", i)
	}
	*ptrs[5] = -5 // a write through a pointer is a write to the list
	i := 0
	for p := range l.All {
		want := i
		if i == 5 {
			want = -5
		}
		require.Equal(t, want, *p, "All yields in push order")
		i++
	}
	assert.Equal(t, n, i)
}

func TestChunksGrowByDoublingUpToTheBound(t *testing.T) {
	var l List[byte]
	for range 2*maxChunk + firstChunk {
		l.Push(0)
	}
	var caps []int
	for _, c := range l.chunks {
		caps = append(caps, cap(c))
	}
	want := []int{}
	for size, total := firstChunk, 0; total < 2*maxChunk+firstChunk; size = min(2*size, maxChunk) {
		want = append(want, size)
		total += size
	}
	assert.Equal(t, want, caps)
}

func TestZeroListIsEmptyAndAllStopsEarly(t *testing.T) {
	var l List[string]
	assert.Zero(t, l.Len())
	for range l.All {
		t.Fatal("an empty list yields nothing")
	}
	l.Push("a")
	l.Push("b")
	var got []string
	for p := range l.All {
		got = append(got, *p)
		break
	}
	assert.Equal(t, []string{"a"}, got)
}
