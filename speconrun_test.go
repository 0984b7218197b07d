package bgtask

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A Manager over a session service runs tasks that carry their own
// function in-process, each its own, beside the tasks the service runs;
// the service never hears of them.
func TestTasksWithTheirOwnFunctionBesideASessionService(t *testing.T) {
	h := newHarness(t, nil)
	researcher := func(ctx context.Context, run Run) (string, error) { return "found: " + run.Prompt, nil }
	var models []string
	coder := func(ctx context.Context, run Run) (string, error) {
		models = append(models, run.Model.String()) // one attempt at a time
		if run.Model.Provider == "a" {
			return "", errors.New("503 Service Unavailable")
		}
		return "patched on " + run.Model.String(), nil
	}
	r := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "the logs", Models: mustModels(t, "a/one"), Run: researcher})
	c := h.launchSpec(Spec{ParentSessionID: "chat", Prompt: "the bug", Models: mustModels(t, "a/one", "b/two"), Run: coder})
	plain := h.running("chat")

	rd, cd := h.wait(r.ID), h.wait(c.ID)
	assert.Equal(t, StatusCompleted, rd.Status)
	assert.Equal(t, "found: the logs", rd.Result)
	assert.Equal(t, StatusCompleted, cd.Status)
	assert.Equal(t, "patched on b/two", cd.Result)
	assert.Equal(t, []string{"a/one", "b/two"}, models, "a retry runs the function again with the next model")
	assert.True(t, strings.HasPrefix(rd.SessionID, "fn_"), rd.SessionID)
	require.Len(t, h.host.starts, 1, "the service started only its own task")
	assert.Equal(t, plain.ID, h.host.starts[0].TaskID)
	assert.Empty(t, h.host.aborts, "nor was it asked to abort a function's run (%v)", h.host.aborts)
	assert.NotContains(t, Envelope(cd), "inspected", "a function's run leaves no session to offer")
}

// A task's own function is stopped by its run token (its context ends),
// takes its prompts (Extend) though the service cannot, and its panic is
// guarded.
func TestATasksOwnFunctionIsStoppedPromptedAndGuarded(t *testing.T) {
	h := newHarness(t, nil)
	waiting := func(ctx context.Context, run Run) (string, error) {
		select {
		case p := <-run.Prompts():
			return "took " + p.Prompt, nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
	stopped := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), Run: waiting})
	waitFor(t, h.m, stopped.ID, func(t Task) bool { return t.Status == StatusRunning })
	require.NoError(t, stopErr(h.m.Stop(context.Background(), Target{Task: stopped.ID})))
	assert.Equal(t, StatusCancelled, h.wait(stopped.ID).Status)
	assert.Empty(t, h.host.aborts, "the service was not asked")

	prompted := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), Run: waiting})
	waitFor(t, h.m, prompted.ID, func(t Task) bool { return t.Status == StatusRunning })
	n, err := h.m.Extend(context.Background(), prompted.ID, "more")
	require.NoError(t, err)
	a, err := h.m.WaitAnswer(context.Background(), prompted.ID, n)
	require.NoError(t, err)
	assert.Equal(t, "took more", a.Text)
	_, err = h.m.Extend(context.Background(), h.running("chat").ID, "more")
	assert.ErrorIs(t, err, errors.ErrUnsupported, "the service's own tasks cannot take prompts")

	panicky := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one", "b/two"),
		Run: func(context.Context, Run) (string, error) { panic("boom") }})
	done := h.wait(panicky.ID)
	assert.Equal(t, StatusError, done.Status)
	assert.Len(t, done.Attempts, 1, "a panic is never retried")
	var p *PanicError
	assert.ErrorAs(t, done.Cause, &p)
}

// On a FuncHost a task's own function runs instead of the host's.
func TestATasksOwnFunctionOnAFuncHost(t *testing.T) {
	h := newFuncHarness(t, func(ctx context.Context, run Run) (string, error) { return "the default", nil })
	own := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"),
		Run: func(ctx context.Context, run Run) (string, error) { return "its own", nil }})
	other := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	assert.Equal(t, "its own", h.wait(own.ID).Result)
	assert.Equal(t, "the default", h.wait(other.ID).Result)
}

// A task with its own function neither continues a session nor is
// continued: nothing remains of its run.
func TestATasksOwnFunctionCannotContinueOrBeContinued(t *testing.T) {
	h := harnessOn(t, resumingHost{&testHost{}}, &testHost{})
	fn := func(ctx context.Context, run Run) (string, error) { return "", errors.New("400 bad request") }
	ended := h.launchSpec(Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), Run: fn})
	require.Equal(t, StatusError, h.wait(ended.ID).Status)
	_, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), ContinueFrom: ended.ID})
	assert.ErrorIs(t, err, errors.ErrUnsupported)
	_, err = h.m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), ContinueFrom: ended.ID, Run: fn})
	assert.ErrorIs(t, err, errors.ErrUnsupported)
}

// After a restart a task whose own function was running is interrupt:
// the function died with the process.
func TestATasksOwnFunctionAfterARestart(t *testing.T) {
	dir := t.TempDir()
	cj := openJournal(t, dir)
	m, err := Open(context.Background(), &testHost{}, WithJournal(cj))
	require.NoError(t, err)
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"),
		Run: func(ctx context.Context, run Run) (string, error) { <-ctx.Done(); return "", ctx.Err() }})
	require.NoError(t, err)
	waitFor(t, m, task.ID, func(t Task) bool { return t.Status == StatusRunning })
	crash(t, m, cj)

	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	m, err = Open(context.Background(), &testHost{}, WithJournal(j))
	require.NoError(t, err)
	shutdownAtCleanup(t, m)
	again, err := m.Wait(context.Background(), task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusInterrupt, again.Status)
	// Running is shown once the run is bound; the crash may come before
	// that bind reached the journal (the restart then finds a start whose
	// outcome it cannot know) or after (a run lost across the restart).
	// Either way the host was not asked: the function died with the process.
	assert.True(t, strings.Contains(again.Error, lostAcrossRestart) || strings.Contains(again.Error, startOutcomeUnknown),
		"interrupt for the restart: %q", again.Error)
}

// mustOpen(nil) is an in-process Manager: every task brings its own function.
func TestANilHostMakesAnInProcessManager(t *testing.T) {
	m := mustOpen(nil, WithIDs(SequentialIDs()))
	shutdownAtCleanup(t, m)
	_, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one")})
	var se *SpecError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, "Run", se.Field)
	assert.Empty(t, m.Snapshot().Tasks, "a refused launch records nothing")
	task, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"),
		Run: func(ctx context.Context, run Run) (string, error) { return "mine", nil }})
	require.NoError(t, err)
	done, err := m.Wait(context.Background(), task.ID)
	require.NoError(t, err)
	assert.Equal(t, "mine", done.Result)

	o, err := Open(context.Background(), nil)
	require.NoError(t, err)
	require.NoError(t, o.Shutdown(context.Background()))
}

// What an in-process harness needs no more: a model chain (a launch with
// none runs once, with no model) and, with no Notifier, a parent session
// (the task then has none: paging and tree limits count it under "").
func TestInProcessDefaults(t *testing.T) {
	m := mustOpen(nil, WithIDs(SequentialIDs()), WithTreeLimits(TreeLimits{MaxPerParent: 1}))
	shutdownAtCleanup(t, m)
	hold := make(chan struct{})
	task, err := m.Launch(context.Background(), Spec{Prompt: "go",
		Run: func(ctx context.Context, run Run) (string, error) {
			<-hold
			return "ran on " + run.Model.String() + "|", nil
		}})
	require.NoError(t, err)
	assert.Empty(t, task.ParentSessionID)
	assert.Equal(t, Model{}, task.Model)
	_, err = m.Launch(context.Background(), Spec{Run: func(context.Context, Run) (string, error) { return "", nil }})
	assert.ErrorIs(t, err, ErrFanOutLimit, "tasks with no parent count together under the tree limits")
	close(hold)
	done, err := m.Wait(context.Background(), task.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusCompleted, done.Status)
	assert.Len(t, done.Attempts, 1)
	assert.Equal(t, "ran on |", done.Result)
	assert.Equal(t, "Background task attempts:\n- Attempt 1 — COMPLETED — no model — fn_attempt-1", Timeline(done))
	page, err := m.Tasks(Query{Statuses: []Status{StatusCompleted}})
	require.NoError(t, err)
	require.Len(t, page.Tasks, 1, "found by a query")
	assert.Equal(t, task.ID, page.Tasks[0].ID)

	told := mustOpen(nil, WithNotifier(NotifierFunc(func(context.Context, Notification) error { return nil })))
	shutdownAtCleanup(t, told)
	_, err = told.Launch(context.Background(), Spec{Run: func(context.Context, Run) (string, error) { return "", nil }})
	var se *SpecError
	require.ErrorAs(t, err, &se, "with a Notifier, its notifications need a parent")
	assert.Equal(t, "ParentSessionID", se.Field)
}

// askingHost is a session service that can say what became of a session
// (a StatusHost) and resume one; it records what it was asked.
type askingHost struct {
	*testHost
	asked []string
}

func (h *askingHost) SessionStatus(_ context.Context, sid string) (SessionReport, error) {
	h.mu.Lock()
	h.asked = append(h.asked, sid)
	h.mu.Unlock()
	return SessionReport{State: SessionStateAlive}, nil
}

func (h *askingHost) FindSession(_ context.Context, req SessionRequest) (string, error) {
	h.mu.Lock()
	h.asked = append(h.asked, "find "+req.AttemptID)
	h.mu.Unlock()
	return "", nil
}

func (h *askingHost) ResumeSession(context.Context, string, SessionRequest) error { return nil }

// After a restart, the service is never asked about, nor asked to run or
// resume, a task that ran its own function: running or queued, it is
// interrupt, and its envelope offers no session.
func TestAfterARestartTheServiceNeverHearsOfATasksOwnFunction(t *testing.T) {
	dir := t.TempDir()
	cj := openJournal(t, dir)
	host := &askingHost{testHost: &testHost{}}
	m, err := Open(context.Background(), host, WithJournal(cj), WithModelLimits(ModelLimits{Default: 1}))
	require.NoError(t, err)
	blocked := func(ctx context.Context, run Run) (string, error) { <-ctx.Done(); return "", ctx.Err() }
	running, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), Run: blocked})
	require.NoError(t, err)
	waitFor(t, m, running.ID, func(t Task) bool { return t.Status == StatusRunning })
	queued, err := m.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), Run: blocked})
	require.NoError(t, err)
	waitFor(t, m, queued.ID, func(t Task) bool { return t.Pending == PendingQueued })
	crash(t, m, cj)

	j, err := OpenFileJournal(dir)
	require.NoError(t, err)
	host2 := &askingHost{testHost: &testHost{}}
	m2, err := Open(context.Background(), host2, WithJournal(j), WithModelLimits(ModelLimits{Default: 1}))
	require.NoError(t, err)
	shutdownAtCleanup(t, m2)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second) // failure detection only
	defer cancel()
	for _, id := range []string{running.ID, queued.ID} {
		done, err := m2.Wait(ctx, id)
		require.NoError(t, err)
		assert.Equal(t, StatusInterrupt, done.Status, id)
		assert.Equal(t, lostAcrossRestart, done.Error, id)
		assert.NotContains(t, Envelope(done), "inspected", "its function's run left no session")
	}
	_, err = m2.Launch(context.Background(), Spec{ParentSessionID: "chat", Models: mustModels(t, "a/one"), ContinueFrom: running.ID})
	assert.ErrorIs(t, err, errors.ErrUnsupported, "a run of its own function cannot be resumed, after a restart too")
	host2.mu.Lock()
	defer host2.mu.Unlock()
	assert.Empty(t, host2.asked, "never asked about a function's session")
	assert.Empty(t, host2.starts, "never asked to run a function's task")
}
