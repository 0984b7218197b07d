// Command fallback runs one background task across a fallback chain of
// three models on a simulated host: the first provider is forbidden, the
// second is rate-limited, the third answers. It prints every notification
// the parent chat session receives, as it arrives, and the final timeline.
//
//	go run ./examples/fallback
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "fallback:", err)
		os.Exit(1)
	}
}

// providerError is what a provider SDK returns: a message and an HTTP
// status, which bgtask's default classifier reads through StatusCode.
type providerError struct {
	code int
	msg  string
}

func (e *providerError) Error() string   { return e.msg }
func (e *providerError) StatusCode() int { return e.code }

// simHost plays the session service. Each child session reports from its
// own goroutine, like a real event stream, so its events may reach bgtask
// before StartSession has returned: bgtask holds those until the bind.
type simHost struct {
	m        *bgtask.Manager
	children sync.WaitGroup // the simulated children, joined before exit

	mu sync.Mutex
	n  int
}

// outcomes scripts what each model does.
var outcomes = map[string]error{
	"openai/gpt-5.4-mini":        &providerError{code: 403, msg: "Forbidden: Selected provider is forbidden"},
	"anthropic/claude-haiku-4.5": &providerError{code: 429, msg: "Too Many Requests"},
}

func (h *simHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	h.mu.Lock()
	h.n++
	sid := "ses_" + strconv.Itoa(h.n)
	h.mu.Unlock()
	h.children.Add(1)
	go func() {
		defer h.children.Done()
		_ = h.m.Observe(bgtask.Event{SessionID: sid, Kind: bgtask.SessionBusy})
		if err := outcomes[req.Model.String()]; err != nil {
			_ = h.m.Observe(bgtask.Event{SessionID: sid, Kind: bgtask.SessionError, Err: err})
			return
		}
		_ = h.m.Observe(bgtask.Event{SessionID: sid, Kind: bgtask.SessionIdle, Text: "The flaky test races on a shared temp dir."})
	}()
	return sid, nil
}

func (h *simHost) AbortSession(ctx context.Context, sessionID string) error { return nil }

func run(ctx context.Context, w io.Writer) error {
	host := &simHost{}
	m, err := bgtask.Open(ctx, host,
		bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithNotifier(bgtask.NotifierFunc(func(ctx context.Context, n bgtask.Notification) error {
			fmt.Fprintf(w, "→ parent %s gets %s:\n%s\n\n", n.ParentSessionID, n.Kind, n.Text)
			return nil
		})),
	)
	if err != nil {
		return err
	}
	host.m = m

	task, err := m.Launch(ctx, bgtask.Spec{
		ParentSessionID: "ses_parent",
		Description:     "find why the test is flaky",
		Agent:           "explore",
		Prompt:          "Find why TestUpload is flaky.",
		Models: []bgtask.Model{
			{Provider: "openai", ID: "gpt-5.4-mini"},
			{Provider: "anthropic", ID: "claude-haiku-4.5"},
			{Provider: "google", ID: "gemini-2.5-flash-lite"},
		},
	})
	if err != nil {
		return err
	}
	done, err := m.Wait(ctx, task.ID)
	if err != nil {
		return err
	}
	// Shutdown delivers what is still queued for the parent, then returns
	// once no goroutine of the Manager is left.
	if err := m.Shutdown(ctx); err != nil {
		return err
	}
	host.children.Wait()

	fmt.Fprintf(w, "Task %s ended %s with: %q\n\n%s\n", done.ID, done.Status, done.Result, bgtask.Timeline(done))
	return nil
}
