package pgledger

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// running launches a task from parent at node n and returns it once it
// runs and its session's binding is durable (a later commit of the same
// member is: commits land in order).
func running(t *testing.T, n *Node, parent string) bgtask.Task {
	t.Helper()
	return runningSpec(t, n, bgtask.Spec{ParentSessionID: parent})
}

// chain joins n nodes and launches a branch of depth running tasks from
// "chat": task i at node i mod n, from task i-1's session.
func chain(t *testing.T, n, depth int) (*fixture, *service, []*Node, []bgtask.Task) {
	t.Helper()
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, n, 0)
	parent := "chat"
	var tasks []bgtask.Task
	for i := range depth {
		task := running(t, ns[i%n], parent)
		tasks, parent = append(tasks, task), task.SessionID
	}
	return f, svc, ns, tasks
}

// A branch spans three processes: a closure in one stops the runs the
// other two own, exactly, and leaves what is outside the branch alone.
func TestCloseBranchAcrossProcesses(t *testing.T) {
	f, svc, ns, br := chain(t, 3, 3)
	a, b, c := br[0], br[1], br[2]
	outside := running(t, ns[2], "elsewhere")

	rep, err := ns[0].Stop(ctx(t), bgtask.Target{Session: "chat"})
	require.NoError(t, err)
	var ids []string
	for _, r := range rep.Stopped {
		ids = append(ids, r.TaskID)
		assert.Equal(t, bgtask.StatusCancelled, r.Status, "%+v", r)
		assert.NotEmpty(t, r.Token)
	}
	assert.ElementsMatch(t, []string{a.ID, b.ID, c.ID}, ids)
	for i, task := range []bgtask.Task{a, b, c} {
		got := mustTask(t, ns[i], task.ID)
		assert.Equal(t, bgtask.StatusCancelled, got.Status, "owned by w%d", i)
		assert.True(t, svc.aborted(task.SessionID))
		require.NotNil(t, got.Stop, "owned by w%d", i)
		assert.Equal(t, bgtask.StopCause{Kind: bgtask.StopClosure, Root: "chat"}, *got.Stop, "in every process, the closure is who asked (w%d)", i)
		assert.ErrorIs(t, got.Cause, bgtask.ErrCancelled)
	}
	assert.Equal(t, bgtask.StatusRunning, mustTask(t, ns[2], outside.ID).Status, "outside the branch")
	assert.False(t, svc.aborted(outside.SessionID))

	snap, err := ns[1].Snapshot(ctx(t))
	require.NoError(t, err)
	recs := snap.Closures
	require.Len(t, recs, 1, "one row, by value, readable anywhere")
	assert.Equal(t, "chat", recs[0].SessionID)
	assert.ElementsMatch(t, rep.Stopped, recs[0].Stopped)
	assert.Equal(t, 0, f.count("bgtask_closures", "closed_at IS NULL"), "the fence came down")
	_, err = ns[2].Launch(ctx(t), bgtask.Spec{ParentSessionID: b.SessionID, Models: spec.Models})
	assert.NoError(t, err, "launches from the branch are admitted again")
}

// While a closure runs its fence holds in every process: a launch from
// any session in the branch is refused wherever it is asked, and one from
// outside is not. A closure of a session nobody knows writes nothing.
func TestTheFenceHoldsInEveryProcess(t *testing.T) {
	f, svc, ns, br := chain(t, 3, 2)
	a, b := br[0], br[1]
	g := svc.hold(b.SessionID)

	done := stopping(t, ns[2], bgtask.Target{Session: a.SessionID}) // a's session: the task as a unit
	recv(t, g.asked, "w1 to be asked to stop b")                    // w1 heard and is stopping b
	for i, n := range ns {
		_, err := n.Launch(ctx(t), bgtask.Spec{ParentSessionID: b.SessionID, Models: spec.Models})
		assert.ErrorIs(t, err, bgtask.ErrBranchClosing, "at w%d", i)
		_, err = n.Launch(ctx(t), bgtask.Spec{ParentSessionID: a.SessionID, Models: spec.Models})
		assert.ErrorIs(t, err, bgtask.ErrBranchClosing, "at w%d", i)
	}
	_, err := ns[1].Launch(ctx(t), bgtask.Spec{ParentSessionID: "elsewhere", Models: spec.Models})
	assert.NoError(t, err, "outside the branch")
	close(g.release)
	r := recv(t, done, "the closure to return")
	require.NoError(t, r.err)
	assert.Equal(t, a.ID, r.rep.TaskID)
	assert.Len(t, r.rep.Stopped, 2)
	assert.Equal(t, 0, f.count("bgtask_launching", ""), "every refused launch left nothing behind")

	_, err = ns[0].Stop(ctx(t), bgtask.Target{Session: "nobody's"})
	assert.ErrorIs(t, err, bgtask.ErrUnknownSession)
	_, err = ns[0].Stop(ctx(t), bgtask.Target{Session: " "})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	_, err = ns[0].Stop(ctx(t), bgtask.Target{Task: "no such task", Tree: true})
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	_, err = ns[0].Stop(ctx(t), bgtask.Target{Task: "", Tree: true})
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
	_, err = ns[0].Stop(ctx(t), bgtask.Target{Task: "no such task", Tree: true})
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	assert.Equal(t, 1, f.count("bgtask_closures", ""), "refused closures wrote nothing")
}

// A run that does not stop before the caller's context ends is named,
// with the member that owns it and the process holding that member; the
// fence comes down all the same, and the stop goes on.
func TestAClosureNamesTheRunsThatDidNotStop(t *testing.T) {
	f, svc, ns, br := chain(t, 2, 2)
	a, b := br[0], br[1]
	g := svc.hold(b.SessionID)
	// The caller gives up once a's stop is written and b's owner is
	// inside b's abort (held): a deadline would race both on a slow
	// machine.
	short, cancel := context.WithCancel(ctx(t))
	defer cancel()
	go func() {
		defer cancel()
		for {
			select {
			case task := <-f.stopped:
				if task != a.ID {
					continue
				}
				_, _ = ns[0].Manager().Wait(short, a.ID) // its end is in the database
				select {
				case <-g.asked:
				case <-short.Done():
				}
				return
			case <-short.Done():
				return
			}
		}
	}()
	rep, err := ns[0].Stop(short, bgtask.Target{Session: "chat"})
	var un *UnstoppedError
	require.ErrorAs(t, err, &un)
	assert.True(t, errors.Is(err, context.Canceled), "%v", err)
	require.Len(t, un.Runs, 1)
	assert.Equal(t, b.ID, un.Runs[0].TaskID)
	assert.Equal(t, b.Attempts[0].Token, un.Runs[0].Token)
	assert.Equal(t, "w1", un.Runs[0].Member)
	assert.NotEmpty(t, un.Runs[0].Holder)
	assert.Contains(t, err.Error(), b.ID)
	require.Len(t, rep.Stopping, 1)
	assert.Equal(t, b.ID, rep.Stopping[0].TaskID)
	require.Len(t, rep.Stopped, 1)
	assert.Equal(t, a.ID, rep.Stopped[0].TaskID)
	assert.Equal(t, 0, f.count("bgtask_closures", "closed_at IS NULL"), "the fence came down")

	close(g.release)
	got, err := ns[1].Manager().Wait(ctx(t), b.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, got.Status, "the stop went on")
}

// A launch that passed the fence check just before a closure opened is
// waited for: once its task lands it is in scope, and is stopped.
func TestALaunchInFlightIsWaitedForAndStopped(t *testing.T) {
	_, svc, ns, br := chain(t, 2, 1)
	a := br[0]
	require.NoError(t, ns[1].admit(ctx(t), ns[1].o.Member, "late", a.SessionID, false)) // past the check
	g := svc.hold(a.SessionID)
	done := make(chan error, 1)
	var rep bgtask.ClosureReport
	go func() {
		var err error
		rep, err = ns[0].Stop(ctx(t), bgtask.Target{Session: "chat"})
		done <- err
	}()
	recv(t, g.asked, "the closure to stop a") // the closure is open
	close(g.release)
	select {
	case err := <-done:
		t.Fatalf("the closure returned while a launch in its scope was in flight: %v", err)
	default:
	}
	_, err := ns[1].Manager().Launch(ctx(t), bgtask.Spec{ID: "late", ParentSessionID: a.SessionID, Models: spec.Models})
	require.NoError(t, err)
	require.NoError(t, recv(t, done, "the closure to return"))
	var ids []string
	for _, r := range rep.Stopped {
		ids = append(ids, r.TaskID)
	}
	assert.Contains(t, ids, a.ID)
	got, err := ns[1].Manager().Wait(ctx(t), "late")
	require.NoError(t, err)
	// Stopped by the closure before it started, or its start refused by
	// the fence (the gate may answer first): either way nothing ran.
	switch got.Status {
	case bgtask.StatusCancelled:
		assert.Contains(t, ids, "late", "the closure lists what it stopped")
	case bgtask.StatusError:
		assert.Contains(t, got.Error, "is inside the branch closure")
	default:
		t.Fatalf("the late task is %s", got.Status)
	}
	assert.Empty(t, svc.sessionOf(got.Attempts[0].ID), "no session was started")
}

// A process that died between a launch's fence check and its landing
// leaves nothing in the way: the member's next life clears it, and a
// closure of the branch does not wait for it.
func TestALaunchLeftInFlightByADeadProcessIsCleared(t *testing.T) {
	f, svc, ns, br := chain(t, 2, 1)
	a := br[0]
	require.NoError(t, ns[1].admit(ctx(t), ns[1].o.Member, "ghost", a.SessionID, false))
	ns[1].kill()
	f.expire("w1")
	again, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w1", Host: svc, Poll: 50 * time.Millisecond})
	require.NoError(t, err)
	closeAtEnd(t, again)
	assert.Equal(t, 0, f.count("bgtask_launching", ""), "the restart cleared it")
	short, cancel := context.WithTimeout(ctx(t), 10*time.Second)
	defer cancel()
	rep, err := ns[0].Stop(short, bgtask.Target{Session: "chat"})
	require.NoError(t, err)
	assert.Len(t, rep.Stopped, 1)
}

// A fence check that runs after its launch landed (retried, and queued in
// a server that was stopped: it ran once the server went on) leaves no
// launch in flight behind; one that did, from a check whose snapshot
// missed the landing, neither holds a closure of the branch up nor
// outlives the next prune.
func TestAFenceCheckAfterItsLaunchLandedLeavesNothingInFlight(t *testing.T) {
	f, _, ns, br := chain(t, 2, 1)
	a := br[0]
	landed := running(t, ns[1], a.SessionID)
	require.NoError(t, ns[1].admit(ctx(t), ns[1].o.Member, landed.ID, a.SessionID, false), "the late check")
	assert.Equal(t, 0, f.count("bgtask_launching", ""), "no launch in flight for a task that landed")

	f.exec(`INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) VALUES ($1, $2, $3, 'w1')`, landed.ID, a.SessionID)
	short, cancel := context.WithTimeout(ctx(t), 10*time.Second)
	defer cancel()
	rep, err := ns[0].Stop(short, bgtask.Target{Session: "chat"})
	require.NoError(t, err, "the closure is not held up by a landed task's row")
	var ids []string
	for _, r := range rep.Stopped {
		ids = append(ids, r.TaskID)
	}
	assert.ElementsMatch(t, []string{a.ID, landed.ID}, ids)
	assert.Equal(t, 1, f.prune(bgtask.Retention{}).Launching, "the next prune deletes it")
	assert.Equal(t, 0, f.count("bgtask_launching", ""))
}

// A launch that failed may leave its row in flight behind (its check
// committed after its caller left, or its clearing got no answer): the
// node's loop clears those of its members older than the lease, but not
// one a launch of its own still has in flight, and looks again while a
// younger one is left. Nothing is looked at until a launch failed.
func TestALaunchThatFailedLeavesNothingInFlight(t *testing.T) {
	f := newFixture(t)
	passes := make(chan struct{}, 1)
	n, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: newService(), Poll: 20 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(tlog{t}, nil)), pass: func() { tell(passes)(struct{}{}) }})
	require.NoError(t, err)
	closeAtEnd(t, n)
	// A whole pass since: the first signal may be buffered from before,
	// the second from a pass already under way; the third's pass began
	// after the second's ended.
	aPassSince := func() {
		for range 3 {
			recv(t, passes, "a pass of the node's loop")
		}
	}
	f.exec(`INSERT INTO bgtask_launching (ledger, task_id, parent_session, member, at) VALUES
($1, 'old', 'chat', 'w0', now() - interval '1 hour'), ($1, 'young', 'chat', 'w0', now()),
($1, 'mine', 'chat', 'w0', now() - interval '1 hour'), ($1, 'others', 'chat', 'someone else', now() - interval '1 hour')`)
	n.launchBegins("mine")
	aPassSince()
	assert.Equal(t, 4, f.count("bgtask_launching", ""), "nothing is swept until a launch failed")

	n.launchBegins("failed")
	n.launchEnds("failed", true)
	aPassSince()
	assert.Equal(t, 0, f.count("bgtask_launching", "task_id = 'old'"), "a failed launch's row, older than the lease")
	assert.Equal(t, 1, f.count("bgtask_launching", "task_id = 'young'"), "not older than the lease yet")
	assert.Equal(t, 1, f.count("bgtask_launching", "task_id = 'mine'"), "a launch of the node's still in flight")
	assert.Equal(t, 1, f.count("bgtask_launching", "task_id = 'others'"), "another member's")

	f.exec(`UPDATE bgtask_launching SET at = now() - interval '1 hour' WHERE ledger = $1 AND task_id = 'young'`)
	aPassSince()
	assert.Equal(t, 0, f.count("bgtask_launching", "task_id = 'young'"), "looked at again: a younger one was left")
	n.launchEnds("mine", true)
	aPassSince()
	assert.Equal(t, 1, f.count("bgtask_launching", ""), "only the other member's is left")
}

// A closure whose process died holds no fence: once that member's lease
// expired launches in the branch are admitted, and the member's next life
// closes the row.
func TestAClosureOfADeadProcessHoldsNoFence(t *testing.T) {
	f, svc, ns, br := chain(t, 2, 1)
	a := br[0]
	// w1 opened a closure of a's branch and died before it ended.
	_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_closures (ledger, root_session, member) VALUES ($1, 'chat', 'w1')`, f.ledger)
	require.NoError(t, err)
	_, err = ns[0].Launch(ctx(t), bgtask.Spec{ParentSessionID: a.SessionID, Models: spec.Models})
	require.ErrorIs(t, err, bgtask.ErrBranchClosing, "while w1 holds its lease")
	ns[1].kill()
	f.expire("w1")
	_, err = ns[0].Launch(ctx(t), bgtask.Spec{ParentSessionID: a.SessionID, Models: spec.Models})
	require.NoError(t, err, "w1 is dead: its fence holds no more")
	again, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w1", Host: svc, Poll: 50 * time.Millisecond})
	require.NoError(t, err)
	closeAtEnd(t, again)
	assert.Equal(t, 0, f.count("bgtask_closures", "closed_at IS NULL"), "w1's next life closed it")
}

// A retry its owner decides before it hears of a closure does not start:
// the start asks the fence in the database, and is refused.
func TestARetryInAClosingBranchDoesNotStart(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	var ns []*Node
	for i := range 2 { // no polling: the closure below is never served
		passed := make(chan struct{})
		var once sync.Once
		node, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: fmt.Sprintf("w%d", i), Host: svc, Poll: time.Hour,
			pass: func() { once.Do(func() { close(passed) }) }})
		require.NoError(t, err)
		closeAtEnd(t, node)
		// The loop's one pass (at Join, then every hour) is over before
		// the closure is opened: else it would serve it, and stop b.
		recv(t, passed, fmt.Sprintf("w%d's first pass", i))
		ns = append(ns, node)
	}
	a := running(t, ns[0], "chat")
	b := running(t, ns[1], a.SessionID)
	// w0 opens a closure of the branch; w1 has not heard of it yet.
	_, err := f.pool.Exec(ctx(t), `INSERT INTO bgtask_closures (ledger, root_session, member) VALUES ($1, 'chat', 'w0')`, f.ledger)
	require.NoError(t, err)
	require.NoError(t, ns[1].Observe(context.Background(), bgtask.Event{AttemptID: b.Attempts[0].ID, Kind: bgtask.SessionError, Err: errors.New("429 Too Many Requests")}))
	got, err := ns[1].Manager().Wait(ctx(t), b.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusError, got.Status)
	require.Len(t, got.Attempts, 2)
	assert.ErrorContains(t, errors.New(got.Attempts[1].Error), "is inside the branch closure")
	assert.Empty(t, svc.sessionOf(got.Attempts[1].ID), "no session was started for the retry")
}

// A closure across the fleet says who acted, when its caller named them:
// on its report and record, and on each task it stopped, in whichever
// process owns it.
func TestAFleetClosureRecordsWhoActed(t *testing.T) {
	_, _, ns, tasks := chain(t, 2, 2)
	rep, err := ns[0].Stop(ctx(t), bgtask.Target{Task: tasks[0].ID, Tree: true, Actor: "carol"})
	require.NoError(t, err)
	assert.Equal(t, "carol", rep.Actor)
	kid, err := bgtasktest.WaitStatus(ctx(t), ns[1].Manager(), tasks[1].ID, bgtask.StatusCancelled)
	require.NoError(t, err)
	require.NotNil(t, kid.Stop)
	assert.Equal(t, "carol", kid.Stop.Actor, "the other process's stop names who acted")
	snap, err := ns[1].Snapshot(ctx(t))
	require.NoError(t, err)
	require.NotEmpty(t, snap.Closures)
	assert.Equal(t, "carol", snap.Closures[len(snap.Closures)-1].Actor, "the closure's record")
}
