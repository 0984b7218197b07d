package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var models = []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {Provider: "google", ID: "gemini"}}

// journaled starts a Manager on a file journal in dir with two tasks: one
// that failed over and completed, one still running; and a closed branch.
func journaled(t *testing.T, dir string) (*bgtask.Manager, *bgtasktest.Host, []bgtask.Task) {
	t.Helper()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	host := bgtasktest.NewHost()
	m := bgtask.New(host, bgtask.WithJournal(j), bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	ctx := context.Background()
	a, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Description: "look it up", Models: models})
	require.NoError(t, err)
	run, err := bgtasktest.WaitStatus(ctx, m, a.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, host.Fail(run.SessionID, errors.New("429 Too Many Requests")))
	run, err = bgtasktest.WaitFor(ctx, m, a.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	require.NoError(t, host.Idle(run.SessionID, "forty-two"))
	_, err = m.Wait(ctx, a.ID)
	require.NoError(t, err)
	b, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "other", Description: "still going", Models: models})
	require.NoError(t, err)
	_, err = bgtasktest.WaitStatus(ctx, m, b.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	c, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "doomed", Models: models})
	require.NoError(t, err)
	_, err = bgtasktest.WaitStatus(ctx, m, c.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	_, err = m.CloseBranch(ctx, "doomed")
	require.NoError(t, err)
	return m, host, []bgtask.Task{a, b, c}
}

func cmd(t *testing.T, args ...string) string {
	t.Helper()
	var out bytes.Buffer
	require.NoError(t, run(context.Background(), args, &out))
	return out.String()
}

func TestItReadsAJournalWhoseWriterIsRunning(t *testing.T) {
	dir := t.TempDir()
	m, _, tasks := journaled(t, dir)
	defer m.Shutdown(context.Background())

	list := cmd(t, "tasks", dir)
	assert.Contains(t, list, "TASK")
	for _, task := range tasks {
		assert.Contains(t, list, task.ID)
	}
	assert.Regexp(t, `task-1\s+completed\s+chat\s+2\s+google/gemini\s+look it up`, list)
	assert.Regexp(t, `task-2\s+running\s+other`, list, "the writer's live task, as written so far")
	running := cmd(t, "tasks", dir, "-status", "running")
	assert.Contains(t, running, "task-2")
	assert.NotContains(t, running, "task-1")
	assert.NotContains(t, cmd(t, "tasks", dir, "-parent", "chat"), "task-2")

	one := cmd(t, "task", dir, tasks[0].ID)
	assert.Contains(t, one, "Attempt 1 — ERROR — openai/gpt-5")
	assert.Contains(t, one, "Attempt 2 — COMPLETED — google/gemini")
	for _, want := range []string{"launched under chat", "attempt 1 running in session ses-1", "attempt 1 error: 429 Too Many Requests",
		"retry scheduled after attempt 1 failed", "attempt 2 completed", "Outcome: completed", "<task id=\"task-1\" state=\"completed\">"} {
		assert.Contains(t, one, want)
	}
	assert.Less(t, strings.Index(one, "attempt 1 error"), strings.Index(one, "attempt 2 completed"), "records in order")

	closures := cmd(t, "closures", dir)
	assert.Contains(t, closures, "doomed closed at")
	assert.Contains(t, closures, "stopped task-3")

	var out bytes.Buffer
	err := run(context.Background(), []string{"task", dir, "nope"}, &out)
	assert.ErrorIs(t, err, bgtask.ErrUnknownTask)
	assert.ErrorIs(t, run(context.Background(), []string{"tasks"}, &out), errUsage)
	assert.ErrorIs(t, run(context.Background(), []string{"frobnicate", dir}, &out), errUsage)
}

func TestItReadsAJournalACrashLeftWithoutChangingIt(t *testing.T) {
	dir := t.TempDir()
	m, _, tasks := journaled(t, dir)
	require.NoError(t, m.Shutdown(context.Background()))
	segs, err := filepath.Glob(filepath.Join(dir, "seg-*.log"))
	require.NoError(t, err)
	last := segs[len(segs)-1]
	f, err := os.OpenFile(last, os.O_WRONLY, 0)
	require.NoError(t, err)
	// A record cut short, the crash, where the next record goes: after the
	// last one, in the zeroed space the journal keeps ahead of it.
	_, err = f.WriteAt([]byte{0x40, 0, 0, 0, 1, 2, 3}, recordsEnd(t, last))
	require.NoError(t, err)
	require.NoError(t, f.Close())
	before, err := os.ReadFile(last)
	require.NoError(t, err)

	list := cmd(t, "tasks", dir)
	assert.Contains(t, list, "note: the last record is torn")
	assert.Contains(t, list, tasks[0].ID)
	after, err := os.ReadFile(last)
	require.NoError(t, err)
	assert.Equal(t, before, after, "not a byte changed")

	bad := filepath.Join(t.TempDir(), "j")
	require.NoError(t, os.MkdirAll(bad, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(bad, filepath.Base(segs[0])), append(bytes.Repeat([]byte{7}, 40), before...), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(bad, "seg-9999999999999999.log"), []byte{}, 0o644))
	var out bytes.Buffer
	err = run(context.Background(), []string{"tasks", bad}, &out)
	require.Error(t, err, "corruption before the tail is an error")
	assert.Contains(t, err.Error(), "offset")
}

// recordsEnd walks a journal segment's record headers (a 4-byte
// little-endian length, its top two bits flags, then 8 bytes of checksums) to
// where its records end: the file's end, or a header of zeros.
func recordsEnd(t *testing.T, path string) int64 {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	off := 0
	for off+12 <= len(data) && !bytes.Equal(data[off:off+12], make([]byte, 12)) {
		off += 12 + int(binary.LittleEndian.Uint32(data[off:])&^(3<<30)) // less the base and batch flags
	}
	require.LessOrEqual(t, off, len(data))
	return int64(off)
}

// lines is a Writer whose lines a test waits for.
type lines struct {
	mu  sync.Mutex
	buf strings.Builder
	ch  chan struct{}
}

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf.Write(p)
	select {
	case l.ch <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (l *lines) await(t *testing.T, ctx context.Context, sub string) {
	t.Helper()
	for {
		l.mu.Lock()
		got := l.buf.String()
		l.mu.Unlock()
		if strings.Contains(got, sub) {
			return
		}
		select {
		case <-l.ch:
		case <-ctx.Done():
			t.Fatalf("no %q in:\n%s", sub, got)
		}
	}
}

func TestFollowPrintsALiveServicesTasksAsTheyChange(t *testing.T) {
	host := bgtasktest.NewHost()
	m := bgtask.New(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	defer func() {
		srv.CloseClientConnections()
		srv.Close()
		_ = m.Shutdown(context.Background())
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	out := &lines{ch: make(chan struct{}, 1)}
	fctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- run(fctx, []string{"follow", srv.URL}, out) }()

	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: models})
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	out.await(t, ctx, "task-1 running attempts=1 openai/gpt-5")
	require.NoError(t, host.Idle(running.SessionID, "ok"))
	out.await(t, ctx, "task-1 completed attempts=1")
	out.await(t, ctx, "Attempt 1 — COMPLETED — openai/gpt-5 — ses-1")
	stop()
	assert.NoError(t, <-done)
}

func TestFollowOfABadURLReturnsAtOnce(t *testing.T) {
	var out bytes.Buffer
	err := run(context.Background(), []string{"follow", "not a url"}, &out)
	assert.ErrorContains(t, err, "not an http(s) URL")
}
