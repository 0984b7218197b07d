package slots

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func release(p *Pool[int], key string) []*Waiter[int] {
	var got []*Waiter[int]
	p.Release(key, func(w *Waiter[int]) { got = append(got, w) })
	return got
}

func TestGrantThatReleasesAtOnce(t *testing.T) {
	p := New[int]()
	require.Nil(t, p.Acquire("k", 1, 0))
	p.Acquire("k", 1, 1)
	p.Acquire("k", 1, 2)
	var order []int
	var grant func(w *Waiter[int])
	grant = func(w *Waiter[int]) {
		order = append(order, w.V)
		p.Release("k", grant) // the granted run ends at once
	}
	p.Release("k", grant)
	assert.Equal(t, []int{1, 2}, order)
	assert.Empty(t, p.Stats())
}

func TestFIFOHandOver(t *testing.T) {
	p := New[int]()
	assert.Nil(t, p.Acquire("k", 2, 1))
	assert.Nil(t, p.Acquire("k", 2, 2))
	w3 := p.Acquire("k", 2, 3)
	w4 := p.Acquire("k", 2, 4)
	require.NotNil(t, w3)
	require.NotNil(t, w4)
	assert.Equal(t, 1, p.Position(w3))
	assert.Equal(t, 2, p.Position(w4))
	assert.Equal(t, []Stat{{Key: "k", Running: 2, Queued: 2, Limit: 2}}, p.Stats())

	got := release(p, "k")
	require.Len(t, got, 1)
	assert.Equal(t, 3, got[0].V, "first in, first served")
	assert.False(t, w3.Queued())
	assert.Equal(t, 1, p.Position(w4))
	got = release(p, "k")
	require.Len(t, got, 1)
	assert.Equal(t, 4, got[0].V)
	release(p, "k")
	release(p, "k")
	assert.Empty(t, p.Stats(), "an idle key is forgotten")
}

func TestNewcomerDoesNotJumpTheQueue(t *testing.T) {
	p := New[int]()
	assert.Nil(t, p.Acquire("k", 1, 1))
	w := p.Acquire("k", 1, 2)
	require.NotNil(t, w)
	// A raised limit with a waiter present: the waiter goes first.
	assert.NotNil(t, p.Acquire("k", 1, 3))
}

func TestRemoveHeadMiddleTail(t *testing.T) {
	for _, victim := range []int{0, 1, 2} {
		p := New[int]()
		require.Nil(t, p.Acquire("k", 1, -1))
		ws := []*Waiter[int]{p.Acquire("k", 1, 0), p.Acquire("k", 1, 1), p.Acquire("k", 1, 2)}
		assert.True(t, p.Remove(ws[victim]))
		assert.False(t, p.Remove(ws[victim]), "removed once")
		var order []int
		for range 3 {
			for _, w := range release(p, "k") {
				order = append(order, w.V)
			}
		}
		var want []int
		for i := range 3 {
			if i != victim {
				want = append(want, i)
			}
		}
		assert.Equal(t, want, order, "victim %d", victim)
	}
}

func TestUnlimited(t *testing.T) {
	p := New[int]()
	for i := range 100 {
		assert.Nil(t, p.Acquire("k", 0, i))
	}
	assert.Equal(t, 100, p.Stats()[0].Running)
}

func TestReleaseOfUnheldSlotPanics(t *testing.T) {
	p := New[int]()
	assert.Panics(t, func() { release(p, "nothing") })
}

func BenchmarkHandOver(b *testing.B) {
	p := New[int]()
	p.Acquire("k", 1, 0)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		p.Acquire("k", 1, i)
		p.Release("k", func(*Waiter[int]) {})
	}
}
