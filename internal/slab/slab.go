// Package slab is an append-only list whose elements never move: it grows
// by adding chunks (doubling, up to a bound) instead of copying, so a
// pointer to an element stays valid and a large list leaves no trail of
// outgrown arrays for the garbage collector.
package slab

const (
	firstChunk = 16
	maxChunk   = 4096
)

// List is an append-only list. The zero value is an empty list.
type List[T any] struct {
	chunks [][]T
	n      int
}

// Push appends v and returns a pointer to the stored element, valid for
// the life of the list.
func (l *List[T]) Push(v T) *T {
	if len(l.chunks) == 0 || len(l.chunks[len(l.chunks)-1]) == cap(l.chunks[len(l.chunks)-1]) {
		size := firstChunk
		if len(l.chunks) > 0 {
			size = min(2*cap(l.chunks[len(l.chunks)-1]), maxChunk)
		}
		l.chunks = append(l.chunks, make([]T, 0, size))
	}
	last := &l.chunks[len(l.chunks)-1]
	*last = append(*last, v)
	l.n++
	return &(*last)[len(*last)-1]
}

// Len returns the number of elements.
func (l *List[T]) Len() int { return l.n }

// All yields a pointer to every element, in order.
func (l *List[T]) All(yield func(*T) bool) {
	for _, c := range l.chunks {
		for i := range c {
			if !yield(&c[i]) {
				return
			}
		}
	}
}
