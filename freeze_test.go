package bgtask

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/bgtask/bgtask/internal/slots"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Freezing: a settled task is kept compact (ledger.freeze). These tests
// read frozen tasks through the public API and hold every read to what the
// same task read while it was warm.

// freezeAll freezes every settled task that may be, as a restart does.
func freezeAll(m *Manager) {
	m.mu.Lock()
	m.freezeSome(-1)
	m.mu.Unlock()
}

// freezeOne freezes task id alone, as freezeSome would (it leaves the
// queue of tasks to freeze), and reports whether it could.
func freezeOne(m *Manager, id string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.led.tasks[id]
	if e == nil || !m.freezable(e) || !m.led.freeze(e) {
		return false
	}
	m.led.warm = slices.DeleteFunc(m.led.warm, func(w *entry) bool { return w == e })
	return true
}

// frozen reports whether task id, in memory, is frozen: its hot part gone,
// its attempts and sessions in cold alone.
func frozen(t *testing.T, m *Manager, id string) bool {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.led.tasks[id]
	require.NotNil(t, e, "task %s is not in memory", id)
	return e.hot == nil && e.cold != "" && e.attempts == nil && e.sessions == nil
}

func requireFrozen(t *testing.T, m *Manager, ids ...string) {
	t.Helper()
	for _, id := range ids {
		require.True(t, frozen(t, m, id), "task %s is frozen", id)
	}
}

// inside reports whether s's bytes are part of cold's: an index key
// re-keyed by freeze.
func inside(s, cold string) bool {
	if s == "" {
		return true
	}
	p, c := uintptr(unsafe.Pointer(unsafe.StringData(s))), uintptr(unsafe.Pointer(unsafe.StringData(cold)))
	return p >= c && p+uintptr(len(s)) <= c+uintptr(len(cold))
}

// checkIndexes holds the attempt and session indexes to the attempts and
// sessions of every task, warm or frozen: each attempt resolves to its own
// place, each session indexed to a task is one of its sessions, and a
// frozen task's keys are substrings of its cold string.
func checkIndexes(t *testing.T, m *Manager) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	l, attempts := m.led, 0
	for _, e := range m.order {
		atts := e.atts()
		require.Equal(t, len(atts), e.count(), "task %s", e.id)
		for i, a := range atts {
			attempts++
			ref, ok := l.attemptOf(a.ID)
			require.True(t, ok, "attempt %s of task %s is indexed", a.ID, e.id)
			require.Same(t, e, ref.e)
			require.Equal(t, i, ref.index, "attempt %s", a.ID)
			require.Equal(t, a, *ref.attempt())
		}
		require.Equal(t, atts[e.current], *e.cur(), "task %s", e.id)
		for _, s := range e.sessionList() {
			if ref, ok := l.bySession[s]; ok && ref.e == e {
				require.Less(t, ref.index, len(atts), "session %s of task %s", s, e.id)
			}
		}
	}
	require.Len(t, l.byAttempt, attempts, "one index entry per attempt in memory")
	for k, e := range l.byAttempt {
		require.Same(t, l.tasks[e.id], e, "attempt %s names a task in memory", k)
		if e.cold != "" {
			require.True(t, inside(k, e.cold), "attempt key %s of frozen task %s is re-keyed into its cold string", k, e.id)
		}
	}
	for k, ref := range l.bySession {
		require.Same(t, l.tasks[ref.e.id], ref.e, "session %s names a task in memory", k)
		require.Contains(t, ref.e.sessionList(), k, "session %s is one of task %s's", k, ref.e.id)
		if ref.e.cold != "" {
			require.True(t, inside(k, ref.e.cold), "session key %s of frozen task %s is re-keyed into its cold string", k, ref.e.id)
		}
	}
}

// readsOf renders every read of tasks ids, one line each. With local it adds
// what only this process has (Value, Err) and the Manager-wide reads
// (Snapshot with its sequence, Tasks, Dropped().Undelivered, closure
// records).
func readsOf(t *testing.T, m *Manager, ids []string, local bool) string {
	t.Helper()
	ctx := testCtx(t)
	var b strings.Builder
	add := func(what string, v any, err error) {
		require.NoError(t, err, what)
		j, err := json.Marshal(v)
		require.NoError(t, err, what)
		fmt.Fprintf(&b, "%s: %s\n", what, j)
	}
	for _, id := range ids {
		task, err := m.Task(id)
		require.NoError(t, err, "task %s", id)
		add("Task "+id, task, nil)
		waited, err := m.Wait(ctx, id)
		add("Wait", waited, err)
		answer, err := m.WaitAnswer(ctx, id, 1)
		add("WaitAnswer", answer, err)
		add("Envelope", Envelope(task), nil)
		add("Timeline", Timeline(task), nil)
		page, err := m.Tasks(Query{Parent: task.ParentSessionID, Statuses: []Status{task.Status}, Limit: 1000})
		add("Page", page, err)
		if local {
			add("Value", fmt.Sprintf("%#v", task.Value), nil)
			add("Err", fmt.Sprintf("%T %v", task.Cause, task.Cause), nil)
		}
	}
	if local {
		snap := m.Snapshot()
		snap.Epoch = 0 // a Manager's own: two Managers never share one
		add("Snapshot", snap, nil)
		add("Tasks", m.Snapshot().Tasks, nil)
		add("Undelivered", m.Dropped().Undelivered, nil)
		add("Closures", m.Snapshot().Closures, nil)
	}
	return b.String()
}

// failingStart fails the start of a task whose prompt is "no start".
func failingStart(ctx context.Context, req SessionRequest, sid string) (string, error) {
	if req.Prompt == "no start" {
		return "", Permanent(errors.New("no capacity"))
	}
	return sid, nil
}

// richTasks ends a task in each of the ways a task ends, under "chat", and
// returns their ids once every notification was delivered.
func richTasks(t *testing.T, h *harness) []string {
	t.Helper()
	ctx := testCtx(t)
	one := func(s *Spec) { s.Models = mustModels(t, "a/one") }
	var ids []string
	// It answered, with a value, a finish reason, a key, metadata and deadlines.
	a := h.running("chat", func(s *Spec) {
		s.Key, s.Agent, s.Metadata, s.Timeout, s.AttemptTimeout = "k", "agent", map[string]string{"team": "x"}, time.Hour, time.Hour
	})
	require.NoError(t, h.observe(Event{SessionID: a.SessionID, Kind: SessionBusy, Progress: "half way"}))
	require.NoError(t, h.observe(Event{SessionID: a.SessionID, Kind: SessionIdle, Text: "the answer", Reason: "", Value: map[string]int{"n": 42}}))
	// It failed over twice (forbidden, then rate limited), then answered.
	b := h.running("chat", func(s *Spec) { s.Models = mustModels(t, "a/one", "b/two", "c/three") })
	require.NoError(t, h.observe(Event{SessionID: b.SessionID, Kind: SessionError, Err: errForbidden}))
	b2 := waitFor(t, h.m, b.ID, func(x Task) bool { return len(x.Attempts) == 2 && x.Status == StatusRunning })
	require.NoError(t, h.observe(Event{AttemptID: b2.CurrentAttemptID, Kind: SessionError, Err: errRateLimited}))
	b3 := waitFor(t, h.m, b.ID, func(x Task) bool { return len(x.Attempts) == 3 && x.Status == StatusRunning })
	require.NoError(t, h.observe(Event{SessionID: b3.SessionID, Kind: SessionIdle, Text: "third time"}))
	// It failed for good, with its last output as evidence.
	c := h.running("chat", one)
	require.NoError(t, h.observe(Event{SessionID: c.SessionID, Kind: SessionBusy, Text: "partial output"}))
	require.NoError(t, h.observe(Event{SessionID: c.SessionID, Kind: SessionError, Err: Permanent(errors.New("the tool crashed"))}))
	// Its turn ended with no final message; its output was cut off.
	d := h.running("chat", one)
	require.NoError(t, h.observe(Event{SessionID: d.SessionID, Kind: SessionIdle, NoFinalText: true}))
	e := h.running("chat", one)
	require.NoError(t, h.observe(Event{SessionID: e.SessionID, Kind: SessionIdle, Text: "cut", Reason: ReasonOutputLimit}))
	// Cancelled while it ran; interrupted; its start failed.
	f := h.running("chat")
	require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: f.ID})))
	g := h.running("chat", one)
	require.NoError(t, h.observe(Event{SessionID: g.SessionID, Kind: SessionInterrupted}))
	n := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "no start", Models: mustModels(t, "a/one")})
	for _, task := range []Task{a, b, c, d, e, f, g, n} {
		ids = append(ids, h.wait(task.ID).ID)
	}
	h.settle()
	return ids
}

// Every read of a frozen task — Task, Wait, WaitAnswer, Tasks,
// Snapshot, Tasks, its envelope and timeline, its Value and Err — gives
// what it gave while the task was warm, and freezing changes nothing a
// subscriber sees (the snapshot's sequence).
func TestAFrozenTaskReadsAsItDidWarm(t *testing.T) {
	h := newHarness(t, &testHost{start: failingStart})
	ids := richTasks(t, h)
	for _, id := range ids {
		require.False(t, frozen(t, h.m, id), "fewer than freezeLag tasks settled: %s is warm", id)
	}
	warm := readsOf(t, h.m, ids, true)
	freezeAll(h.m)
	requireFrozen(t, h.m, ids...)
	checkIndexes(t, h.m)
	checkInvariants(t, h.m)
	assert.Equal(t, warm, readsOf(t, h.m, ids, true))
}

// Freezing as a live Manager does it: past the latest freezeLag settled
// tasks, at an unlock.
func TestTasksSettledPastTheLagAreFrozen(t *testing.T) {
	h := newHarness(t, &testHost{start: failingStart})
	ids := richTasks(t, h)
	warm := readsOf(t, h.m, ids, false)
	for i := range freezeLag {
		finish(t, h, fmt.Sprintf("later-%d", i))
	}
	h.settle()
	_, _ = h.m.Task(ids[0]) // an unlock
	requireFrozen(t, h.m, ids...)
	checkIndexes(t, h.m)
	assert.Equal(t, warm, readsOf(t, h.m, ids, false))
}

// staleEvents are events for every attempt of tasks ids, by attempt id, by
// session and with a wrong token, and events for no attempt.
func staleEvents(t *testing.T, m *Manager, ids []string) []Event {
	t.Helper()
	evs := []Event{{AttemptID: "attempt-none", Kind: SessionBusy}, {SessionID: "ses-none", Kind: SessionIdle, Text: "x"}}
	for _, id := range ids {
		task, err := m.Task(id)
		require.NoError(t, err)
		for _, a := range task.Attempts {
			evs = append(evs,
				Event{AttemptID: a.ID, Kind: SessionBusy},
				Event{AttemptID: a.ID, Token: a.Token + "-old", Kind: SessionInterrupted},
				Event{AttemptID: a.ID, SessionID: "ses-other", Kind: SessionDeleted})
			if a.SessionID != "" {
				evs = append(evs,
					Event{SessionID: a.SessionID, Kind: SessionIdle, Text: "late"},
					Event{SessionID: a.SessionID, Kind: SessionError, Err: errRateLimited})
			}
		}
	}
	return evs
}

// observeAll observes evs and returns, for each, its error and the attempt
// the line that logged it named.
func observeAll(t *testing.T, m *Manager, logs *logSink, evs []Event) []string {
	t.Helper()
	var out []string
	for _, ev := range evs {
		err := m.Observe(ev)
		require.Error(t, err, "%+v", ev)
		recs := logs.Records()
		last := recs[len(recs)-1]
		require.Equal(t, "event ignored", last["msg"])
		out = append(out, fmt.Sprintf("%v stale=%v unknown=%v task=%s attempt=%s",
			err, errors.Is(err, ErrStaleEvent), errors.Is(err, ErrUnknownSession), last["task"], last["attempt"]))
	}
	return out
}

// An event for a frozen task, by its attempt or its session, is refused as
// it was while the task was warm: the same error, the same attempt named,
// and nothing changes.
func TestStaleEventsForAFrozenTaskAreRefusedAsForAWarmOne(t *testing.T) {
	h := newHarness(t, &testHost{start: failingStart})
	ids := richTasks(t, h)
	evs := staleEvents(t, h.m, ids)
	warm := observeAll(t, h.m, h.logs, evs)
	before := readsOf(t, h.m, ids, true)
	freezeAll(h.m)
	requireFrozen(t, h.m, ids...)
	assert.Equal(t, warm, observeAll(t, h.m, h.logs, evs))
	assert.Equal(t, before, readsOf(t, h.m, ids, true), "a refused event changes nothing")
	requireFrozen(t, h.m, ids...)
}

// branchRun builds a tree whose ended tasks are frozen or not, closes it
// as how says, and renders what came of it.
func branchRun(t *testing.T, freeze bool, how string) string {
	h := newHarness(t, nil)
	ctx := testCtx(t)
	one := func(s *Spec) { s.Models = mustModels(t, "a/one") }
	a := h.running("chat", one)
	b := h.running(a.SessionID, one) // launched from a's session
	require.NoError(t, h.observe(Event{SessionID: b.SessionID, Kind: SessionIdle, Text: "b done"}))
	h.wait(b.ID)
	h.settle() // b's result delivered to a's session: a's turn is not held for it (the children gate)
	require.NoError(t, h.observe(Event{SessionID: a.SessionID, Kind: SessionIdle, Text: "a done"}))
	e := h.running("chat", one)
	require.NoError(t, h.observe(Event{SessionID: e.SessionID, Kind: SessionIdle, Text: "e done"}))
	for _, id := range []string{a.ID, e.ID} {
		h.wait(id)
	}
	c := h.running(a.SessionID, one) // live under the ended a
	d := h.running(b.SessionID, one) // live under the ended b
	h.settle()
	if freeze {
		freezeAll(h.m)
		requireFrozen(t, h.m, a.ID, b.ID, e.ID)
	}
	var rep ClosureReport
	var err error
	switch how {
	case "CloseBranch":
		rep, err = h.m.Stop(ctx, Target{Session: "chat"})
	case "CloseBranch of a's session":
		rep, err = h.m.Stop(ctx, Target{Session: a.SessionID})
	case "CloseTask":
		rep, err = h.m.Stop(ctx, Target{Task: a.ID, Tree: true})
	case "Cancel":
		require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: a.ID})), "an ended task: nothing to do")
		run := a.Attempts[0]
		require.NoError(t, stopErr(h.m.Stop(ctx, Target{Run: RunRef{TaskID: a.ID, AttemptID: run.ID, Token: run.Token}})))
		for _, id := range []string{c.ID, d.ID} {
			require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: id})))
		}
	}
	require.NoError(t, err)
	h.settle()
	checkIndexes(t, h.m)
	rep.Passes = min(rep.Passes, 1) // how many scans it took is timing, not freezing
	for _, id := range []string{c.ID, d.ID} {
		assert.Equal(t, StatusCancelled, h.task(id).Status, "%s: the live run below the frozen tasks was stopped", how)
	}
	kinds := map[string][]NotificationKind{}
	for _, n := range h.rec.All() {
		kinds[n.TaskID] = append(kinds[n.TaskID], n.Kind)
	}
	for _, k := range kinds {
		slices.Sort(k) // the lanes of different parents deliver in no order between them
	}
	aborts := slices.Clone(h.host.Aborts())
	slices.Sort(aborts) // a closure stops its runs side by side: in no order between them
	j, err := json.Marshal([]any{rep, h.m.Snapshot().Tasks, h.m.Snapshot().Closures, aborts, kinds})
	require.NoError(t, err)
	return string(j)
}

// Stop of a task, of a run, of a task with Tree and of a session over a
// branch that holds frozen tasks do what they did over the same branch warm:
// the live runs below them stop, the ended tasks stay as they were.
func TestClosingABranchOfFrozenTasksIsClosingItWarm(t *testing.T) {
	for _, how := range []string{"CloseBranch", "CloseBranch of a's session", "CloseTask", "Cancel"} {
		t.Run(how, func(t *testing.T) {
			assert.Equal(t, branchRun(t, false, how), branchRun(t, true, how))
		})
	}
}

// continueRun continues an ended task, frozen or not, and renders what
// came of it.
func continueRun(t *testing.T, freeze bool) string {
	ctx := testCtx(t)
	host := &resumeHost{testHost: &testHost{}}
	m := mustOpen(host, WithIDs(SequentialIDs()), WithClock(clock.NewFake(t0)), WithNotifier(&recorder{}))
	shutdownAtCleanup(t, m)
	first, err := m.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "draft it", Models: oneModel})
	require.NoError(t, err)
	ses := waitStatus(t, m, first.ID, StatusRunning).SessionID
	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "the draft"}))
	_, err = m.Wait(ctx, first.ID)
	require.NoError(t, err)
	require.NoError(t, m.life.group.Wait(ctx))
	if freeze {
		freezeAll(m)
		requireFrozen(t, m, first.ID)
	}
	next, err := m.Launch(ctx, Spec{ParentSessionID: "p", Prompt: "polish it", ContinueFrom: first.ID, Models: oneModel})
	require.NoError(t, err)
	assert.Equal(t, ses, waitStatus(t, m, next.ID, StatusRunning).SessionID, "the same session")
	_, again := m.Launch(ctx, Spec{ParentSessionID: "p", ContinueFrom: first.ID, Models: oneModel})
	require.ErrorIs(t, again, ErrInvalidArgument, "its session is the live task's now")
	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "polished"}))
	done, err := m.Wait(ctx, next.ID)
	require.NoError(t, err)
	assert.Equal(t, "the draft", done.Outcome.PriorOutput)
	stale := m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "late"})
	require.ErrorIs(t, stale, ErrStaleEvent)
	require.NoError(t, m.life.group.Wait(ctx))
	checkIndexes(t, m)
	ids := []string{first.ID, next.ID}
	reads := readsOf(t, m, ids, true)
	freezeAll(m) // both, now: the session is indexed to the second
	requireFrozen(t, m, ids...)
	checkIndexes(t, m)
	assert.Equal(t, reads, readsOf(t, m, ids, true))
	host.mu.Lock()
	defer host.mu.Unlock()
	return fmt.Sprint(reads, again, stale, host.resumed)
}

// ContinueFrom a frozen task resumes its session as from a warm one.
func TestContinueFromAFrozenTask(t *testing.T) {
	assert.Equal(t, continueRun(t, false), continueRun(t, true))
}

// A task whose session was continued by a task retention has forgotten
// since is refused as a continuation (it no longer holds its session),
// with a SpecError: the Launch neither panics nor wedges the Manager.
func TestContinueFromATaskWhoseContinuationWasForgotten(t *testing.T) {
	ctx := testCtx(t)
	host := &resumeHost{testHost: &testHost{}}
	m := mustOpen(host, WithIDs(SequentialIDs()), WithRetention(Retention{MaxEnded: 1}))
	shutdownAtCleanup(t, m)
	_, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel}) // live: p's ended tasks stay
	require.NoError(t, err)
	first, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: oneModel})
	require.NoError(t, err)
	ses := waitStatus(t, m, first.ID, StatusRunning).SessionID
	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "draft"}))
	next, err := m.Launch(ctx, Spec{ParentSessionID: "q", ContinueFrom: first.ID, Models: oneModel})
	require.NoError(t, err)
	waitStatus(t, m, next.ID, StatusRunning)
	require.NoError(t, m.Observe(Event{SessionID: ses, Kind: SessionIdle, Text: "polished"}))
	_, err = m.Task(next.ID)
	require.ErrorIs(t, err, ErrForgotten, "q has no live task: the continuation goes")
	_, err = m.Task(first.ID)
	require.NoError(t, err)
	launch := func() (err error) {
		defer func() {
			if r := recover(); r != nil { // under m.mu: free it, or the cleanup's Shutdown hangs
				m.mu.Unlock()
				err = fmt.Errorf("Launch panicked: %v", r)
			}
		}()
		_, err = m.Launch(ctx, Spec{ParentSessionID: "p", ContinueFrom: first.ID, Models: oneModel})
		return err
	}
	err = launch()
	var se *SpecError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, "ContinueFrom", se.Field)
	_, err = m.Task(first.ID) // the Manager still answers
	assert.NoError(t, err)
}

// openHarness opens a Manager on the file journal in dir, as newHarness
// makes one (no record tap: a journal's own records are what a restart
// reads).
func openHarness(t *testing.T, dir string, host *testHost) *harness {
	t.Helper()
	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	h := &harness{t: t, host: host, rec: &recorder{}, clock: clock.NewFake(t0), logs: &logSink{}}
	h.m, err = Open(context.Background(), host, WithJournal(j), WithIDs(SequentialIDs()), WithClock(h.clock),
		WithNotifier(h.rec), WithLogger(slog.New(h.logs)))
	require.NoError(t, err)
	shutdownAtCleanup(t, h.m)
	return h
}

// A restart freezes the retained settled tasks past the latest freezeLag
// (on a goroutine of its own, once Open returned), and each reads as it
// did before the restart, warm; a stale event for one is refused as it
// was.
func TestARestartFreezesTheRetainedTasksAndReadsThemAsBefore(t *testing.T) {
	dir := t.TempDir()
	host := &testHost{start: failingStart}
	h1 := openHarness(t, dir, host)
	ids := richTasks(t, h1)
	evs := staleEvents(t, h1.m, ids)
	for _, id := range ids {
		require.False(t, frozen(t, h1.m, id))
	}
	before := readsOf(t, h1.m, ids, false)
	refused := observeAll(t, h1.m, h1.logs, evs)
	for i := range freezeLag {
		finish(t, h1, fmt.Sprintf("later-%d", i))
	}
	h1.settle()
	require.NoError(t, h1.m.Shutdown(testCtx(t)))

	h2 := openHarness(t, dir, host)
	h2.settle() // the replayed tasks are frozen
	requireFrozen(t, h2.m, ids...)
	checkIndexes(t, h2.m)
	checkInvariants(t, h2.m)
	assert.Equal(t, before, readsOf(t, h2.m, ids, false))
	assert.Equal(t, refused, observeAll(t, h2.m, h2.logs, evs))
	requireFrozen(t, h2.m, ids...)
}

// Retention forgets frozen tasks as it forgets warm ones: their ids are
// forgotten, their sessions and attempts unknown, the indexes hold exactly
// the tasks kept.
func TestRetentionForgetsFrozenTasks(t *testing.T) {
	const keep, n = freezeLag + 6, freezeLag + 36
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: keep}))
	var tasks []Task
	for i := range n {
		tasks = append(tasks, finish(t, h, fmt.Sprintf("p%d", i)))
		h.settle()
		if i == keep-1 {
			requireFrozen(t, h.m, tasks[0].ID) // frozen before it is forgotten
		}
	}
	ctx := testCtx(t)
	for _, old := range tasks[:n-keep] {
		_, err := h.m.Task(old.ID)
		assert.ErrorIs(t, err, ErrForgotten)
		_, err = h.m.Wait(ctx, old.ID)
		assert.ErrorIs(t, err, ErrForgotten)
		assert.ErrorIs(t, stopErr(h.m.Stop(ctx, Target{Task: old.ID})), ErrForgotten)
		assert.ErrorIs(t, h.m.Observe(Event{SessionID: old.SessionID, Kind: SessionBusy}), ErrUnknownSession)
		assert.ErrorIs(t, h.m.Observe(Event{AttemptID: old.CurrentAttemptID, Kind: SessionBusy}), ErrUnknownSession)
	}
	kept := tasks[n-keep:]
	requireFrozen(t, h.m, kept[0].ID, kept[keep-freezeLag-1].ID)
	for _, task := range kept {
		got, err := h.m.Task(task.ID)
		require.NoError(t, err)
		require.NoError(t, sameJSON("task "+task.ID, task, got))
	}
	checkIndexes(t, h.m)
	h.m.mu.Lock()
	defer h.m.mu.Unlock()
	assert.Len(t, h.m.led.tasks, keep)
	assert.Len(t, h.m.led.byAttempt, keep)
	assert.Len(t, h.m.led.bySession, keep)
}

// Retention by age reads a frozen task's end from its cold string.
func TestRetentionByAgeForgetsFrozenTasks(t *testing.T) {
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: -1, MaxAge: time.Minute}))
	var old []Task
	for i := range 3 {
		old = append(old, finish(t, h, fmt.Sprintf("p%d", i)))
	}
	h.settle()
	freezeAll(h.m)
	for _, task := range old {
		requireFrozen(t, h.m, task.ID)
	}
	h.clock.Advance(2 * time.Minute)
	fresh := finish(t, h, "q")
	for _, task := range old {
		_, err := h.m.Task(task.ID)
		assert.ErrorIs(t, err, ErrForgotten)
	}
	_, err := h.m.Task(fresh.ID)
	assert.NoError(t, err)
	checkIndexes(t, h.m)
}

// A retry whose abort of the failed session returns after the task ended
// (cancelled meanwhile) crashes nothing, whether the task was frozen or
// forgotten (retention) in between: the retry sees its run is over.
func TestARetryThatReturnsAfterItsTaskFrozeOrWasForgotten(t *testing.T) {
	for _, forget := range []bool{false, true} {
		t.Run(fmt.Sprintf("forgotten=%v", forget), func(t *testing.T) {
			ctx := testCtx(t)
			host, release, entered := abortGate()
			var once sync.Once
			keep := Retention{MaxEnded: -1}
			if forget {
				keep = Retention{MaxEnded: 1}
			}
			m := mustOpen(host, WithIDs(SequentialIDs()), WithClock(clock.NewFake(t0)), WithRetention(keep)) // no notifier: settled as it ends
			shutdownAtCleanup(t, m)
			t.Cleanup(func() { once.Do(func() { close(release) }) }) // before the Shutdown: a failing test never holds the abort
			h := &harness{t: t, m: m, host: host}
			task := h.running("p")
			require.NoError(t, m.Observe(Event{SessionID: task.SessionID, Kind: SessionError, Err: errRateLimited}))
			assert.Equal(t, task.SessionID, recv(t, entered, "the retry's abort"), "the retry aborts the failed session")
			require.NoError(t, stopErr(m.Stop(ctx, Target{Task: task.ID})), "the next attempt has no child: it ends at once")
			ended := h.task(task.ID)
			require.Equal(t, StatusCancelled, ended.Status)
			if forget {
				finish(t, h, "q")
				_, err := m.Task(task.ID)
				require.ErrorIs(t, err, ErrForgotten)
			} else {
				freezeAll(m)
				requireFrozen(t, m, task.ID)
			}
			once.Do(func() { close(release) })
			require.NoError(t, m.life.group.Wait(ctx))
			assert.Len(t, host.Starts(), 1+btoi(forget), "no start for the cancelled retry")
			if !forget {
				assert.Equal(t, ended, h.task(task.ID))
				requireFrozen(t, m, task.ID)
				checkIndexes(t, m)
			}
		})
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Timers that come due after their task froze — the stall watch, the
// task's and the attempt's deadlines, the queue timeout, the retry delay —
// change nothing.
func TestTimersDueAfterTheirTaskFrozeChangeNothing(t *testing.T) {
	h := newHarness(t, nil, WithStallTimeout(time.Minute),
		WithModelLimits(ModelLimits{Models: map[string]int{"a/one": 1}, QueueTimeout: time.Minute}), WithRetryDelay(func(int, error) time.Duration { return time.Minute }))
	ctx := testCtx(t)
	holder := h.running("p1", func(s *Spec) {
		s.Models, s.Timeout, s.AttemptTimeout = mustModels(t, "a/one"), time.Minute, time.Minute
	})
	queued := h.running("p2", func(s *Spec) { s.Models = mustModels(t, "a/one") })
	require.Equal(t, PendingQueued, queued.Pending)
	require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: queued.ID})))
	delayed := h.running("p3", func(s *Spec) { s.Models = mustModels(t, "b/two", "c/three") })
	require.NoError(t, h.observe(Event{SessionID: delayed.SessionID, Kind: SessionError, Err: errRateLimited}))
	waitFor(t, h.m, delayed.ID, func(x Task) bool { return x.Pending == PendingRetryDelay })
	require.NoError(t, stopErr(h.m.Stop(ctx, Target{Task: delayed.ID})))
	require.NoError(t, h.observe(Event{SessionID: holder.SessionID, Kind: SessionIdle, Text: "done"}))
	ids := []string{holder.ID, queued.ID, delayed.ID}
	for _, id := range ids {
		h.wait(id)
	}
	h.settle()
	freezeAll(h.m)
	requireFrozen(t, h.m, ids...)
	before := readsOf(t, h.m, ids, true)
	starts := len(h.host.Starts())
	h.clock.Advance(10 * time.Minute)
	h.settle()
	assert.Equal(t, before, readsOf(t, h.m, ids, true))
	assert.Len(t, h.host.Starts(), starts)
	requireFrozen(t, h.m, ids...)
}

// An abort in flight keeps its task warm: a run that ended on its own
// while its abort was out (the child answered first) is frozen only once
// the abort returned, and the late answer changes nothing.
func TestAnAbortThatReturnsAfterTheRunEndedFreezesItsTaskAfter(t *testing.T) {
	ctx := testCtx(t)
	host, release, entered := abortGate()
	var once sync.Once
	m := mustOpen(host, WithIDs(SequentialIDs()), WithClock(clock.NewFake(t0))) // no notifier: settled as it ends
	shutdownAtCleanup(t, m)
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	h := &harness{t: t, m: m, host: host}
	task := h.running("p")
	cancelled := make(chan error, 1)
	go func() { cancelled <- stopErr(m.Stop(ctx, Target{Task: task.ID})) }()
	assert.Equal(t, task.SessionID, recv(t, entered, "the Stop's abort"))
	require.NoError(t, m.Observe(Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "first"}), "the child answered before the abort landed")
	done := h.wait(task.ID)
	require.Equal(t, StatusCompleted, done.Status)
	freezeAll(m)
	require.False(t, frozen(t, m, task.ID), "its abort is still out")
	once.Do(func() { close(release) })
	require.NoError(t, recv(t, cancelled, "Stop to return"))
	require.NoError(t, m.life.group.Wait(ctx))
	assert.Equal(t, done, h.task(task.ID), "the abort came too late to change it")
	freezeAll(m)
	requireFrozen(t, m, task.ID)
	assert.Equal(t, done, h.task(task.ID))
	checkIndexes(t, m)
}

// lateInputs has the core decide, for task id, each input an effect could
// bring back after the task ended — a start that returns (without a
// session, then with session late), a deadline, a stall check, a queue
// timeout (w: another task's place in the queue), a retry, a recovery
// answer, a function's return, a gate check, an Extend, a stop — and
// renders what it answered.
func lateInputs(t *testing.T, m *Manager, id, late string, w *slots.Waiter[queued]) string {
	t.Helper()
	m.mu.Lock()
	locked := true
	defer func() { // a panic below must not leave the Manager locked for the cleanup's Shutdown
		if locked {
			m.mu.Unlock()
		}
	}()
	e := m.led.tasks[id]
	cur := *e.cur()
	m.decide(&deadlineIn{e: e})
	m.decide(&deadlineIn{e: e, a: cur})
	stall := stallCheckIn{e: e, a: cur}
	m.decide(&stall)
	m.decide(&queueTimeoutIn{e: e, a: cur, w: w})
	retry := retryReadyIn{e: e, next: cur}
	m.decide(&retry)
	m.decide(&recoveredIn{e: e, a: cur, sid: cur.SessionID, report: SessionReport{State: SessionStateAlive}})
	m.decide(&runReturnedIn{attemptID: cur.ID, token: cur.Token, text: "stopped", ended: true})
	m.decide(&gateCheckIn{e: e, g: &gateHold{}})
	extend := extendIn{e: e, prompt: "more"}
	m.decide(&extend)
	stop := stopIn{id: id}
	m.decide(&stop)
	m.decide(&startedIn{e: e, a: cur, seq: 1 << 40})
	m.decide(&startedIn{e: e, a: cur, seq: 1<<40 + 1, sid: late})
	locked = false
	require.NoError(t, m.unlock())
	out := fmt.Sprint(stall.out.done, retry.out.wait == nil, retry.out.err, extend.n, extend.err, stop.out.done, stop.out.err)
	return strings.ReplaceAll(out, id, "<task>")
}

// Inputs that land for a frozen task act on it as on the same task warm:
// nothing changes but a late start's session, indexed to it as an orphan
// and aborted — the task thaws for that record, and freezes again.
func TestLateInputsForAFrozenTaskActAsForAWarmOne(t *testing.T) {
	h := newHarness(t, nil, WithModelLimits(ModelLimits{Models: map[string]int{"q/slot": 1}}))
	one := func(s *Spec) { s.Models = mustModels(t, "a/one") }
	var ids []string
	for range 2 {
		task := h.running("chat", one)
		require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "done"}))
		ids = append(ids, h.wait(task.ID).ID)
	}
	slot := func(s *Spec) { s.Models = mustModels(t, "q/slot") }
	h.running("q", slot)
	queuedTask := h.running("q", slot)
	require.Equal(t, PendingQueued, queuedTask.Pending)
	h.settle()
	warmID, frozenID := ids[0], ids[1]
	require.True(t, freezeOne(h.m, frozenID))
	require.False(t, frozen(t, h.m, warmID))
	before := readsOf(t, h.m, ids, false)
	h.m.mu.Lock()
	w := h.m.led.tasks[queuedTask.ID].slot.waiter
	h.m.mu.Unlock()
	require.NotNil(t, w)
	warm := lateInputs(t, h.m, warmID, "ses-late-warm", w)
	assert.Equal(t, warm, lateInputs(t, h.m, frozenID, "ses-late-frozen", w))
	h.settle()
	assert.Equal(t, before, readsOf(t, h.m, ids, false))
	assert.Subset(t, h.host.Aborts(), []string{"ses-late-warm", "ses-late-frozen"}, "each late session is aborted, never adopted")
	for _, late := range []string{"ses-late-warm", "ses-late-frozen"} {
		assert.ErrorIs(t, h.m.Observe(Event{SessionID: late, Kind: SessionIdle, Text: "x"}), ErrStaleEvent, "%s resolves, as stale", late)
	}
	require.False(t, frozen(t, h.m, frozenID), "thawed for the orphan's record")
	checkIndexes(t, h.m)
	freezeAll(h.m)
	requireFrozen(t, h.m, ids...)
	checkIndexes(t, h.m)
	assert.Equal(t, before, readsOf(t, h.m, ids, false))
	assert.ErrorIs(t, h.m.Observe(Event{SessionID: "ses-late-frozen", Kind: SessionBusy}), ErrStaleEvent)
	assert.Equal(t, PendingQueued, h.task(queuedTask.ID).Pending, "its place in the queue is untouched")
}

// A task whose times cold cannot keep exactly (a clock in a zone other
// than UTC and Local) stays warm and reads as ever; it is looked at once,
// not again at every unlock.
func TestATaskThatCannotFreezeStaysWarmAndIsNotLookedAtAgain(t *testing.T) {
	h := newHarness(t, nil, WithClock(clock.NewFake(t0.In(time.FixedZone("UTC+1", 3600)))))
	var tasks []Task
	for i := range freezeLag + 2*freezeBudget {
		tasks = append(tasks, finish(t, h, fmt.Sprintf("p%d", i)))
	}
	h.settle()
	for range 4 { // unlocks
		_, _ = h.m.Task(tasks[0].ID)
	}
	for _, task := range tasks {
		require.False(t, frozen(t, h.m, task.ID), "task %s", task.ID)
		got, err := h.m.Task(task.ID)
		require.NoError(t, err)
		require.NoError(t, sameJSON("task "+task.ID, task, got))
	}
	h.m.mu.Lock()
	warm := len(h.m.led.warm)
	h.m.mu.Unlock()
	assert.LessOrEqual(t, warm, freezeLag, "the tasks that cannot freeze left the queue of those to freeze")
}

// Fence, from the context of a frozen task's run, says it is superseded,
// as it said once the task ended; a stop of that run does nothing.
func TestFenceAndStopsOfAFrozenTasksRun(t *testing.T) {
	var mu sync.Mutex
	var started context.Context
	host := &testHost{start: func(ctx context.Context, req SessionRequest, sid string) (string, error) {
		mu.Lock()
		started = ctx
		mu.Unlock()
		return sid, nil
	}}
	h := newHarness(t, host)
	task := h.running("chat", func(s *Spec) { s.Models = mustModels(t, "a/one") })
	mu.Lock()
	ctx := started
	mu.Unlock()
	require.NoError(t, Fence(ctx), "its run is live")
	require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "done"}))
	done := h.wait(task.ID)
	h.settle()
	warm := Fence(ctx)
	require.ErrorIs(t, warm, ErrSuperseded)
	freezeAll(h.m)
	requireFrozen(t, h.m, task.ID)
	assert.Equal(t, warm, Fence(ctx))
	ref, ok := RunFromContext(ctx)
	require.True(t, ok)
	stop := testCtx(t)
	assert.NoError(t, stopErr(h.m.Stop(stop, Target{Run: ref})))
	assert.NoError(t, stopErr(h.m.Stop(stop, Target{Task: task.ID})))
	assert.Equal(t, done, h.task(task.ID))
	assert.Empty(t, h.host.Aborts(), "nothing to abort")
	requireFrozen(t, h.m, task.ID)
}

// abortGate is a host each of whose aborts reports its session on entered
// and returns once release is closed.
func abortGate() (host *testHost, release chan struct{}, entered chan string) {
	release, entered = make(chan struct{}), make(chan string, 1)
	host = &testHost{abort: func(ctx context.Context, sid string) error {
		entered <- sid
		<-release
		return nil
	}}
	return host, release, entered
}
