// Command delegation shows answers given once, in order: a lead subagent
// delegates two async subtasks from its own session, gets a supplemental
// prompt while they run, and answers only after both subtasks' results
// reached it. The turn it ends early, while they still run, is held by the
// children gate and never reaches the chat; then invocation 1 (the launch
// prompt) and invocation 2 (the supplemental one) are each answered once,
// in order.
//
//	go run ./examples/delegation
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "delegation:", err)
		os.Exit(1)
	}
}

const text = "the quick brown fox jumps over the lazy dog"

// sessions routes what a parent session is told to the function running
// it: the notifier hands each subtask's result to its lead this way.
type sessions struct {
	mu      sync.Mutex
	results map[string]chan string // lead's session id → its subtasks' results
}

func (s *sessions) inbox(sid string) chan string {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch, ok := s.results[sid]
	if !ok {
		ch = make(chan string, 8)
		s.results[sid] = ch
	}
	return ch
}

func run(ctx context.Context, out io.Writer) error {
	var (
		m        *bgtask.Manager
		routes   = &sessions{results: map[string]chan string{}}
		chatMu   sync.Mutex
		chat     []bgtask.Notification // what the chat session was told, in order
		subtasks = make(chan struct{}) // closed once the lead's early turn was held
		running  = make(chan struct{}) // closed once the lead runs: it can be extended
		logMu    sync.Mutex
		log      []string
	)
	say := func(format string, args ...any) {
		logMu.Lock()
		log = append(log, fmt.Sprintf(format, args...))
		logMu.Unlock()
	}

	fn := func(ctx context.Context, r bgtask.Run) (string, error) {
		switch r.Agent {
		case "count":
			<-subtasks
			return fmt.Sprintf("%d words", len(strings.Fields(r.Prompt))), nil
		case "longest":
			<-subtasks
			longest := ""
			for _, w := range strings.Fields(r.Prompt) {
				if len(w) > len(longest) {
					longest = w
				}
			}
			return "the longest word is " + longest, nil
		}
		// The lead: delegate from its own session, then end a turn at once.
		close(running)
		results := routes.inbox(r.SessionID)
		for _, agent := range []string{"count", "longest"} {
			if _, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: r.SessionID, Agent: agent, Description: agent, Prompt: text,
				Models: []bgtask.Model{{Provider: "local", ID: "tiny"}}}); err != nil {
				return "", err
			}
		}
		r.Answer(1, "I have started two subtasks.")
		if t, _ := m.Task(r.TaskID); t.Activity == bgtask.ActivityAwaitingChildren {
			say("the lead ended a turn while its subtasks ran: held (%s)", t.Activity)
		}
		close(subtasks)
		var got []string
		var extra bgtask.PromptRequest
		for len(got) < 2 || extra.Invocation == 0 {
			select {
			case res := <-results:
				got = append(got, res)
			case extra = <-r.Prompts():
				say("the lead took invocation %d: %q", extra.Invocation, extra.Prompt)
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
		r.Answer(1, "Both subtasks reported: "+strings.Join(slices.Sorted(slices.Values(got)), "; ")+".")
		return fmt.Sprintf("To %q: I used %d subtasks.", extra.Prompt, len(got)), nil
	}

	notifier := bgtask.NotifierFunc(func(ctx context.Context, n bgtask.Notification) error {
		if n.ParentSessionID == "chat" {
			chatMu.Lock()
			chat = append(chat, n)
			chatMu.Unlock()
			return nil
		}
		if n.Kind != bgtask.NotifyFinalSummary {
			return nil
		}
		// A subtask's result reaches its lead now: say so before the lead
		// can act on it, so its next turn is never mistaken for one that
		// came before.
		bgtask.Delivered(ctx)
		routes.inbox(n.ParentSessionID) <- n.Task.Result
		return nil
	})

	m, err := bgtask.Open(ctx, bgtask.NewFuncHost(fn), bgtask.WithNotifier(notifier), bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		return err
	}
	defer func() { _ = m.Shutdown(context.Background()) }()

	lead, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Agent: "lead", Description: "analyse a sentence",
		Prompt: "Analyse: " + text, Models: []bgtask.Model{{Provider: "local", ID: "tiny"}}})
	if err != nil {
		return err
	}
	select { // Extend needs a running task: a pending one is refused
	case <-running:
	case <-ctx.Done():
		return ctx.Err()
	}
	n, err := m.Extend(ctx, lead.ID, "how many subtasks did you use?")
	if err != nil {
		return err
	}
	done, err := m.Wait(ctx, lead.ID)
	if err != nil {
		return err
	}
	if err := m.Shutdown(ctx); err != nil { // every notification delivered
		return err
	}

	fmt.Fprintf(out, "Lead %s: %s; the supplemental prompt was invocation %d\n\n", done.ID, done.Status, n)
	logMu.Lock()
	for _, l := range log {
		fmt.Fprintln(out, "- "+l)
	}
	logMu.Unlock()
	fmt.Fprintln(out, "\nAnswers, by invocation:")
	for _, in := range done.Invocations {
		if in.Answer == nil {
			return errors.New("an invocation has no answer")
		}
		fmt.Fprintf(out, "  %d. %q → %q\n", in.N, in.Prompt, in.Answer.Text)
	}
	fmt.Fprintln(out, "\nWhat the chat was told, in order:")
	chatMu.Lock()
	defer chatMu.Unlock()
	for _, n := range chat {
		fmt.Fprintf(out, "--- %s\n%s\n", n.Kind, n.Text)
	}
	return nil
}
