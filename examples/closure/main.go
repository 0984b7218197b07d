// Command closure builds a three-level tree of background tasks whose
// subagents launch subagents of their own, lets one intermediate task
// end early (it gives up; its children run on), then closes the whole branch below
// the chat session and prints the report, the closure record and the
// parent's notification.
//
//	go run ./examples/closure
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
		fmt.Fprintln(os.Stderr, "closure:", err)
		os.Exit(1)
	}
}

const depth = 3 // levels of tasks below the chat session

func run(ctx context.Context, w io.Writer) error {
	var started sync.WaitGroup // one Done per task that is running
	started.Add(2 + 4 + 8)
	var m *bgtask.Manager

	// Each subagent at level < depth launches two children from its own
	// session, then works until it is stopped — except "early", which
	// gives up right after launching its children. (An answer would wait:
	// the children gate holds a task's answer while tasks it launched run.)
	subagent := func(ctx context.Context, run bgtask.Run) (string, error) {
		level := strings.Count(run.Prompt, "/")
		if level < depth {
			for i := range 2 {
				_, err := m.Launch(ctx, bgtask.Spec{
					ParentSessionID: run.SessionID,
					Description:     fmt.Sprintf("%s/%d", run.Prompt, i),
					Prompt:          fmt.Sprintf("%s/%d", run.Prompt, i),
					Models:          []bgtask.Model{{Provider: "local", ID: "tiny"}},
				})
				if err != nil {
					return "", err
				}
			}
		}
		started.Done()
		if run.Prompt == "task/0" {
			return "", bgtask.Permanent(errors.New("gave up early; my children go on"))
		}
		<-ctx.Done()
		return "", ctx.Err()
	}

	var notes []bgtask.Notification
	var mu sync.Mutex
	m, err := bgtask.Open(ctx, bgtask.NewFuncHost(subagent),
		bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithNotifier(bgtask.NotifierFunc(func(ctx context.Context, n bgtask.Notification) error {
			if n.Kind == bgtask.NotifyBranchClosed {
				mu.Lock()
				notes = append(notes, n)
				mu.Unlock()
			}
			return nil
		})),
	)
	if err != nil {
		return err
	}
	defer m.Shutdown(context.Background())

	var early string // task/0's id
	for i := range 2 {
		t, err := m.Launch(ctx, bgtask.Spec{
			ParentSessionID: "ses_chat",
			Description:     fmt.Sprintf("task/%d", i),
			Prompt:          fmt.Sprintf("task/%d", i),
			Models:          []bgtask.Model{{Provider: "local", ID: "tiny"}},
		})
		if err != nil {
			return err
		}
		if i == 0 {
			early = t.ID
		}
	}
	started.Wait()
	// task/0 gave up once its children were launched: the closure comes
	// after its end (else it might be the one to stop it).
	if _, err := m.Wait(ctx, early); err != nil {
		return err
	}

	rep, err := m.Stop(ctx, bgtask.Target{Session: "ses_chat"})
	if err != nil {
		return err
	}
	if err := m.Shutdown(ctx); err != nil { // delivers the notification
		return err
	}

	fmt.Fprintf(w, "Closed %s in %d passes; %d runs stopped:\n", rep.SessionID, rep.Passes, len(rep.Stopped))
	stopped := slices.Clone(rep.Stopped)
	slices.SortFunc(stopped, func(a, b bgtask.StoppedRun) int { return strings.Compare(a.TaskID, b.TaskID) })
	for _, s := range stopped {
		t, _ := m.Task(s.TaskID)
		fmt.Fprintf(w, "  %-8s %-9s %-24s session %s token %s\n", s.TaskID, s.Status, t.Description, s.SessionID, s.Token)
	}
	fmt.Fprintln(w, "\nEvery task after the closure:")
	for _, t := range m.Snapshot().Tasks {
		fmt.Fprintf(w, "  %-8s %-9s %s\n", t.ID, t.Status, t.Description)
	}
	recs := m.Snapshot().Closures
	fmt.Fprintf(w, "\nClosure record: root %s, %d stopped, %d failed, %d passes\n",
		recs[0].SessionID, len(recs[0].Stopped), len(recs[0].Failed), recs[0].Passes)
	for _, n := range notes {
		fmt.Fprintf(w, "\nNotification to %s:\n%s\n", n.ParentSessionID, n.Text)
	}
	return nil
}
