package callq

import (
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// rig is a queue whose goroutines are joined by wait, and whose recorded
// items are kept in order.
type rig struct {
	wg       sync.WaitGroup
	mu       sync.Mutex
	recorded []int
	batches  int
	changed  chan struct{} // closed and replaced whenever something is recorded
	refuse   bool          // spawn refuses (a closed group)
	q        *Queue[int]
}

func newRig(max int, call func(int)) *rig {
	r := &rig{changed: make(chan struct{})}
	spawn := func(f func()) bool {
		r.mu.Lock()
		refuse := r.refuse
		r.mu.Unlock()
		if refuse {
			return false
		}
		r.wg.Add(1)
		go func() { defer r.wg.Done(); f() }()
		return true
	}
	r.q = New(max, spawn, spawn, call, r.record)
	return r
}

func (r *rig) record(items []int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recorded = append(r.recorded, items...)
	r.batches++
	close(r.changed)
	r.changed = make(chan struct{})
}

// waitRecorded waits until want is recorded; the deadline only detects a
// failure.
func (r *rig) waitRecorded(t *testing.T, want int) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		r.mu.Lock()
		has := slices.Contains(r.recorded, want)
		ch := r.changed
		r.mu.Unlock()
		if has {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("item %d was never recorded", want)
		}
	}
}

func TestEveryItemIsCalledAndRecordedOnce(t *testing.T) {
	var mu sync.Mutex
	calls := map[int]int{}
	r := newRig(4, func(v int) {
		mu.Lock()
		calls[v]++
		mu.Unlock()
	})
	const n = 500
	for i := range n {
		require.True(t, r.q.Add(i))
	}
	r.wg.Wait()
	assert.Len(t, calls, n)
	for i := range n {
		assert.Equal(t, 1, calls[i], "item %d", i)
	}
	sorted := slices.Sorted(slices.Values(r.recorded))
	assert.Equal(t, n, len(sorted))
	for i, v := range sorted {
		require.Equal(t, i, v, "each item recorded exactly once")
	}
	assert.Zero(t, r.q.Workers())
}

func TestWorkersGrowToTheBoundWhileCallsHang(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan int, 100)
	r := newRig(8, func(v int) {
		entered <- v
		<-release
	})
	for i := range 20 {
		require.True(t, r.q.Add(i))
	}
	for range 8 {
		<-entered // eight calls hang at once: the set grew to its bound
	}
	assert.Equal(t, 8, r.q.Workers())
	select {
	case v := <-entered:
		t.Fatalf("a ninth call (%d) started beyond the bound", v)
	default:
	}
	close(release)
	r.wg.Wait()
	assert.Len(t, r.recorded, 20)
}

func TestAQuickCallDoesNotGrowTheSet(t *testing.T) {
	// One item at a time, each answered before the next is added: one
	// worker is all it takes.
	r := newRig(8, func(int) {})
	for i := range 50 {
		require.True(t, r.q.Add(i))
		r.waitRecorded(t, i)
		r.wg.Wait() // the worker and the recorder have left
		assert.Zero(t, r.q.Workers())
	}
}

func TestAnAnswerIsRecordedWhileOtherCallsHang(t *testing.T) {
	release := make(chan struct{})
	r := newRig(4, func(v int) {
		if v != 0 {
			<-release
		}
	})
	for i := range 10 {
		require.True(t, r.q.Add(i))
	}
	r.waitRecorded(t, 0) // not behind the hung calls
	r.mu.Lock()
	assert.Equal(t, []int{0}, r.recorded)
	r.mu.Unlock()
	close(release)
	r.wg.Wait()
	assert.Len(t, r.recorded, 10)
}

func TestTheOwnerTakesAnswersItself(t *testing.T) {
	// The owner holds the lock the recorder needs. Answers that land
	// meanwhile are the owner's to Take, except what the blocked recorder
	// took before it blocked: each item is recorded exactly once.
	var owner sync.Mutex
	exited := make(chan struct{}, 4)
	r := newRig(1, func(int) {})
	spawn := r.q.spawn
	r.q.spawn = func(f func()) bool { return spawn(func() { f(); exited <- struct{}{} }) }
	r.q.add = r.q.spawn
	r.q.record = func(items []int) {
		owner.Lock()
		defer owner.Unlock()
		r.record(items)
	}
	owner.Lock()
	for i := range 10 {
		require.True(t, r.q.Add(i))
	}
	<-exited // the worker left: every answer has landed
	taken := r.q.Take(nil)
	owner.Unlock()
	r.wg.Wait()
	assert.Empty(t, r.q.Take(nil), "nothing is left to take")
	all := append(slices.Clone(taken), r.recorded...)
	slices.Sort(all)
	assert.Equal(t, []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, all)
}

func TestARefusedSpawn(t *testing.T) {
	r := newRig(4, func(int) {})
	r.refuse = true
	assert.False(t, r.q.Add(1), "no worker runs and none can start")
	assert.Zero(t, r.q.Workers())

	// A worker that cannot start a recorder records its answer itself.
	release := make(chan struct{})
	r2 := newRig(1, func(int) { <-release })
	require.True(t, r2.q.Add(7))
	r2.mu.Lock()
	r2.refuse = true
	r2.mu.Unlock()
	close(release)
	r2.wg.Wait()
	assert.Equal(t, []int{7}, r2.recorded)
}

func TestARefusedGrowAfterTheWorkerTookEverything(t *testing.T) {
	// A worker is inside a call when Add queues more, so Add tries to
	// grow the set; before that spawn is refused, the worker takes the new
	// item, calls it, and leaves. Add must not report it unqueued.
	var wg sync.WaitGroup
	release := make(chan struct{})
	workerLeft := make(chan struct{})
	var mu sync.Mutex
	spawns, calls, recorded := 0, 0, 0
	var q *Queue[int]
	spawn := func(f func()) bool {
		mu.Lock()
		spawns++
		n := spawns
		mu.Unlock()
		switch n {
		case 1: // the worker
			wg.Add(1)
			go func() {
				defer wg.Done()
				f()
				close(workerLeft)
			}()
		case 2: // Add's grow: refused once the worker is gone
			close(release)
			<-workerLeft
			return false
		default: // recorders
			wg.Add(1)
			go func() { defer wg.Done(); f() }()
		}
		return true
	}
	inCall := make(chan struct{})
	q = New(4, spawn, spawn, func(v int) {
		mu.Lock()
		calls++
		mu.Unlock()
		if v == 1 {
			close(inCall)
			<-release
		}
	}, func(vs []int) {
		mu.Lock()
		recorded += len(vs)
		mu.Unlock()
	})
	require.True(t, q.Add(1))
	<-inCall
	assert.True(t, q.Add(2), "the worker called it: the caller must not settle it too")
	wg.Wait()
	assert.Equal(t, 2, calls)
	assert.Equal(t, 2, recorded)
	assert.Zero(t, q.Workers())
}
