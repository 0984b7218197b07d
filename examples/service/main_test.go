package main

import (
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

// holdSnapshots delays every /tasks response until release is closed,
// after taking the snapshot: the response is older than what follows it.
func holdSnapshots(next http.Handler, taken chan<- struct{}, release <-chan struct{}) http.Handler {
	var once sync.Once
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/tasks" {
			next.ServeHTTP(w, r)
			return
		}
		rec := httptest.NewRecorder()
		next.ServeHTTP(rec, r) // the snapshot is taken now
		once.Do(func() { close(taken) })
		<-release
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
	})
}

func TestMirrorConvergesWhenTheSnapshotIsOvertakenByNewerEvents(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	g := &gate{done: map[string]chan struct{}{}}
	m := bgtask.New(bgtask.NewFuncHost(g.run), bgtask.WithIDs(bgtask.SequentialIDs()))
	defer m.Shutdown(context.Background())
	models := []bgtask.Model{{Provider: "p", ID: "m"}}
	a, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "ui", Prompt: "a", Models: models})
	require.NoError(t, err)

	taken, release := make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(holdSnapshots(Handler(m, 0), taken, release))
	defer srv.Close()
	client := &Client{Base: srv.URL, HTTP: srv.Client()}
	fctx, stop := context.WithCancel(ctx)
	followed := make(chan error, 1)
	go func() { followed <- client.Follow(fctx, nil) }()

	<-taken // the snapshot shows a still running
	close(g.ch("a"))
	done, err := m.Wait(ctx, a.ID)
	require.NoError(t, err)
	// The newer events reach the mirror before the older snapshot does.
	require.NoError(t, client.Mirror.Wait(ctx, func(ts []bgtask.Task) bool {
		return len(ts) == 1 && ts[0].Status == bgtask.StatusCompleted
	}))
	close(release)
	require.NoError(t, client.Mirror.Wait(ctx, func(ts []bgtask.Task) bool { return true }))
	// Apply the (older) snapshot explicitly too: it must not erase the news.
	require.NoError(t, client.Resync(ctx))
	got, ok := client.Mirror.Task(a.ID)
	require.True(t, ok)
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
	assert.Equal(t, done.Revision, got.Revision)
	stop()
	require.NoError(t, <-followed)
}

func TestMirrorConvergesUnderConcurrentChangesAndLag(t *testing.T) {
	for _, buffer := range []int{0, 2} { // 2: the stream lags and the client resyncs
		t.Run(fmt.Sprintf("buffer=%d", buffer), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			g := &gate{done: map[string]chan struct{}{}}
			m := bgtask.New(bgtask.NewFuncHost(g.run), bgtask.WithIDs(bgtask.SequentialIDs()))
			defer m.Shutdown(context.Background())
			srv := httptest.NewServer(Handler(m, buffer))
			defer srv.Close()
			client := &Client{Base: srv.URL, HTTP: srv.Client()}
			fctx, stop := context.WithCancel(ctx)
			ready := make(chan struct{})
			followed := make(chan error, 1)
			go func() { followed <- client.Follow(fctx, ready) }()
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
						assert.NoError(t, client.Cancel(ctx, task.ID))
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
			require.NoError(t, client.Mirror.Wait(ctx, func(got []bgtask.Task) bool { return converged(got, want) }),
				"mirror %v", summarize(client.Mirror.Tasks()))
			stop()
			require.NoError(t, <-followed)
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
