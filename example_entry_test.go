package bgtask_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/bgtask/bgtask"
)

// Extend sends a further prompt into a running task's child conversation;
// WaitAnswer returns each invocation's answer, in order. Here the child is
// a FuncHost function: it takes the next prompt from Run.Prompts while its
// first turn is still going, answers the launch prompt with Run.Answer,
// and its return answers the prompt it took.
func ExampleManager_Extend() {
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		select {
		case p := <-run.Prompts():
			run.Answer(1, "read "+run.Prompt)
			return "now " + p.Prompt, nil
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	ctx := context.Background()
	sub, _ := m.Subscribe(ctx, 64)
	task, _ := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "the logs", Models: []bgtask.Model{{ID: "m"}}})
	for c := range sub.C { // a task takes prompts once it runs (has its session)
		if c.Task.ID == task.ID && c.Task.Status == bgtask.StatusRunning {
			break
		}
	}
	sub.Close()
	n, err := m.Extend(ctx, task.ID, "the metrics") // returns once the function took it
	fmt.Println(n, err)
	for i := 1; i <= n; i++ {
		a, _ := m.WaitAnswer(ctx, task.ID, i)
		fmt.Println(a.Invocation, a.Status, "|", a.Text)
	}
	// Output:
	// 2 <nil>
	// 1 completed | read the logs
	// 2 completed | now the metrics
}

// A FuncHost tree: a function launches subagents with its own context (the
// context carries its run: Launch makes the run's session their parent)
// and waits for them all with WaitParent; stopping the root's tree would
// stop every level.
func ExampleManager_Launch_nested() {
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		if !strings.HasPrefix(run.Prompt, "plan:") {
			return "did " + run.Prompt, nil
		}
		for _, step := range strings.Split(strings.TrimPrefix(run.Prompt, "plan:"), ",") {
			if _, err := run.Manager().Launch(ctx, bgtask.Spec{Prompt: step, Models: []bgtask.Model{{ID: "worker"}}}); err != nil {
				return "", err
			}
		}
		children, err := run.Manager().WaitParent(ctx, run.SessionID)
		if err != nil {
			return "", err
		}
		var done []string
		for _, c := range children {
			done = append(done, c.Result)
		}
		return strings.Join(done, "; "), nil
	}), bgtask.WithTreeLimits(bgtask.TreeLimits{MaxDepth: 2}))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	lead, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Prompt: "plan:fetch,parse",
		Models: []bgtask.Model{{ID: "lead"}}})
	done, _ := m.Wait(context.Background(), lead.ID)
	fmt.Println(done.Status, "|", done.Result)
	// Output: completed | did fetch; did parse
}

// With a journal, what one process decided a restart replays: Open reads
// it back. (A run the old process left running is ended honestly: a
// FuncHost's functions died with it, so it is interrupt, "lost across
// restart".)
func ExampleOpenFileJournal() {
	dir, _ := os.MkdirTemp("", "bgtask-journal")
	defer os.RemoveAll(dir)
	answer := func(ctx context.Context, run bgtask.Run) (string, error) { return "done: " + run.Prompt, nil }

	j, err := bgtask.OpenFileJournal(dir)
	if err != nil {
		panic(err)
	}
	m, _ := bgtask.Open(context.Background(), bgtask.NewFuncHost(answer), bgtask.WithJournal(j))
	task, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Prompt: "index the repo", Models: []bgtask.Model{{ID: "m"}}})
	_, _ = m.Wait(context.Background(), task.ID)
	_ = m.Shutdown(context.Background()) // closes the journal

	j, _ = bgtask.OpenFileJournal(dir)
	m, _ = bgtask.Open(context.Background(), bgtask.NewFuncHost(answer), bgtask.WithJournal(j))
	defer m.Shutdown(context.Background())
	again, err := m.Task(task.ID)
	fmt.Println(again.Status, "|", again.Result, "|", err)
	// Output: completed | done: index the repo | <nil>
}

// An in-process harness with two kinds of subagent: each launch brings its
// own function (Spec.Run), so the spawn tool needs no side map and no
// context values; Open with a nil host means there is no session service at
// all.
func ExampleSpec_run() {
	m, err := bgtask.Open(context.Background(), nil, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())

	kinds := map[string]func(topic string) bgtask.RunFunc{
		"research": func(topic string) bgtask.RunFunc {
			return func(ctx context.Context, run bgtask.Run) (string, error) {
				return "three sources on " + topic, nil // call the model here, with run.Model
			}
		},
		"code": func(topic string) bgtask.RunFunc {
			return func(ctx context.Context, run bgtask.Run) (string, error) {
				if run.Model.ID == "fast" {
					return "", errors.New("503 Service Unavailable") // the next model is tried
				}
				return "a patch for " + topic + " (" + run.Model.ID + ")", nil
			}
		},
	}
	// The spawn tool: one launch per call, whatever kind it asks for.
	spawn := func(ctx context.Context, parent, kind, topic string) (bgtask.Task, error) {
		return m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Agent: kind, Prompt: topic,
			Models: []bgtask.Model{{ID: "fast"}, {ID: "careful"}}, Run: kinds[kind](topic)})
	}

	ctx := context.Background()
	a, _ := spawn(ctx, "chat", "research", "flaky tests")
	b, _ := spawn(ctx, "chat", "code", "the race")
	for _, id := range []string{a.ID, b.ID} {
		done, _ := m.Wait(ctx, id)
		fmt.Println(done.Agent, done.Status, len(done.Attempts), "|", done.Result)
	}
	// Output:
	// research completed 1 | three sources on flaky tests
	// code completed 2 | a patch for the race (careful)
}
