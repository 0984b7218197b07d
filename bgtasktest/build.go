package bgtasktest

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/bgtask/bgtask"
)

// TaskBuild describes a task for BuildTask: its attempts, in order.
type TaskBuild struct {
	// ParentSessionID is the task's parent ("": "chat").
	ParentSessionID string
	// Prompt and Metadata are the launch's (Spec.Prompt, Spec.Metadata).
	Prompt   string
	Metadata map[string]string
	// LaunchedAt is when it was launched (zero: 2026-01-01 00:00 UTC); the
	// attempts' times follow from it and their Took.
	LaunchedAt time.Time
	// Attempts are its attempts, at least one. Every attempt but the last
	// ended in error (a failure the task retried); the last may have any
	// status.
	Attempts []AttemptBuild
}

// AttemptBuild is one attempt of a built task.
type AttemptBuild struct {
	// Model is its model (zero: ID "model-N" for attempt N).
	Model bgtask.Model
	// Status is how it stands: error for every attempt but the last; the
	// last may be pending (its session start never answered), running,
	// completed, error, cancelled or interrupt.
	Status bgtask.Status
	// Took is how long it ran before it ended (or, running, until the
	// snapshot).
	Took time.Duration
	// Result is a completed attempt's answer.
	Result string
	// Err is a failed attempt's error (nil: "500 Internal Server Error").
	Err error
}

// BuildTask returns the snapshot a Manager keeps of a task whose attempts
// went as b says, for tests of code that renders or maps snapshots: a
// real Manager runs it on a Clock and this package's Host, so every field
// is as bgtask sets it — the ids ("task-1", "attempt-N", "ses-N"), the
// times, the Timeline, the Outcome and its Envelope. It returns an error
// for a b that no task can go through.
func BuildTask(b TaskBuild) (bgtask.Task, error) {
	if err := b.check(); err != nil {
		return bgtask.Task{}, err
	}
	at := b.LaunchedAt
	if at.IsZero() {
		at = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	parent := b.ParentSessionID
	if parent == "" {
		parent = "chat"
	}
	models := make([]bgtask.Model, len(b.Attempts))
	for i, a := range b.Attempts {
		models[i] = a.Model
		if models[i] == (bgtask.Model{}) {
			models[i] = bgtask.Model{ID: fmt.Sprintf("model-%d", i+1)}
		}
	}
	clk, host := NewClock(at), NewHost()
	m, err := bgtask.Open(context.Background(), host, bgtask.WithClock(clk), bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithRetryable(func(error, bool) bool { return true })) // every failure but the last retries: MaxAttempts ends the chain
	if err != nil {
		return bgtask.Task{}, err
	}
	host.Attach(m)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	defer func() {
		host.Release()
		_ = m.Shutdown(ctx)
	}()
	last := len(b.Attempts) - 1
	if b.Attempts[last].Status == bgtask.StatusPending && last == 0 {
		host.HangStarts(1)
	}
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: parent, Prompt: b.Prompt, Metadata: b.Metadata,
		Models: models, MaxAttempts: len(models)})
	if err != nil {
		return bgtask.Task{}, err
	}
	for i, a := range b.Attempts {
		if i == last && a.Status == bgtask.StatusPending {
			for len(host.Starts()) < i+1 { // the start is made: Release (at the end) lets it return
				if err := host.AwaitCalls(ctx, len(host.Starts())+len(host.Aborts())+1); err != nil {
					return bgtask.Task{}, err
				}
			}
			return WaitFor(ctx, m, task.ID, func(t bgtask.Task) bool { return len(t.Attempts) == i+1 && t.Pending == bgtask.PendingAwaitingSession })
		}
		run, err := WaitFor(ctx, m, task.ID, func(t bgtask.Task) bool { return len(t.Attempts) == i+1 && t.Status == bgtask.StatusRunning })
		if err != nil {
			return bgtask.Task{}, err
		}
		clk.Advance(a.Took)
		if i+1 == last && b.Attempts[last].Status == bgtask.StatusPending {
			host.HangStarts(1) // the retry's start never answers
		}
		switch a.Status {
		case bgtask.StatusRunning:
			return m.Task(task.ID)
		case bgtask.StatusCompleted:
			err = host.Idle(run.SessionID, a.Result)
		case bgtask.StatusError:
			failure := a.Err
			if failure == nil {
				failure = errors.New("500 Internal Server Error")
			}
			err = host.Fail(run.SessionID, failure)
		case bgtask.StatusCancelled:
			_, err = m.Stop(ctx, bgtask.Target{Task: task.ID})
		case bgtask.StatusInterrupt:
			err = host.Emit(bgtask.Event{SessionID: run.SessionID, Kind: bgtask.SessionInterrupted})
		}
		if err != nil {
			return bgtask.Task{}, err
		}
	}
	return m.Wait(ctx, task.ID)
}

func (b *TaskBuild) check() error {
	if len(b.Attempts) == 0 {
		return errors.New("bgtasktest: BuildTask: no attempt")
	}
	for i, a := range b.Attempts {
		switch {
		case i < len(b.Attempts)-1 && a.Status != bgtask.StatusError:
			return fmt.Errorf("bgtasktest: BuildTask: attempt %d is %q: only a failed attempt is followed by another", i+1, a.Status)
		case a.Took < 0:
			return fmt.Errorf("bgtasktest: BuildTask: attempt %d took %v", i+1, a.Took)
		}
		switch a.Status {
		case bgtask.StatusPending, bgtask.StatusRunning, bgtask.StatusCompleted, bgtask.StatusError, bgtask.StatusCancelled, bgtask.StatusInterrupt:
		default:
			return fmt.Errorf("bgtasktest: BuildTask: attempt %d has no status bgtask knows (%q)", i+1, a.Status)
		}
	}
	return nil
}
