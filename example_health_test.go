package bgtask_test

import (
	"context"
	"fmt"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
)

// rateLimited is a provider's 429 with its Retry-After.
type rateLimited struct{ after time.Duration }

func (e rateLimited) Error() string             { return "429 Too Many Requests" }
func (e rateLimited) RetryAfter() time.Duration { return e.after }

// WithHealth shares what one task learned of a model with every other: the
// first task's 429 cools the model for its Retry-After, and the next task
// skips it for the chain's next model without spending an attempt on it.
func ExampleWithHealth() {
	ctx := context.Background()
	clk := bgtasktest.NewClock(time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC))
	host := bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		if run.Model.Provider == "openai" {
			return "", rateLimited{after: 30 * time.Second}
		}
		return "done on " + run.Model.String(), nil
	})
	m, err := bgtask.Open(context.Background(), host, bgtask.WithClock(clk), bgtask.WithIDs(bgtask.SequentialIDs()), bgtask.WithHealth(bgtask.HealthPolicy{}))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(ctx)
	chain := []bgtask.Model{{Provider: "openai", ID: "gpt-5.4-mini"}, {Provider: "google", ID: "gemini-2.5-flash"}}
	run := func() bgtask.Task {
		t, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "summarise the logs", Models: chain})
		if err != nil {
			panic(err)
		}
		t, err = m.Wait(ctx, t.ID)
		if err != nil {
			panic(err)
		}
		return t
	}
	first := run()  // the 429: attempt 1 fails, attempt 2 runs on gemini
	second := run() // openai cools: skipped, one attempt
	fmt.Println(len(first.Attempts), "attempts, then", len(second.Attempts))
	fmt.Println(bgtask.Timeline(second))
	for _, h := range m.Health() {
		fmt.Println(h.Key(), h.State, h.Why, h.Until.Format(time.RFC3339))
	}
	fmt.Println(m.ResetHealth(ctx, "openai/gpt-5.4-mini"))
	// Output:
	// 2 attempts, then 1
	// Background task attempts:
	// - Skipped openai/gpt-5.4-mini before attempt 1 — cooling (rate_limited) until 2026-12-02T10:00:30Z
	// - Attempt 1 — COMPLETED — google/gemini-2.5-flash — fn_attempt-3
	// openai/gpt-5.4-mini cooling rate_limited 2026-12-02T10:00:30Z
	// <nil>
}
