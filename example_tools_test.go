package bgtask_test

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/bgtask/bgtask"
)

// shutdownOrSay shuts m down and prints what went wrong, if anything.
func shutdownOrSay(m *bgtask.Manager) {
	if err := m.Shutdown(context.Background()); err != nil {
		fmt.Println("shutdown:", err)
	}
}

// subagentTool is a CLI coding agent's synchronous sub-agent tool: the
// model calls it and reads what it returns, the sub-agent's answer or an
// error's text. agent is the sub-agent's loop (its model client).
type subagentTool struct {
	m     *bgtask.Manager
	agent bgtask.RunFunc
}

func (t subagentTool) Call(ctx context.Context, prompt string) (string, error) {
	task, err := t.m.Run(ctx, bgtask.Spec{Description: "sub-agent", Prompt: prompt, Run: t.agent})
	if err != nil { // no clean answer: err says why, in plain words
		return "", fmt.Errorf("sub-agent: %w", err)
	}
	return task.Outcome.Answer, nil
}

// A coding agent's sub-agent tool runs a sub-agent to its end with
// Manager.Run. When the user presses Esc, the turn's context is cancelled:
// the tool returns only once the sub-agent really stopped, cancelled, with
// the context's error.
func Example_syncSubagent() {
	m, err := bgtask.Open(context.Background(), nil, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer shutdownOrSay(m)

	started, stopped := make(chan struct{}), make(chan struct{})
	tool := subagentTool{m: m, agent: func(ctx context.Context, run bgtask.Run) (string, error) {
		switch run.Prompt {
		case "find the flaky test":
			return "TestRetry: it sleeps 10ms and races the timer", nil
		case "read the vendored code":
			return "", bgtask.Permanent(errors.New("prompt is too long: 210000 tokens > 200000 maximum"))
		}
		close(started) // a long refactor: it runs until stopped
		<-ctx.Done()
		close(stopped)
		return "", ctx.Err()
	}}

	ctx := context.Background()
	answer, err := tool.Call(ctx, "find the flaky test")
	fmt.Printf("model reads: %q, %v\n", answer, err)
	_, err = tool.Call(ctx, "read the vendored code")
	fmt.Println("model reads:", err)

	turn, esc := context.WithCancel(ctx)
	go func() { <-started; esc() }() // the user presses Esc mid-run
	_, err = tool.Call(turn, "refactor the parser")
	task, _ := m.Task("task-3")
	select {
	case <-stopped:
		fmt.Println("sub-agent had stopped when Call returned:", task.Status)
	default:
		fmt.Println("Call returned while the sub-agent ran")
	}
	fmt.Println("model reads:", err, "| context.Canceled:", errors.Is(err, context.Canceled))
	// Output:
	// model reads: "TestRetry: it sleeps 10ms and races the timer", <nil>
	// model reads: sub-agent: prompt is too long: 210000 tokens > 200000 maximum
	// sub-agent had stopped when Call returned: cancelled
	// model reads: sub-agent: stopped: the caller of task task-3 went away: context canceled | context.Canceled: true
}

// origin is where a spawn came from: where its answer goes.
type origin struct {
	Channel string
	Chat    int64
}

// assistant is a personal assistant's spawn and status tools: a spawn
// remembers its origin on the task itself (Spec.Attach), so status (or a
// restarted process) reads it back without a side map.
type assistant struct {
	m     *bgtask.Manager
	agent bgtask.RunFunc
}

func (a assistant) spawn(ctx context.Context, from origin, prompt string) (string, error) {
	task, err := a.m.Launch(ctx, bgtask.Spec{Description: prompt, Prompt: prompt, Attach: from, Run: a.agent})
	if err != nil {
		return "", err
	}
	return task.ID, nil
}

func (a assistant) status(id string) string {
	task, err := a.m.Task(id)
	if err != nil {
		return err.Error() // unknown task: "task-9"
	}
	to, ok := bgtask.Attached[origin](task)
	if !ok {
		return id + ": no origin"
	}
	switch {
	case task.Status.Live():
		return fmt.Sprintf("%s: working on %q; the answer goes to %s chat %d", id, task.Description, to.Channel, to.Chat)
	case task.Outcome.State == bgtask.StatusCompleted:
		return fmt.Sprintf("%s: done, sent to %s chat %d: %s", id, to.Channel, to.Chat, task.Outcome.Answer)
	default:
		return fmt.Sprintf("%s: %s (%s chat %d was told)", id, task.Outcome.State, to.Channel, to.Chat)
	}
}

// A personal assistant's spawn tool attaches where a request came from
// (a typed origin) to the task it launches; its status tool reads the
// origin back from the task's snapshot to say where the answer goes.
func Example_spawnTool() {
	m, err := bgtask.Open(context.Background(), nil, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer shutdownOrSay(m)

	release := make(chan struct{})
	a := assistant{m: m, agent: func(ctx context.Context, run bgtask.Run) (string, error) {
		if strings.HasPrefix(run.Prompt, "book") {
			select { // waits for the airline until released
			case <-release:
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
		return "done: " + run.Prompt, nil
	}}

	ctx := context.Background()
	flight, err := a.spawn(ctx, origin{Channel: "telegram", Chat: 42}, "book a flight to Lisbon")
	if err != nil {
		fmt.Println(err)
		return
	}
	digest, err := a.spawn(ctx, origin{Channel: "slack", Chat: 7}, "summarise my inbox")
	if err != nil {
		fmt.Println(err)
		return
	}
	if _, err := m.Wait(ctx, digest); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(a.status(flight))
	fmt.Println(a.status(digest))
	close(release)
	if _, err := m.Wait(ctx, flight); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(a.status(flight))
	fmt.Println(a.status("task-9"))
	// Output:
	// task-1: working on "book a flight to Lisbon"; the answer goes to telegram chat 42
	// task-2: done, sent to slack chat 7: done: summarise my inbox
	// task-1: done, sent to telegram chat 42: done: book a flight to Lisbon
	// unknown task: "task-9"
}

// backgroundTool is an agent framework's "background" tool: it starts a
// job beneath whichever agent calls it (the agent's ctx says which) and
// returns at once; the job does not hold the agent's end (Detached).
type backgroundTool struct {
	m   *bgtask.Manager
	job bgtask.RunFunc
}

func (t backgroundTool) Call(ctx context.Context, job string) (string, error) {
	task, err := t.m.Launch(ctx, bgtask.Spec{Description: job, Prompt: job, Run: t.job, Detached: true})
	if err != nil {
		return "", err
	}
	return "started " + task.ID + " in the background", nil
}

// stopTool is the framework's stop tool: it stops an agent and everything
// the agent started, and says what it stopped.
type stopTool struct{ m *bgtask.Manager }

func (t stopTool) Call(ctx context.Context, id string) (string, error) {
	report, err := t.m.Stop(ctx, bgtask.Target{Task: id, Tree: true})
	if err != nil {
		return "", err
	}
	stopped := make([]string, 0, len(report.Stopped))
	for _, r := range report.Stopped {
		stopped = append(stopped, r.TaskID+" ("+string(r.Status)+")")
	}
	return "stopped " + id + " and: " + strings.Join(stopped, ", "), nil
}

// An agent framework's nested background tool: the parent agent calls it
// with its own context (no Run value threaded, no ParentSessionID), so the
// job goes beneath the parent; Detached lets the parent complete while the
// job runs. Stopping the parent's tree still stops the job.
func Example_backgroundTool() {
	m, err := bgtask.Open(context.Background(), nil, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer shutdownOrSay(m)

	jobRuns := make(chan struct{})
	background := backgroundTool{m: m, job: func(ctx context.Context, run bgtask.Run) (string, error) {
		close(jobRuns) // a long watch: it runs until stopped
		<-ctx.Done()
		return "", ctx.Err()
	}}
	parent := func(ctx context.Context, run bgtask.Run) (string, error) {
		return background.Call(ctx, "watch the deploy") // the model called the tool
	}

	ctx := context.Background()
	lead, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Description: "release agent", Run: parent})
	if err != nil {
		fmt.Println(err)
		return
	}
	lead, err = m.Wait(ctx, lead.ID)
	if err != nil {
		fmt.Println(err)
		return
	}
	arrived(jobRuns, "the background job to run")
	job, _ := m.Tasks(bgtask.Query{Parent: lead.SessionID})
	fmt.Println("parent:", lead.Status, "|", lead.Result)
	fmt.Println("child:", job.Tasks[0].ID, job.Tasks[0].Status, "detached:", job.Tasks[0].Detached)

	said, err := stopTool{m: m}.Call(ctx, lead.ID)
	fmt.Println(said, err)
	child, err := m.Wait(ctx, job.Tasks[0].ID)
	fmt.Println("child:", child.Status, err)
	// Output:
	// parent: completed | started task-2 in the background
	// child: task-2 running detached: true
	// stopped task-1 and: task-2 (cancelled) <nil>
	// child: cancelled <nil>
}
