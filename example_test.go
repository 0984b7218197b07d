package bgtask_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/bgtask/bgtask"
)

// scriptedHost answers every StartSession at once. Its child sessions report
// their outcome by attempt id from inside StartSession — before the session
// is bound — which bgtask holds and applies at the bind.
type scriptedHost struct {
	m *bgtask.Manager
}

func (h *scriptedHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	ev := bgtask.Event{AttemptID: req.AttemptID, Kind: bgtask.SessionIdle, Text: "42"}
	switch req.Model.Provider {
	case "openai":
		ev = bgtask.Event{AttemptID: req.AttemptID, Kind: bgtask.SessionError, Err: errors.New("Forbidden: Selected provider is forbidden")}
	case "anthropic":
		ev = bgtask.Event{AttemptID: req.AttemptID, Kind: bgtask.SessionError, Err: errors.New("429 Too Many Requests")}
	}
	_ = h.m.Observe(ev)
	return fmt.Sprintf("ses_%d", req.AttemptNumber), nil
}

func (h *scriptedHost) AbortSession(ctx context.Context, sessionID string) error { return nil }

func ExampleManager() {
	ctx := context.Background()
	host := &scriptedHost{}
	m, err := bgtask.Open(context.Background(), host,
		bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithNotifier(bgtask.NotifierFunc(func(ctx context.Context, n bgtask.Notification) error {
			fmt.Println("parent:", n.Kind)
			return nil
		})),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	host.m = m

	task, err := m.Launch(ctx, bgtask.Spec{
		ParentSessionID: "ses_parent",
		Prompt:          "What is six times seven?",
		Models: []bgtask.Model{
			{Provider: "openai", ID: "gpt-5.4-mini"},
			{Provider: "anthropic", ID: "claude-haiku-4.5"},
			{Provider: "google", ID: "gemini-2.5-flash-lite"},
		},
	})
	if err != nil {
		panic(err)
	}
	done, _ := m.Wait(ctx, task.ID)
	_ = m.Shutdown(ctx) // delivers what is queued, then stops every goroutine

	fmt.Println(done.Status, done.Result)
	fmt.Println(bgtask.Timeline(done))
	// Output:
	// parent: retry_scheduled
	// parent: retry_session_ready
	// parent: retry_scheduled
	// parent: retry_session_ready
	// parent: final_summary
	// parent: all_complete
	// completed 42
	// Background task attempts:
	// - Attempt 1 — ERROR — openai/gpt-5.4-mini — ses_1
	//   Error: Forbidden: Selected provider is forbidden
	// - Attempt 2 — ERROR — anthropic/claude-haiku-4.5 — ses_2
	//   Error: 429 Too Many Requests
	// - Attempt 3 — COMPLETED — google/gemini-2.5-flash-lite — ses_3
}

func ExampleTimeline() {
	fmt.Println(bgtask.Timeline(bgtask.Task{Attempts: []bgtask.Attempt{
		{Number: 1, Status: bgtask.StatusError, Model: bgtask.Model{Provider: "openai", ID: "gpt-5.4-mini"}, SessionID: "ses_aaa", Error: "Forbidden: Selected provider is forbidden"},
		{Number: 2, Status: bgtask.StatusCompleted, Model: bgtask.Model{Provider: "google", ID: "gemini-2.5-flash-lite"}, SessionID: "ses_ccc"},
	}}))
	// Output:
	// Background task attempts:
	// - Attempt 1 — ERROR — openai/gpt-5.4-mini — ses_aaa
	//   Error: Forbidden: Selected provider is forbidden
	// - Attempt 2 — COMPLETED — google/gemini-2.5-flash-lite — ses_ccc
}
