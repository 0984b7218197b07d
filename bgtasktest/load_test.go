package bgtasktest_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
)

// mixed are builds of every status, live ones included, with and without
// ids.
func mixed() []bgtasktest.TaskBuild {
	return []bgtasktest.TaskBuild{
		{ID: "search-1", Description: "search the web", Agent: "researcher", Prompt: "find the papers",
			Metadata: map[string]string{"tool": "spawn"}, LaunchedAt: at,
			Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusCompleted, Took: time.Minute, Result: "3 links"}}},
		{ID: "review-7", Description: "review the diff", Agent: "reviewer", Attempts: []bgtasktest.AttemptBuild{
			{Model: bgtask.Model{Provider: "a", ID: "big"}, Status: bgtask.StatusError, Took: 2 * time.Second, Err: errors.New("429 Too Many Requests")},
			{Model: bgtask.Model{Provider: "b", ID: "small"}, Status: bgtask.StatusError, Took: time.Second, Err: errors.New("boom")},
		}},
		{Description: "given no id", Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusCancelled, Took: time.Second}}},
		{ID: "lost", Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusInterrupt}}},
		{ID: "live", Description: "still at it", Agent: "coder", Metadata: map[string]string{"tool": "spawn"},
			Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusError}, {Status: bgtask.StatusRunning, Took: 5 * time.Minute}}},
		{ID: "starting", Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusPending}}},
	}
}

func load(t *testing.T, builds []bgtasktest.TaskBuild, opts ...bgtask.Option) (*bgtask.Manager, context.Context) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	m, err := bgtasktest.Load(ctx, builds, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, m.Shutdown(context.Background())) })
	return m, ctx
}

func ids(tasks []bgtask.Task) []string {
	var out []string
	for _, t := range tasks {
		out = append(out, t.ID)
	}
	return out
}

func TestLoadHoldsExactlyTheBuiltTasksInOrder(t *testing.T) {
	m, ctx := load(t, mixed())
	want := []string{"search-1", "review-7", "task-1", "lost", "live", "starting"}
	snap := m.Snapshot()
	require.Equal(t, want, ids(snap.Tasks))
	page, err := m.Tasks(bgtask.Query{})
	require.NoError(t, err)
	assert.Equal(t, want, ids(page.Tasks))
	spawned, err := m.Tasks(bgtask.Query{Metadata: map[string]string{"tool": "spawn"}})
	require.NoError(t, err)
	assert.Equal(t, []string{"search-1", "live"}, ids(spawned.Tasks))

	statuses := []bgtask.Status{bgtask.StatusCompleted, bgtask.StatusError, bgtask.StatusCancelled, bgtask.StatusInterrupt, bgtask.StatusRunning, bgtask.StatusPending}
	attempts := []int{1, 2, 1, 1, 2, 1}
	for i, task := range snap.Tasks {
		assert.Equal(t, statuses[i], task.Status, task.ID)
		assert.Len(t, task.Attempts, attempts[i], task.ID)
		assert.Equal(t, "chat", task.ParentSessionID, task.ID)
		assert.Equal(t, task.Status.Terminal(), task.Outcome != nil, "%s: an outcome once terminal", task.ID)
		got, err := m.Task(task.ID)
		require.NoError(t, err)
		assert.Equal(t, task.Status, got.Status, task.ID)
	}

	search := snap.Tasks[0]
	assert.Equal(t, "search the web", search.Description)
	assert.Equal(t, "researcher", search.Agent)
	assert.Equal(t, "find the papers", search.Prompt)
	assert.Equal(t, map[string]string{"tool": "spawn"}, search.Metadata)
	assert.Equal(t, "3 links", search.Result)
	assert.Equal(t, at, search.LaunchedAt)
	assert.Equal(t, at.Add(time.Minute), search.CompletedAt)

	review, err := m.Wait(ctx, "review-7") // ended: at once
	require.NoError(t, err)
	assert.Equal(t, "review the diff", review.Description)
	assert.Equal(t, "reviewer", review.Agent)
	assert.Equal(t, at.Add(time.Minute), review.LaunchedAt, "launched when the build before it ended")
	assert.Equal(t, at.Add(time.Minute+3*time.Second), review.CompletedAt)
	assert.Equal(t, `Background task attempts:
- Attempt 1 — ERROR — a/big — ses-2
  Error: 429 Too Many Requests
- Attempt 2 — ERROR — b/small — ses-3
  Error: boom`, bgtask.Timeline(review))

	assert.Equal(t, "given no id", snap.Tasks[2].Description)
	require.NotNil(t, snap.Tasks[2].Stop)
	assert.Equal(t, bgtask.StopCancel, snap.Tasks[2].Stop.Kind)

	live := snap.Tasks[4]
	assert.Equal(t, "still at it", live.Description)
	assert.Equal(t, "coder", live.Agent)
	assert.Equal(t, "model-2", live.Model.ID)
	assert.NotEmpty(t, live.SessionID)
	assert.Equal(t, 2, live.Current().Number)

	starting := snap.Tasks[5]
	assert.Equal(t, bgtask.PendingAwaitingSession, starting.Pending)
	assert.Empty(t, starting.SessionID)
}

func TestALoadedRunningTaskStopsCancelled(t *testing.T) {
	m, ctx := load(t, mixed())
	stopped := make(chan error, 1)
	go func() { _, err := m.Stop(ctx, bgtask.Target{Task: "live"}); stopped <- err }()
	_, err := bgtasktest.WaitStatus(ctx, m, "live", bgtask.StatusCancelled) // seen on the change stream
	require.NoError(t, err)
	require.NoError(t, <-stopped)
	done, err := m.Wait(ctx, "live")
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, done.Status)
	assert.Equal(t, bgtask.StatusCancelled, done.Current().Status)
	require.NotNil(t, done.Stop)
	assert.Equal(t, bgtask.StopCancel, done.Stop.Kind)
	assert.Len(t, done.Attempts, 2, "no retry after a stop")
	require.NotNil(t, done.Outcome)
}

func TestALoadedPendingTaskStopsCancelled(t *testing.T) {
	m, ctx := load(t, mixed())
	_, err := m.Stop(ctx, bgtask.Target{Task: "starting"})
	require.NoError(t, err)
	done, err := m.Wait(ctx, "starting")
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, done.Status)
	assert.NotEmpty(t, done.SessionID, "its start answered once the stop was asked, and that session was aborted")
}

func TestALoadedRunningTaskEndsByItsSessionsEvents(t *testing.T) {
	m, ctx := load(t, mixed())
	live, err := m.Task("live")
	require.NoError(t, err)
	require.NoError(t, m.Observe(bgtask.Event{SessionID: live.SessionID, Kind: bgtask.SessionIdle, Text: "done at last"}))
	done, err := m.Wait(ctx, "live")
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCompleted, done.Status)
	assert.Equal(t, "done at last", done.Result)
}

func TestLoadWithANotifierAndAJournal(t *testing.T) {
	dir := t.TempDir()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	rec := &bgtasktest.Recorder{}
	m, ctx := load(t, mixed(), bgtask.WithNotifier(rec), bgtask.WithJournal(j))
	summary, err := rec.AwaitFinal(ctx, "review-7")
	require.NoError(t, err)
	assert.Equal(t, "chat", summary.ParentSessionID)
	require.NoError(t, m.Shutdown(ctx)) // the live ones end interrupt

	j, err = bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	again, err := bgtask.Open(ctx, bgtasktest.NewHost(), bgtask.WithJournal(j))
	require.NoError(t, err)
	defer func() { assert.NoError(t, again.Shutdown(ctx)) }()
	assert.Equal(t, []string{"search-1", "review-7", "task-1", "lost", "live", "starting"}, ids(again.Snapshot().Tasks), "replayed")

	j, err = bgtask.OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	_, err = bgtasktest.Load(ctx, mixed()[:1], bgtask.WithJournal(j))
	require.NoError(t, err, "a journal of its own")
}

func TestBuildTaskTakesTheLaunchFields(t *testing.T) {
	task, err := bgtasktest.BuildTask(bgtasktest.TaskBuild{ID: "call_42/msg_7", Description: "summarise", Agent: "writer",
		Metadata: map[string]string{"k": "v"}, Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusCompleted}}})
	require.NoError(t, err)
	assert.Equal(t, "call_42/msg_7", task.ID)
	assert.Equal(t, "summarise", task.Description)
	assert.Equal(t, "writer", task.Agent)
	assert.Equal(t, map[string]string{"k": "v"}, task.Metadata)
	assert.Equal(t, bgtask.StatusCompleted, task.Status)
}

func TestAnInvalidIDIsRefusedNamingTheField(t *testing.T) {
	for _, id := range []string{"has space", "tab\there", strings.Repeat("x", 513)} {
		_, err := bgtasktest.BuildTask(bgtasktest.TaskBuild{ID: id, Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusCompleted}}})
		require.Error(t, err, id)
		assert.True(t, strings.HasPrefix(err.Error(), "bgtasktest: BuildTask: "), err.Error())
		var spec *bgtask.SpecError
		require.ErrorAs(t, err, &spec)
		assert.Equal(t, "ID", spec.Field)
		assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)

		builds := append(mixed()[:2], bgtasktest.TaskBuild{ID: id, Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusRunning}}})
		m, err := bgtasktest.Load(context.Background(), builds)
		require.Error(t, err)
		assert.Nil(t, m)
		assert.Contains(t, err.Error(), "bgtasktest: Load: build 3: invalid spec: ID: ")
		require.ErrorAs(t, err, &spec)
		assert.Equal(t, "ID", spec.Field)
	}
	_, err := bgtasktest.BuildTask(bgtasktest.TaskBuild{ID: strings.Repeat("x", 512), Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusCompleted}}})
	assert.NoError(t, err, "512 bytes is the most")
}

func TestLoadRefusesDuplicateIDs(t *testing.T) {
	builds := mixed()
	builds[3].ID = "review-7"
	_, err := bgtasktest.Load(context.Background(), builds)
	assert.EqualError(t, err, `bgtasktest: Load: builds 2 and 4 have the same ID "review-7"`)
	builds = mixed()
	builds[0].ID = "task-1" // the id the build with none would be given: it is given the next
	m, _ := load(t, builds)
	assert.Equal(t, []string{"task-1", "review-7", "task-2", "lost", "live", "starting"}, ids(m.Snapshot().Tasks))
}

func TestLoadRefusesWhatNoTaskGoesThrough(t *testing.T) {
	builds := mixed()
	builds[2].Attempts = nil
	_, err := bgtasktest.Load(context.Background(), builds)
	assert.EqualError(t, err, "bgtasktest: Load: build 3: no attempt")
	builds = mixed()
	builds[1].LaunchedAt = at // before build 1 ended
	_, err = bgtasktest.Load(context.Background(), builds)
	assert.ErrorContains(t, err, "bgtasktest: Load: build 2: LaunchedAt 2026-03-01T09:00:00Z is before 2026-03-01T09:01:00Z")
}

func TestLoadRefusesAnOptionThatChangesABuild(t *testing.T) {
	dir := t.TempDir()
	full, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	m, _ := load(t, mixed()[:1], bgtask.WithJournal(full))
	require.NoError(t, m.Shutdown(context.Background()))
	full, err = bgtask.OpenFileJournal(dir)
	require.NoError(t, err)

	twoRunning := []bgtasktest.TaskBuild{
		{Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusRunning}}},
		{Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusRunning}}},
	}
	cooled := mixed()[:3] // review-7's 429 cools a/big, which the next build runs on
	cooled[2].Attempts[0].Model = bgtask.Model{Provider: "a", ID: "big"}
	for _, c := range []struct {
		name   string
		opt    bgtask.Option
		want   string
		builds []bgtasktest.TaskBuild
	}{
		{"another clock", bgtask.WithClock(bgtasktest.NewClock(at)), "an option gives it another (WithClock)", nil},
		{"no retry", bgtask.WithRetryable(func(error, bool) bool { return false }),
			"build 2 (review-7): attempt 2 should be running, but the task is error in attempt 1, on a/big: 429 Too Many Requests: an option of the Manager changed the build", nil},
		{"a retry delay", bgtask.WithRetryDelay(func(int, error) time.Duration { return time.Second }),
			"build 2 (review-7): attempt 2 should be running, but the task is pending (retry_delay) in attempt 2", nil},
		{"a stall timeout", bgtask.WithStallTimeout(30 * time.Second),
			"build 1 (search-1): attempt 1 should still be running after 1m0s, but the task is error in attempt 1, on model-1: stalled: no activity for 30s", nil},
		{"a limit that queues", bgtask.WithModelLimits(bgtask.ModelLimits{Default: 1}),
			"build 2 (task-2): attempt 1 should be running, but the task is pending (queued) in attempt 1", twoRunning},
		{"retention", bgtask.WithRetention(bgtask.Retention{MaxEnded: 1}), "an option of the Manager forgot some (WithRetention)", mixed()[:4]},
		{"a start gate", bgtask.WithStartGate(func(context.Context, bgtask.SessionRequest) error { return errors.New("closed") }),
			"build 1 (search-1): attempt 1 should be running, but the task is error in attempt 1", nil},
		{"other metrics, with a pending build", bgtask.WithMetrics(bgtask.NopMetrics{}), "build 6 (starting): a pending build needs Load's own Metrics", nil},
		{"a journal holding tasks", bgtask.WithJournal(full), "bgtasktest: Load: the Manager holds tasks before any build (1, its Journal's)", nil},
		{"health cooldowns", bgtask.WithHealth(bgtask.HealthPolicy{}),
			"build 3 (task-1): attempt 1 should be running, but the task is pending (cooldown) in attempt 1, on a/big", cooled},
	} {
		builds := c.builds
		if builds == nil {
			builds = mixed()
		}
		m, err := bgtasktest.Load(context.Background(), builds, c.opt)
		assert.Nil(t, m, c.name)
		require.Error(t, err, c.name)
		assert.Contains(t, err.Error(), c.want, c.name)
		assert.True(t, strings.HasPrefix(err.Error(), "bgtasktest: Load: "), err.Error())
	}

	// A stall timeout longer than every Took is no obstacle, nor is a limit that queues nothing.
	load(t, mixed()[:4], bgtask.WithStallTimeout(time.Hour), bgtask.WithModelLimits(bgtask.ModelLimits{Default: 1}))
	// A later build's clock may stall a live task built before it.
	_, err = bgtasktest.Load(context.Background(), []bgtasktest.TaskBuild{
		{Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusRunning, Took: time.Second}}},
		{Attempts: []bgtasktest.AttemptBuild{{Status: bgtask.StatusCompleted, Took: 59 * time.Second}}},
	}, bgtask.WithStallTimeout(time.Minute))
	assert.ErrorContains(t, err, "bgtasktest: Load: build 1 (task-1): the task was running in attempt 1, on model-1 when built, and is ")
}

func TestAPermanentFailureCannotBeRetried(t *testing.T) {
	_, err := bgtasktest.BuildTask(bgtasktest.TaskBuild{Attempts: []bgtasktest.AttemptBuild{
		{Status: bgtask.StatusError, Err: bgtask.Permanent(errors.New("400 Bad Request"))}, {Status: bgtask.StatusCompleted},
	}})
	assert.ErrorContains(t, err, "bgtasktest: BuildTask: attempt 2 should be running, but the task is error in attempt 1")
}

func TestLoadOfNothingAndShutdownLeavesNoGoroutine(t *testing.T) {
	m, err := bgtasktest.Load(context.Background(), nil)
	require.NoError(t, err)
	assert.Empty(t, m.Snapshot().Tasks)
	require.NoError(t, m.Shutdown(context.Background()))

	m, err = bgtasktest.Load(context.Background(), mixed(), bgtask.WithNotifier(&bgtasktest.Recorder{}))
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(context.Background()))
	for _, task := range m.Snapshot().Tasks {
		assert.True(t, task.Status.Terminal(), "%s: %s", task.ID, task.Status)
	}
	goleak.VerifyNone(t)
}
