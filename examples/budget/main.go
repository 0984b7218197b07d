// Command budget runs a research tree that spends past its budget: a
// root subagent launches three researchers in-process, each reports the
// tokens and cost of its model calls (Run.Usage) and paces itself by the
// budget notice its receipt carries. The tree has 6,000 tokens, 3 spawns
// and a soft threshold at 50%. It shows what the parent chat is told (the
// soft notice, the hard stop, the closure, each task's end with its
// usage line), what a fourth spawn is refused with, and what the live
// page's JSON holds for the root.
//
//	go run ./examples/budget
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "budget:", err)
		os.Exit(1)
	}
}

// chat is the parent chat session: what it is told, in order.
type chat struct {
	mu   sync.Mutex
	told []bgtask.Notification
}

func (c *chat) Notify(_ context.Context, n bgtask.Notification) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.told = append(c.told, n)
	return nil
}

func (c *chat) all() []bgtask.Notification {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]bgtask.Notification(nil), c.told...)
}

// Outcome is what run saw, for its test.
type Outcome struct {
	Root       bgtask.Task
	Kids       []bgtask.Task
	Refused    error // the fourth spawn's
	Told       []bgtask.Notification
	Overrun    int64 // tokens spent past the limit
	PageBudget *bgtask.BudgetState
}

// researcher is a subagent: it makes model calls of 800 tokens each and
// reports them, until its run is stopped (Fence fails: the budget's stop
// is asked in the commit that spent it) or it has done 10 calls (more than the budget holds).
func researcher(ctx context.Context, run bgtask.Run) (string, error) {
	for call := 1; call <= 10; call++ {
		if err := bgtask.Fence(ctx); err != nil {
			return "", err // stopped: no new request
		}
		if err := run.Usage(bgtask.Usage{InputTokens: 700, CachedTokens: 300, OutputTokens: 100, Requests: 1, Cost: 2_400}); err != nil {
			return "", err
		}
		run.Progress(fmt.Sprintf("call %d done", call))
	}
	return "found it", nil
}

func run(ctx context.Context, out io.Writer) (Outcome, error) {
	var o Outcome
	c := &chat{}
	spawned := make(chan bgtask.Task, 4)
	refused := make(chan error, 1)
	rootDone := make(chan struct{})
	begin := make(chan struct{}) // the researchers start once every spawn was asked
	root := func(ctx context.Context, run bgtask.Run) (string, error) {
		if err := run.Usage(bgtask.Usage{InputTokens: 400, OutputTokens: 100, Requests: 1, Cost: 1_000}); err != nil {
			return "", err
		}
		for i := range 4 {
			t, err := run.Manager().Launch(ctx, bgtask.Spec{Description: fmt.Sprintf("researcher %d", i+1), Run: func(ctx context.Context, r bgtask.Run) (string, error) {
				select {
				case <-begin:
				case <-ctx.Done():
					return "", ctx.Err()
				}
				return researcher(ctx, r)
			}})
			if err != nil {
				refused <- err // the fourth: no spawn left
				break
			}
			spawned <- t
		}
		close(spawned)
		close(begin)
		<-ctx.Done() // the root waits for its researchers until the budget stops it
		close(rootDone)
		return "", ctx.Err()
	}
	m, err := bgtask.Open(ctx, nil, bgtask.WithNotifier(c))
	if err != nil {
		return o, err
	}
	defer m.Shutdown(context.Background())

	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Description: "research the question", Run: root,
		Budget: &bgtask.Budget{Tokens: 6000, Spawns: 3, SoftPercent: 50}})
	if err != nil {
		return o, err
	}
	for t := range spawned {
		o.Kids = append(o.Kids, t)
	}
	select {
	case o.Refused = <-refused:
	case <-ctx.Done():
		return o, ctx.Err()
	}
	if o.Root, err = m.Wait(ctx, task.ID); err != nil {
		return o, err
	}
	<-rootDone
	for i, k := range o.Kids {
		if o.Kids[i], err = m.Wait(ctx, k.ID); err != nil {
			return o, err
		}
	}
	if err := m.Shutdown(ctx); err != nil { // every notification delivered
		return o, err
	}
	o.Root, _ = m.Task(task.ID)
	o.Told = c.all()
	s, _, err := m.Budget(task.ID)
	if err != nil {
		return o, err
	}
	o.Overrun = s.Spent.Tokens() - s.Limit.Tokens
	o.PageBudget = o.Root.Budget

	fmt.Fprintln(out, "== the fourth spawn ==")
	fmt.Fprintln(out, o.Refused)
	fmt.Fprintln(out, "\n== what the parent chat was told ==")
	for _, n := range o.Told {
		if n.ParentSessionID != "chat" { // a researcher's end, told to the root's session
			fmt.Fprintf(out, "(to the root's session) [%s] %s\n", n.Kind, firstLine(n.Text))
			continue
		}
		fmt.Fprintf(out, "[%s]\n%s\n", n.Kind, n.Text)
	}
	fmt.Fprintln(out, "\n== the page's JSON for the root (usage and budget) ==")
	page, _ := json.MarshalIndent(struct {
		Usage  *bgtask.TaskUsage   `json:"usage"`
		Budget *bgtask.BudgetState `json:"budget"`
	}{o.Root.Usage, o.Root.Budget}, "", "  ")
	fmt.Fprintln(out, string(page))
	fmt.Fprintf(out, "\nspent %d tokens of %d: %d past it, what the live runs had in flight when it was reached\n",
		s.Spent.Tokens(), s.Limit.Tokens, o.Overrun)
	if !errors.Is(o.Refused, bgtask.ErrBudget) {
		return o, fmt.Errorf("the fourth spawn was not refused by the budget: %v", o.Refused)
	}
	return o, nil
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
