package bgtask_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/bgtask/bgtask"
)

// quietHost starts a session per attempt and stops it when asked; what the
// children do is reported with Observe.
type quietHost struct{}

func (h *quietHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	return fmt.Sprintf("ses_%s", req.AttemptID), nil
}

func (h *quietHost) AbortSession(ctx context.Context, sessionID string) error { return nil }

// running launches a task under parent and waits until its session runs.
func running(m *bgtask.Manager, parent string) bgtask.Task {
	task, err := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: parent, Prompt: "work",
		Models: []bgtask.Model{{Provider: "openai", ID: "gpt-5.4-mini"}, {Provider: "google", ID: "gemini-2.5-flash"}}})
	if err != nil {
		panic(err)
	}
	return runningOn(m, task.ID, 1)
}

// runningOn waits until task id runs its attempt number n. It panics (an
// Example has no t to fail) if no change comes for 20 s: a broken build
// fails at once, naming the task, instead of hanging until go test's
// timeout.
func runningOn(m *bgtask.Manager, id string, n int) bgtask.Task {
	sub, _ := m.Subscribe(context.Background(), 64)
	defer sub.Close()
	for t, err := m.Task(id); err == nil && (t.Status != bgtask.StatusRunning || len(t.Attempts) < n); t, err = m.Task(id) {
		select {
		case <-sub.C:
		case <-time.After(20 * time.Second):
			panic(fmt.Sprintf("task %s: not running attempt %d after 20 s (%s, %d attempts)", id, n, t.Status, len(t.Attempts)))
		}
	}
	t, _ := m.Task(id)
	return t
}

// arrived waits for ch to close or send, and panics, naming what, if it
// does not within 20 s, as runningOn does.
func arrived[T any](ch <-chan T, what string) {
	select {
	case <-ch:
	case <-time.After(20 * time.Second):
		panic("not within 20 s: " + what)
	}
}

// Open takes the Host and the options; Shutdown stops everything it
// started.
func ExampleOpen() {
	m, err := bgtask.Open(context.Background(), &quietHost{},
		bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithModelLimits(bgtask.ModelLimits{Default: 2}),
		bgtask.WithRetryDelay(bgtask.Backoff(0, 0, 0)),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	fmt.Println(len(m.Snapshot().Tasks))
	// Output: 0
}

// Launch records the task and its first attempt, and starts the child
// session in the background.
func ExampleManager_Launch() {
	m, err := bgtask.Open(context.Background(), &quietHost{}, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	task, err := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Prompt: "summarise the logs",
		Models: []bgtask.Model{{Provider: "openai", ID: "gpt-5.4-mini"}}})
	fmt.Println(task.ID, task.Status, task.Current().Number, err)
	_, err = m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", MaxAttempts: -1})
	fmt.Println(errors.Is(err, bgtask.ErrInvalidArgument), err)
	// Output:
	// task-1 pending 1 <nil>
	// true invalid spec: MaxAttempts: is negative (-1)
}

// Observe is how the harness reports what a child session did; an event
// of an attempt that is no longer current changes nothing.
func ExampleManager_Observe() {
	m, err := bgtask.Open(context.Background(), &quietHost{}, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	t := running(m, "chat")
	first := t.SessionID
	fmt.Println(m.Observe(bgtask.Event{SessionID: first, Kind: bgtask.SessionError, Err: errors.New("429 Too Many Requests")}))
	runningOn(m, t.ID, 2) // the retry runs on the next model (no start is in flight)
	fmt.Println(m.Observe(bgtask.Event{SessionID: first, Kind: bgtask.SessionIdle, Text: "late"}))
	fmt.Println(m.Observe(bgtask.Event{SessionID: "ses_nobody", Kind: bgtask.SessionBusy}))
	// Output:
	// <nil>
	// stale event
	// unknown session
}

// Stop returns once the host confirmed the child stopped.
func ExampleManager_Stop() {
	m, err := bgtask.Open(context.Background(), &quietHost{}, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	t := running(m, "chat")
	rep, err := m.Stop(context.Background(), bgtask.Target{Task: t.ID})
	fmt.Println(err, len(rep.Stopped))
	done, _ := m.Wait(context.Background(), t.ID)
	fmt.Println(done.Status, done.Outcome.State)
	// Output:
	// <nil> 1
	// cancelled cancelled
}

// Stop with Target.Session stops a session's whole branch of work,
// exactly by run token, and says what it stopped.
func ExampleManager_Stop_session() {
	m, err := bgtask.Open(context.Background(), &quietHost{}, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	lead := running(m, "chat")
	running(m, lead.SessionID) // launched by the lead's session: in its branch
	running(m, "another chat")
	rep, err := m.Stop(context.Background(), bgtask.Target{Session: "chat"})
	fmt.Println(len(rep.Stopped), err)
	for _, s := range rep.Stopped {
		fmt.Println(s.TaskID, s.Status)
	}
	// Output:
	// 2 <nil>
	// task-1 cancelled
	// task-2 cancelled
}

// Subscribe streams every change, in sequence order.
func ExampleManager_Subscribe() {
	m, err := bgtask.Open(context.Background(), &quietHost{}, bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	sub, _ := m.Subscribe(context.Background(), 64)
	defer sub.Close()
	task, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Models: []bgtask.Model{{ID: "m"}}})
	for c := range sub.C {
		fmt.Println(c.Task.ID, c.Task.Status)
		if c.Task.Status == bgtask.StatusRunning {
			_ = m.Observe(bgtask.Event{SessionID: c.Task.SessionID, Kind: bgtask.SessionIdle, Text: "done"})
		}
		if c.Task.ID == task.ID && c.Task.Status.Terminal() {
			break
		}
	}
	// Output:
	// task-1 pending
	// task-1 running
	// task-1 completed
}

// A subagent written as a Go function: its return is the evidence.
func ExampleNewFuncHost() {
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		if run.Model.ID == "flaky" {
			return "", errors.New("503 Service Unavailable")
		}
		return "answered by " + run.Model.String() + " on attempt " + fmt.Sprint(run.Attempt), nil
	}))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer m.Shutdown(context.Background())
	task, _ := m.Launch(context.Background(), bgtask.Spec{ParentSessionID: "chat", Prompt: "q",
		Models: []bgtask.Model{{ID: "flaky"}, {ID: "steady"}}})
	done, _ := m.Wait(context.Background(), task.ID)
	fmt.Println(done.Status, "|", done.Result)
	// Output: completed | answered by steady on attempt 2
}
