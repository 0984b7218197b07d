package pgledger

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stepped is a batch statement a test steps through: each run is
// announced on ran with its calls, and waits for its answer on release.
type stepped struct {
	ran     chan []int
	release chan error
	mu      sync.Mutex
	dropped []string
}

func newStepped() *stepped {
	return &stepped{ran: make(chan []int), release: make(chan error)}
}

func (s *stepped) run(ctx context.Context, qs []int) ([]string, error) {
	s.ran <- qs
	select {
	case err := <-s.release:
		if err != nil {
			return nil, err
		}
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	out := make([]string, len(qs))
	for i, q := range qs {
		out[i] = fmt.Sprint("answer-", q)
	}
	return out, nil
}

func (s *stepped) drop(_ context.Context, q int, a string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.dropped = append(s.dropped, fmt.Sprint(q, "=", a))
}

// call is one caller of a batch, on a goroutine of its own.
type call struct {
	a    string
	err  error
	done chan struct{}
}

// answers waits for c's answer and checks it is want.
func (c *call) answers(t *testing.T, want string) {
	t.Helper()
	<-c.done
	require.NoError(t, c.err)
	assert.Equal(t, want, c.a)
}

func callOf(ctx context.Context, b *batch[int, string], q int) *call {
	c := &call{done: make(chan struct{})}
	go func() { defer close(c.done); c.a, c.err = b.do(ctx, q) }()
	return c
}

// The calls that come while a statement is in flight go together in the
// next, and each gets its own answer.
func TestBatchSendsTheCallsThatWaitedTogether(t *testing.T) {
	s := newStepped()
	b, q := testBatch(s)
	defer b.close()
	first := callOf(context.Background(), b, 1)
	require.Equal(t, []int{1}, <-s.ran)
	// While the first is in flight, three more come.
	var rest []*call
	for k := 2; k <= 4; k++ {
		rest = append(rest, callOf(context.Background(), b, k))
		waitQueued(t, b, q, k-1)
	}
	s.release <- nil
	<-first.done
	assert.Equal(t, "answer-1", first.a)
	assert.Equal(t, []int{2, 3, 4}, <-s.ran, "the three that waited, in one statement")
	s.release <- nil
	for i, c := range rest {
		c.answers(t, fmt.Sprint("answer-", i+2))
	}
}

// testBatch is a batch of s's whose callers tell q once they are queued.
func testBatch(s *stepped) (*batch[int, string], chan struct{}) {
	b := newBatch(s.run, s.drop)
	q := make(chan struct{}, 64)
	b.enqueued = func() { q <- struct{}{} }
	return b, q
}

// waitQueued waits until n calls are queued behind the statement in
// flight.
func waitQueued(t *testing.T, b *batch[int, string], q chan struct{}, n int) {
	t.Helper()
	for {
		b.mu.Lock()
		got := len(b.queue)
		b.mu.Unlock()
		if got >= n {
			return
		}
		<-q
	}
}

// An error of the statement is every call's of it.
func TestBatchGivesItsErrorToEveryCall(t *testing.T) {
	s := newStepped()
	b, q := testBatch(s)
	defer b.close()
	first := callOf(context.Background(), b, 1)
	<-s.ran
	second, third := callOf(context.Background(), b, 2), callOf(context.Background(), b, 3)
	waitQueued(t, b, q, 2)
	s.release <- nil
	<-first.done
	<-s.ran
	boom := errors.New("boom")
	s.release <- boom
	for _, c := range []*call{second, third} {
		<-c.done
		assert.ErrorIs(t, c.err, boom)
	}
}

// A caller whose context ends returns at once. If its call was not sent
// yet, it is not sent; if it was, what it did is undone (drop), and the
// others in its statement get their answers.
func TestBatchCallerThatLeaves(t *testing.T) {
	s := newStepped()
	b, q := testBatch(s)
	defer b.close()
	first := callOf(context.Background(), b, 1)
	<-s.ran
	gone, leave := context.WithCancel(context.Background())
	unsent := callOf(gone, b, 2)
	waitQueued(t, b, q, 1)
	kept := callOf(context.Background(), b, 3)
	waitQueued(t, b, q, 2)
	leave()
	<-unsent.done
	assert.ErrorIs(t, unsent.err, context.Canceled, "it returns when its context ends, with the statement before still in flight")
	s.release <- nil
	<-first.done
	assert.Equal(t, []int{3}, <-s.ran, "a call whose caller left before it was sent is not sent")

	// Sent, then left while another caller of its statement waits: undone
	// once the answer comes.
	gone2, leave2 := context.WithCancel(context.Background())
	sent := callOf(gone2, b, 4)
	waitQueued(t, b, q, 1)
	stays := callOf(context.Background(), b, 5)
	waitQueued(t, b, q, 2)
	s.release <- nil
	<-kept.done
	assert.Equal(t, "answer-3", kept.a)
	assert.Equal(t, []int{4, 5}, <-s.ran)
	leave2()
	<-sent.done
	assert.ErrorIs(t, sent.err, context.Canceled)
	s.release <- nil
	<-stays.done
	assert.Equal(t, "answer-5", stays.a)
	b.close() // joins the sender: the drop has run
	s.mu.Lock()
	defer s.mu.Unlock()
	assert.Equal(t, []string{"4=answer-4"}, s.dropped)
}

// close cancels the statement in flight (its callers get the error), and a
// call after it is sent alone, under its caller's context.
func TestBatchClose(t *testing.T) {
	s := newStepped()
	b, _ := testBatch(s)
	inflight := callOf(context.Background(), b, 1)
	<-s.ran
	b.close()
	<-inflight.done
	assert.ErrorIs(t, inflight.err, context.Canceled)

	late := callOf(context.Background(), b, 2)
	assert.Equal(t, []int{2}, <-s.ran)
	s.release <- nil
	late.answers(t, "answer-2")
}

// The fence checks of many launches, and of many starts, in one statement
// each: a launch (a start) inside the branch of an open closure is
// refused with the closure's id, the others beside it go on; a launch let
// through is in flight (bgtask_launching) for a closure to wait for.
func TestFenceChecksInOneStatement(t *testing.T) {
	f := newFixture(t)
	f.open("w1", Options{}) // the closure's member holds its lease: the fence is up
	var id int64
	require.NoError(t, f.pool.QueryRow(ctx(t), `INSERT INTO bgtask_closures (ledger, root_session, task_id, member)
VALUES ($1, 'root', 't-root', 'w1') RETURNING id`, f.ledger).Scan(&id))
	admit := func(task, parent []string) []*int64 {
		t.Helper()
		member := make([]string, len(task))
		for i := range member {
			member[i] = "w1"
		}
		var out []*int64
		require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT bgtask_admit_all($1, $2, $3, $4, '10 seconds')`, f.ledger, task, parent, member).Scan(&out))
		return out
	}
	got := admit([]string{"in", "out", "in-too"}, []string{"root", "elsewhere", "root"})
	require.Len(t, got, 3)
	require.NotNil(t, got[0])
	assert.Equal(t, id, *got[0])
	assert.Nil(t, got[1])
	require.NotNil(t, got[2])
	assert.Equal(t, 1, f.count("bgtask_launching", ""), "only the launch let through is in flight")
	assert.Equal(t, 1, f.count("bgtask_launching", "task_id = 'out'"))

	var starts []*int64
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT bgtask_start_fenced_all($1, $2, $3)`, f.ledger,
		[]string{"x", "t-root", "y"}, []string{"elsewhere", "p", "root"}).Scan(&starts))
	require.Len(t, starts, 3)
	assert.Nil(t, starts[0])
	require.NotNil(t, starts[1], "the closure's own task")
	require.NotNil(t, starts[2], "a task launched from the root session")

	// The fence down: all of them go through, in one insert.
	_, err := f.pool.Exec(ctx(t), `UPDATE bgtask_closures SET closed_at = now() WHERE id = $1`, id)
	require.NoError(t, err)
	assert.Equal(t, []*int64{nil, nil}, admit([]string{"a", "b"}, []string{"root", "elsewhere"}))
	assert.Equal(t, 3, f.count("bgtask_launching", ""))
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT bgtask_start_fenced_all($1, $2, $3)`, f.ledger,
		[]string{"t-root"}, []string{"p"}).Scan(&starts))
	assert.Equal(t, []*int64{nil}, starts)
}

// A statement all of whose callers left is cancelled: a stalled one holds
// the calls queued behind it up no longer than their callers wait.
func TestBatchCancelsAStatementNobodyWaitsFor(t *testing.T) {
	s := newStepped()
	b, q := testBatch(s)
	defer b.close()
	c1, leave1 := context.WithCancel(context.Background())
	c2, leave2 := context.WithCancel(context.Background())
	first := callOf(c1, b, 1)
	<-s.ran
	second := callOf(c2, b, 2)
	waitQueued(t, b, q, 1)
	leave1()
	<-first.done
	assert.ErrorIs(t, first.err, context.Canceled)
	// The first statement, cancelled, ends without an answer from the
	// test; the second goes, and is cancelled once its caller leaves too.
	assert.Equal(t, []int{2}, <-s.ran)
	leave2()
	<-second.done
	b.close()
	s.mu.Lock()
	defer s.mu.Unlock()
	assert.Empty(t, s.dropped, "nothing to undo: the statements were cancelled")
}

// A statement that answers the wrong number of calls fails them all, in a
// batch and alone, rather than give one caller another's answer.
func TestBatchRefusesTooFewAnswers(t *testing.T) {
	short := func(_ context.Context, qs []int) ([]string, error) { return make([]string, len(qs)-1), nil }
	b := newBatch(short, nil)
	_, err := b.do(context.Background(), 1)
	assert.ErrorContains(t, err, "0 answers to 1 call")
	b.close()
	//lint:ignore SA1012 a nil context is taken as Background
	_, err = b.do(nil, 2)
	assert.ErrorContains(t, err, "0 answers to 1 call")
}

// A call alone says must go alone (text the database would refuse for
// the whole statement) is sent at once, in a statement of its own, even
// while another is in flight; the others go on batched.
func TestBatchSendsSomeAlone(t *testing.T) {
	s := newStepped()
	b, q := testBatch(s)
	b.alone = func(q int) bool { return q < 0 }
	b.run = func(ctx context.Context, qs []int) ([]string, error) {
		if qs[0] < 0 { // refused at once, as the database would
			s.ran <- qs
			return nil, errors.New("refused")
		}
		return s.run(ctx, qs)
	}
	defer b.close()
	first := callOf(context.Background(), b, 1)
	require.Equal(t, []int{1}, <-s.ran)
	queuedBehind := callOf(context.Background(), b, 2)
	waitQueued(t, b, q, 1)
	bad := callOf(context.Background(), b, -1)
	assert.Equal(t, []int{-1}, <-s.ran, "alone, beside the statement in flight")
	<-bad.done
	assert.ErrorContains(t, bad.err, "refused")
	s.release <- nil
	<-first.done
	assert.Equal(t, []int{2}, <-s.ran, "the others are not failed by it")
	s.release <- nil
	queuedBehind.answers(t, "answer-2")
}

// A launch from a parent the database cannot store (a NUL byte, bytes
// that are not UTF-8) is refused, alone: the launches beside it go on.
func TestALaunchOfTextTheDatabaseRefuses(t *testing.T) {
	f := newFixture(t)
	n := f.nodes(newService(), 1, 0)[0]
	for _, parent := range []string{"p\x00", "p\xff"} {
		bad := spec
		bad.ParentSessionID = parent
		_, err := n.Launch(ctx(t), bad)
		require.Error(t, err, "parent %q", parent)
		assert.ErrorContains(t, err, "checking the fence") // the first statement a launch with a parent makes
	}
	good := spec
	good.ParentSessionID = "chat-1"
	task, err := n.Launch(ctx(t), good)
	require.NoError(t, err)
	assert.Equal(t, "chat-1", task.ParentSessionID)
}
