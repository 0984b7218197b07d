package feed

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var errLag = errors.New("lagged")

func drain[T any](c <-chan T) []T {
	var out []T
	for v := range c {
		out = append(out, v)
	}
	return out
}

func TestEverySubscriberGetsEveryValueInOrder(t *testing.T) {
	f := New[int](errLag)
	a, b := f.Add(8), f.Add(8)
	for i := range 5 {
		f.Publish(i)
	}
	f.EndAll(nil)
	assert.Equal(t, []int{0, 1, 2, 3, 4}, drain(a.C()))
	assert.Equal(t, []int{0, 1, 2, 3, 4}, drain(b.C()))
	assert.NoError(t, a.Err())
	assert.Zero(t, f.Len())
}

func TestAFullBufferEndsOnlyThatSubscriberWithTheLagError(t *testing.T) {
	f := New[int](errLag)
	slow, fast := f.Add(2), f.Add(8)
	for i := range 3 { // the third overflows slow's buffer of 2
		f.Publish(i)
	}
	assert.Equal(t, []int{0, 1}, drain(slow.C()), "what was buffered is kept, then the channel closes")
	assert.ErrorIs(t, slow.Err(), errLag)
	select {
	case <-slow.Done():
	default:
		t.Fatal("Done not closed")
	}
	require.Equal(t, 1, f.Len())
	f.Publish(3)
	f.End(fast, nil)
	assert.Equal(t, []int{0, 1, 2, 3}, drain(fast.C()))
}

func TestEndIsOnceAndKeepsTheFirstError(t *testing.T) {
	f := New[int](errLag)
	s := f.Add(0) // a buffer below 1 is 1
	f.Publish(1)
	first := errors.New("first")
	f.End(s, first)
	f.End(s, errors.New("second")) // no double close, no overwrite
	f.EndAll(errors.New("third"))
	assert.Equal(t, []int{1}, drain(s.C()))
	assert.Equal(t, first, s.Err())
}
