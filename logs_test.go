package bgtask

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Logs and metrics that tell the story: who stopped what, what a branch
// closure did, what a restart's recovery found — and no line says
// `reason=""`.

// attrSink keeps every line with its attributes as they were given.
type attrSink struct {
	mu    sync.Mutex
	lines []line
}

type line struct {
	msg   string
	level slog.Level
	attrs []slog.Attr
}

// get returns the string form of attribute key ("" if the line has none).
func (l line) get(key string) string {
	for _, a := range l.attrs {
		if a.Key == key {
			return a.Value.String()
		}
	}
	return ""
}

func (l line) has(key string) bool {
	return slices.ContainsFunc(l.attrs, func(a slog.Attr) bool { return a.Key == key })
}

func (s *attrSink) Enabled(context.Context, slog.Level) bool { return true }
func (s *attrSink) Handle(_ context.Context, r slog.Record) error {
	l := line{msg: r.Message, level: r.Level}
	r.Attrs(func(a slog.Attr) bool { l.attrs = append(l.attrs, a); return true })
	s.mu.Lock()
	s.lines = append(s.lines, l)
	s.mu.Unlock()
	return nil
}
func (s *attrSink) WithAttrs([]slog.Attr) slog.Handler { return s }
func (s *attrSink) WithGroup(string) slog.Handler      { return s }

func (s *attrSink) all() []line {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.lines)
}

// find returns the lines with msg whose attributes include want.
func (s *attrSink) find(msg string, want map[string]string) []line {
	var out []line
	for _, l := range s.all() {
		if l.is(msg, want) {
			out = append(out, l)
		}
	}
	return out
}

// is says whether l is a msg line with the attributes of want.
func (l line) is(msg string, want map[string]string) bool {
	if l.msg != msg {
		return false
	}
	for k, v := range want {
		if l.get(k) != v {
			return false
		}
	}
	return true
}

// one returns the one line with msg and want, failing the test otherwise.
func (s *attrSink) one(t *testing.T, msg string, want map[string]string) line {
	t.Helper()
	got := s.find(msg, want)
	require.Len(t, got, 1, "one %q line with %v in:\n%v", msg, want, s.all())
	return got[0]
}

// index is the position of the first line with msg and want, or -1.
func (s *attrSink) index(msg string, want map[string]string) int {
	for i, l := range s.all() {
		if l.is(msg, want) {
			return i
		}
	}
	return -1
}

// Each source of a stop logs one info line saying who asked, before the
// task's end, which says it again.
func TestAStopAskedIsLoggedWithWhoAsked(t *testing.T) {
	bg := context.Background()
	for _, tt := range []struct {
		name string
		opts []func(*Spec)
		stop func(h *harness, task Task, cancelCaller func())
		want func(task Task) map[string]string
	}{
		{name: "Cancel", stop: func(h *harness, task Task, _ func()) {
			require.NoError(t, stopErr(h.m.Stop(bg, Target{Task: task.ID})))
		},
			want: func(Task) map[string]string {
				return map[string]string{"stop.kind": "cancel", "stop": "the caller cancelled", "stop.status": "cancelled"}
			}},
		{name: "Stop on another's behalf", stop: func(h *harness, task Task, _ func()) {
			require.NoError(t, stopErr(h.m.Stop(bg, Target{Task: task.ID, NoWait: true, Cause: &StopCause{Kind: StopClosure, Root: "elsewhere"}})))
		}, want: func(Task) map[string]string {
			return map[string]string{"stop.kind": "closure", "stop.root": "elsewhere"}
		}},
		{name: "CloseBranch", stop: func(h *harness, task Task, _ func()) {
			_, err := h.m.Stop(bg, Target{Session: "chat"})
			require.NoError(t, err)
		}, want: func(Task) map[string]string {
			return map[string]string{"stop.kind": "closure", "stop.root": "chat", "stop": "everything session chat started was stopped"}
		}},
		{name: "CloseTask", stop: func(h *harness, task Task, _ func()) {
			_, err := h.m.Stop(bg, Target{Task: task.ID, Tree: true})
			require.NoError(t, err)
		}, want: func(task Task) map[string]string {
			return map[string]string{"stop.kind": "closure", "stop.task": task.ID, "stop": "task " + task.ID + " was stopped with everything beneath it"}
		}},
		{name: "deadline", opts: []func(*Spec){func(s *Spec) { s.Timeout = time.Minute }},
			stop: func(h *harness, task Task, _ func()) { h.clock.Advance(time.Minute) },
			want: func(Task) map[string]string {
				return map[string]string{"stop.kind": "deadline", "stop.status": "error"}
			}},
		{name: "caller's context", opts: []func(*Spec){func(s *Spec) { s.CancelWithCaller = true }},
			stop: func(h *harness, task Task, cancelCaller func()) { cancelCaller() },
			want: func(task Task) map[string]string {
				return map[string]string{"stop.kind": "caller", "stop.task": task.ID}
			}},
		{name: "Shutdown", stop: func(h *harness, task Task, _ func()) { require.NoError(t, h.m.Shutdown(bg)) },
			want: func(Task) map[string]string {
				return map[string]string{"stop.kind": "shutdown", "stop.status": "interrupt"}
			}},
		{name: "a deleted session", stop: func(h *harness, task Task, _ func()) {
			require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionDeleted}))
		}, want: func(Task) map[string]string {
			return map[string]string{"stop.kind": "session_deleted", "stop": "its session was deleted"}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sink := &attrSink{}
			h := newHarness(t, nil, WithLogger(slog.New(sink)))
			ctx, cancel := context.WithCancel(bg)
			defer cancel()
			spec := Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/two")}
			for _, o := range tt.opts {
				o(&spec)
			}
			task, err := h.m.Launch(ctx, spec)
			require.NoError(t, err)
			task = waitFor(t, h.m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
			tt.stop(h, task, cancel)
			h.wait(task.ID)
			h.settle() // the lines are written as the lock is let go, maybe after Wait returned

			want := tt.want(task)
			asked := sink.one(t, "stop asked", map[string]string{"task": task.ID})
			assert.Equal(t, slog.LevelInfo, asked.level)
			assert.Equal(t, task.CurrentAttemptID, asked.get("attempt"))
			assert.Equal(t, task.SessionID, asked.get("session"))
			assert.Equal(t, "running", asked.get("status"), "the run as the stop found it")
			for k, v := range want {
				assert.Equal(t, v, asked.get(k), "%s of %v", k, asked.attrs)
			}
			for _, k := range []string{"stop.root", "stop.task", "stop.note"} {
				if _, named := want[k]; !named {
					assert.False(t, asked.has(k), "a kind that does not name %s leaves it out: %v", k, asked.attrs)
				}
			}
			ended := sink.one(t, "task ended", map[string]string{"task": task.ID})
			assert.Equal(t, want["stop.kind"], ended.get("stop.kind"), "the end says who asked too")
			assert.Less(t, sink.index("stop asked", map[string]string{"task": task.ID}),
				sink.index("task ended", map[string]string{"task": task.ID}), "asked, then ended")
		})
	}
}

// A branch closure logs its beginning (what it closes, who began it) and
// its end with what became of the runs it asked to stop; each run's stop
// names the closure's root.
func TestABranchClosureLogsItsBeginningAndEndWithCounts(t *testing.T) {
	sink := &attrSink{}
	host := &testHost{}
	h := newHarness(t, host, WithLogger(slog.New(sink)))
	mid, midSes := h.child("root")
	grand, grandSes := h.child(midSes)
	stuck, stuckSes := h.child(grandSes)
	done, doneSes := h.child("root")
	require.NoError(t, h.observe(Event{SessionID: doneSes, Kind: SessionIdle, Text: "done before"}))
	h.wait(done.ID)
	host.mu.Lock()
	host.abort = func(_ context.Context, sid string) error {
		if sid == stuckSes {
			return errors.New("the session service is down")
		}
		return nil
	}
	host.mu.Unlock()

	rep, err := h.m.Stop(context.Background(), Target{Session: "root"})
	require.ErrorIs(t, err, ErrBranchNotStopped)
	h.settle()

	begun := sink.one(t, "branch closure begun", map[string]string{"session": "root"})
	assert.Equal(t, slog.LevelInfo, begun.level)
	assert.Equal(t, "stop_session", begun.get("by"))
	assert.Equal(t, "closure", begun.get("stop.kind"))
	assert.Equal(t, "root", begun.get("stop.root"))
	assert.False(t, begun.has("task"), "the root is no task's session: no task, and no empty one")
	for _, id := range []string{mid.ID, grand.ID, stuck.ID} {
		asked := sink.one(t, "stop asked", map[string]string{"task": id})
		assert.Equal(t, "root", asked.get("stop.root"), "task %s: its stop names the closure's root", id)
		assert.Less(t, sink.index("branch closure begun", nil), sink.index("stop asked", map[string]string{"task": id}))
	}
	assert.Empty(t, sink.find("stop asked", map[string]string{"task": done.ID}), "an ended task is not asked")
	ended := sink.one(t, "branch closure ended", map[string]string{"session": "root"})
	assert.Equal(t, "stop_session", ended.get("by"))
	assert.Equal(t, "2", ended.get("stopped"))
	assert.Equal(t, "1", ended.get("failed"))
	assert.Equal(t, "0", ended.get("stopping"))
	assert.Equal(t, strconv.Itoa(rep.Passes), ended.get("passes"))
	assert.True(t, ended.has("duration"))
	assert.False(t, ended.has("err"), "the failures are counted, not listed")
	assert.Len(t, rep.Stopped, 2)
	assert.Len(t, rep.Failed, 1)

	// A Stop with Tree says so, and names the task closed; a Stop of a
	// session with NoWait says so too.
	host.mu.Lock()
	host.abort = nil
	host.mu.Unlock()
	_, err = h.m.Stop(context.Background(), Target{Task: stuck.ID, Tree: true})
	require.NoError(t, err)
	h.settle()
	begun = sink.one(t, "branch closure begun", map[string]string{"by": "stop_tree"})
	assert.Equal(t, stuck.ID, begun.get("task"))
	assert.Equal(t, stuckSes, begun.get("session"))
	ended = sink.one(t, "branch closure ended", map[string]string{"by": "stop_tree"})
	assert.Equal(t, "1", ended.get("stopped"))

	other, _ := h.child("second")
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Session: "second", NoWait: true})))
	h.wait(other.ID)
	h.settle()
	sink.one(t, "branch closure begun", map[string]string{"by": "stop_session", "session": "second"})
	ended = sink.one(t, "branch closure ended", map[string]string{"by": "stop_session", "session": "second"})
	assert.Equal(t, "1", ended.get("stopped"))
}

// The closures no caller asked for name what began them: the caller's
// context of a task with Spec.CancelWithCaller, and a deleted session.
func TestAClosureNoCallerAskedForSaysWhatBeganIt(t *testing.T) {
	t.Run("caller", func(t *testing.T) {
		sink := &attrSink{}
		h := newHarness(t, nil, WithLogger(slog.New(sink)))
		ctx, cancel := context.WithCancel(context.Background())
		task, err := h.m.Launch(ctx, Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), CancelWithCaller: true})
		require.NoError(t, err)
		task = waitFor(t, h.m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
		kid, _ := h.child(task.SessionID)
		cancel()
		h.wait(task.ID)
		h.wait(kid.ID)
		h.settle()
		begun := sink.one(t, "branch closure begun", map[string]string{"by": "caller"})
		assert.Equal(t, task.ID, begun.get("task"))
		assert.Equal(t, "caller", begun.get("stop.kind"))
		assert.Equal(t, task.ID, begun.get("stop.task"))
		ended := sink.one(t, "branch closure ended", map[string]string{"by": "caller"})
		assert.Equal(t, "2", ended.get("stopped"))
		asked := sink.one(t, "stop asked", map[string]string{"task": kid.ID})
		assert.Equal(t, "caller", asked.get("stop.kind"), "the kid's stop: the caller of its ancestor")
		assert.Equal(t, task.ID, asked.get("stop.task"))
	})
	t.Run("session deleted", func(t *testing.T) {
		sink := &attrSink{}
		h := newHarness(t, nil, WithLogger(slog.New(sink)))
		task, ses := h.child("chat")
		kid, _ := h.child(ses)
		require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionDeleted}))
		h.wait(task.ID)
		h.wait(kid.ID)
		h.settle()
		assert.Equal(t, "session_deleted", sink.one(t, "stop asked", map[string]string{"task": task.ID}).get("stop.kind"))
		begun := sink.one(t, "branch closure begun", map[string]string{"by": "session_deleted"})
		assert.Equal(t, ses, begun.get("session"))
		assert.Equal(t, task.ID, begun.get("task"))
		ended := sink.one(t, "branch closure ended", map[string]string{"by": "session_deleted"})
		assert.Equal(t, "1", ended.get("stopped"), "the kid; its root had ended already")
		asked := sink.one(t, "stop asked", map[string]string{"task": kid.ID})
		assert.Equal(t, "closure", asked.get("stop.kind"))
		assert.Equal(t, ses, asked.get("stop.root"))
	})
}

// storyMetrics records the measurements that tell who stopped what.
type storyMetrics struct {
	NopMetrics
	mu        sync.Mutex
	stops     map[string][]StopCause // by task
	begun     []ClosureSummary
	ended     []ClosureSummary
	recovered []RecoveryCounts
	reasons   map[string]Reason // by task
}

func newStoryMetrics() *storyMetrics {
	return &storyMetrics{stops: map[string][]StopCause{}, reasons: map[string]Reason{}}
}

func (s *storyMetrics) StopAsked(t Task, c StopCause) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stops[t.ID] = append(s.stops[t.ID], c)
}

func (s *storyMetrics) ClosureBegun(c ClosureSummary) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.begun = append(s.begun, c)
}

func (s *storyMetrics) ClosureEnded(c ClosureSummary, _ time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ended = append(s.ended, c)
}

func (s *storyMetrics) Recovered(c RecoveryCounts, _ time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.recovered = append(s.recovered, c)
}

func (s *storyMetrics) TaskEnded(t Task, _ Status, reason Reason, _ time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reasons[t.ID] = reason
}

// The Metrics hear the same facts as the log lines.
func TestMetricsTellWhoStoppedWhatAndWhatAClosureDid(t *testing.T) {
	mt := newStoryMetrics()
	h := newHarness(t, nil, WithMetrics(mt))
	bg := context.Background()
	clean := h.running("chat")
	require.NoError(t, h.observe(Event{SessionID: clean.SessionID, Kind: SessionIdle, Text: "ok"}))
	cancelled := h.running("chat")
	require.NoError(t, stopErr(h.m.Stop(bg, Target{Task: cancelled.ID})))
	late := h.running("chat", func(s *Spec) { s.Timeout = time.Minute })
	h.clock.Advance(time.Minute)
	h.wait(late.ID)
	top, topSes := h.child("tree")
	kid, _ := h.child(topSes)
	rep, err := h.m.Stop(bg, Target{Session: "tree"})
	require.NoError(t, err)
	h.wait(clean.ID)
	h.settle()

	mt.mu.Lock()
	defer mt.mu.Unlock()
	assert.Equal(t, map[string][]StopCause{
		cancelled.ID: {{Kind: StopCancel}},
		late.ID:      {{Kind: StopDeadline}},
		top.ID:       {{Kind: StopClosure, Root: "tree"}},
		kid.ID:       {{Kind: StopClosure, Root: "tree"}},
	}, mt.stops, "one measurement per task stopped, with who asked")
	assert.Equal(t, []ClosureSummary{{SessionID: "tree", By: "stop_session", Stop: StopCause{Kind: StopClosure, Root: "tree"}}}, mt.begun)
	assert.Equal(t, []ClosureSummary{{SessionID: "tree", By: "stop_session", Stop: StopCause{Kind: StopClosure, Root: "tree"},
		Stopped: 2, Passes: rep.Passes}}, mt.ended)
	assert.Equal(t, Reason(""), mt.reasons[clean.ID], "a clean answer has no reason: an adapter leaves it out")
	assert.Equal(t, ReasonDeadline, mt.reasons[late.ID])
	assert.Empty(t, mt.recovered, "no journal: no recovery")
}

// A restart logs one line with what its recovery found and did, and
// measures the same counts; a fresh journal is no restart.
func TestARestartLogsAndMeasuresWhatItsRecoveryDid(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	host := &svcHost{svc: svc}
	sink1 := &attrSink{}
	hold := NotifierFunc(func(ctx context.Context, n Notification) error { <-ctx.Done(); return ctx.Err() })
	j1 := openJournal(t, dir)
	m1, err := Open(context.Background(), host, WithJournal(j1), WithNotifier(hold), WithNotifyRetry(1, nil), WithLogger(slog.New(sink1)))
	require.NoError(t, err)
	spec := func(parent string) Spec {
		return Spec{ParentSessionID: parent, Models: []Model{{Provider: "a", ID: "1"}}}
	}
	ctx := context.Background()

	done, err := m1.Launch(ctx, spec("p-done")) // its final summary and all_complete are never delivered
	require.NoError(t, err)
	waitStatus(t, m1, done.ID, StatusRunning)
	require.NoError(t, m1.Observe(Event{SessionID: "s-" + done.CurrentAttemptID, Kind: SessionIdle, Text: "before"}))
	waitStatus(t, m1, done.ID, StatusCompleted)
	var ids []string
	for _, p := range []string{"p-alive", "p-ended", "p-gone"} {
		task, err := m1.Launch(ctx, spec(p))
		require.NoError(t, err)
		waitStatus(t, m1, task.ID, StatusRunning)
		ids = append(ids, task.ID)
	}
	alive, ended, gone := ids[0], ids[1], ids[2]
	crash(t, m1, j1)
	assert.Empty(t, sink1.find("recovered from the journal", nil), "a fresh journal: no restart")

	svc.set("s-"+mustTask(t, m1, ended).CurrentAttemptID, SessionStateEnded, Event{Kind: SessionIdle, Text: "done while you were away"})
	svc.mu.Lock()
	delete(svc.sessions, "s-"+mustTask(t, m1, gone).CurrentAttemptID)
	svc.mu.Unlock()

	sink := &attrSink{}
	mt := newStoryMetrics()
	rec := &recorder{}
	j2 := openJournal(t, dir)
	m2, err := Open(ctx, host, WithJournal(j2), WithNotifier(rec), WithLogger(slog.New(sink)), WithMetrics(mt))
	require.NoError(t, err)
	readopted := waitStatus(t, m2, alive, StatusRunning)
	require.NoError(t, m2.Observe(Event{SessionID: readopted.SessionID, Kind: SessionIdle, Text: "after"}))
	waitStatus(t, m2, alive, StatusCompleted)
	waitStatus(t, m2, ended, StatusCompleted)
	waitStatus(t, m2, gone, StatusInterrupt)
	require.NoError(t, m2.Shutdown(ctx))

	want := RecoveryCounts{Tasks: 4, Live: 3, Readopted: 1, Ended: 1, Interrupted: 1, Redelivered: 2}
	got := sink.one(t, "recovered from the journal", nil)
	assert.Equal(t, slog.LevelInfo, got.level)
	for k, v := range map[string]int{"tasks": want.Tasks, "live": want.Live, "readopted": want.Readopted, "ended": want.Ended,
		"interrupted": want.Interrupted, "stopped": 0, "started": 0, "retried": 0, "redelivered": want.Redelivered,
		"owed": 0, "undelivered": 0, "closures": 0} {
		assert.Equal(t, strconv.Itoa(v), got.get(k), "%s in %v", k, got.attrs)
	}
	assert.True(t, got.has("duration"))
	mt.mu.Lock()
	assert.Equal(t, []RecoveryCounts{want}, mt.recovered, "measured once, with the same counts")
	mt.mu.Unlock()
	var again []NotificationKind
	for _, n := range rec.All() {
		if n.ParentSessionID == "p-done" {
			again = append(again, n.Kind)
		}
	}
	assert.Equal(t, []NotificationKind{NotifyFinalSummary, NotifyAllComplete}, again, "the two redelivered")
}

func mustTask(t *testing.T, m *Manager, id string) Task {
	t.Helper()
	task, err := m.Task(id)
	require.NoError(t, err)
	return task
}

// A closure the crash interrupted is finished by the restart, which says
// so: the closure is the restart's, and the recovery counts it.
func TestAClosureFinishedAtRestartSaysSo(t *testing.T) {
	dir := t.TempDir()
	svc := newSessionService()
	crashMidClosure(t, dir, svc)
	ctx := context.Background()

	sink := &attrSink{}
	j2 := openJournal(t, dir)
	m2, err := Open(ctx, &svcHost{svc: svc, abortOK: true}, WithJournal(j2), WithLogger(slog.New(sink)))
	require.NoError(t, err)
	require.NoError(t, m2.Shutdown(ctx))
	begun := sink.one(t, "branch closure begun", map[string]string{"by": "restart"})
	assert.Equal(t, "root", begun.get("session"))
	ended := sink.one(t, "branch closure ended", map[string]string{"by": "restart"})
	recs := m2.Snapshot().Closures
	require.NotEmpty(t, recs)
	rec := recs[len(recs)-1] // the restart's closure
	require.Equal(t, "root", rec.SessionID)
	// What it found still running is counted (the re-adopted run's own
	// stop may have ended it first): as its record says.
	assert.Equal(t, strconv.Itoa(len(rec.Stopped)), ended.get("stopped"), "%v", ended.attrs)
	assert.Equal(t, "0", ended.get("failed"))
	assert.Equal(t, "0", ended.get("stopping"))
	assert.Equal(t, strconv.Itoa(rec.Passes), ended.get("passes"))
	assert.False(t, ended.has("ended"), "it ran to its end")
	got := sink.one(t, "recovered from the journal", nil)
	assert.Equal(t, "1", got.get("closures"))
	assert.Equal(t, "1", got.get("readopted"), "the run was alive: taken back, then stopped by the closure")
	assert.Less(t, sink.index("branch closure ended", nil), sink.index("recovered from the journal", nil),
		"the recovery is over once the closure is")
}

// No line anywhere — info, debug, warn, error — carries an attribute
// whose value is an empty string: a line says what it knows.
func TestNoLogLineHasAnEmptyAttribute(t *testing.T) {
	sink := &attrSink{}
	release := make(chan struct{})
	host := &testHost{}
	h := newHarness(t, host, WithLogger(slog.New(sink)))
	bg := context.Background()

	clean := h.running("chat")
	require.NoError(t, h.observe(Event{SessionID: clean.SessionID, Kind: SessionIdle, Text: "ok"}))
	retried := h.running("chat")
	require.NoError(t, h.observe(Event{SessionID: retried.SessionID, Kind: SessionError, Err: errors.New("429 Too Many Requests")}))
	retried = waitFor(t, h.m, retried.ID, func(t Task) bool { return t.Status == StatusRunning && t.SessionID != retried.SessionID })
	require.NoError(t, h.observe(Event{SessionID: retried.SessionID, Kind: SessionInterrupted}))
	cancelled := h.running("chat")
	require.NoError(t, stopErr(h.m.Stop(bg, Target{Task: cancelled.ID})))
	late := h.running("chat", func(s *Spec) { s.Timeout = time.Minute })
	h.clock.Advance(time.Minute)
	h.wait(late.ID)
	_, topSes := h.child("tree")
	h.child(topSes)
	_, err := h.m.Stop(bg, Target{Session: "tree"})
	require.NoError(t, err)
	deleted, _ := h.child("chat")
	require.NoError(t, h.observe(Event{SessionID: deleted.SessionID, Kind: SessionDeleted}))
	assert.ErrorIs(t, h.m.Observe(Event{SessionID: "nobody", Kind: SessionBusy}), ErrUnknownSession) // debug: ignored
	// An event held while a start is in flight (debug), and a failed
	// abort (warn).
	asked := make(chan string, 1)
	host.mu.Lock()
	host.start = func(ctx context.Context, _ SessionRequest, sid string) (string, error) {
		asked <- sid
		<-release
		return sid, nil
	}
	host.abort = func(context.Context, string) error { return errors.New("no") }
	host.mu.Unlock()
	held := h.launch("a/one")
	require.NoError(t, h.m.Observe(Event{SessionID: recv(t, asked, "the held start"), Kind: SessionBusy}), "held: its start is in flight")
	close(release)
	held = waitFor(t, h.m, held.ID, func(t Task) bool { return t.Status == StatusRunning })
	assert.Error(t, stopErr(h.m.Stop(bg, Target{Task: held.ID})))
	host.mu.Lock()
	host.abort = nil
	host.mu.Unlock()
	require.NoError(t, h.m.Shutdown(bg))

	lines := sink.all()
	levels := map[slog.Level]bool{}
	for _, l := range lines {
		levels[l.level] = true
		for _, a := range l.attrs {
			if a.Value.Kind() == slog.KindString {
				assert.NotEmpty(t, a.Value.String(), "%q has an empty %s: %v", l.msg, a.Key, l.attrs)
			}
		}
	}
	assert.True(t, levels[slog.LevelDebug] && levels[slog.LevelInfo] && levels[slog.LevelWarn], "a varied run: %v", levels)
	ended := sink.one(t, "task ended", map[string]string{"task": clean.ID})
	assert.Equal(t, "completed", ended.get("status"))
	assert.False(t, ended.has("reason"), "a clean answer has no reason: %v", ended.attrs)
	assert.False(t, ended.has("stop"), "nor a stop")
	for _, msg := range []string{"task launched", "attempt started", "retry scheduled", "task ended",
		"stop asked", "branch closure begun", "branch closure ended", "event ignored",
		"event held until its session is bound", "abort failed; the child is still running"} {
		assert.NotEmpty(t, sink.find(msg, nil), "the run logged %q", msg)
	}
}

// A deleted session's closure that cannot run its passes (the Manager
// shut down, a run whose abort failed still live) ends as it began: one
// "ended" line and one ClosureEnded for its "begun", saying Shutdown cut
// it short.
func TestADeletedSessionsClosureAfterShutdownEndsAsItBegan(t *testing.T) {
	if os.Getenv("BGTASK_TEST_JOURNAL") != "" {
		t.Skip("Shutdown closed the remote journal: the deleted session after it cannot be recorded, and is refused")
	}
	sink, mt := &attrSink{}, newStoryMetrics()
	host := &testHost{abort: func(context.Context, string) error { return errors.New("the session service is down") }}
	h := newHarness(t, host, WithLogger(slog.New(sink)), WithMetrics(mt))
	task, ses := h.child("chat")
	require.Error(t, h.m.Shutdown(context.Background()), "its abort failed: it runs on")
	require.Equal(t, StatusRunning, h.task(task.ID).Status)
	require.NoError(t, h.m.Observe(Event{SessionID: ses, Kind: SessionDeleted}))
	h.wait(task.ID)

	begun := sink.find("branch closure begun", map[string]string{"by": "session_deleted"})
	require.Len(t, begun, 1, "%v", sink.all())
	assert.Equal(t, ses, begun[0].get("session"))
	ended := sink.one(t, "branch closure ended", map[string]string{"by": "session_deleted"})
	assert.Equal(t, ses, ended.get("session"))
	assert.Equal(t, "shutdown", ended.get("ended"))
	assert.Equal(t, "0", ended.get("stopped"))
	assert.Less(t, sink.index("branch closure begun", nil), sink.index("branch closure ended", nil))
	mt.mu.Lock()
	defer mt.mu.Unlock()
	require.Len(t, mt.begun, 1)
	require.Len(t, mt.ended, 1, "every ClosureBegun has its ClosureEnded")
	assert.Equal(t, "session_deleted", mt.ended[0].By)
	assert.Equal(t, "shutdown", mt.ended[0].Ended)
	assert.False(t, mt.ended[0].Dropped)
}

// A closure whose caller's context ends before its runs stopped says so
// (ClosureSummary.Ended, the line's "ended"); one that ran to its end says
// nothing of the kind.
func TestAClosureCutShortByItsCallerSaysWhy(t *testing.T) {
	sink, mt := &attrSink{}, newStoryMetrics()
	host := &testHost{}
	h := newHarness(t, host, WithLogger(slog.New(sink)), WithMetrics(mt))
	done, _ := h.child("whole")
	_, err := h.m.Stop(context.Background(), Target{Session: "whole"})
	require.NoError(t, err)
	h.wait(done.ID)
	task, _ := h.child("root")
	held, release := make(chan string, 1), make(chan struct{})
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	host.mu.Lock()
	host.abort = func(_ context.Context, sid string) error {
		held <- sid
		<-release
		return nil
	}
	host.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	closed := make(chan error, 1)
	go func() {
		_, err := h.m.Stop(ctx, Target{Session: "root"})
		closed <- err
	}()
	recv(t, held, "the closure's abort") // the abort is out; the closure waits for it
	cancel()
	require.ErrorIs(t, recv(t, closed, "the branch's Stop to return at its context's end"), context.Canceled)
	close(release)
	h.wait(task.ID)
	h.settle()

	whole := sink.one(t, "branch closure ended", map[string]string{"session": "whole"})
	assert.False(t, whole.has("ended"), "it ran to its end: %v", whole.attrs)
	ended := sink.one(t, "branch closure ended", map[string]string{"session": "root"})
	assert.Equal(t, "cancelled", ended.get("ended"))
	assert.Equal(t, "1", ended.get("stopping"), "asked to stop, not stopped when it returned")
	mt.mu.Lock()
	defer mt.mu.Unlock()
	require.Len(t, mt.ended, 2)
	assert.Equal(t, "", mt.ended[0].Ended)
	assert.Equal(t, "cancelled", mt.ended[1].Ended)
	assert.Equal(t, 1, mt.ended[1].Stopping)
}

// A stop asked of a task that is already stopping (its deadline's abort
// held by the host, then a Stop) logs no second "stop asked": the first
// stop is who stopped it.
func TestASecondStopOfAStoppingTaskLogsNoSecondLine(t *testing.T) {
	sink, mt := &attrSink{}, newStoryMetrics()
	held, release := make(chan string, 1), make(chan struct{})
	host := &testHost{abort: func(_ context.Context, sid string) error {
		held <- sid
		<-release
		return nil
	}}
	h := newHarness(t, host, WithLogger(slog.New(sink)), WithMetrics(mt))
	waiting := make(chan string, 1)
	h.m.hooks.waiting = func(id string) { waiting <- id }
	task := h.running("chat", func(s *Spec) { s.Timeout = time.Minute })
	h.clock.Advance(time.Minute)
	recv(t, held, "the deadline's abort") // the deadline's abort, held
	cancelled := make(chan error, 1)
	go func() { cancelled <- stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})) }()
	require.Equal(t, task.ID, recv(t, waiting, "the Stop to wait for the abort in flight"), "the Stop was decided: it waits for the abort in flight")
	close(release)
	require.NoError(t, recv(t, cancelled, "Stop to return"))
	h.wait(task.ID)
	h.settle()

	asked := sink.find("stop asked", nil)
	require.Len(t, asked, 1, "%v", asked)
	assert.Equal(t, "deadline", asked[0].get("stop.kind"))
	mt.mu.Lock()
	defer mt.mu.Unlock()
	assert.Equal(t, map[string][]StopCause{task.ID: {{Kind: StopDeadline}}}, mt.stops)
}

// A Stop of a run (Target.Run) asks its stop once: one "stop asked" line.
func TestCancelRunLogsOneStopAsked(t *testing.T) {
	sink := &attrSink{}
	h := newHarness(t, nil, WithLogger(slog.New(sink)))
	task := h.running("chat")
	cur := task.Current()
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Run: RunRef{TaskID: task.ID, AttemptID: cur.ID, Token: cur.Token}})))
	h.wait(task.ID)
	h.settle()
	asked := sink.find("stop asked", nil)
	require.Len(t, asked, 1, "%v", asked)
	assert.Equal(t, task.ID, asked[0].get("task"))
	assert.Equal(t, "cancel", asked[0].get("stop.kind"))
}

// recoveryHost is the session service as a restart sees it, with two
// twists: the question about session late is answered only once lateEnded
// is closed, and FindSession names, for the attempts in misfound, a
// session that is not theirs.
type recoveryHost struct {
	svcHost
	late      string
	lateEnded <-chan struct{}
	misfound  map[string]string // attempt id → the session FindSession names
}

func (h *recoveryHost) FindSession(ctx context.Context, req SessionRequest) (string, error) {
	if sid, ok := h.misfound[req.AttemptID]; ok {
		return sid, nil
	}
	return h.svcHost.FindSession(ctx, req)
}

func (h *recoveryHost) SessionStatus(ctx context.Context, sid string) (SessionReport, error) {
	if sid == h.late {
		select {
		case <-h.lateEnded:
		case <-ctx.Done():
		}
	}
	return h.svcHost.SessionStatus(ctx, sid)
}

// endedHook is storyMetrics that closes ended once task id ended.
type endedHook struct {
	*storyMetrics
	id    string
	ended chan struct{}
}

func (m *endedHook) TaskEnded(t Task, state Status, reason Reason, d time.Duration) {
	m.storyMetrics.TaskEnded(t, state, reason, d)
	if t.ID == m.id {
		close(m.ended)
	}
}

// Every run live at the crash is counted once, in exactly one outcome:
// Live is Readopted + Ended + Interrupted + Stopped + Started — a run
// whose deadline passed across the restart and whose abort landed before
// the host's answer, and a run whose session the host found but the
// ledger refused, included. A closure the restart drops is not counted
// finished.
func TestARestartCountsEachLiveRunInExactlyOneOutcome(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	svc := newSessionService()
	j1 := openJournal(t, dir)
	m1, err := Open(ctx, &svcHost{svc: svc}, WithJournal(j1), WithClock(clock.NewFake(t0)),
		WithModelLimits(ModelLimits{Models: map[string]int{"q/1": 1}}), WithRetryDelay(func(int, error) time.Duration { return 0 }))
	require.NoError(t, err)
	launch := func(parent string, spec Spec, want func(Task) bool) Task {
		t.Helper()
		spec.ParentSessionID = parent
		task, err := m1.Launch(ctx, spec)
		require.NoError(t, err)
		return waitFor(t, m1, task.ID, want)
	}
	running := func(task Task) bool { return task.Status == StatusRunning }
	one := func(model string) Spec { return Spec{Models: mustModels(t, model)} }

	alive := launch("p-alive", one("q/1"), running)
	queued := launch("p-queued", one("q/1"), func(task Task) bool { return task.Pending == PendingQueued })
	ended := launch("p-ended", one("a/1"), running)
	gone := launch("p-gone", one("a/1"), running)
	lateSpec := one("a/1")
	lateSpec.Timeout = time.Hour
	late := launch("p-late", lateSpec, running)
	retried := launch("p-retried", Spec{Models: mustModels(t, "a/1", "b/2")}, running)
	svc.mu.Lock()
	svc.gate[2] = make(chan struct{}) // never opened: the retry's start answers no more
	svc.mu.Unlock()
	require.NoError(t, m1.Observe(Event{SessionID: retried.SessionID, Kind: SessionError, Err: errRateLimited}))
	recv(t, svc.gated, "the retry's start")
	svc.mu.Lock()
	svc.gate[1] = make(chan struct{})
	svc.mu.Unlock()
	lost, err := m1.Launch(ctx, Spec{ParentSessionID: "p-lost", Models: mustModels(t, "a/1")})
	require.NoError(t, err)
	require.Equal(t, lost.CurrentAttemptID, recv(t, svc.gated, "the lost task's start"))
	require.NoError(t, stopErr(m1.Stop(ctx, Target{Session: "ghost", NoWait: true})), "a start in flight may create it: its closure is recorded")
	crash(t, m1, j1)
	r := mustTask(t, m1, retried.ID)
	require.Len(t, r.Attempts, 2)

	svc.mu.Lock()
	clear(svc.gate)
	svc.mu.Unlock()
	svc.set(ended.SessionID, SessionStateEnded, Event{Kind: SessionIdle, Text: "done while you were away"})
	svc.mu.Lock()
	delete(svc.sessions, gone.SessionID)
	svc.mu.Unlock()

	mt := &endedHook{storyMetrics: newStoryMetrics(), id: late.ID, ended: make(chan struct{})}
	host := &recoveryHost{svcHost: svcHost{svc: svc, abortOK: true}, late: late.SessionID, lateEnded: mt.ended,
		misfound: map[string]string{r.Attempts[1].ID: r.Attempts[0].SessionID}} // the session of its own failed attempt
	sink := &attrSink{}
	m2, err := Open(ctx, host, WithJournal(openJournal(t, dir)), WithClock(clock.NewFake(t0.Add(2*time.Hour))),
		WithMetrics(mt), WithLogger(slog.New(sink)))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)

	assert.Equal(t, StatusRunning, mustTask(t, m2, alive.ID).Status)
	assert.Equal(t, StatusRunning, mustTask(t, m2, lost.ID).Status)
	assert.Equal(t, StatusCompleted, mustTask(t, m2, ended.ID).Status)
	assert.Equal(t, StatusInterrupt, mustTask(t, m2, gone.ID).Status)
	lt := mustTask(t, m2, late.ID)
	assert.Equal(t, StatusError, lt.Status)
	assert.Equal(t, ReasonDeadline, lt.Outcome.Reason)
	rt := mustTask(t, m2, retried.ID)
	assert.Equal(t, StatusInterrupt, rt.Status, "the session found is its failed attempt's: never taken back, never left pending")
	assert.Equal(t, startOutcomeUnknown, rt.Error)
	_ = queued

	want := RecoveryCounts{Tasks: 7, Live: 7, Readopted: 2, Ended: 1, Interrupted: 2, Stopped: 1, Started: 1}
	mt.mu.Lock()
	got := slices.Clone(mt.recovered)
	mt.mu.Unlock()
	require.Len(t, got, 1)
	n := got[0]
	assert.Equal(t, n.Live, n.Readopted+n.Ended+n.Interrupted+n.Stopped+n.Started, "each live run in exactly one outcome: %+v", n)
	assert.Equal(t, want, n)
	line := sink.one(t, "recovered from the journal", nil)
	assert.Equal(t, "7", line.get("live"))
	assert.Equal(t, "1", line.get("stopped"))
	assert.Equal(t, "0", line.get("closures"), "the ghost's closure was dropped, not finished")
}
