package bgtask_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/bgtask/bgtask"
)

// A subagent returns a result of the harness's own type; the one caller
// that launched it hears of its end once, after the final summary.
func ExampleReturning() {
	type Result struct{ ForModel, ForUser string }
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(bgtask.Returning(func(ctx context.Context, run bgtask.Run) (Result, error) {
		return Result{ForModel: "3 files changed", ForUser: "see the diff of " + run.Description}, nil
	}, func(r Result) string { return r.ForModel })))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())

	done := make(chan bgtask.Task, 1)
	_, err = m.Launch(context.Background(), bgtask.Spec{
		ParentSessionID: "chat", Description: "the refactor", Prompt: "refactor it",
		Models: []bgtask.Model{{ID: "gpt-primary"}},
		OnDone: func(t bgtask.Task) { done <- t },
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	t := <-done
	r, _ := bgtask.ValueOf[Result](t)
	fmt.Println(t.Status, "|", t.Result, "|", r.ForUser)
	// Output: completed | 3 files changed | see the diff of the refactor
}

// A subagent spawns beneath its own session; the tree's limits are the
// core's to enforce.
func ExampleWithTreeLimits() {
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		if run.Depth == 2 {
			_, err := run.Manager().Launch(ctx, bgtask.Spec{Prompt: "deeper", Models: []bgtask.Model{{ID: "m"}}})
			return fmt.Sprintf("depth %d, spawning: %v", run.Depth, err), nil
		}
		kid, err := run.Manager().Launch(ctx, bgtask.Spec{Prompt: "dig", Models: []bgtask.Model{{ID: "m"}}})
		if err != nil {
			return "", err
		}
		done, err := run.Manager().Wait(ctx, kid.ID)
		return done.Result, err
	}), bgtask.WithTreeLimits(bgtask.TreeLimits{MaxDepth: 2}), bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())

	task, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Prompt: "research", Models: []bgtask.Model{{ID: "m"}}})
	done, _ := m.Wait(context.Background(), task.ID)
	fmt.Println(done.Result)
	// Output: depth 2, spawning: spawn depth limit reached (2) under session fn_attempt-2
}

// A chatty child stuck in a loop never stalls; its wall-clock deadline
// ends it.
func ExampleSpec_timeout() {
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		for {
			run.Busy()
			select {
			case <-ctx.Done():
				return "", ctx.Err()
			case <-time.After(time.Millisecond):
			}
		}
	}))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())

	task, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Prompt: "loop",
		Models: []bgtask.Model{{ID: "m"}, {ID: "fallback"}}, Timeout: 20 * time.Millisecond})
	done, _ := m.Wait(context.Background(), task.ID)
	fmt.Println(done.Status, done.Outcome.Reason, len(done.Attempts), errors.Is(done.Cause, bgtask.ReasonDeadline))
	// Output: error deadline 1 true
}

type quotaErr struct{}

func (quotaErr) Error() string { return "400 quota exceeded for this key" }

// A harness adds a rule of its own to the default classifier.
func ExampleWithRetryable() {
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		if run.Attempt == 1 {
			return "", quotaErr{}
		}
		return "answered on " + run.Model.String(), nil
	}), bgtask.WithRetryable(func(err error, retryable bool) bool {
		return retryable || errors.As(err, new(quotaErr))
	}))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())

	task, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Prompt: "q",
		Models: []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {ID: "router-backup"}}})
	done, _ := m.Wait(context.Background(), task.ID)
	fmt.Println(done.Result)
	// Output: answered on router-backup
}

// A harness's own name for a model has no provider.
func ExampleParseModel() {
	alias, _ := bgtask.ParseModel("gpt-primary")
	full, _ := bgtask.ParseModel("openrouter/meta/llama-4")
	fmt.Printf("%q %q | %q %q\n", alias.Provider, alias, full.Provider, full.ID)
	// Output: "" "gpt-primary" | "openrouter" "meta/llama-4"
}
