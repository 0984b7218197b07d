package bgtask

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sessionService is a session service that outlives the harness process:
// sessions are tagged with the attempt that asked for them, and answer
// StatusHost's questions.
type sessionService struct {
	mu       sync.Mutex
	sessions map[string]*svcSession // by session id
	byAtt    map[string]string      // attempt id → session id
	gate     map[int]chan struct{}  // attempt number → StartSession waits for it
	gated    chan string            // the attempts whose StartSession waits at a gate
}

type svcSession struct {
	state SessionState
	end   Event
}

func newSessionService() *sessionService {
	return &sessionService{sessions: map[string]*svcSession{}, byAtt: map[string]string{}, gate: map[int]chan struct{}{}, gated: make(chan string, 16)}
}

func (s *sessionService) set(sid string, state SessionState, end Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sessions[sid] = &svcSession{state: state, end: end}
}

// svcHost is one process's connection to the service.
type svcHost struct {
	svc     *sessionService
	abortOK bool          // aborts stop the session (else the process is going away)
	aborted chan struct{} // with abortOK: closed at the first abort asked
}

func (h *svcHost) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	sid := "s-" + req.AttemptID
	h.svc.mu.Lock()
	h.svc.sessions[sid] = &svcSession{state: SessionStateAlive}
	h.svc.byAtt[req.AttemptID] = sid
	gate := h.svc.gate[req.AttemptNumber]
	h.svc.mu.Unlock()
	if gate != nil { // the session exists; the answer is lost with the process
		h.svc.gated <- req.AttemptID
		select {
		case <-gate:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	return sid, nil
}

func (h *svcHost) AbortSession(ctx context.Context, sid string) error {
	if !h.abortOK {
		if h.aborted != nil { // the abort hangs until the process dies
			close(h.aborted)
			h.aborted = nil
			<-ctx.Done()
			return ctx.Err()
		}
		return errors.New("the harness is going away: the session service keeps it")
	}
	h.svc.mu.Lock()
	defer h.svc.mu.Unlock()
	delete(h.svc.sessions, sid)
	return nil
}

func (h *svcHost) SessionStatus(ctx context.Context, sid string) (SessionReport, error) {
	h.svc.mu.Lock()
	defer h.svc.mu.Unlock()
	s := h.svc.sessions[sid]
	if s == nil {
		return SessionReport{State: SessionStateGone}, nil
	}
	return SessionReport{State: s.state, End: s.end}, nil
}

func (h *svcHost) FindSession(ctx context.Context, req SessionRequest) (string, error) {
	h.svc.mu.Lock()
	defer h.svc.mu.Unlock()
	return h.svc.byAtt[req.AttemptID], nil
}

// plainHost is a Host that cannot say what became of a session.
type plainHost struct{ h *svcHost }

func (p plainHost) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	return p.h.StartSession(ctx, req)
}
func (p plainHost) AbortSession(ctx context.Context, sid string) error {
	return p.h.AbortSession(ctx, sid)
}

// crashJournal is a journal whose process "dies": from crash on, nothing
// more reaches the disk, and the Manager is not told.
type crashJournal struct {
	Journal
	crashed atomic.Bool
}

type doneCommit struct{}

func (doneCommit) Wait() error { return nil }

func (j *crashJournal) Append(batch []Record) Commit {
	if j.crashed.Load() {
		return doneCommit{}
	}
	return j.Journal.Append(batch)
}

// crash ends m as a killed process would: nothing it does from now on is
// durable. Its goroutines are joined (the test's, not the world's).
func crash(t *testing.T, m *Manager, j *crashJournal) {
	t.Helper()
	j.crashed.Store(true)
	// A short deadline: a start hanging in the dead process is cut off
	// (what the process's death does).
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_ = m.Shutdown(ctx)
}

func openJournal(t *testing.T, dir string) *crashJournal {
	t.Helper()
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	return &crashJournal{Journal: j}
}

func waitStatus(t *testing.T, m *Manager, id string, want Status) Task {
	t.Helper()
	return waitFor(t, m, id, func(task Task) bool { return task.Status == want })
}

func TestRestartRecoversEveryTaskAsTheEvidenceSays(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	host := &svcHost{svc: svc}
	rec1 := &recorder{}
	j1 := openJournal(t, dir)
	m1, err := Open(context.Background(), host, WithJournal(j1), WithNotifier(rec1))
	require.NoError(t, err)
	epoch1 := m1.Snapshot().Epoch
	spec := func(parent string) Spec {
		return Spec{ParentSessionID: parent, Models: []Model{{Provider: "a", ID: "1"}}}
	}
	ctx := context.Background()

	done, err := m1.Launch(ctx, spec("p-done"))
	require.NoError(t, err)
	waitStatus(t, m1, done.ID, StatusRunning)
	require.NoError(t, m1.Observe(Event{SessionID: "s-" + done.CurrentAttemptID, Kind: SessionIdle, Text: "before"}))
	waitStatus(t, m1, done.ID, StatusCompleted)

	alive, err := m1.Launch(ctx, spec("p-alive"))
	require.NoError(t, err)
	waitStatus(t, m1, alive.ID, StatusRunning)
	ended, err := m1.Launch(ctx, spec("p-ended"))
	require.NoError(t, err)
	waitStatus(t, m1, ended.ID, StatusRunning)
	gone, err := m1.Launch(ctx, spec("p-gone"))
	require.NoError(t, err)
	waitStatus(t, m1, gone.ID, StatusRunning)

	// A start whose answer dies with the process: its session exists.
	svc.mu.Lock()
	svc.gate[1] = make(chan struct{}) // never opened
	svc.mu.Unlock()
	lost, err := m1.Launch(ctx, spec("p-lost"))
	require.NoError(t, err)
	require.Equal(t, lost.CurrentAttemptID, recv(t, svc.gated, "the lost task's start"), "the start was asked for, its session made")
	finals1 := finalSummaries(rec1.All())
	crash(t, m1, j1)
	svc.mu.Lock()
	delete(svc.gate, 1)
	svc.mu.Unlock()

	// While the harness is down, the service goes on.
	svc.set("s-"+ended.CurrentAttemptID, SessionStateEnded, Event{Kind: SessionIdle, Text: "done while you were away"})
	svc.mu.Lock()
	delete(svc.sessions, "s-"+gone.CurrentAttemptID)
	svc.mu.Unlock()

	rec2 := &recorder{}
	j2 := openJournal(t, dir)
	m2, err := Open(ctx, host, WithJournal(j2), WithNotifier(rec2))
	require.NoError(t, err)
	defer func() { _ = m2.Shutdown(context.Background()) }()
	assert.NotEqual(t, epoch1, m2.Snapshot().Epoch, "a new process life")

	got, err := m2.Task(done.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusCompleted, got.Status)
	assert.Equal(t, "before", got.Result)

	got = waitStatus(t, m2, alive.ID, StatusRunning)
	assert.Equal(t, "s-"+alive.CurrentAttemptID, got.SessionID, "re-adopted, on its own session")
	require.NoError(t, m2.Observe(Event{SessionID: got.SessionID, Kind: SessionIdle, Text: "after"}))
	got = waitStatus(t, m2, alive.ID, StatusCompleted)
	assert.Equal(t, "after", got.Result)

	got = waitStatus(t, m2, ended.ID, StatusCompleted)
	assert.Equal(t, "done while you were away", got.Result)

	got = waitStatus(t, m2, gone.ID, StatusInterrupt)
	assert.Contains(t, got.Error, lostAcrossRestart)

	got = waitStatus(t, m2, lost.ID, StatusRunning)
	assert.Equal(t, "s-"+lost.CurrentAttemptID, got.SessionID, "found by its attempt id and bound")

	// Every task's final summary reaches its parent exactly once over both
	// lives (by ID); none was lost.
	require.NoError(t, m2.Observe(Event{SessionID: got.SessionID, Kind: SessionIdle, Text: "found"}))
	waitStatus(t, m2, lost.ID, StatusCompleted)
	require.NoError(t, m2.Shutdown(context.Background()))
	byTask := map[string]int{}
	ids := map[string]bool{}
	for _, n := range append(finals1, finalSummaries(rec2.All())...) {
		if ids[n.ID] {
			continue // a duplicate across the crash: same ID, dropped by the receiver
		}
		ids[n.ID] = true
		byTask[n.TaskID]++
	}
	for _, id := range []string{done.ID, alive.ID, ended.ID, gone.ID, lost.ID} {
		assert.Equal(t, 1, byTask[id], "final summaries of %s", id)
	}
}

func finalSummaries(ns []Notification) []Notification {
	var out []Notification
	for _, n := range ns {
		if n.Kind == NotifyFinalSummary {
			out = append(out, n)
		}
	}
	return out
}

func TestRestartWithAHostThatCannotSayInterruptsWhatMayHaveAChild(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	host := plainHost{&svcHost{svc: svc}}
	j1 := openJournal(t, dir)
	m1, err := Open(context.Background(), host, WithJournal(j1), WithModelLimits(ModelLimits{Default: 1}))
	require.NoError(t, err)
	ctx := context.Background()
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}}
	running, err := m1.Launch(ctx, spec)
	require.NoError(t, err)
	waitStatus(t, m1, running.ID, StatusRunning)
	queued, err := m1.Launch(ctx, spec) // waits for the slot: it never asked for a child
	require.NoError(t, err)
	assert.Equal(t, PendingQueued, waitStatus(t, m1, queued.ID, StatusPending).Pending)
	crash(t, m1, j1)

	j2 := openJournal(t, dir)
	m2, err := Open(ctx, host, WithJournal(j2), WithModelLimits(ModelLimits{Default: 1}))
	require.NoError(t, err)
	defer func() { _ = m2.Shutdown(context.Background()) }()
	got := waitStatus(t, m2, running.ID, StatusInterrupt)
	assert.Contains(t, got.Error, lostAcrossRestart, "never cancelled, never completed without evidence")
	got = waitStatus(t, m2, queued.ID, StatusRunning)
	assert.True(t, strings.HasPrefix(got.SessionID, "s-"), "the run that never started starts now")
}

func TestASecondOpenerOfAJournalIsRefused(t *testing.T) {
	dir := t.TempDir()
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	_, err = OpenFileJournal(dir)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "in use")
	require.NoError(t, j.Close())
	j, err = OpenFileJournal(dir)
	require.NoError(t, err)
	require.NoError(t, j.Close())
}

// failJournal fails every append from the first on.
type failJournal struct{ Journal }

func (failJournal) Append([]Record) Commit { return failedCommit{errors.New("disk full")} }

func TestAJournalThatFailsStopsTheManagerBeforeAnyEffect(t *testing.T) {
	dir := t.TempDir()
	inner, err := OpenFileJournal(dir)
	require.NoError(t, err)
	host := &testHost{}
	m, err := Open(context.Background(), host, WithJournal(failJournal{inner}))
	require.ErrorIs(t, err, ErrJournal, "the epoch record could not be made durable")
	assert.Nil(t, m)
	assert.Empty(t, host.starts)
}

// A journal is compacted as tasks are forgotten: what a restart replays is
// exactly what was retained, and the journal does not grow with every task
// ever launched.
func TestCompactionKeepsExactlyWhatRetentionKeeps(t *testing.T) {
	dir := t.TempDir()
	host := answeringHost()
	j1, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m1, err := Open(context.Background(), host, WithJournal(j1), WithRetention(Retention{MaxEnded: 50}))
	require.NoError(t, err)
	host.m = m1
	ctx := context.Background()
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}}
	for range compactEvery + 200 {
		task, err := m1.Launch(ctx, spec)
		require.NoError(t, err)
		_, err = m1.Wait(ctx, task.ID)
		require.NoError(t, err)
	}
	require.NoError(t, m1.life.group.Wait(ctx))
	m1.mu.Lock()
	compacted := m1.led.compactedAt
	m1.mu.Unlock()
	require.NotZero(t, compacted, "the journal was compacted")
	want := m1.Snapshot().Tasks
	require.NoError(t, m1.Shutdown(ctx))

	j2, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m2, err := Open(ctx, &benchHost{}, WithJournal(j2), WithRetention(Retention{MaxEnded: 50}))
	require.NoError(t, err)
	defer func() { _ = m2.Shutdown(ctx) }()
	got := m2.Snapshot().Tasks
	require.Equal(t, len(want), len(got), "the same retained tasks")
	for i := range want {
		want[i].Activity = ""
		require.NoError(t, sameJSON("task "+want[i].ID, want[i], got[i]))
	}
	m2.mu.Lock()
	n := 0
	for _, e := range m2.led.tasks {
		n += e.count()
	}
	m2.mu.Unlock()
	assert.Less(t, n, compactEvery, "forgotten tasks are not on disk")
}

// A closure a crash interrupts is finished by the restart: the fence goes
// up again, the runs in the branch are stopped, and its record is kept.
func TestAClosureInProgressAtACrashIsFinishedAtRestart(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	task := crashMidClosure(t, dir, svc)
	ctx := context.Background()

	host2 := &svcHost{svc: svc, abortOK: true}
	j2 := openJournal(t, dir)
	m2, err := Open(ctx, host2, WithJournal(j2))
	require.NoError(t, err)
	defer func() { _ = m2.Shutdown(context.Background()) }()
	got, err := m2.Task(task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusCancelled, got.Status, "the restart finished the closure: the child was stopped, confirmed")
	recs := m2.Snapshot().Closures
	require.NotEmpty(t, recs)
	assert.Equal(t, "root", recs[len(recs)-1].SessionID)
	svc.mu.Lock()
	_, alive := svc.sessions["s-"+task.CurrentAttemptID]
	svc.mu.Unlock()
	assert.False(t, alive, "the child session is gone")
}

// crashMidClosure launches a task under "root" on a journal in dir, closes
// the branch of "root", and crashes the process while the closure's abort
// of the task's session (a session of svc) is in flight.
func crashMidClosure(t *testing.T, dir string, svc *sessionService) Task {
	t.Helper()
	hung := make(chan struct{})
	j1 := openJournal(t, dir)
	m1, err := Open(context.Background(), &svcHost{svc: svc, aborted: hung}, WithJournal(j1))
	require.NoError(t, err)
	ctx := context.Background()
	task, err := m1.Launch(ctx, Spec{ParentSessionID: "root", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	waitStatus(t, m1, task.ID, StatusRunning)
	closed := make(chan error, 1)
	go func() {
		_, err := m1.Stop(ctx, Target{Session: "root"})
		closed <- err
	}()
	recv(t, hung, "the closure's abort") // the closure's abort is in flight when the process dies
	crash(t, m1, j1)
	recv(t, closed, "the branch's Stop to return at the crash")
	return task
}

// panicJournal is user code that panics in every method.
type panicJournal struct{}

func (panicJournal) Append([]Record) Commit          { panic("append") }
func (panicJournal) Replay(func(Record) error) error { return nil }
func (panicJournal) Compact([]Record) error          { panic("compact") }
func (panicJournal) Close() error                    { panic("close") }

type panicReplay struct{ panicJournal }

func (panicReplay) Replay(func(Record) error) error { panic("replay") }

func TestAJournalThatPanicsNeverCrashesTheProcess(t *testing.T) {
	_, err := Open(context.Background(), &testHost{}, WithJournal(panicReplay{}))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the journal's Replay panicked")

	_, err = Open(context.Background(), &testHost{}, WithJournal(panicJournal{}))
	require.ErrorIs(t, err, ErrJournal, "the epoch's append panicked: the Manager stops")
	assert.Contains(t, err.Error(), "the journal's Append panicked")

	_, err = OpenFileJournal("  ")
	assert.ErrorIs(t, err, ErrInvalidArgument)
}

// A notification the Notifier refused for good before a crash is settled:
// the restart does not deliver it again (out of its parent's order).
func TestAGivenUpNotificationIsNotDeliveredAgainAfterARestart(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	host := &svcHost{svc: svc}
	refuse := NotifierFunc(func(ctx context.Context, n Notification) error { return errors.New("no") })
	j1 := openJournal(t, dir)
	m1, err := Open(context.Background(), host, WithJournal(j1), WithNotifier(refuse), WithNotifyRetry(1, nil))
	require.NoError(t, err)
	ctx := context.Background()
	task, err := m1.Launch(ctx, Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	got := waitStatus(t, m1, task.ID, StatusRunning)
	require.NoError(t, m1.Observe(Event{SessionID: got.SessionID, Kind: SessionIdle, Text: "x"}))
	waitStatus(t, m1, task.ID, StatusCompleted)
	require.NoError(t, m1.life.group.Wait(ctx)) // the refusal is settled
	require.NotEmpty(t, m1.Dropped().Undelivered)
	crash(t, m1, j1)

	rec := &recorder{}
	j2 := openJournal(t, dir)
	m2, err := Open(ctx, host, WithJournal(j2), WithNotifier(rec))
	require.NoError(t, err)
	want := m1.Dropped().Undelivered
	lost := m2.Dropped().Undelivered
	require.Len(t, lost, len(want), "Undelivered outlives the process")
	for i := range want {
		assert.Equal(t, want[i].ID, lost[i].ID)
		assert.Equal(t, want[i].Text, lost[i].Text)
	}
	err = m2.Shutdown(ctx)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not delivered (see Undelivered)")
	assert.Empty(t, rec.All(), "nothing is delivered again")
}

// A nil or typed-nil journal is a caller's bug (a journal whose opening
// failed, its error lost): refused at once with a clear error, never a
// crash and never a Manager silently in memory.
func TestANilJournalIsRefused(t *testing.T) {
	var typed *fileJournal
	for name, j := range map[string]Journal{"nil": nil, "typed nil": typed} {
		t.Run(name, func(t *testing.T) {
			m, err := Open(context.Background(), &testHost{}, WithJournal(j))
			require.ErrorIs(t, err, ErrInvalidArgument)
			assert.Contains(t, err.Error(), "WithJournal")
			assert.Nil(t, m)
		})
	}
}

// switchJournal is a journal that starts failing when fail is set: a disk
// that fills up, a lease lost, in the middle of a run.
type switchJournal struct {
	Journal
	fail atomic.Bool
}

func (j *switchJournal) Append(b []Record) Commit {
	if j.fail.Load() {
		return failedCommit{errors.New("the disk filled up")}
	}
	return j.Journal.Append(b)
}

// A journal that fails while runs are live, aborts are wanted and starts
// are in flight: the Manager stops acting on the world; Wait and
// WaitParent with no deadline return its error, and Shutdown still returns (no answer can be recorded any more, so none
// is waited for) and says why.
func TestShutdownAfterTheJournalFailedMidRunReturns(t *testing.T) {
	inner, err := OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	defer inner.Close()
	j := &switchJournal{Journal: inner}
	release := make(chan struct{})
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		if req.AttemptNumber == 1 && strings.HasSuffix(req.TaskID, "-hang") {
			<-release // a start in flight when the journal fails
		}
		return sid, nil
	}}
	m, err := Open(context.Background(), host, WithJournal(j))
	require.NoError(t, err)
	spec := Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}}
	running, err := m.Launch(context.Background(), spec)
	require.NoError(t, err)
	waitFor(t, m, running.ID, func(t Task) bool { return t.Status == StatusRunning })
	hung := spec
	hung.ID = "t-hang"
	_, err = m.Launch(context.Background(), hung)
	require.NoError(t, err)

	j.fail.Store(true)
	assert.ErrorIs(t, stopErr(m.Stop(context.Background(), Target{Task: running.ID})), ErrJournal)
	// Waits for what will never be recorded return, with no deadline.
	_, err = m.Wait(context.Background(), running.ID)
	assert.ErrorIs(t, err, ErrJournal)
	_, err = m.WaitParent(context.Background(), "p")
	assert.ErrorIs(t, err, ErrJournal)
	close(release)
	done := make(chan error, 1)
	go func() { done <- m.Shutdown(context.Background()) }()
	select {
	case err := <-done:
		assert.ErrorIs(t, err, ErrJournal)
	case <-time.After(30 * time.Second):
		t.Fatal("Shutdown hung after the journal failed")
	}
	assert.NotContains(t, host.aborts, "ses-1", "an abort ran though its intent was never durable")
}

// gateJournal holds every batch's durability while gate is set, until
// open is closed.
type gateJournal struct {
	Journal
	gate atomic.Bool
	open chan struct{}
}

type gatedCommit struct {
	c    Commit
	open <-chan struct{}
}

func (g gatedCommit) Wait() error { <-g.open; return g.c.Wait() }

func (j *gateJournal) Append(b []Record) Commit {
	c := j.Journal.Append(b)
	if j.gate.Load() {
		return gatedCommit{c: c, open: j.open}
	}
	return c
}

// What Wait and WaitParent return survives a crash: a task's end is shown
// to them only once its records are durable, though Task sees it at once.
func TestWaitReturnsOnlyWhatIsDurable(t *testing.T) {
	inner, err := OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	j := &gateJournal{Journal: inner, open: make(chan struct{})}
	host := &testHost{}
	m, err := Open(context.Background(), host, WithJournal(j))
	require.NoError(t, err)
	defer func() { _ = m.Shutdown(context.Background()) }()
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	running := waitFor(t, m, task.ID, func(t Task) bool { return t.Status == StatusRunning })

	j.gate.Store(true)
	observed := make(chan error, 1)
	go func() {
		observed <- m.Observe(Event{AttemptID: running.Attempts[0].ID, Kind: SessionIdle, Text: "done"})
	}()
	waitFor(t, m, task.ID, func(t Task) bool { return t.Status == StatusCompleted }) // in memory, not durable
	short, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	_, err = m.Wait(short, task.ID)
	cancel()
	assert.ErrorIs(t, err, context.DeadlineExceeded, "Wait returned an end that is not durable")
	short, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
	_, err = m.WaitParent(short, "p")
	cancel()
	assert.ErrorIs(t, err, context.DeadlineExceeded, "WaitParent returned an end that is not durable")

	close(j.open)
	require.NoError(t, recv(t, observed, "Observe to return once its commit is durable"))
	got, err := m.Wait(context.Background(), task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusCompleted, got.Status)
}

// stallingJournal's replay waits for its context to end, as storage that
// stalls would; its records are memJournal's.
type stallingJournal struct {
	memJournal
	replaying chan struct{}
}

func (j *stallingJournal) ReplayContext(ctx context.Context, fn func(Record) error) error {
	close(j.replaying)
	<-ctx.Done()
	return fmt.Errorf("stalled: %w", ctx.Err())
}

// Open bounds a contextReplayer's replay by its own context: a journal
// whose storage stalls cannot hold it past its deadline, and it returns
// the replay's error, leaving nothing behind.
func TestOpenBoundsAcontextReplayerByItsContext(t *testing.T) {
	j := &stallingJournal{replaying: make(chan struct{})}
	host := &testHost{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type opened struct {
		m   *Manager
		err error
	}
	done := make(chan opened, 1)
	go func() {
		m, err := Open(ctx, host, WithJournal(j))
		done <- opened{m, err}
	}()
	recv(t, j.replaying, "the replay")
	cancel()
	got := recv(t, done, "Open to return at its context's end")
	require.ErrorIs(t, got.err, context.Canceled, "the replay's error, through Open")
	assert.Nil(t, got.m)
	assert.Empty(t, host.starts)
}

// replayCounter is a memJournal that is a contextReplayer and counts which
// of its replays was called.
type replayCounter struct {
	memJournal
	plain, withCtx int
}

func (j *replayCounter) Replay(fn func(Record) error) error {
	j.plain++
	return j.memJournal.Replay(fn)
}

func (j *replayCounter) ReplayContext(ctx context.Context, fn func(Record) error) error {
	j.withCtx++
	if err := ctx.Err(); err != nil {
		return err
	}
	return j.memJournal.Replay(fn)
}

// A contextReplayer's records are replayed through ReplayContext alone, as
// Replay's would be: a restart on it finds what was committed.
func TestAcontextReplayerIsReplayedThroughReplayContext(t *testing.T) {
	j := &replayCounter{}
	host := answeringHost()
	m1, err := Open(context.Background(), host, WithJournal(j))
	require.NoError(t, err)
	host.m = m1
	task, err := m1.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	done, err := m1.Wait(context.Background(), task.ID)
	require.NoError(t, err)
	require.NoError(t, m1.Shutdown(context.Background()))

	m2, err := Open(context.Background(), host, WithJournal(j))
	require.NoError(t, err)
	defer func() { _ = m2.Shutdown(context.Background()) }()
	again, err := m2.Task(task.ID)
	require.NoError(t, err, "replayed through ReplayContext")
	assert.Equal(t, done.Status, again.Status)
	assert.Equal(t, 2, j.withCtx)
	assert.Equal(t, 0, j.plain)
}
