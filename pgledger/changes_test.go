package pgledger

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/mirror"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A subscriber in one process sees the changes of every process, and a
// mirror fed with them and a snapshot converges on the fleet's tasks.
func TestTheChangeStreamSpansProcesses(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 3, 0)
	early := running(t, ns[2], "chat") // before the subscription: the snapshot has it

	sub, err := ns[0].Subscribe(ctx(t), 0)
	require.NoError(t, err)
	defer sub.Close()
	var m mirror.Mirror
	snap, err := ns[0].Snapshot(ctx(t))
	require.NoError(t, err)
	assert.Equal(t, LedgerEpoch(f.ledger), snap.Epoch)
	m.ApplySnapshot(snap)
	applied := make(chan struct{})
	go func() {
		defer close(applied)
		for c := range sub.C {
			m.ApplyChange(c)
		}
	}()

	var want []string
	for i, n := range ns {
		task := running(t, n, "chat")
		require.NoError(t, n.Observe(context.Background(), bgtask.Event{AttemptID: task.Attempts[0].ID, Kind: bgtask.SessionIdle, Text: "from w" + string(rune('0'+i))}))
		want = append(want, task.ID)
	}
	require.NoError(t, ns[1].Observe(context.Background(), bgtask.Event{SessionID: early.SessionID, Kind: bgtask.SessionIdle, Text: "early"}))
	want = append(want, early.ID)
	awaitMirror(t, &m, want, bgtask.StatusCompleted, "the mirror converged on every process's tasks")
	got, err := m.Task(early.ID)
	require.NoError(t, err)
	assert.Equal(t, "early", got.Result)
	sub.Close()
	recv(t, applied, "the subscription to end at Close")
	assert.NoError(t, sub.Err())
}

// A subscriber whose buffer overflows is ended with bgtask.ErrLagged,
// and resyncs from a snapshot.
func TestALaggingSubscriberResyncs(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, 0)
	sub, err := ns[0].Subscribe(ctx(t), 1)
	require.NoError(t, err)
	var ids []string
	for range 4 {
		task := running(t, ns[1], "chat")
		ids = append(ids, task.ID)
	}
	// Nobody reads sub.C: once a second change reaches the subscription it
	// has lagged. (Reading it here could keep up with the changes, and
	// then it would never lag.)
	recv(t, sub.Done(), "the subscription to lag")
	require.True(t, errors.Is(sub.Err(), bgtask.ErrLagged), "%v", sub.Err())
	for range sub.C { // closed: what it held before it lagged
	}
	// The resync: subscribe again, then start from a snapshot.
	again, err := ns[0].Subscribe(ctx(t), 0)
	require.NoError(t, err)
	defer again.Close()
	snap, err := ns[0].Snapshot(ctx(t))
	require.NoError(t, err)
	var m mirror.Mirror
	m.ApplySnapshot(snap)
	go func() {
		for c := range again.C {
			m.ApplyChange(c)
		}
	}()
	awaitMirror(t, &m, ids, bgtask.StatusRunning, "the mirror holds every task after the resync")
}

// awaitMirror waits until m holds every task of ids with status.
func awaitMirror(t *testing.T, m *mirror.Mirror, ids []string, status bgtask.Status, msg string) {
	t.Helper()
	wait, cancel := context.WithTimeout(ctx(t), 30*time.Second)
	defer cancel()
	require.NoError(t, m.Wait(wait, func(tasks []bgtask.Task) bool {
		n := 0
		for _, task := range tasks {
			if task.Status == status && slices.Contains(ids, task.ID) {
				n++
			}
		}
		return n == len(ids)
	}), msg)
}

// The change stream keeps each task's newest change only: a publish
// replaces the rows of its tasks (a task twice in one publish keeps its
// last), and the newest row of each comes after every row it replaced.
func TestAPublishReplacesItsTasksRows(t *testing.T) {
	f := newFixture(t)
	j := f.open("w1", Options{})
	publish := func(tasks []string, status ...string) {
		t.Helper()
		bodies := make([]string, len(tasks))
		for i := range tasks {
			bodies[i] = fmt.Sprintf(`{"id": %q, "status": %q}`, tasks[i], status[i])
		}
		_, err := f.pool.Exec(ctx(t), `SELECT bgtask_publish($1, $2, $3, $4, $5::jsonb[])`, f.ledger, "w1", j.Fence(), tasks, bodies)
		require.NoError(t, err)
	}
	rows := func() map[string]string {
		t.Helper()
		r, err := f.pool.Query(ctx(t), `SELECT task_id, body ->> 'status' FROM bgtask_changes WHERE ledger = $1 ORDER BY id`, f.ledger)
		require.NoError(t, err)
		got := map[string]string{}
		var order []string
		var task, status string
		_, err = pgx.ForEachRow(r, []any{&task, &status}, func() error {
			require.NotContains(t, got, task, "one row per task")
			got[task] = status
			order = append(order, task)
			return nil
		})
		require.NoError(t, err)
		got["order"] = strings.Join(order, ",")
		return got
	}
	publish([]string{"a", "b", "c"}, "pending", "pending", "pending")
	publish([]string{"b", "a"}, "running", "running")
	publish([]string{"a", "a"}, "completed", "error")
	assert.Equal(t, map[string]string{"a": "error", "b": "running", "c": "pending", "order": "c,b,a"}, rows())
}
