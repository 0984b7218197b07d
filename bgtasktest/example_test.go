package bgtasktest_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
)

// A test of a harness's fallback, with no sleeps: the scripted host fails
// the first model's session, the retry waits out a delay on the test's
// clock, and the final summary is awaited, not read right after Wait.
func Example() {
	ctx := context.Background()
	clk := bgtasktest.NewClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	host := bgtasktest.NewHost()
	rec := &bgtasktest.Recorder{}
	m, err := bgtask.Open(context.Background(), host, bgtask.WithClock(clk), bgtask.WithNotifier(rec), bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithRetryDelay(bgtask.Backoff(time.Second, time.Minute, 0)))
	if err != nil {
		fmt.Println(err)
		return
	}
	host.Attach(m)
	defer m.Shutdown(ctx)

	task, _ := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "summarise",
		Models: []bgtask.Model{{Provider: "a", ID: "big"}, {Provider: "b", ID: "small"}}})
	running, _ := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	made, _ := clk.Timers()
	_ = host.Fail(running.SessionID, errors.New("429 Too Many Requests"))
	_ = clk.AwaitTimers(ctx, made+1) // the retry delay's timer exists

	clk.Advance(time.Second)
	second, _ := bgtasktest.WaitFor(ctx, m, task.ID, func(t bgtask.Task) bool {
		return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning
	})
	_ = host.Idle(second.SessionID, "three bullet points")

	done, _ := m.Wait(ctx, task.ID)
	summary, _ := rec.AwaitFinal(ctx, task.ID)
	fmt.Println(done.Status, done.Model, "|", done.Result)
	fmt.Println(summary.Kind, rec.Kinds(task.ID))
	fmt.Println(host.Aborts())
	// Output:
	// completed b/small | three bullet points
	// final_summary [retry_scheduled retry_session_ready final_summary]
	// [ses-1]
}

// A test of code that reads a Manager gets one holding the tasks it needs,
// in one line: each is built as a real task goes, live ones included.
func ExampleLoad() {
	ctx := context.Background()
	m, err := bgtasktest.Load(ctx, []bgtasktest.TaskBuild{
		{ID: "search", Description: "search the web", Attempts: []bgtasktest.AttemptBuild{
			{Status: bgtask.StatusCompleted, Took: time.Minute, Result: "3 links"}}},
		{ID: "review", Description: "review the diff", Agent: "reviewer", Attempts: []bgtasktest.AttemptBuild{
			{Status: bgtask.StatusError, Err: errors.New("429 Too Many Requests")}, {Status: bgtask.StatusRunning, Took: time.Second}}},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(ctx)

	for _, t := range m.Snapshot().Tasks {
		fmt.Println(t.ID, t.Status, len(t.Attempts), t.Description)
	}
	_, _ = m.Stop(ctx, bgtask.Target{Task: "review"})
	stopped, _ := m.Wait(ctx, "review")
	fmt.Println(stopped.ID, stopped.Status)
	// Output:
	// search completed 1 search the web
	// review running 2 review the diff
	// review cancelled
}
