package bgtask

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tree launches a task under parent and waits until it runs; it returns the
// task and its session.
func (h *harness) child(parent string, models ...string) (Task, string) {
	h.t.Helper()
	if len(models) == 0 {
		models = []string{"a/one", "b/two"}
	}
	task := h.launchSpec(Spec{ParentSessionID: parent, Models: mustModels(h.t, models...)})
	h.settle()
	got := h.task(task.ID)
	require.Equal(h.t, StatusRunning, got.Status)
	return got, got.SessionID
}

func statuses(h *harness, ids ...string) []Status {
	var out []Status
	for _, id := range ids {
		out = append(out, h.task(id).Status)
	}
	return out
}

func TestCloseBranchStopsGrandchildrenBehindAFinishedIntermediate(t *testing.T) {
	h := newHarness(t, nil)
	mid, midSes := h.child("root")
	grand, grandSes := h.child(midSes)
	great, _ := h.child(grandSes)
	// The intermediate ends (it fails: a turn end would wait at the
	// children gate); its descendants run on.
	require.NoError(t, h.observe(Event{SessionID: midSes, Kind: SessionError, Err: Permanent(errors.New("done early"))}))

	rep, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.NoError(t, err)
	assert.Equal(t, StatusError, h.task(mid.ID).Status, "a finished task keeps its outcome")
	assert.Equal(t, []Status{StatusCancelled, StatusCancelled}, statuses(h, grand.ID, great.ID))
	var stopped []string
	for _, s := range rep.Stopped {
		stopped = append(stopped, s.TaskID)
		assert.Equal(t, StatusCancelled, s.Status)
		assert.NotEmpty(t, s.Token)
		assert.NotEmpty(t, s.SessionID)
	}
	assert.ElementsMatch(t, []string{grand.ID, great.ID}, stopped)
	assert.Equal(t, "root", rep.SessionID)
	assert.GreaterOrEqual(t, rep.Passes, 2, "a pass that stopped work is followed by a rescan")
}

func TestCloseBranchFollowsSupersededAttemptSessions(t *testing.T) {
	h := newHarness(t, nil)
	task, firstSes := h.child("root")
	// A child launched from the first attempt's session, which then fails
	// over to a new session.
	orphan, _ := h.child(firstSes)
	require.NoError(t, h.observe(Event{SessionID: firstSes, Kind: SessionError, Err: errRateLimited}))
	h.settle()
	require.NotEqual(t, firstSes, h.task(task.ID).SessionID)

	_, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.NoError(t, err)
	assert.Equal(t, []Status{StatusCancelled, StatusCancelled}, statuses(h, task.ID, orphan.ID))
}

func TestCloseBranchLeavesSiblingsAndAncestorsAlone(t *testing.T) {
	h := newHarness(t, nil)
	top, topSes := h.child("root")
	left, leftSes := h.child(topSes)
	right, rightSes := h.child(topSes)
	leftKid, _ := h.child(leftSes)
	rightKid, _ := h.child(rightSes)

	_, err := h.m.Stop(context.Background(), Target{Session: leftSes})
	require.NoError(t, err)
	assert.Equal(t, StatusCancelled, h.task(left.ID).Status, "the root session's own live run is in scope")
	assert.Equal(t, StatusCancelled, h.task(leftKid.ID).Status)
	assert.Equal(t, []Status{StatusRunning, StatusRunning, StatusRunning}, statuses(h, top.ID, right.ID, rightKid.ID))
}

func TestCloseBranchOfASupersededSessionClosesTheWholeTask(t *testing.T) {
	// A task is the unit: closing any of its sessions covers all of them,
	// its current run included.
	h := newHarness(t, nil)
	task, firstSes := h.child("root")
	kid, _ := h.child(firstSes)
	require.NoError(t, h.observe(Event{SessionID: firstSes, Kind: SessionError, Err: errRateLimited}))
	h.settle()
	_, err := h.m.Stop(context.Background(), Target{Session: firstSes})
	require.NoError(t, err)
	assert.Equal(t, StatusCancelled, h.task(kid.ID).Status)
	assert.Equal(t, StatusCancelled, h.task(task.ID).Status, "the replacement run belongs to the same task")
}

// heldAborts returns a harness whose aborts all wait for release; entered
// is closed when the first one starts.
func heldAborts(t *testing.T) (h *harness, entered <-chan struct{}, release chan<- struct{}) {
	in := make(chan struct{})
	out := make(chan struct{})
	var once sync.Once
	h = newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		once.Do(func() { close(in) })
		<-out
		return nil
	}})
	return h, in, out
}

func TestCloseBranchFenceRefusesNewWorkInScopeOnly(t *testing.T) {
	h, entered, release := heldAborts(t)
	_, midSes := h.child("root")
	_, grandSes := h.child(midSes)
	_, outsideSes := h.child("elsewhere")

	type result struct {
		rep ClosureReport
		err error
	}
	done := make(chan result, 1)
	go func() {
		rep, err := h.m.Stop(context.Background(), Target{Session: "root"})
		done <- result{rep, err}
	}()
	recv(t, entered, "the closure's first abort") // the closure is mid-flight, its fence up

	for _, parent := range []string{"root", midSes, grandSes} {
		_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: parent, Models: mustModels(t, "a/one")})
		assert.ErrorIs(t, err, ErrBranchClosing, "parent %s is in scope", parent)
	}
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: outsideSes, Models: mustModels(t, "a/one")})
	assert.NoError(t, err, "outside the branch work goes on")

	close(release)
	r := recv(t, done, "the branch's Stop to return")
	require.NoError(t, r.err)
	_, err = h.m.Launch(context.Background(), Spec{ParentSessionID: "root", Models: mustModels(t, "a/one")})
	assert.NoError(t, err, "the fence comes down when Stop returns")
}

func TestRetryableErrorInsideAClosingBranchStartsNothing(t *testing.T) {
	entered := make(chan string, 4)
	release := make(chan struct{})
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		entered <- sid
		<-release
		return nil
	}})
	task, ses := h.child("root")
	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); done <- err }()
	recv(t, entered, "the closure's abort")
	// The child fails with a retryable error while its abort is in flight.
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionError, Err: errRateLimited}))
	close(release)
	require.NoError(t, recv(t, done, "the branch's Stop to return"))
	got := h.task(task.ID)
	assert.Len(t, got.Attempts, 1, "no retry in a closing branch")
	assert.Equal(t, StatusError, got.Status, "the child ended on its own failure; the closure only forbids a retry")
	assert.Equal(t, errRateLimited.Error(), got.Error, "the failure is kept")
	assert.Len(t, h.host.Starts(), 1)
}

func TestCloseBranchAbortsAnInFlightStartOnArrival(t *testing.T) {
	entered := make(chan struct{})
	release := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.ParentSessionID == "root" {
			close(entered)
			<-release
		}
		return sid, nil
	}})
	task := h.launchSpec(Spec{ParentSessionID: "root", Models: mustModels(t, "a/one")})
	recv(t, entered, "the start under root")
	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); done <- err }()
	// The closure must wait for the start; release it once the fence is up.
	for {
		h.m.mu.Lock()
		up := len(h.m.closures.active) == 1
		wait := h.m.waitAny()
		h.m.unlock()
		if up {
			break
		}
		recv(t, wait, "a change (the closure's fence going up)")
	}
	close(release)
	require.NoError(t, recv(t, done, "the branch's Stop to return"))
	got := h.task(task.ID)
	assert.Equal(t, StatusCancelled, got.Status)
	assert.Equal(t, []string{"ses-1"}, h.host.Aborts(), "the arriving session was aborted")
}

func TestCloseBranchReportsAFailedStopByName(t *testing.T) {
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		if sid == "ses-2" {
			return errors.New("session is wedged")
		}
		return nil
	}})
	a, _ := h.child("root")
	b, bSes := h.child("root")
	require.Equal(t, "ses-2", bSes)

	rep, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrBranchNotStopped)
	var ce *ClosureError
	require.ErrorAs(t, err, &ce)
	require.Len(t, ce.Failed, 1)
	assert.Equal(t, b.ID, ce.Failed[0].TaskID)
	assert.Equal(t, "ses-2", ce.Failed[0].SessionID)
	assert.Contains(t, err.Error(), b.ID)
	assert.Contains(t, err.Error(), "session is wedged")
	assert.Equal(t, StatusCancelled, h.task(a.ID).Status)
	assert.Equal(t, StatusRunning, h.task(b.ID).Status, "keeps its live state")
	assert.Len(t, rep.Stopped, 1)
	assert.Len(t, rep.Failed, 1)

	// The fence is down even though the closure failed.
	_, err = h.m.Launch(context.Background(), Spec{ParentSessionID: "root", Models: mustModels(t, "a/one")})
	assert.NoError(t, err)
}

func TestOverlappingAndNestedClosuresBothReturn(t *testing.T) {
	release := make(chan struct{})
	var calls sync.Map
	entered := make(chan struct{}, 8)
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		if _, dup := calls.LoadOrStore(sid, true); dup {
			return errors.New("aborted twice")
		}
		entered <- struct{}{}
		<-release
		return nil
	}})
	_, midSes := h.child("root")
	deep, _ := h.child(midSes)

	errs := make(chan error, 3)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); errs <- err }()
	recv(t, entered, "the first closure's abort")
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); errs <- err }() // overlapping
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: midSes}); errs <- err }() // nested
	close(release)
	for range 3 {
		assert.NoError(t, recv(t, errs, "each of the three Stops to return"))
	}
	assert.Equal(t, StatusCancelled, h.task(deep.ID).Status)
	n := 0
	calls.Range(func(_, _ any) bool { n++; return true })
	assert.Equal(t, 2, n, "each run was aborted once: the closures shared the work")
	assert.Len(t, h.m.Snapshot().Closures, 3)
}

func TestDeletedSessionCancelsTaskAndClosesItsBranch(t *testing.T) {
	h := newHarness(t, nil)
	task, ses := h.child("root")
	kid, kidSes := h.child(ses)
	grand, _ := h.child(kidSes)
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionDeleted}))
	assert.Equal(t, StatusCancelled, h.wait(task.ID).Status)
	assert.Equal(t, StatusCancelled, h.wait(kid.ID).Status)
	assert.Equal(t, StatusCancelled, h.wait(grand.ID).Status)
	h.settle()
	recs := h.m.Snapshot().Closures
	require.Len(t, recs, 1)
	assert.Equal(t, ses, recs[0].SessionID)
}

func TestStaleTokenCancelDoesNotTouchTheReplacementRun(t *testing.T) {
	h := newHarness(t, nil)
	task, ses := h.child("root")
	first := task.Attempts[0]
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionError, Err: errRateLimited}))
	h.settle()
	replacement := h.task(task.ID)
	require.Equal(t, StatusRunning, replacement.Status)

	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Run: RunRef{TaskID: task.ID, AttemptID: first.ID, Token: first.Token}})))
	got := h.task(task.ID)
	assert.Equal(t, replacement, got, "the replacement run is untouched")
	assert.Equal(t, []string{ses}, h.host.Aborts(), "only the failed session's retry abort")

	cur := got.Current()
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Run: RunRef{TaskID: task.ID, AttemptID: cur.ID, Token: cur.Token}})))
	assert.Equal(t, StatusCancelled, h.task(task.ID).Status)
}

func TestClosureRecordAndNotification(t *testing.T) {
	h := newHarness(t, nil)
	top, topSes := h.child("chat")
	kid, _ := h.child(topSes)
	rep, err := h.m.Stop(context.Background(), Target{Session: topSes})
	require.NoError(t, err)
	h.settle()
	recs := h.m.Snapshot().Closures
	require.Len(t, recs, 1)
	assert.Equal(t, topSes, recs[0].SessionID)
	assert.Equal(t, rep.Stopped, recs[0].Stopped)
	assert.Equal(t, t0, recs[0].At)

	var closed []Notification
	for _, n := range h.rec.All() {
		if n.Kind == NotifyBranchClosed {
			closed = append(closed, n)
		}
	}
	require.Len(t, closed, 1)
	assert.Equal(t, "chat", closed[0].ParentSessionID, "goes to the root task's parent")
	assert.True(t, strings.HasPrefix(closed[0].Text, "[Branch closure]"), closed[0].Text)
	assert.Contains(t, closed[0].Text, top.ID)
	assert.Contains(t, closed[0].Text, kid.ID)

	// A root that is no task's session, only a parent, is notified itself.
	plain := h.launchSpec(Spec{ParentSessionID: "plain-session", Models: mustModels(t, "a/one")})
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(plain.ID).SessionID, Kind: SessionIdle, Text: "done"}))
	_, err = h.m.Stop(context.Background(), Target{Session: "plain-session"})
	require.NoError(t, err)
	h.settle()
	last := h.rec.All()[len(h.rec.All())-1]
	assert.Equal(t, NotifyBranchClosed, last.Kind)
	assert.Equal(t, "plain-session", last.ParentSessionID)
	assert.Contains(t, last.Text, "nothing was running")
}

func TestCloseBranchFromInsideACallbackDoesNotWaitOnItself(t *testing.T) {
	var m *Manager
	type result struct {
		rep ClosureReport
		err error
	}
	inner := make(chan result, 1)
	var kidID string
	h := newHarness(t, &testHost{abort: func(ctx context.Context, sid string) error {
		if ref, ok := RunFromContext(ctx); ok && ref.TaskID == kidID {
			rep, err := m.Stop(ctx, Target{Session: "root"})
			inner <- result{rep, err}
		}
		return nil
	}})
	m = h.m
	_, ses := h.child("root")
	kid, _ := h.child(ses)
	kidID = kid.ID
	require.NoError(t, stopErr(m.Stop(context.Background(), Target{Task: kid.ID})))
	r := recv(t, inner, "the Stop made inside the abort callback")
	assert.ErrorIs(t, r.err, ErrStopPending)
	assert.Equal(t, 1, r.rep.Passes)
	h.settle()
	_, err := m.Stop(context.Background(), Target{Session: "root"})
	require.NoError(t, err)
}

func TestMetadataReservedPrefixIsRefused(t *testing.T) {
	h := newHarness(t, nil)
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/b"), Metadata: map[string]string{"bgtask.closure": "x"}})
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "bgtask.closure")
	meta := map[string]string{"ticket": "T-1"}
	task, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/b"), Metadata: meta})
	require.NoError(t, err)
	meta["ticket"] = "changed"
	assert.Equal(t, "T-1", h.task(task.ID).Metadata["ticket"], "the spec's map is copied")
}

// walks reports how many closure walks the Manager has made.
func (h *harness) walks() uint64 {
	h.m.mu.Lock()
	defer h.m.unlock()
	return h.m.closures.scanGen
}

func TestARescanIsProvenWithoutAWalkWhenNothingWidened(t *testing.T) {
	h := newHarness(t, nil)
	_, midSes := h.child("root")
	h.child(midSes)
	h.child("root")
	before := h.walks()
	rep, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.NoError(t, err)
	assert.Len(t, rep.Stopped, 3)
	assert.Equal(t, 2, rep.Passes, "the rescan still counts as a pass")
	assert.Equal(t, before+1, h.walks(), "nothing was recorded that could add a run: the rescan needs no walk")
}

func TestARescanWalksAgainWhenTheLedgerWidened(t *testing.T) {
	h, entered, release := heldAborts(t)
	task, _ := h.child("root")
	before := h.walks()
	done := make(chan error, 1)
	go func() { _, err := h.m.Stop(context.Background(), Target{Session: "root"}); done <- err }()
	recv(t, entered, "the closure's abort")
	// A launch anywhere is a record that could add a run to some branch.
	outside := h.launchSpec(Spec{ParentSessionID: "elsewhere", Models: mustModels(t, "a/one")})
	close(release)
	require.NoError(t, recv(t, done, "the branch's Stop to return"))
	assert.Equal(t, before+2, h.walks(), "the rescan walked the branch again")
	assert.Equal(t, StatusCancelled, h.task(task.ID).Status)
	h.settle()
	assert.Equal(t, StatusRunning, h.task(outside.ID).Status, "outside the branch")
}

func TestALongClosureWalkLetsOthersIn(t *testing.T) {
	h := newHarness(t, nil)
	var ids []string
	for range yieldEvery + 50 {
		ids = append(ids, h.launchSpec(Spec{ParentSessionID: "root", Models: mustModels(t, "a/one")}).ID)
	}
	h.settle()
	last := h.task(ids[len(ids)-1]) // visited last: after the first yield
	yields := 0
	var outside Task
	h.m.hooks.yield = func() {
		yields++
		if yields > 1 {
			return
		}
		// m.mu is free: events, launches and reads go through meanwhile.
		require.NoError(t, h.m.Observe(Event{SessionID: last.SessionID, Kind: SessionIdle, Text: "done first"}))
		_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "root", Models: mustModels(t, "a/one")})
		assert.ErrorIs(t, err, ErrBranchClosing, "the fence holds while the walk yields")
		outside, err = h.m.Launch(context.Background(), Spec{ParentSessionID: "elsewhere", Models: mustModels(t, "a/one")})
		assert.NoError(t, err)
	}
	rep, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.NoError(t, err)
	assert.Equal(t, 2, yields, "the launch outside widened the ledger: the rescan walked again, and yielded too")
	assert.Len(t, rep.Stopped, len(ids)-1, "the task that ended during the yield was not stopped")
	assert.Equal(t, StatusCompleted, h.task(last.ID).Status)
	for _, id := range ids[:len(ids)-1] {
		require.Equal(t, StatusCancelled, h.task(id).Status, id)
	}
	assert.Equal(t, 2, rep.Passes)
	h.settle()
	assert.Equal(t, StatusRunning, h.task(outside.ID).Status)
}

func TestAStartThatEndsWhileAWalkYieldsDoesNotHangTheClosure(t *testing.T) {
	// The walk sees a start in flight, then lets others in; the start fails
	// meanwhile and the task ends. The pass has nothing else to wait for:
	// it must not wait for a change that already happened.
	release := make(chan struct{})
	h := newHarness(t, &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.Prompt == "slow" {
			<-release
			return "", Permanent(errors.New("no capacity"))
		}
		return "", Permanent(errors.New("forbidden")) // ends at once
	}})
	var ended []string
	launch := func(prompt string) string {
		return h.launchSpec(Spec{ParentSessionID: "root", Prompt: prompt, Models: mustModels(t, "a/one")}).ID
	}
	for range 10 {
		ended = append(ended, launch("fail"))
	}
	slow := launch("slow") // visited before the first yield
	for range yieldEvery {
		ended = append(ended, launch("fail"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // failure detection only
	defer cancel()
	for _, id := range ended {
		_, err := h.m.Wait(ctx, id)
		require.NoError(t, err)
	}
	yields := 0
	h.m.hooks.yield = func() {
		if yields++; yields == 1 {
			close(release)
			_, err := h.m.Wait(ctx, slow)
			require.NoError(t, err)
		}
	}
	rep, err := h.m.Stop(ctx, Target{Session: "root"})
	require.NoError(t, err, "the closure waited for a change that had already happened")
	assert.GreaterOrEqual(t, yields, 1)
	assert.Equal(t, StatusCancelled, h.task(slow).Status, "a start that fails inside a closing branch ends the task cancelled")
	assert.GreaterOrEqual(t, rep.Passes, 2)
}
