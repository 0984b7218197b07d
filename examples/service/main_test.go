package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/internal/testkit"
	"github.com/bgtask/bgtask/mirror"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRunEndToEnd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var buf bytes.Buffer
	require.NoError(t, run(ctx, &buf))
	out := buf.String()
	assert.Contains(t, out, "task-1 completed attempts=1")
	assert.Contains(t, out, "task-2 completed attempts=2", "the flaky task fell back, and the mirror saw it")
	assert.Contains(t, out, "task-3 cancelled attempts=1", "cancelled over HTTP")
}

// gate is a FuncHost whose subagents finish when the test says so.
type gate struct {
	mu   sync.Mutex
	done map[string]chan struct{}
}

func (g *gate) ch(prompt string) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.done[prompt] == nil {
		g.done[prompt] = make(chan struct{})
	}
	return g.done[prompt]
}

func (g *gate) run(ctx context.Context, run bgtask.Run) (string, error) {
	run.Busy()
	select {
	case <-g.ch(run.Prompt):
		return "ok " + run.Prompt, nil
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

func TestMirrorConvergesUnderConcurrentChangesAndLag(t *testing.T) {
	for _, buffer := range []int{0, 2} { // 2: the stream lags and the client resyncs
		t.Run(fmt.Sprintf("buffer=%d", buffer), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			g := &gate{done: map[string]chan struct{}{}}
			m := testkit.MustOpen(bgtask.NewFuncHost(g.run), bgtask.WithIDs(bgtask.SequentialIDs()))
			defer m.Shutdown(context.Background())
			srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{Buffer: buffer}))
			defer func() {
				srv.CloseClientConnections()
				srv.Close()
			}()
			client := &bgtaskhttp.Client{Base: srv.URL, HTTP: srv.Client()}
			var mir mirror.Mirror
			fctx, stop := context.WithCancel(ctx)
			ready := make(chan struct{})
			followed := make(chan error, 1)
			go func() { followed <- client.Follow(fctx, &mir, ready) }()
			<-ready

			models := []bgtask.Model{{Provider: "p", ID: "m"}}
			var wg sync.WaitGroup
			var ids []string
			var mu sync.Mutex
			for i := range 20 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					p := fmt.Sprint(i)
					task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "ui", Prompt: p, Models: models})
					if !assert.NoError(t, err) {
						return
					}
					mu.Lock()
					ids = append(ids, task.ID)
					mu.Unlock()
					if i%5 == 0 {
						assert.NoError(t, testkit.StopErr(client.Stop(ctx, bgtask.Target{Task: task.ID})))
						return
					}
					close(g.ch(p))
				}()
			}
			wg.Wait()
			for _, id := range ids {
				_, err := m.Wait(ctx, id)
				require.NoError(t, err)
			}
			want := m.Snapshot()
			require.NoError(t, mir.Wait(ctx, func(got []bgtask.Task) bool { return converged(got, want) }),
				"mirror %v", summarize(mir.Tasks()))
			stop()
			require.ErrorIs(t, <-followed, context.Canceled)
		})
	}
}

func summarize(ts []bgtask.Task) string {
	var b strings.Builder
	for _, t := range ts {
		fmt.Fprintf(&b, "%s:%s:%d ", t.ID, t.Status, t.Revision)
	}
	return b.String()
}

func TestServeRunsUntilInterruptedAndItsJournalOutlivesIt(t *testing.T) {
	dir := t.TempDir()
	life := func() bgtask.Snapshot {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		out := &syncBuffer{lines: make(chan string, 4)}
		served := make(chan error, 1)
		go func() { served <- serve(ctx, "127.0.0.1:0", dir, out) }()
		line := <-out.lines
		require.Contains(t, line, "serving on http://")
		assert.Equal(t, "journal in "+dir+": go run ./cmd/bgtask tasks "+dir+"\n", <-out.lines)
		base := strings.TrimSpace(strings.TrimSuffix(strings.TrimPrefix(line, "serving on "), " (Ctrl-C to stop)\n"))
		c := &bgtaskhttp.Client{Base: base}
		snap, err := c.Snapshot(ctx)
		require.NoError(t, err)
		cancel()
		require.NoError(t, <-served)
		return snap
	}
	first := life()
	require.NotEmpty(t, first.Tasks, "a round is launched at once")
	v, err := bgtask.ReadFileJournal(dir)
	require.NoError(t, err)
	assert.Equal(t, first.Tasks[0].ID, v.Tasks[0].ID, "the tasks are in the journal")

	second := life()
	require.Greater(t, len(second.Tasks), len(first.Tasks), "the first life's tasks, recovered, and a new round")
	assert.Equal(t, first.Tasks[0].ID, second.Tasks[0].ID)
	assert.True(t, second.Tasks[0].Status.Terminal(), "ended by the first life's shutdown, or lost across the restart")
	rounds := map[string]int{}
	for _, task := range second.Tasks {
		rounds[task.ParentSessionID]++
	}
	assert.Equal(t, 5, rounds["chat-1"], "the second life's round is numbered on, not mixed into the first's: %v", rounds)
}

func TestTheServerBoundsEveryPhaseOfARequestButTheStream(t *testing.T) {
	srv := newServer(http.NotFoundHandler())
	assert.Positive(t, srv.ReadHeaderTimeout)
	assert.Positive(t, srv.ReadTimeout, "a trickled body does not hold a connection")
	assert.Positive(t, srv.IdleTimeout)
	assert.Zero(t, srv.WriteTimeout, "the event stream lasts as long as its client")
}

// instant is a subagent's work that is done at once.
func instant(context.Context, bgtask.Run) error { return nil }

func TestRoundsKeepAVariedPopulationAndForgetTheOld(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := testkit.MustOpen(bgtask.NewFuncHost(subagent(instant)), options()...)
	defer m.Shutdown(context.Background())
	p := newPopulation(m)
	var rounds [][]string
	for range 30 {
		ids, err := p.round(ctx)
		require.NoError(t, err)
		require.Len(t, ids, 5, "nothing piles up: every round is launched")
		rounds = append(rounds, ids)
		for _, id := range ids[:4] { // all but the waiter, which the next round cancels
			_, err := m.Wait(ctx, id)
			require.NoError(t, err)
		}
		assert.LessOrEqual(t, len(m.Snapshot().Tasks), maxLive+maxEnded, "the tasks kept stay bounded")
	}
	_, err := m.Task(rounds[0][0])
	assert.ErrorIs(t, err, bgtask.ErrForgotten, "old tasks are forgotten")

	// A whole round, its waiter cancelled by the next: every kind of end.
	last := rounds[len(rounds)-2]
	get := func(id string) bgtask.Task {
		task, err := m.Wait(ctx, id)
		require.NoError(t, err)
		return task
	}
	steady, flaky, broken, tree, wait := get(last[0]), get(last[1]), get(last[2]), get(last[3]), get(last[4])
	assert.Equal(t, bgtask.StatusCompleted, steady.Status)
	assert.Equal(t, bgtask.StatusCompleted, flaky.Status)
	assert.Len(t, flaky.Attempts, 2, "it failed over to the next model")
	assert.Equal(t, bgtask.StatusError, broken.Status)
	assert.Len(t, broken.Attempts, 3, "it failed on every model of the chain")
	assert.Equal(t, bgtask.StatusCompleted, tree.Status)
	kids, err := m.Tasks(bgtask.Query{Parent: tree.SessionID})
	require.NoError(t, err)
	assert.Len(t, kids.Tasks, treeKids, "a subagent tree")
	assert.Contains(t, tree.Result, "completed")
	assert.Equal(t, bgtask.StatusCancelled, wait.Status)
}

func TestRoundsNeverPileUpTasksThatDoNotEnd(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	started := make(chan string, 1000)
	// Work that never ends, but a tree's once released: it goes on to
	// launch its subagents.
	release := make(chan struct{})
	never := func(ctx context.Context, run bgtask.Run) error {
		started <- run.Prompt
		if run.Prompt == "tree" {
			select {
			case <-release:
				return nil
			case <-ctx.Done():
			}
		}
		<-ctx.Done()
		return ctx.Err()
	}
	await := func(n int) {
		for range n {
			select {
			case <-started:
			case <-ctx.Done():
				t.Fatal("the work never started")
			}
		}
	}
	m := testkit.MustOpen(bgtask.NewFuncHost(subagent(never)), options()...)
	defer m.Shutdown(context.Background())
	p := newPopulation(m)
	live := func() int {
		n := 0
		for _, task := range m.Snapshot().Tasks {
			if task.Status.Live() {
				n++
			}
		}
		return n
	}
	skipped := 0
	for range 20 {
		ids, err := p.round(ctx)
		require.NoError(t, err)
		if ids == nil {
			skipped++
		} else {
			await(4) // steady, flaky, broken and the tree: all at work
		}
		assert.LessOrEqual(t, live(), maxLive)
	}
	assert.Positive(t, skipped, "the bound held rounds back")
	assert.Equal(t, 3, p.rounds, "rounds while the bound allowed them, counting the subagents the trees will launch")
	close(release)
	await(treeKids * p.rounds)
	assert.LessOrEqual(t, live(), maxLive, "the trees' subagents too")
}

// syncBuffer hands each Write to a channel.
type syncBuffer struct{ lines chan string }

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.lines <- string(p)
	return len(p), nil
}

func TestServeStopsPromptlyWhileAStreamIsOpen(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{lines: make(chan string, 4)}
	var serr error
	served := make(chan struct{})
	go func() {
		defer close(served)
		serr = serve(ctx, "127.0.0.1:0", "", out)
	}()
	defer func() {
		cancel()
		<-served
	}()
	line := <-out.lines
	require.Contains(t, line, "serving on http://")
	base := strings.TrimSpace(strings.TrimSuffix(strings.TrimPrefix(line, "serving on "), " (Ctrl-C to stop)\n"))

	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get(base + "/events")
	require.NoError(t, err)
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	for line := ""; line != "event: snapshot\n"; {
		line, err = rd.ReadString('\n')
		require.NoError(t, err, "the stream is open: its snapshot comes")
	}

	cancel() // Ctrl-C
	// Far below the 5s the server's own shutdown may wait.
	bound, stop := context.WithTimeout(context.Background(), 3*time.Second)
	defer stop()
	select {
	case <-served:
		require.NoError(t, serr)
	case <-bound.Done():
		t.Fatal("serve did not return within 3s of its interruption while a stream was open")
	}
}
