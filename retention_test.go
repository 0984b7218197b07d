package bgtask

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// finish launches a task under parent and completes it.
func finish(t *testing.T, h *harness, parent string) Task {
	t.Helper()
	task, err := h.m.Launch(context.Background(), Spec{ParentSessionID: parent, Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	got := waitStatus(t, h.m, task.ID, StatusRunning)
	// It may be forgotten as soon as it ends: hold on to it first.
	h.m.mu.Lock()
	e := h.m.led.tasks[task.ID]
	ended := e.waitDone()
	h.m.mu.Unlock()
	require.NoError(t, h.m.Observe(Event{SessionID: got.SessionID, Kind: SessionIdle, Text: "ok"}))
	recv(t, ended, "task %s to end", task.ID)
	h.m.mu.Lock()
	done := e.project()
	h.m.mu.Unlock()
	require.Equal(t, StatusCompleted, done.Status)
	return done
}

func TestRetentionForgetsTheOldestEndedTasksAndSaysSo(t *testing.T) {
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: 3}))
	var tasks []Task
	for i := range 5 {
		tasks = append(tasks, finish(t, h, fmt.Sprintf("p%d", i)))
		h.settle() // its final summary delivered: nothing holds it
	}
	h.settle()
	for _, old := range tasks[:2] {
		_, err := h.m.Task(old.ID)
		assert.ErrorIs(t, err, ErrForgotten)
		assert.NotErrorIs(t, err, ErrUnknownTask, "it existed")
		_, err = h.m.Wait(context.Background(), old.ID)
		assert.ErrorIs(t, err, ErrForgotten)
		assert.ErrorIs(t, stopErr(h.m.Stop(context.Background(), Target{Task: old.ID})), ErrForgotten)
		assert.ErrorIs(t, h.m.Observe(Event{SessionID: old.SessionID, Kind: SessionBusy}), ErrUnknownSession, "its session index is gone too")
	}
	for _, kept := range tasks[2:] {
		got, err := h.m.Task(kept.ID)
		require.NoError(t, err)
		assert.Equal(t, StatusCompleted, got.Status)
	}
	assert.Len(t, h.m.Snapshot().Tasks, 3)
	_, err := h.m.Task("never-was")
	assert.ErrorIs(t, err, ErrUnknownTask)
	h.m.mu.Lock()
	assert.Len(t, h.m.led.tasks, 3)
	assert.Len(t, h.m.led.byAttempt, 3)
	assert.Len(t, h.m.led.bySession, 3)
	assert.Len(t, h.m.led.byParent, 3)
	h.m.mu.Unlock()
}

func TestRetentionKeepsTasksWhoseParentStillHasLiveOnes(t *testing.T) {
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: 1}))
	live, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	a := finish(t, h, "p")
	b := finish(t, h, "p")
	_, err = h.m.Task(a.ID)
	require.NoError(t, err, "its parent still has a live task")
	_, err = h.m.Task(b.ID)
	require.NoError(t, err)
	h.settle()
	require.NoError(t, h.m.Observe(Event{SessionID: h.task(live.ID).SessionID, Kind: SessionIdle, Text: "ok"}))
	h.settle()             // live's summary delivered: c, ending next, is the newest ended task
	c := finish(t, h, "q") // the next end looks again
	_, err = h.m.Task(a.ID)
	assert.ErrorIs(t, err, ErrForgotten)
	_, err = h.m.Task(c.ID)
	assert.NoError(t, err)
}

func TestRetentionKeepsATaskUntilItsNotificationsAreDelivered(t *testing.T) {
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: 1}))
	release := make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // a failing test never holds the lane
	h.rec.hook = func(ctx context.Context, n Notification) error {
		if n.Kind == NotifyFinalSummary && n.ParentSessionID == "slow" {
			<-release
		}
		return nil
	}
	slow := finish(t, h, "slow")
	finish(t, h, "q1")
	finish(t, h, "q2")
	_, err := h.m.Task(slow.ID)
	require.NoError(t, err, "its final summary is not delivered yet")
	once.Do(func() { close(release) })
	h.settle() // the lane delivers it
	finish(t, h, "q3")
	_, err = h.m.Task(slow.ID)
	assert.ErrorIs(t, err, ErrForgotten)
}

func TestRetentionByAge(t *testing.T) {
	h := newHarness(t, nil, WithRetention(Retention{MaxEnded: -1, MaxAge: time.Minute}))
	old := finish(t, h, "p1")
	h.settle()
	h.clock.Advance(2 * time.Minute)
	fresh := finish(t, h, "p2")
	_, err := h.m.Task(old.ID)
	assert.ErrorIs(t, err, ErrForgotten)
	_, err = h.m.Task(fresh.ID)
	assert.NoError(t, err)
}

func TestPageReadsTasksAPageAtATimeByParentAndStatus(t *testing.T) {
	h := newHarness(t, nil)
	var pIDs []string
	for i := range 7 {
		parent := "other"
		if i%2 == 0 {
			parent = "p"
		}
		task := finish(t, h, parent)
		if parent == "p" {
			pIDs = append(pIDs, task.ID)
		}
	}
	live, err := h.m.Launch(context.Background(), Spec{ParentSessionID: "p", Models: []Model{{Provider: "a", ID: "1"}}})
	require.NoError(t, err)
	pIDs = append(pIDs, live.ID)
	var got []string
	q := Query{Parent: "p", Limit: 2}
	for pages := 0; ; pages++ {
		require.Less(t, pages, 10)
		p, err := h.m.Tasks(q)
		require.NoError(t, err)
		for _, task := range p.Tasks {
			assert.Equal(t, "p", task.ParentSessionID)
			got = append(got, task.ID)
		}
		if p.Next == "" {
			break
		}
		assert.Len(t, p.Tasks, 2)
		q.After = p.Next
	}
	assert.Equal(t, pIDs, got, "every task of the parent, once, in launch order")
	p, err := h.m.Tasks(Query{Parent: "p", Statuses: []Status{StatusCompleted}, Limit: 1000})
	require.NoError(t, err)
	assert.Len(t, p.Tasks, len(pIDs)-1)
	_, err = h.m.Tasks(Query{Limit: 1001})
	assert.ErrorIs(t, err, ErrInvalidArgument)
	_, err = h.m.Tasks(Query{After: "nope"})
	assert.ErrorIs(t, err, ErrInvalidArgument)
}
