package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
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
			m := bgtask.New(bgtask.NewFuncHost(g.run), bgtask.WithIDs(bgtask.SequentialIDs()))
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

func TestServeRunsUntilInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{lines: make(chan string, 4)}
	served := make(chan error, 1)
	go func() { served <- serve(ctx, "127.0.0.1:0", out) }()
	line := <-out.lines
	require.Contains(t, line, "serving on http://")
	base := strings.TrimSpace(strings.TrimSuffix(strings.TrimPrefix(line, "serving on "), " (Ctrl-C to stop)\n"))
	c := &bgtaskhttp.Client{Base: base}
	snap, err := c.Snapshot(context.Background())
	require.NoError(t, err)
	assert.NotEmpty(t, snap.Tasks, "a task is launched at once")
	cancel()
	require.NoError(t, <-served)
}

// syncBuffer hands each Write to a channel.
type syncBuffer struct{ lines chan string }

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.lines <- string(p)
	return len(p), nil
}
