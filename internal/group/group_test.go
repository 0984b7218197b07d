package group

import (
	"context"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestWaitIncludesGoroutinesStartedDuringWait(t *testing.T) {
	var g Group
	release := make(chan struct{})
	second := make(chan struct{})
	require.True(t, g.Go(func() {
		<-release
		// Started while Wait is already waiting: no Add-after-Wait problem.
		g.Go(func() { <-second })
	}))
	done := make(chan error, 1)
	go func() { done <- g.Wait(context.Background()) }()
	close(release)
	select {
	case <-done:
		t.Fatal("Wait returned while a goroutine still ran")
	default:
	}
	close(second)
	require.NoError(t, <-done)
	assert.Zero(t, g.Running())
}

func TestWaitHonoursContext(t *testing.T) {
	var g Group
	block := make(chan struct{})
	g.Go(func() { <-block })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, g.Wait(ctx), context.Canceled)
	assert.Equal(t, 1, g.Running())
	close(block)
	require.NoError(t, g.Wait(context.Background()))
}

func TestCloseRefusesNewGoroutines(t *testing.T) {
	var g Group
	g.Close()
	ran := false
	assert.False(t, g.Go(func() { ran = true }))
	require.NoError(t, g.Wait(context.Background()))
	assert.False(t, ran)
}

// safety bounds every wait on another goroutine, so a broken Group fails the
// test instead of hanging it. Nothing waits for time to pass otherwise.
const safety = 10 * time.Second

func waitIdle(t *testing.T, g *Group) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), safety)
	defer cancel()
	require.NoError(t, g.Wait(ctx))
	assert.Zero(t, g.Running())
}

// busy reports whether Wait would block: with its context already done,
// Wait returns at once, nil only when nothing is counted.
func busy(g *Group) bool {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return g.Wait(ctx) != nil
}

// goid returns the id of the calling goroutine, to tell where a job ran.
func goid() uint64 {
	var buf [64]byte
	s := string(buf[:runtime.Stack(buf[:], false)])
	s = strings.TrimPrefix(s, "goroutine ")
	id, err := strconv.ParseUint(s[:strings.IndexByte(s, ' ')], 10, 64)
	if err != nil {
		panic(err)
	}
	return id
}

type jobFunc func(w *Worker)

func (f jobFunc) Run(w *Worker) { f(w) }

func TestReservationCountsUntilReleased(t *testing.T) {
	var g Group
	require.True(t, g.Reserve())
	assert.Equal(t, 1, g.Running())
	assert.True(t, busy(&g), "Wait must wait for a reservation")

	require.True(t, g.Reserve())
	assert.Equal(t, 2, g.Running())
	g.Release()
	assert.Equal(t, 1, g.Running())
	assert.True(t, busy(&g))

	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), safety)
		defer cancel()
		done <- g.Wait(ctx)
	}()
	g.Release()
	require.NoError(t, <-done)
	assert.Zero(t, g.Running())
	assert.False(t, busy(&g))
}

func TestReservationCountsUntilStartedJobFinishes(t *testing.T) {
	var g Group
	require.True(t, g.Reserve())
	// Between Reserve and Start: counted already.
	assert.Equal(t, 1, g.Running())
	assert.True(t, busy(&g))

	started := make(chan struct{})
	release := make(chan struct{})
	startReturned := make(chan struct{})
	var ranAlongside bool
	g.Start(nil, jobFunc(func(*Worker) {
		close(started)
		select { // bounded, so a Start that runs the job in place fails, not hangs
		case <-startReturned:
			ranAlongside = true
			<-release
		case <-time.After(safety):
		}
	}))
	close(startReturned)
	<-started
	assert.Equal(t, 1, g.Running(), "Start must not count the reservation twice")
	assert.True(t, busy(&g), "Wait must wait for the started job")
	close(release)
	waitIdle(t, &g)
	assert.True(t, ranAlongside, "Start(nil, job) ran the job before returning")
}

func TestReserveAfterClose(t *testing.T) {
	var g Group
	require.True(t, g.Reserve()) // reserved before Close: still counted
	g.Close()
	assert.False(t, g.Reserve())
	assert.Equal(t, 1, g.Running(), "a refused Reserve counts nothing")
	g.Release()
	assert.Zero(t, g.Running())
	assert.False(t, g.Reserve())
	assert.Zero(t, g.Running())
	assert.False(t, busy(&g))
}

func TestStartWithoutWorkerRunsOnNewGoroutine(t *testing.T) {
	var g Group
	caller := goid()
	require.True(t, g.Reserve())
	release := make(chan struct{})
	ran := make(chan uint64, 1)
	var gotW *Worker
	g.Start(nil, jobFunc(func(w *Worker) {
		gotW = w
		ran <- goid()
		select { // Start returns while the job still runs
		case <-release:
		case <-time.After(safety):
		}
	}))
	var id uint64
	select {
	case id = <-ran:
	case <-time.After(safety):
		t.Fatal("job did not run")
	}
	assert.NotEqual(t, caller, id, "job ran on the caller's goroutine")
	close(release)
	waitIdle(t, &g)
	assert.NotNil(t, gotW, "a job is given the worker running it")
}

func TestStartOnFreeWorkerRunsAfterCurrentJob(t *testing.T) {
	var g Group
	type result struct {
		firstID, secondID       uint64
		firstW, secondW         *Worker
		runningReserved         int // after the continuation's Reserve
		runningHanded           int // after Start handed it to the worker
		flagSeen                bool
		secondRanBeforeFirstEnd bool
	}
	var r result
	finished := make(chan struct{})
	firstReturned := false // touched by both jobs: -race reports any overlap
	second := jobFunc(func(w *Worker) {
		r.secondID, r.secondW = goid(), w
		r.flagSeen = firstReturned
		close(finished)
	})
	first := jobFunc(func(w *Worker) {
		r.firstID, r.firstW = goid(), w
		if !g.Reserve() {
			panic("Reserve refused")
		}
		r.runningReserved = g.Running()
		g.Start(w, second)
		r.runningHanded = g.Running()
		select {
		case <-finished:
			r.secondRanBeforeFirstEnd = true
		default:
		}
		firstReturned = true
	})
	require.True(t, g.Reserve())
	g.Start(nil, first)
	select {
	case <-finished:
	case <-time.After(safety):
		t.Fatal("continuation did not run")
	}
	waitIdle(t, &g)

	assert.True(t, r.flagSeen, "continuation ran before the current job returned")
	assert.False(t, r.secondRanBeforeFirstEnd)
	assert.Equal(t, r.firstID, r.secondID, "continuation ran on another goroutine")
	assert.Same(t, r.firstW, r.secondW, "continuation got another worker")
	assert.Equal(t, 2, r.runningReserved)
	assert.Equal(t, 1, r.runningHanded, "the worker itself counts for its continuation")
}

func TestStartTakesOneContinuationPerWorker(t *testing.T) {
	var g Group
	var (
		firstID, secondID, thirdID uint64
		firstW, thirdW             *Worker
		thirdRanAlongside          bool
		secondSawFirstReturned     bool
	)
	thirdRan := make(chan struct{})
	secondRan := make(chan struct{})
	firstReturned := false // first and second only: -race reports any overlap
	second := jobFunc(func(*Worker) {
		secondID = goid()
		secondSawFirstReturned = firstReturned
		close(secondRan)
	})
	third := jobFunc(func(w *Worker) {
		thirdID, thirdW = goid(), w
		close(thirdRan)
	})
	first := jobFunc(func(w *Worker) {
		firstID, firstW = goid(), w
		if ok1, ok2 := g.Reserve(), g.Reserve(); !ok1 || !ok2 {
			panic("Reserve refused")
		}
		g.Start(w, second) // w is free: taken as its continuation
		g.Start(w, third)  // w.next is set: must run elsewhere, now
		// If third were queued behind first, this would wait for nothing.
		select {
		case <-thirdRan:
			thirdRanAlongside = true
		case <-time.After(safety):
		}
		firstReturned = true
	})
	require.True(t, g.Reserve())
	g.Start(nil, first)
	for _, ch := range []chan struct{}{secondRan, thirdRan} {
		select {
		case <-ch:
		case <-time.After(safety):
			t.Fatal("a started job did not run")
		}
	}
	waitIdle(t, &g)

	assert.True(t, thirdRanAlongside, "second Start with a busy worker did not run on a new goroutine")
	assert.NotEqual(t, firstID, thirdID)
	assert.NotSame(t, firstW, thirdW)
	assert.Equal(t, firstID, secondID, "the continuation ran on another goroutine")
	assert.True(t, secondSawFirstReturned, "the continuation ran before the current job returned")
}

// chain starts itself again on its worker until left runs out.
type chain struct {
	g                 *Group
	left, runs        int
	id                uint64
	otherGoroutine    bool
	depth, worstDepth int
	maxRunning        int
}

func (c *chain) Run(w *Worker) {
	var pcs [256]uintptr
	depth := runtime.Callers(0, pcs[:])
	id := goid()
	if c.runs == 0 {
		c.id, c.depth = id, depth
	}
	c.runs++
	c.otherGoroutine = c.otherGoroutine || id != c.id
	c.worstDepth = max(c.worstDepth, depth)
	if c.left == 0 {
		return
	}
	c.left--
	if !c.g.Reserve() {
		panic("Reserve refused")
	}
	c.maxRunning = max(c.maxRunning, c.g.Running())
	c.g.Start(w, c)
}

func TestLongChainRunsWithoutRecursion(t *testing.T) {
	const n = 10000
	var g Group
	c := &chain{g: &g, left: n}
	require.True(t, g.Reserve())
	g.Start(nil, c)
	waitIdle(t, &g) // orders c's writes before the reads below

	assert.Equal(t, n+1, c.runs)
	assert.Zero(t, c.left)
	assert.False(t, c.otherGoroutine, "a continuation ran on another goroutine")
	assert.Equal(t, c.depth, c.worstDepth, "the stack grew along the chain")
	assert.Equal(t, 2, c.maxRunning, "counts leaked along the chain")
}
