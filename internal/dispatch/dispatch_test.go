package dispatch

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/bgtask/bgtask/internal/group"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestLanesDeliverInOrderPerKeyOneAtATime(t *testing.T) {
	var g group.Group
	var mu sync.Mutex
	got := map[string][]int{}
	busy := map[string]bool{}
	var overlap bool
	l := New(g.Go, func(key string, item int) {
		mu.Lock()
		if busy[key] {
			overlap = true
		}
		busy[key] = true
		mu.Unlock()
		mu.Lock()
		got[key] = append(got[key], item)
		busy[key] = false
		mu.Unlock()
	})
	for i := range 200 {
		l.Push(fmt.Sprintf("k%d", i%3), i)
	}
	require.NoError(t, g.Wait(context.Background()))
	assert.False(t, overlap, "two deliveries for one key overlapped")
	for k := range 3 {
		key := fmt.Sprintf("k%d", k)
		var want []int
		for i := k; i < 200; i += 3 {
			want = append(want, i)
		}
		assert.Equal(t, want, got[key])
	}
	assert.Zero(t, l.Pending())
}

func TestSlowKeyDoesNotBlockOthers(t *testing.T) {
	var g group.Group
	block := make(chan struct{})
	taken := make(chan struct{})
	fast := make(chan int, 1)
	l := New(g.Go, func(key string, item int) {
		if key == "slow" {
			if item == 1 {
				close(taken)
			}
			<-block
			return
		}
		fast <- item
	})
	l.Push("slow", 1)
	<-taken
	l.Push("fast", 2)
	assert.Equal(t, 2, <-fast)
	assert.Equal(t, 0, l.Pending(), "the slow item is being delivered, not pending")
	l.Push("slow", 3)
	assert.Equal(t, 1, l.Pending())
	close(block)
	require.NoError(t, g.Wait(context.Background()))
}

func TestPushAfterCloseKeepsItemsPending(t *testing.T) {
	var g group.Group
	g.Close()
	l := New(g.Go, func(string, int) { t.Fatal("delivered after close") })
	l.Push("k", 1)
	l.Push("k", 2)
	assert.Equal(t, 2, l.Pending())
}

func TestAFullLaneGivesUpItsOldestWaitingItem(t *testing.T) {
	var g group.Group
	block := make(chan struct{})
	entered := make(chan struct{})
	var mu sync.Mutex
	var got []int
	l := New(g.Go, func(_ string, item int) {
		if item == 0 {
			close(entered)
			<-block // the worker is stuck on the first item
		}
		mu.Lock()
		got = append(got, item)
		mu.Unlock()
	})
	l.SetLimit(2, nil)
	var evicted []int
	_, _, ok := l.Push("k", 0)
	require.True(t, ok)
	<-entered
	for i := 1; i < 5; i++ {
		old, ev, ok := l.Push("k", i)
		require.True(t, ok)
		if ev {
			evicted = append(evicted, old)
		}
	}
	// 0 is being delivered; 1..4 came while at most two may wait.
	assert.Equal(t, []int{1, 2}, evicted, "the oldest waiting items make room")
	assert.Equal(t, 2, l.Pending())
	_, ev, _ := l.Push("other", 9)
	assert.False(t, ev, "the bound is per lane")
	close(block)
	require.NoError(t, g.Wait(context.Background()))
	mu.Lock()
	defer mu.Unlock()
	assert.ElementsMatch(t, []int{0, 3, 4, 9}, got)
}

func TestAFullLaneGivesUpTheItemItsVictimPicks(t *testing.T) {
	var g group.Group
	block := make(chan struct{})
	entered := make(chan struct{})
	l := New(g.Go, func(_ string, item int) {
		if item == 0 {
			close(entered)
			<-block
		}
	})
	l.SetLimit(3, func(items []int) int { // the first odd item, else the oldest
		for i, v := range items {
			if v%2 == 1 {
				return i
			}
		}
		return 0
	})
	l.Push("k", 0)
	<-entered
	var evicted []int
	for _, v := range []int{2, 3, 4, 6, 8} {
		if old, ev, _ := l.Push("k", v); ev {
			evicted = append(evicted, old)
		}
	}
	assert.Equal(t, []int{3, 2}, evicted, "the odd one first, then the oldest")
	close(block)
	require.NoError(t, g.Wait(context.Background()))
}
