package bgtask

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The tests of what a real harness needed (structured results, a
// completion hook, what the run is told, context, tree limits, deadlines,
// lookups, models, ids, retry classification, dependency cost).

// report is a harness's own result type: a part for the model, a part for
// the user.
type report struct {
	ForModel string
	ForUser  string
}

func TestARunReturnsAStructuredResultKeptBesideTheTask(t *testing.T) {
	h := newFuncHarness(t, Returning(func(ctx context.Context, run Run) (report, error) {
		return report{ForModel: "model part of " + run.Prompt, ForUser: "user part"}, nil
	}, func(r report) string { return r.ForModel }))
	task := h.launchSpec(Spec{ParentSessionID: "p", Prompt: "q", Models: mustModels(t, "a/one")})
	done := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "model part of q", done.Result, "the text form is text(v)")
	assert.Equal(t, "model part of q", done.Outcome.Answer)
	got, ok := ValueOf[report](done)
	require.True(t, ok, "Value is a report: %#v", done.Value)
	assert.Equal(t, report{ForModel: "model part of q", ForUser: "user part"}, got)
	_, isString := ValueOf[string](done)
	assert.False(t, isString)
	again, err := h.m.Task(task.ID)
	require.NoError(t, err)
	assert.Equal(t, got, again.Value, "every later snapshot carries it")
	b, err := json.Marshal(done)
	require.NoError(t, err)
	assert.NotContains(t, string(b), "user part", "process-local: never in JSON")
}

func TestReturningWithoutTextRendersTheValue(t *testing.T) {
	h := newFuncHarness(t, Returning(func(context.Context, Run) (int, error) { return 42, nil }, nil))
	done := h.wait(h.launchSpec(Spec{ParentSessionID: "p", Models: mustModels(t, "a/one")}).ID)
	assert.Equal(t, "42", done.Result)
	n, ok := ValueOf[int](done)
	assert.True(t, ok)
	assert.Equal(t, 42, n)
}

// quotaError is a provider error of a harness's own type.
type quotaError struct{ code int }

func (e *quotaError) Error() string   { return fmt.Sprintf("quota exhausted (%d)", e.code) }
func (e *quotaError) StatusCode() int { return e.code }

func TestTaskErrIsTheOriginalErrorOfTheCurrentAttempt(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one", "b/two")
	h.settle()
	first := h.task(task.ID)
	require.NoError(t, h.observe(Event{SessionID: first.SessionID, Kind: SessionError, Err: fmt.Errorf("calling the provider: %w", &quotaError{code: 429})}))
	h.settle()
	retried := h.task(task.ID)
	require.Len(t, retried.Attempts, 2)
	assert.Nil(t, retried.Cause, "the new attempt has not failed: the old one's error is not its")
	require.NoError(t, h.observe(Event{SessionID: retried.SessionID, Kind: SessionError, Err: Permanent(&quotaError{code: 403})}))
	done := h.wait(task.ID)
	require.Equal(t, StatusError, done.Status)
	var q *quotaError
	require.ErrorAs(t, done.Cause, &q, "the value itself, for errors.As")
	assert.Equal(t, 403, q.code)
	assert.True(t, IsPermanent(done.Cause))
	assert.Equal(t, done.Error, done.Cause.Error(), "Error is its text")
}

func TestTaskErrOfAFailedStartIsAStartErrorWrappingTheHosts(t *testing.T) {
	host := &testHost{start: func(context.Context, SessionRequest, string) (string, error) {
		return "", &quotaError{code: 400}
	}}
	h := newHarness(t, host)
	done := h.wait(h.launch("a/one").ID)
	require.Equal(t, StatusError, done.Status)
	var se *StartError
	require.ErrorAs(t, done.Cause, &se)
	var q *quotaError
	require.ErrorAs(t, done.Cause, &q)
	assert.Equal(t, 400, q.code)
}

func TestEventValueIsTheCurrentRunsResult(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launch("a/one")
	h.settle()
	ses := h.task(task.ID).SessionID
	require.NoError(t, h.observe(Event{SessionID: ses, Kind: SessionIdle, Text: "the answer", Value: report{ForUser: "for the user"}}))
	done := h.wait(task.ID)
	got, ok := ValueOf[report](done)
	require.True(t, ok)
	assert.Equal(t, "for the user", got.ForUser)
	assert.Nil(t, done.Cause)
}

// doneLog records, in order, the final summaries a notifier was given and
// the OnDone calls.
type doneLog struct {
	mu   sync.Mutex
	seen []string
	done chan Task
}

func (l *doneLog) add(s string) {
	l.mu.Lock()
	l.seen = append(l.seen, s)
	l.mu.Unlock()
}

func (l *doneLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.seen...)
}

func (l *doneLog) onDone(t Task) {
	l.add("done " + t.ID)
	l.done <- t
}

func TestOnDoneIsCalledOnceAfterTheFinalSummary(t *testing.T) {
	log := &doneLog{done: make(chan Task, 4)}
	h := newHarness(t, nil)
	h.rec.hook = func(_ context.Context, n Notification) error {
		if n.Kind == NotifyFinalSummary {
			log.add("summary " + n.TaskID)
		}
		return nil
	}
	task := h.launchSpec(Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), OnDone: log.onDone})
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(task.ID).SessionID, Kind: SessionIdle, Text: "ok"}))
	got := recv(t, log.done, "OnDone")
	assert.Equal(t, StatusCompleted, got.Status)
	require.NotNil(t, got.Outcome, "the final snapshot, with its outcome")
	assert.Equal(t, "ok", got.Outcome.Answer)
	h.settle()
	assert.Equal(t, []string{"summary " + task.ID, "done " + task.ID}, log.all(), "after the final summary, once")
}

func TestOnDoneFollowsAFinalSummaryTheNotifierRefused(t *testing.T) {
	log := &doneLog{done: make(chan Task, 4)}
	h := newHarness(t, nil, WithNotifyRetry(1, nil))
	h.rec.hook = func(context.Context, Notification) error { return errors.New("chat is gone") }
	task := h.launchSpec(Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), OnDone: log.onDone})
	h.settle()
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	got := recv(t, log.done, "OnDone")
	assert.Equal(t, StatusCancelled, got.Status)
	var kinds []NotificationKind
	for _, n := range h.m.Dropped().Undelivered {
		kinds = append(kinds, n.Kind)
	}
	assert.Contains(t, kinds, NotifyFinalSummary, "the summary was given up before OnDone")
}

func TestOnDoneWithoutANotifierForATaskThatEndsBeforeLaunchReturns(t *testing.T) {
	m := mustOpen(NewFuncHost(func(context.Context, Run) (string, error) { return "at once", nil }))
	shutdownAtCleanup(t, m)
	log := &doneLog{done: make(chan Task, 4)}
	for range 3 {
		_, err := m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), OnDone: log.onDone})
		require.NoError(t, err)
	}
	for range 3 {
		got := recv(t, log.done, "OnDone")
		assert.Equal(t, "at once", got.Result)
	}
}

func TestAPanickingOnDoneCrashesNothing(t *testing.T) {
	called := make(chan struct{})
	h := newHarness(t, nil)
	task := h.launchSpec(Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), OnDone: func(Task) {
		close(called)
		panic("harness bug")
	}})
	h.settle()
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	recv(t, called, "OnDone")
	h.settle()
	assert.True(t, hasLog(h.logs, "OnDone panicked"), "%v", h.logs.Records())
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: mustModels(t, "a/one")})
	assert.NoError(t, err, "the Manager goes on")
}

func hasLog(s *logSink, sub string) bool {
	for _, r := range s.Records() {
		if strings.Contains(r["msg"], sub) {
			return true
		}
	}
	return false
}

func TestRunIsToldItsTaskAndLaunchesChildrenBeneathItsSession(t *testing.T) {
	runs := make(chan Run, 4)
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		runs <- run
		if run.Depth > 1 {
			return "child of " + run.ParentSessionID, nil
		}
		child, err := run.Manager().Launch(ctx, Spec{Description: "sub", Prompt: "dig", Models: mustModels(t, "a/one")})
		if err != nil {
			return "", err
		}
		run.Metadata["scribble"] = "on the run's copy"
		done, err := run.Manager().Wait(ctx, child.ID)
		if err != nil {
			return "", err
		}
		return "parent saw: " + done.Result, nil
	})
	task := h.launchSpec(Spec{ParentSessionID: "chat", Description: "research", Agent: "explore", Prompt: "go",
		Metadata: map[string]string{"channel": "c1"}, Models: mustModels(t, "a/one")})
	done := h.wait(task.ID)
	parent, child := recv(t, runs, "the parent's run"), recv(t, runs, "the child's run")
	assert.Equal(t, "research", parent.Description)
	assert.Equal(t, map[string]string{"channel": "c1", "scribble": "on the run's copy"}, parent.Metadata)
	assert.Equal(t, map[string]string{"channel": "c1"}, done.Metadata, "the run's copy is its own")
	assert.Equal(t, "chat", parent.Root)
	assert.Equal(t, 1, parent.Depth)
	assert.Equal(t, parent.SessionID, child.ParentSessionID, "launched beneath the run's session")
	assert.Equal(t, "chat", child.Root)
	assert.Equal(t, 2, child.Depth)
	assert.Equal(t, "sub", child.Description)
	assert.Equal(t, "parent saw: child of "+parent.SessionID, done.Result)
	kid, err := h.m.Task(child.TaskID)
	require.NoError(t, err)
	assert.Equal(t, "chat", kid.Root)
	assert.Equal(t, 2, kid.Depth)
	assert.Equal(t, "dig", kid.Prompt, "the prompt is part of the snapshot")
}

func TestSessionRequestCarriesDescriptionAndMetadata(t *testing.T) {
	h := newHarness(t, nil)
	h.launchSpec(Spec{ParentSessionID: "p", Description: "d", Metadata: map[string]string{"k": "v"}, Models: mustModels(t, "a/one")})
	h.settle()
	starts := h.host.Starts()
	require.Len(t, starts, 1)
	assert.Equal(t, "d", starts[0].Description)
	assert.Equal(t, map[string]string{"k": "v"}, starts[0].Metadata)
}

type turnKey struct{}

func TestInheritValuesCarriesTheLaunchContextsValuesNotItsCancellation(t *testing.T) {
	seen := make(chan string, 2)
	release := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		v, _ := ctx.Value(turnKey{}).(string)
		ref, ok := RunFromContext(ctx)
		seen <- fmt.Sprintf("%s %v", v, ok && ref.TaskID == run.TaskID)
		<-release
		return fmt.Sprintf("ctx err: %v", ctx.Err()), nil
	})
	launchCtx, cancel := context.WithCancel(context.WithValue(context.Background(), turnKey{}, "turn-7"))
	task, err := h.m.Launch(launchCtx, Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), InheritValues: true})
	require.NoError(t, err)
	assert.Equal(t, "turn-7 true", recv(t, seen, "the function's context"), "the launch context's value, and the run still its own")
	cancel() // the caller's turn ends: the task does not
	close(release)
	done := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "ctx err: <nil>", done.Result, "never the launch context's cancellation")

	plain, err := h.m.Launch(context.WithValue(context.Background(), turnKey{}, "not passed"), Spec{ParentSessionID: "p", Models: mustModels(t, "a/one")})
	require.NoError(t, err)
	assert.Equal(t, " true", recv(t, seen, "the second function's context"), "without InheritValues no value is carried")
	h.wait(plain.ID)
}

func TestInheritValuesReachesTheHostsStartSession(t *testing.T) {
	got := make(chan any, 1)
	host := &testHost{start: func(ctx context.Context, _ SessionRequest, sid string) (string, error) {
		got <- ctx.Value(turnKey{})
		return sid, nil
	}}
	h := newHarness(t, host)
	_, err := h.m.Launch(context.WithValue(context.Background(), turnKey{}, "chat-9"), Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), InheritValues: true})
	require.NoError(t, err)
	assert.Equal(t, "chat-9", recv(t, got, "the start's context"))
}

func TestCancelWithCallerStopsTheTaskAndItsBranchWhenTheCallersContextEnds(t *testing.T) {
	started := make(chan string, 4)
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		if run.Depth == 1 {
			if _, err := run.Manager().Launch(ctx, Spec{Prompt: "kid", Models: mustModels(t, "a/one")}); err != nil {
				return "", err
			}
		}
		started <- run.TaskID
		<-ctx.Done()
		return "", ctx.Err()
	})
	ctx, cancel := context.WithCancel(context.Background())
	task, err := h.m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), CancelWithCaller: true})
	require.NoError(t, err)
	first, second := recv(t, started, "the first function to start"), recv(t, started, "the second function to start")
	cancel()
	done := h.wait(task.ID)
	assert.Equal(t, StatusCancelled, done.Status, "an honest cancel: the function returned")
	for _, id := range []string{first, second} {
		got := h.wait(id)
		assert.Equal(t, StatusCancelled, got.Status, "task %s", id)
		require.NotNil(t, got.Stop, id)
		assert.Equal(t, StopCause{Kind: StopCaller, TaskID: task.ID}, *got.Stop, "the task and its branch say who asked: the caller of %s", task.ID)
		assert.ErrorIs(t, got.Cause, ErrCancelled)
	}

	_, err = h.m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), CancelWithCaller: true})
	assert.ErrorIs(t, err, context.Canceled, "a launch with a done context is refused")
}

func TestCancelWithCallerLeavesATaskThatEndedFirstAlone(t *testing.T) {
	h := newHarness(t, nil)
	ctx, cancel := context.WithCancel(context.Background())
	task, err := h.m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "a/one"), CancelWithCaller: true})
	require.NoError(t, err)
	h.settle()
	require.NoError(t, h.observe(Event{SessionID: h.task(task.ID).SessionID, Kind: SessionIdle, Text: "done first"}))
	h.wait(task.ID)
	cancel()
	h.settle()
	assert.Equal(t, StatusCompleted, h.task(task.ID).Status)
	assert.Empty(t, h.host.Aborts())
}

// running launches a task under parent and waits until its session runs.
func (h *harness) running(parent string, opts ...func(*Spec)) Task {
	h.t.Helper()
	spec := Spec{ParentSessionID: parent, Prompt: "p", Models: mustModels(h.t, "a/one", "b/two")}
	for _, o := range opts {
		o(&spec)
	}
	task := h.launchSpec(spec)
	return waitFor(h.t, h.m, task.ID, func(t Task) bool { return t.Status == StatusRunning || t.Pending == PendingQueued })
}

// waitFor waits until task id's snapshot satisfies ok, without sleeping.
func waitFor(t *testing.T, m *Manager, id string, ok func(Task) bool) Task {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		m.mu.Lock()
		e := m.led.tasks[id]
		if e == nil {
			m.unlock()
			t.Fatalf("task %s: not found", id)
		}
		task := e.project()
		ch := e.waitChange() // under the same lock: no change is missed
		m.unlock()
		if ok(task) {
			return task
		}
		select {
		case <-ch:
		case <-ctx.Done():
			t.Fatalf("task %s: still %s", id, task.Status)
		}
	}
}

func TestPageLooksTasksUpByRootMetadataAndStatuses(t *testing.T) {
	h := newHarness(t, nil)
	a := h.running("chat", func(s *Spec) { s.Metadata = map[string]string{"team": "x"}; s.Prompt = "prompt of a" })
	b := h.running(a.SessionID, func(s *Spec) { s.Metadata = map[string]string{"team": "y"} })
	c := h.running("other", func(s *Spec) { s.Metadata = map[string]string{"team": "x", "env": "prod"} })
	require.NoError(t, h.observe(Event{SessionID: b.SessionID, Kind: SessionIdle, Text: "ok"}))
	h.wait(b.ID)

	ids := func(q Query) []string {
		t.Helper()
		p, err := h.m.Tasks(q)
		require.NoError(t, err)
		var out []string
		for _, task := range p.Tasks {
			out = append(out, task.ID)
		}
		return out
	}
	assert.Equal(t, []string{a.ID, b.ID}, ids(Query{Root: "chat"}))
	assert.Equal(t, []string{a.ID, c.ID}, ids(Query{Metadata: map[string]string{"team": "x"}}))
	assert.Equal(t, []string{c.ID}, ids(Query{Metadata: map[string]string{"team": "x", "env": "prod"}}))
	assert.Equal(t, []string{a.ID}, ids(Query{Root: "chat", Metadata: map[string]string{"team": "x"}}))
	assert.Equal(t, []string{b.ID}, ids(Query{Root: "chat", Statuses: []Status{StatusCompleted, StatusError}}))
	assert.Equal(t, []string{a.ID, c.ID}, ids(Query{Statuses: []Status{StatusRunning}}))
	assert.Empty(t, ids(Query{Root: "nobody"}))
	assert.Empty(t, ids(Query{Metadata: map[string]string{"team": "z"}}))

	first, err := h.m.Tasks(Query{Root: "chat", Limit: 1})
	require.NoError(t, err)
	require.Equal(t, a.ID, first.Next)
	assert.Equal(t, "prompt of a", first.Tasks[0].Prompt)
	second, err := h.m.Tasks(Query{Root: "chat", Limit: 1, After: first.Next})
	require.NoError(t, err)
	assert.Equal(t, []string{b.ID}, []string{second.Tasks[0].ID})
	assert.Empty(t, second.Next)
	_, err = h.m.Tasks(Query{Root: "other", After: a.ID})
	assert.ErrorIs(t, err, ErrInvalidArgument, "a cursor from another query")
}

func TestAModelWithNoProviderIsItsIDAlone(t *testing.T) {
	alias, err := ParseModel("gpt-primary")
	require.NoError(t, err)
	assert.Equal(t, Model{ID: "gpt-primary"}, alias)
	assert.Equal(t, "gpt-primary", alias.String())
	assert.Equal(t, "gpt-primary (fast)", Model{ID: "gpt-primary", Variant: "fast"}.String())
	plain := mustOpen(&testHost{})
	shutdownAtCleanup(t, plain)
	opaque, err := plain.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{ID: "openai/plain-model"}}})
	require.NoError(t, err, "a model name is an opaque string: a slash in it is no provider")
	assert.Equal(t, Model{ID: "openai/plain-model"}, opaque.Model)

	h := newHarness(t, nil, WithModelLimits(ModelLimits{Models: map[string]int{"gpt-primary": 1}, Providers: map[string]int{"": 5}}))
	spec := func(s *Spec) { s.Models = []Model{alias, {Provider: "b", ID: "two"}} }
	first := h.running("chat", spec)
	second := h.running("chat", spec)
	assert.Equal(t, StatusRunning, first.Status)
	assert.Equal(t, PendingQueued, second.Pending, "keyed by its ID under ModelLimits.Models, never under a provider")
	assert.Contains(t, fmt.Sprint(h.m.Snapshot().Queues), "model:gpt-primary")
	require.NoError(t, h.observe(Event{SessionID: first.SessionID, Kind: SessionError, Err: errors.New("HTTP 503 overloaded")}))
	h.settle()
	line := Timeline(h.task(first.ID))
	assert.Contains(t, line, "gpt-primary")
	assert.NotContains(t, line, "/gpt-primary")
}

func TestSpecIDSetsTheTaskID(t *testing.T) {
	h := newHarness(t, nil)
	task := h.launchSpec(Spec{ParentSessionID: "p", ID: "harness-42", Models: mustModels(t, "a/one")})
	assert.Equal(t, "harness-42", task.ID)
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", ID: "harness-42", Models: mustModels(t, "a/one")})
	assert.ErrorIs(t, err, ErrIDTaken)
	assert.Len(t, h.m.Snapshot().Tasks, 1)
	long := "call_" + strings.Repeat("x", 507) // 512 bytes: a tool call's id joined to its message's
	assert.Equal(t, long, h.launchSpec(Spec{ParentSessionID: "p", ID: long, Models: mustModels(t, "a/one")}).ID)
	for _, bad := range []string{"has space", "tab\there", strings.Repeat("x", 513), "bad\xffutf8", "nul\x00"} {
		_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", ID: bad, Models: mustModels(t, "a/one")})
		var se *SpecError
		require.ErrorAs(t, err, &se, "%q", bad)
		assert.Equal(t, "ID", se.Field)
	}
	// The generator's next id is one a caller took: it draws again.
	taken := h.launchSpec(Spec{ParentSessionID: "p", ID: "task-2", Models: mustModels(t, "a/one")})
	drawn := h.launch("a/one")
	assert.Equal(t, "task-2", taken.ID)
	assert.NotEqual(t, "task-2", drawn.ID)
	assert.Len(t, h.m.Snapshot().Tasks, 4)
}

func TestAForgottenTasksIDIsStillTaken(t *testing.T) {
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: 1}))
	for _, id := range []string{"first", "second"} {
		task := h.running("chat", func(s *Spec) { s.ID = id })
		require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: task.ID})))
	}
	h.settle()
	_, err := h.m.Task("first")
	require.ErrorIs(t, err, ErrForgotten)
	_, err = h.m.Launch(context.Background(), Spec{ParentSessionID: "p", ID: "first", Models: mustModels(t, "a/one")})
	assert.ErrorIs(t, err, ErrIDTaken)
}

func TestUUIDsIsTheDefaultGenerator(t *testing.T) {
	g1, g2 := newUUIDs(), newUUIDs()
	seen := map[string]bool{}
	for _, g := range []IDGenerator{g1, g2} {
		for range 50 {
			id := g.NewID(idTask)
			u, err := uuid.Parse(id)
			require.NoError(t, err)
			assert.Equal(t, uuid.Version(4), u.Version())
			assert.False(t, seen[id])
			seen[id] = true
		}
	}
	assert.True(t, strings.HasPrefix(g1.NewID(idToken), "run_"))
}

// The root module asks importers for little: the Go version the README
// states, and no dependency beyond the design card's.
func TestTheModuleRequiresWhatTheREADMESays(t *testing.T) {
	mod, err := os.ReadFile("go.mod")
	require.NoError(t, err)
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	goLine := regexp.MustCompile(`(?m)^go (1\.\d+)$`).FindSubmatch(mod)
	require.NotNil(t, goLine, "go.mod has a go directive")
	stated := regexp.MustCompile(`Go (1\.\d+) or newer`).FindSubmatch(readme)
	require.NotNil(t, stated, "the README says which Go versions are supported")
	assert.Equal(t, string(stated[1]), string(goLine[1]), "go.mod's go directive is the README's oldest supported Go")
	assert.NotContains(t, string(mod), "\ntoolchain ", "no toolchain line forces a newer Go on importers")
	// Every module's go directive is the one the README's table gives it.
	rows := regexp.MustCompile("(?m)^\\| `github.com/bgtask/bgtask(/[a-z/]+)?`[^|]*\\| (1\\.\\d+) \\|").FindAllSubmatch(readme, -1)
	mods, err := filepath.Glob("*/go.mod")
	require.NoError(t, err)
	deeper, err := filepath.Glob("*/*/go.mod")
	require.NoError(t, err)
	require.Len(t, rows, 1+len(mods)+len(deeper), "the README's table has a row for every module of the repository")
	for _, row := range rows {
		path := strings.TrimPrefix(string(row[1]), "/")
		if path == "" {
			path = "."
		}
		sub, err := os.ReadFile(path + "/go.mod")
		require.NoError(t, err, "the README names module %s", path)
		line := regexp.MustCompile(`(?m)^go (1\.\d+)(\.\d+)?$`).FindSubmatch(sub)
		require.NotNil(t, line, "%s/go.mod has a go directive", path)
		assert.Equal(t, string(row[2]), string(line[1]), "the README's Go for module %s", path)
	}
	direct := regexp.MustCompile(`(?m)^\t(\S+) v\S+$`).FindAllSubmatch(mod, -1)
	allowed := map[string]bool{"github.com/google/uuid": true, "github.com/stretchr/testify": true, "go.uber.org/goleak": true}
	for _, d := range direct {
		assert.True(t, allowed[string(d[1])], "direct dependency %s is not on the design card", d[1])
	}
}

// A FuncHost parent that waited for its child (Wait) returns while the
// child's final summary is still on its way: its last turn is the answer,
// not held for the gate timeout.
func TestAFuncHostParentThatWaitedForItsChildIsNotHeldByTheGate(t *testing.T) {
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		if run.Depth > 1 {
			return "kid", nil
		}
		child, err := run.Manager().Launch(ctx, Spec{Prompt: "dig", Models: mustModels(t, "a/one")})
		if err != nil {
			return "", err
		}
		done, err := run.Manager().Wait(ctx, child.ID)
		if err != nil {
			return "", err
		}
		return "saw " + done.Result, nil
	})
	release := make(chan struct{})
	h.rec.hook = func(_ context.Context, n Notification) error {
		if n.Kind == NotifyFinalSummary && n.Task.Depth == 2 {
			<-release // a slow chat: the kid's summary is not delivered yet
		}
		return nil
	}
	task := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	done := h.wait(task.ID)
	close(release)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "saw kid", done.Result)
	assert.Empty(t, done.Outcome.Notices, "not degraded: it had the kid's result")
}

// A FuncHost parent that returns while its child still runs is held until
// the child settled, then released at once (no turn can follow), marked
// degraded.
func TestAFuncHostParentThatReturnedBeforeItsChildIsReleasedWhenItSettles(t *testing.T) {
	kidGo := make(chan struct{})
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		if run.Depth > 1 {
			<-kidGo
			return "kid", nil
		}
		if _, err := run.Manager().Launch(ctx, Spec{Prompt: "dig", Models: mustModels(t, "a/one")}); err != nil {
			return "", err
		}
		return "did not wait", nil
	})
	sub, err := h.m.Subscribe(context.Background(), 256)
	require.NoError(t, err)
	defer sub.Close()
	task := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	for { // activity is process-local: it is published, not waited on
		c, open := recvOK(t, sub.C, "the parent's change to awaiting its children")
		require.True(t, open, "the stream closed")
		if c.Task.ID == task.ID && c.Task.Activity == ActivityAwaitingChildren {
			break
		}
	}
	close(kidGo)
	done := h.wait(task.ID)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Equal(t, "did not wait", done.Result)
	assert.True(t, slicesContain(done.Outcome.Notices, "degraded"), "%v", done.Outcome.Notices)
}

func TestOnDoneOfALaunchThatExtendLiveMadeAnExtend(t *testing.T) {
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) {
		p := <-run.Prompts()
		return "got " + p.Prompt, nil
	})
	first := h.launchSpec(Spec{ParentSessionID: "p", Key: "k", Models: mustModels(t, "a/one")})
	waitStatus(t, h.m, first.ID, StatusRunning)
	log := &doneLog{done: make(chan Task, 4)}
	same, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Key: "k", ExtendLive: true, Prompt: "again",
		Models: mustModels(t, "a/one"), OnDone: log.onDone})
	require.NoError(t, err)
	require.Equal(t, first.ID, same.ID)
	got := recv(t, log.done, "OnDone")
	assert.Equal(t, "got again", got.Result)
	h.settle()
	assert.Equal(t, []string{"done " + first.ID}, log.all(), "once")

	_, err = h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Key: "k", ExtendLive: true, CancelWithCaller: true, Models: mustModels(t, "a/one")})
	var se *SpecError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, "ExtendLive", se.Field)
}

func TestOnDoneAtShutdownWithANotifierThatNeverDelivers(t *testing.T) {
	h := newHarness(t, nil)
	h.rec.hook = func(ctx context.Context, n Notification) error {
		if n.Kind == NotifyFinalSummary {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}
	log := &doneLog{done: make(chan Task, 4)}
	task := h.running("p", func(s *Spec) { s.OnDone = log.onDone })
	require.NoError(t, h.observe(Event{SessionID: task.SessionID, Kind: SessionIdle, Text: "ok"}))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = h.m.Shutdown(ctx)
	assert.Equal(t, []string{"done " + task.ID}, log.all())
}

// memJournal keeps records in memory: a journal that outlives a Manager.
type memJournal struct {
	mu      sync.Mutex
	recs    []Record
	crashed bool          // the process died: nothing more is kept
	changed chan struct{} // closed (and replaced) by an Append that kept records; nil until awaited
}

func (j *memJournal) Append(batch []Record) Commit {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.crashed {
		return doneCommit{}
	}
	for _, r := range batch {
		r.Data = append([]byte(nil), r.Data...)
		j.recs = append(j.recs, r)
	}
	if j.changed != nil {
		close(j.changed)
		j.changed = nil
	}
	return doneCommit{}
}

// await waits until the records kept satisfy ok: a commit's append may
// come after the change it holds is visible in memory.
func (j *memJournal) await(t *testing.T, ok func([]Record) bool) {
	t.Helper()
	deadline := time.After(10 * time.Second) // failure detection only
	for {
		j.mu.Lock()
		if ok(j.recs) {
			j.mu.Unlock()
			return
		}
		if j.changed == nil {
			j.changed = make(chan struct{})
		}
		changed := j.changed
		j.mu.Unlock()
		select {
		case <-changed:
		case <-deadline:
			t.Fatal("the journal never kept what was awaited")
		}
	}
}

func (j *memJournal) Replay(fn func(Record) error) error {
	j.mu.Lock()
	recs := append([]Record(nil), j.recs...)
	j.mu.Unlock()
	for _, r := range recs {
		if err := fn(r); err != nil {
			return err
		}
	}
	return nil
}

func (j *memJournal) Compact(keep []Record) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.recs = append([]Record(nil), keep...)
	return nil
}

func (j *memJournal) Close() error { return nil }

// A restart that ends live tasks while retention forgets ended ones never
// trips over the launch order it walks.
func TestARestartThatForgetsAsItReconcilesCrashesNothing(t *testing.T) {
	j := &memJournal{}
	opts := []Option{WithJournal(j), WithIDs(SequentialIDs()), WithRetention(Retention{MaxEnded: 50})}
	host := &testHost{}
	m := mustOpen(host, opts...)
	var live Task
	for i := range 1100 {
		task, err := m.Launch(context.Background(), Spec{ParentSessionID: fmt.Sprintf("chat-%d", i%7), Models: mustModels(t, "a/one")})
		require.NoError(t, err)
		running := waitStatus(t, m, task.ID, StatusRunning)
		if i == 0 {
			live = running
			continue
		}
		require.NoError(t, m.Observe(Event{SessionID: running.SessionID, Kind: SessionIdle, Text: "ok"}))
	}
	j.mu.Lock()
	j.crashed = true
	j.mu.Unlock()
	require.NoError(t, m.Shutdown(context.Background()))
	j.mu.Lock()
	j.crashed = false
	j.mu.Unlock()

	m2, err := Open(context.Background(), plainHost{&svcHost{svc: newSessionService()}}, opts...)
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	got, err := m2.Task(live.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusInterrupt, got.Status)
}

// Shutdown ends queued tasks while retention forgets ended ones: the launch
// order it walks is never tripped over.
func TestAShutdownThatForgetsAsItStopsCrashesNothing(t *testing.T) {
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: 5}), WithModelLimits(ModelLimits{Models: map[string]int{"a/one": 1}}))
	one := func(s *Spec) { s.Models = mustModels(t, "a/one") }
	h.running("chat", one)
	var queued []Task
	for range 10 {
		queued = append(queued, h.running("chat", one))
	}
	require.Equal(t, PendingQueued, queued[0].Pending)
	for i := range 5 { // ended tasks after them in launch order, which retention may forget
		old := h.running(fmt.Sprintf("old-%d", i), func(s *Spec) { s.Models = mustModels(t, "b/two") })
		require.NoError(t, h.observe(Event{SessionID: old.SessionID, Kind: SessionIdle, Text: "ok"}))
		h.wait(old.ID)
	}
	require.NoError(t, h.m.Shutdown(context.Background()))
	for _, q := range queued {
		if got, err := h.m.Task(q.ID); err == nil {
			assert.Equal(t, StatusInterrupt, got.Status)
		}
	}
}
