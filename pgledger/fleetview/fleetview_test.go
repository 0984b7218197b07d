package fleetview_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/mirror"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/bgtask/bgtask/pgledger/fleetview"
	"github.com/bgtask/bgtask/pgledger/internal/fleettest"
	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var url string

func TestMain(m *testing.M) { pgtest.Main(m, "fleetview", &url) }

var _ bgtaskhttp.Fleet = (*fleetview.View)(nil)

// process is one process of a test's fleet.
type process = fleettest.Process

// fleet joins n processes (members w0, w1, …) of a fresh ledger.
func fleet(t *testing.T, n int) []process { return fleettest.Join(t, url, n, pgledger.NodeOptions{}) }

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

var models = []bgtask.Model{{Provider: "a", ID: "1"}}

// running launches a task at p from parent and returns it once it runs
// and its binding is durable (a later commit of the member is).
func running(t *testing.T, p process, parent string) bgtask.Task {
	t.Helper()
	task, err := p.Node.Launch(ctx(t), bgtask.Spec{ParentSessionID: parent, Prompt: "do it", Models: models})
	require.NoError(t, err)
	got, err := bgtasktest.WaitStatus(ctx(t), p.Node.Manager(), task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	_, err = p.Node.Launch(ctx(t), bgtask.Spec{ParentSessionID: "barrier", Prompt: "barrier", Models: models})
	require.NoError(t, err)
	return got
}

// view opens a View of p's node and serves it, closed at the test's end.
func view(t *testing.T, p process, o bgtaskhttp.Options) (*fleetview.View, *httptest.Server) {
	t.Helper()
	v, err := fleetview.Open(ctx(t), p.Node)
	require.NoError(t, err)
	srv := httptest.NewServer(bgtaskhttp.Handler(v, o))
	t.Cleanup(func() {
		srv.Close()
		v.Close()
	})
	return v, srv
}

// One page serves every process's tasks: the snapshot, a task, the
// event stream that follows them (a mirror through the Client), the
// processes, and the page itself.
func TestOnePageShowsEveryProcesssTasks(t *testing.T) {
	ps := fleet(t, 2)
	a := running(t, ps[0], "chat-a")
	b := running(t, ps[1], "chat-b")
	v, srv := view(t, ps[0], bgtaskhttp.Options{})
	holds(t, v, bgtask.StatusRunning, a.ID, b.ID)
	c := &bgtaskhttp.Client{Base: srv.URL}

	var mir mirror.Mirror
	ready := make(chan struct{})
	follow, stop := context.WithCancel(ctx(t))
	followed := make(chan error, 1)
	go func() { followed <- c.Follow(follow, &mir, ready) }()
	defer func() {
		stop()
		<-followed
	}()
	<-ready
	for _, want := range []bgtask.Task{a, b} {
		got, err := c.Task(ctx(t), want.ID)
		require.NoError(t, err, "task %s", want.ID)
		assert.Equal(t, bgtask.StatusRunning, got.Status)
		_, err = mir.Task(want.ID)
		require.NoError(t, err, "the stream's snapshot has %s", want.ID)
	}

	// w1's task ends at w1: the stream tells the page's client.
	require.NoError(t, ps[1].Host.Idle(b.SessionID, "done at w1"))
	require.NoError(t, mir.Wait(ctx(t), func(ts []bgtask.Task) bool {
		for _, t := range ts {
			if t.ID == b.ID {
				return t.Status == bgtask.StatusCompleted
			}
		}
		return false
	}))
	got, err := v.Task(b.ID)
	require.NoError(t, err)
	assert.Equal(t, "done at w1", got.Attempts[0].Result)

	p, err := c.Tasks(ctx(t), bgtask.Query{Statuses: []bgtask.Status{bgtask.StatusCompleted}})
	require.NoError(t, err)
	require.Len(t, p.Tasks, 1)
	assert.Equal(t, b.ID, p.Tasks[0].ID)

	procs, err := c.Processes(ctx(t))
	require.NoError(t, err)
	require.True(t, procs.Fleet)
	require.Len(t, procs.Processes, 2)
	for i, pr := range procs.Processes {
		assert.Equal(t, fmt.Sprintf("w%d", i), pr.Member)
		assert.True(t, pr.Live)
	}
	assert.Equal(t, 2, procs.Processes[0].Running, "its task and its barrier")
	assert.Equal(t, 1, procs.Processes[1].Running, "its barrier")

	resp, err := http.Get(srv.URL + "/")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	page := string(body)
	assert.Contains(t, page, a.ID)
	assert.Contains(t, page, b.ID)
	assert.Contains(t, page, `<section id="processes">`)
	assert.Contains(t, page, `data-member="w1"`)

	h, err := c.History(ctx(t), b.ID)
	require.NoError(t, err)
	require.NotEmpty(t, h, "w1's task's history, read from the ledger")
}

// An action on another process's task is made by its owner, and records
// who asked; one that the owner refuses says why, as the owner said it.
func TestAnActionReachesTheProcessThatOwnsTheTask(t *testing.T) {
	ps := fleet(t, 2)
	b := running(t, ps[1], "chat-b")
	_, srv := view(t, ps[0], bgtaskhttp.Options{Authorize: func(*http.Request) (string, error) { return "ops@example", nil }})
	c := &bgtaskhttp.Client{Base: srv.URL}

	_, err := c.Extend(ctx(t), b.ID, "more")
	assert.ErrorIs(t, err, errors.ErrUnsupported, "w1's host takes no prompts: w1 said so")

	rep, err := c.Stop(ctx(t), bgtask.Target{Task: b.ID})
	require.NoError(t, err)
	require.Len(t, rep.Stopped, 1)
	assert.Equal(t, bgtask.StatusCancelled, rep.Stopped[0].Status)
	got, err := ps[1].Node.Manager().Task(b.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, got.Status)
	require.NotNil(t, got.Stop)
	assert.Equal(t, "ops@example", got.Stop.Actor, "the actor Authorize named, recorded at the owner")
	assert.Equal(t, []string{b.SessionID}, ps[1].Host.Aborts())
}

// A closure made from the fleet's page reaches every process, and the
// View reads its record once it ended.
func TestAClosureFromThePageIsInTheView(t *testing.T) {
	ps := fleet(t, 2)
	a := running(t, ps[0], "chat")
	b := running(t, ps[1], a.SessionID)
	v, srv := view(t, ps[0], bgtaskhttp.Options{})
	c := &bgtaskhttp.Client{Base: srv.URL}
	rep, err := c.Stop(ctx(t), bgtask.Target{Task: a.ID, Tree: true})
	require.NoError(t, err)
	assert.Len(t, rep.Stopped, 2)
	for len(v.Snapshot().Closures) == 0 { // read again after a change showed one
		select {
		case <-fleetview.ClosuresRead(v):
		case <-ctx(t).Done():
			t.Fatal("the closure's record never reached the view")
		}
	}
	cl := v.Snapshot().Closures
	require.Len(t, cl, 1)
	assert.Equal(t, a.ID, cl[0].TaskID)
	got, err := v.Task(b.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusCancelled, got.Status)
}

// The View's own subscription is a bgtask.Subscription: it ends when its
// context does, and when the View closes.
func TestAViewsSubscriptionEnds(t *testing.T) {
	ps := fleet(t, 1)
	v, err := fleetview.Open(ctx(t), ps[0].Node)
	require.NoError(t, err)
	c, cancel := context.WithCancel(ctx(t))
	sub, err := v.Subscribe(c, 0)
	require.NoError(t, err)
	cancel()
	<-sub.Done()
	assert.ErrorIs(t, sub.Err(), context.Canceled)
	other, err := v.Subscribe(ctx(t), 0)
	require.NoError(t, err)
	v.Close()
	<-other.Done()
	assert.ErrorIs(t, other.Err(), bgtask.ErrShutdown)
	_, err = v.Subscribe(ctx(t), 0)
	assert.ErrorIs(t, err, bgtask.ErrShutdown)
	_, err = fleetview.Open(ctx(t), nil)
	assert.ErrorIs(t, err, bgtask.ErrInvalidArgument)
}

// The snapshot served is the fleet's: both processes' tasks, in the
// ledger's epoch.
func TestTheSnapshotIsTheFleets(t *testing.T) {
	ps := fleet(t, 2)
	a := running(t, ps[0], "chat-a")
	b := running(t, ps[1], "chat-b")
	v, srv := view(t, ps[1], bgtaskhttp.Options{})
	holds(t, v, "", a.ID, b.ID)
	resp, err := http.Get(srv.URL + "/snapshot")
	require.NoError(t, err)
	defer resp.Body.Close()
	var snap bgtask.Snapshot
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&snap))
	ids := map[string]bool{}
	for _, t := range snap.Tasks {
		ids[t.ID] = true
	}
	assert.True(t, ids[a.ID] && ids[b.ID], "both processes' tasks: %v", ids)
	own, err := ps[0].Node.Snapshot(ctx(t))
	require.NoError(t, err)
	assert.Equal(t, own.Epoch, snap.Epoch, "the ledger's epoch")
}

// The context Open is given bounds its first snapshot only: the View
// follows the ledger after it ended.
func TestAViewOutlivesTheContextItOpenedWith(t *testing.T) {
	ps := fleet(t, 1)
	opening, cancel := context.WithCancel(ctx(t))
	v, err := fleetview.Open(opening, ps[0].Node)
	require.NoError(t, err)
	defer v.Close()
	cancel()
	sub, err := v.Subscribe(ctx(t), 0)
	require.NoError(t, err, "still following")
	defer sub.Close()
	task := running(t, ps[0], "chat")
	for {
		select {
		case c := <-sub.C:
			if c.Task.ID == task.ID && c.Task.Status == bgtask.StatusRunning {
				got, err := v.Task(task.ID)
				require.NoError(t, err)
				assert.Equal(t, bgtask.StatusRunning, got.Status)
				return
			}
		case <-sub.Done():
			t.Fatalf("the View stopped following: %v", sub.Err())
		}
	}
}

// A View's Launch returns once the View holds the task; a View that does
// not hold a task another process launched (here one that stopped
// following) reads it from the ledger; one the ledger has none of is
// unknown.
func TestALaunchedTaskIsFoundAtEveryProcess(t *testing.T) {
	ps := fleet(t, 2)
	a, err := fleetview.Open(ctx(t), ps[0].Node)
	require.NoError(t, err)
	defer a.Close()
	b, err := fleetview.Open(ctx(t), ps[1].Node)
	require.NoError(t, err)
	b.Close() // it follows nothing now: only the ledger can answer it
	task, err := a.Launch(ctx(t), bgtask.Spec{ParentSessionID: "chat", Prompt: "do it", Models: models, Metadata: map[string]string{"who": "alice"}})
	require.NoError(t, err)
	held := a.Snapshot()
	ids := map[string]bool{}
	for _, t := range held.Tasks {
		ids[t.ID] = true
	}
	assert.True(t, ids[task.ID], "the launching view holds it once Launch returned")
	got, err := b.Task(task.ID)
	require.NoError(t, err, "read from the ledger")
	assert.Equal(t, task.ID, got.ID)
	assert.Equal(t, "alice", got.Metadata["who"])
	_, err = b.Task("no-such-task")
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	_, err = b.Task("")
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	_, err = b.Launch(ctx(t), bgtask.Spec{ParentSessionID: "chat", Prompt: "x", Models: models})
	assert.ErrorIs(t, err, bgtask.ErrShutdown, "a closed view launches nothing")
}

// holds waits until v holds tasks ids (from its snapshot or the changes
// it followed since; not from the ledger, as Task may), in status if it
// is not "" (a task's changes are published a moment after its records).
func holds(t *testing.T, v *fleetview.View, status bgtask.Status, ids ...string) {
	t.Helper()
	sub, err := v.Subscribe(ctx(t), 0)
	require.NoError(t, err)
	defer sub.Close()
	for {
		held := map[string]bool{}
		for _, task := range v.Snapshot().Tasks {
			held[task.ID] = status == "" || task.Status == status
		}
		all := true
		for _, id := range ids {
			all = all && held[id]
		}
		if all {
			return
		}
		_, open := <-sub.C
		require.True(t, open, "the view's changes ended: %v", sub.Err())
	}
}
