package bgtask

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stallJournal holds the durability of every batch appended while it is
// held, until it is released: storage that stalls (a lock held in a
// database, a disk that hangs).
type stallJournal struct {
	Journal
	mu   sync.Mutex
	open chan struct{} // nil: not held
}

func (j *stallJournal) hold() {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.open = make(chan struct{})
}

func (j *stallJournal) release() {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.open != nil {
		close(j.open)
		j.open = nil
	}
}

func (j *stallJournal) Append(b []Record) Commit {
	c := j.Journal.Append(b)
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.open != nil {
		return gatedCommit{c: c, open: j.open}
	}
	return c
}

// within fails the test unless f returns within 10 s (the calls under
// test have a context of a few milliseconds: they must keep to it, and
// not to j's stall, which is released before the test fails).
func within[T any](t *testing.T, j *stallJournal, what string, f func() T) T {
	t.Helper()
	out := make(chan T, 1)
	go func() { out <- f() }()
	select {
	case v := <-out:
		return v
	case <-time.After(10 * time.Second):
		j.release()
		<-out
		t.Fatalf("%s did not return when its context ended: it waited for the stalled journal", what)
		panic("unreachable")
	}
}

func shortCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	t.Cleanup(cancel)
	return ctx
}

func requireDurabilityUnknown(t *testing.T, err error, op string) *DurabilityUnknownError {
	t.Helper()
	var du *DurabilityUnknownError
	require.ErrorAs(t, err, &du, "%s: a typed error that says durability is unknown", op)
	assert.ErrorIs(t, err, ErrDurabilityUnknown)
	assert.ErrorIs(t, err, context.DeadlineExceeded, "it matches the context's error")
	assert.Equal(t, op, du.Op)
	assert.Contains(t, err.Error(), "may or may not")
	return du
}

// Every call that waits for its records to be durable returns when its
// context ends, with the context's error; a Launch's error names the task
// so that a later Task tells the truth; and nothing the records describe
// happens before they are durable — it happens, in order, once they are.
func TestDurableWaitsKeepToTheirContext(t *testing.T) {
	inner, err := OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	j := &stallJournal{Journal: inner}
	w := newCrashWorld()
	rec := &crashRecorder{}
	m, err := Open(context.Background(), w, WithJournal(j), WithNotifier(rec), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	shutdownAtCleanup(t, m)
	spec := Spec{ParentSessionID: "p", Prompt: "go", Models: mustModels(t, "a/1")}

	j.hold()
	var launchErr error
	within(t, j, "Launch", func() struct{} { _, launchErr = m.Launch(shortCtx(t), spec); return struct{}{} })
	du := requireDurabilityUnknown(t, launchErr, "Launch")
	require.NotEmpty(t, du.TaskID)
	w.mu.Lock()
	assert.Empty(t, w.sess, "no session was started before the launch was durable")
	w.mu.Unlock()
	j.release()
	task := waitStatus(t, m, du.TaskID, StatusRunning) // it became durable after all: Task tells
	got, err := m.Task(du.TaskID)
	require.NoError(t, err)
	assert.Equal(t, task.ID, got.ID)

	// Extend: the prompt went to the host; whether its admission is
	// durable is unknown.
	j.hold()
	var extendErr error
	within(t, j, "Extend", func() struct{} { _, extendErr = m.Extend(shortCtx(t), task.ID, "more"); return struct{}{} })
	du = requireDurabilityUnknown(t, extendErr, "Extend")
	assert.Equal(t, task.ID, du.TaskID)
	j.release()
	waitFor(t, m, task.ID, func(t Task) bool { return len(t.Invocations) == 2 })

	// Stop of a task: the abort is not asked for before the stop is durable.
	j.hold()
	cancelErr := within(t, j, "Cancel", func() error { return stopErr(m.Stop(shortCtx(t), Target{Task: task.ID})) })
	du = requireDurabilityUnknown(t, cancelErr, "Stop")
	assert.Equal(t, task.ID, du.TaskID)
	s, _ := w.session(task.SessionID)
	assert.Equal(t, SessionStateAlive, s.state, "no abort before the stop was durable")
	j.release()
	waitStatus(t, m, task.ID, StatusCancelled)

	// Stop of a session and of a task with Tree: the closure goes on
	// without its caller, and ends (its fence comes down, its record is
	// written).
	for _, op := range []string{"CloseBranch", "CloseTask"} {
		tk, err := m.Launch(context.Background(), Spec{ParentSessionID: "q-" + op, Prompt: "go", Models: mustModels(t, "a/1")})
		require.NoError(t, err)
		waitStatus(t, m, tk.ID, StatusRunning)
		before := len(m.Snapshot().Closures)
		j.hold()
		closeErr := within(t, j, op, func() error {
			if op == "CloseTask" {
				_, err := m.Stop(shortCtx(t), Target{Task: tk.ID, Tree: true})
				return err
			}
			_, err := m.Stop(shortCtx(t), Target{Session: "q-" + op})
			return err
		})
		require.Error(t, closeErr)
		assert.ErrorIs(t, closeErr, context.DeadlineExceeded, "%s keeps to its context", op)
		j.release()
		waitStatus(t, m, tk.ID, StatusCancelled)
		waitClosures(t, m, before+1) // it ended without its caller
	}

	// Wait keeps to its context too (the end is in memory, not durable).
	tk, err := m.Launch(context.Background(), spec)
	require.NoError(t, err)
	tk = waitStatus(t, m, tk.ID, StatusRunning)
	j.hold()
	go func() { _ = m.Observe(Event{SessionID: tk.SessionID, Kind: SessionIdle, Text: "done"}) }()
	waitStatus(t, m, tk.ID, StatusCompleted)
	waitErr := within(t, j, "Wait", func() error { _, err := m.Wait(shortCtx(t), tk.ID); return err })
	assert.True(t, errors.Is(waitErr, context.DeadlineExceeded), "Wait: %v", waitErr)
	j.release()
}

// waitClosures waits until m has recorded n closures.
func waitClosures(t *testing.T, m *Manager, n int) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		m.mu.Lock()
		got, ch := len(m.led.closures), m.waitAny()
		m.mu.Unlock()
		if got >= n {
			return
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("%d closures recorded, want %d", got, n)
		}
	}
}
