package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/internal/testkit"
)

// bin is the command, built once for the tests: they run it as a user
// would.
var bin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "bgtask-cmd-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = filepath.Join(dir, "bgtask")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building the command: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		os.RemoveAll(dir)
		os.Exit(code)
	}))
}

// result is what a run of the command left.
type result struct {
	stdout, stderr string
	code           int
}

// cli runs the command with args and returns what it printed and its
// exit status.
func cli(t *testing.T, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var stdout, stderr bytes.Buffer
	c := exec.CommandContext(ctx, bin, args...)
	c.Stdout, c.Stderr = &stdout, &stderr
	err := c.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("bgtask %v: %v", args, err)
	}
	r := result{stdout: stdout.String(), stderr: stderr.String(), code: c.ProcessState.ExitCode()}
	assert.NotContains(t, r.stderr, "bgtask: bgtask:", "one prefix")
	return r
}

// ok runs the command, which must succeed, and returns its stdout.
func ok(t *testing.T, args ...string) string {
	t.Helper()
	r := cli(t, args...)
	require.Equal(t, 0, r.code, "bgtask %v: %s", args, r.stderr)
	return r.stdout
}

var models = []bgtask.Model{{Provider: "openai", ID: "gpt-5"}, {Provider: "google", ID: "gemini"}}

// journaled starts a Manager on a file journal in dir with two tasks: one
// that failed over and completed, one still running; and a closed branch.
func journaled(t *testing.T, dir string) (*bgtask.Manager, []bgtask.Task) {
	t.Helper()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithJournal(j), bgtask.WithIDs(bgtask.SequentialIDs()))
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
	_, err = m.Stop(ctx, bgtask.Target{Session: "doomed"})
	require.NoError(t, err)
	return m, []bgtask.Task{a, b, c}
}

// restarted leaves in dir the journal of two process lives: in the first,
// task-1 and task-2 run under "chat", task-2 completes, and the process
// goes down with task-1 still running (its abort fails, as if it was
// killed); the second finds task-1's run lost and ends it, and chat gets
// its all_complete.
func restarted(t *testing.T, dir string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	life := func() (*bgtask.Manager, *bgtasktest.Host) {
		j, err := bgtask.OpenFileJournal(dir)
		require.NoError(t, err)
		host := bgtasktest.NewHost()
		m, err := bgtask.Open(ctx, host, bgtask.WithJournal(j), bgtask.WithNotifier(&bgtasktest.Recorder{}), bgtask.WithIDs(bgtask.SequentialIDs()))
		require.NoError(t, err)
		host.Attach(m)
		return m, host
	}
	m, host := life()
	a, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Description: "survives", Models: models})
	require.NoError(t, err)
	_, err = bgtasktest.WaitStatus(ctx, m, a.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	b, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Description: "done before", Models: models})
	require.NoError(t, err)
	run, err := bgtasktest.WaitStatus(ctx, m, b.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, host.Idle(run.SessionID, "ok"))
	_, err = m.Wait(ctx, b.ID)
	require.NoError(t, err)
	host.FailAborts(1, errors.New("the process died"))
	require.Error(t, m.Shutdown(ctx), "task-1's run is left running")

	m, _ = life()
	_, err = m.Wait(ctx, a.ID)
	require.NoError(t, err)
	_, err = m.WaitParent(ctx, "chat")
	require.NoError(t, err)
	require.NoError(t, m.Shutdown(ctx))
}

func TestTasksListsAJournalWhoseWriterIsRunning(t *testing.T) {
	dir := t.TempDir()
	m, tasks := journaled(t, dir)
	defer m.Shutdown(context.Background())

	list := ok(t, "tasks", dir)
	assert.Contains(t, list, "TASK")
	for _, task := range tasks {
		assert.Contains(t, list, task.ID)
	}
	assert.Regexp(t, `task-1\s+completed\s+chat\s+2\s+google/gemini\s+look it up`, list)
	assert.Regexp(t, `task-2\s+running\s+other`, list, "the writer's live task, as written so far")

	for _, args := range [][]string{{"tasks", dir, "-status", "running"}, {"tasks", "-status", "running", dir}, {"tasks", "-status=running", dir, "-json=false"}} {
		r := cli(t, args...)
		require.Equal(t, 0, r.code, "%v: %s", args, r.stderr)
		assert.Contains(t, r.stdout, "task-2", "%v: flags before or after the directory", args)
		assert.NotContains(t, r.stdout, "task-1", args)
		assert.Contains(t, r.stderr, "1 of 3 tasks shown", args)
	}
	both := ok(t, "tasks", dir, "-status", "running,completed")
	assert.Contains(t, both, "task-1")
	assert.Contains(t, both, "task-2")
	assert.NotContains(t, both, "task-3", "cancelled")
	assert.NotContains(t, ok(t, "tasks", dir, "-parent", "chat"), "task-2")

	var got []bgtask.Task
	require.NoError(t, json.Unmarshal([]byte(ok(t, "tasks", dir, "-json")), &got))
	require.Len(t, got, 3)
	assert.Equal(t, "task-1", got[0].ID)
	assert.Equal(t, bgtask.StatusCompleted, got[0].Status)
	require.Len(t, got[0].Attempts, 2)
	var none []bgtask.Task
	require.NoError(t, json.Unmarshal([]byte(ok(t, "tasks", dir, "-json", "-parent", "nobody")), &none))
	assert.NotNil(t, none, "an empty list is [], not null")
	assert.Empty(t, none)
}

func TestTaskShowsTimelineRecordsAndOutcome(t *testing.T) {
	dir := t.TempDir()
	m, tasks := journaled(t, dir)
	defer m.Shutdown(context.Background())

	one := ok(t, "task", dir, tasks[0].ID)
	assert.Contains(t, one, "Attempt 1 — ERROR — openai/gpt-5")
	assert.Contains(t, one, "Attempt 2 — COMPLETED — google/gemini")
	for _, want := range []string{"launched under chat", "attempt 1 running in session ses-1", "attempt 1 error: 429 Too Many Requests",
		"retry scheduled after attempt 1 failed", "attempt 2 completed", "Outcome: completed", "<task id=\"task-1\" state=\"completed\">"} {
		assert.Contains(t, one, want)
	}
	assert.Less(t, strings.Index(one, "attempt 1 error"), strings.Index(one, "attempt 2 completed"), "records in order")

	var doc struct {
		Task    bgtask.Task         `json:"task"`
		Records []bgtask.RecordView `json:"records"`
	}
	js := ok(t, "task", dir, "-json", tasks[0].ID)
	assert.Equal(t, js, ok(t, "task", "-json", dir, tasks[0].ID))
	assert.Equal(t, js, ok(t, "task", dir, tasks[0].ID, "-json"))
	require.NoError(t, json.Unmarshal([]byte(js), &doc))
	assert.Equal(t, "task-1", doc.Task.ID)
	require.NotEmpty(t, doc.Records)
	assert.Equal(t, "task_launched", doc.Records[0].Kind)
	for _, r := range doc.Records {
		assert.Equal(t, "task-1", r.TaskID, "task-1's records, and no other task's")
	}

	closures := ok(t, "closures", dir)
	assert.Contains(t, closures, "doomed closed at")
	assert.Contains(t, closures, "stopped task-3")
	var cl []bgtask.ClosureReport
	require.NoError(t, json.Unmarshal([]byte(ok(t, "closures", dir, "-json")), &cl))
	require.Len(t, cl, 1)
	assert.Equal(t, "doomed", cl[0].SessionID)
	require.Len(t, cl[0].Stopped, 1)
	assert.Equal(t, "task-3", cl[0].Stopped[0].TaskID)
}

// lineOf returns the line of out that contains sub, or fails.
func lineOf(t *testing.T, out, sub string) (int, string) {
	t.Helper()
	for i, l := range strings.Split(out, "\n") {
		if strings.Contains(l, sub) {
			return i, l
		}
	}
	t.Fatalf("no line with %q in:\n%s", sub, out)
	return 0, ""
}

func TestRecordsShowTheRestartAndTheParentsRecords(t *testing.T) {
	dir := t.TempDir()
	restarted(t, dir)
	v, err := bgtask.ReadFileJournal(dir)
	require.NoError(t, err)

	all := ok(t, "records", dir)
	assert.Regexp(t, `^SEQ\s+TIME\s+KIND\s+TASK\s+ATTEMPT\s+CHANGE`, all)
	assert.Equal(t, len(v.Records)+2, len(strings.Split(all, "\n")), "a header, a line per record, and the final newline")
	assert.Equal(t, 2, strings.Count(all, " epoch "), "both process lives")
	assert.Regexp(t, `notification_produced\s+-\s+-\s+\[parent chat\] notification \d+ \(all_complete\) for chat produced`, all)
	var recs []bgtask.RecordView
	require.NoError(t, json.Unmarshal([]byte(ok(t, "records", "-json", dir)), &recs))
	assert.Equal(t, v.Records, recs)

	// task-1's records: the restart between its run's start and its end.
	for _, out := range []string{ok(t, "records", dir, "task-1"), ok(t, "task", dir, "task-1")} {
		bound, _ := lineOf(t, out, "session_bound")
		restart, line := lineOf(t, out, "process life")
		final, _ := lineOf(t, out, "attempt_finalized")
		assert.Contains(t, line, "epoch")
		assert.Less(t, bound, restart, out)
		assert.Less(t, restart, final, out)
		assert.Contains(t, out, "lost across restart")
		assert.NotContains(t, out, "task-2", "another task's records are not task-1's")
	}
	_, line := lineOf(t, ok(t, "task", dir, "task-1"), "all_complete")
	assert.Contains(t, line, "[parent chat]", "its parent's records while it lived")
	first := ok(t, "records", dir, "task-2")
	assert.NotContains(t, first, "process life", "task-2 ended before the restart")
}

func TestAnIDPrefixNamesATask(t *testing.T) {
	dir := t.TempDir()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	m := testkit.MustOpen(bgtask.NewFuncHost(func(ctx context.Context, _ bgtask.Run) (string, error) { return "ok", nil }), bgtask.WithJournal(j))
	ctx := context.Background()
	ids := []string{"01HAAA", "01HAAB", "01HBBB", "t", "tx"}
	for i := range 7 {
		ids = append(ids, fmt.Sprintf("many-%d", i))
	}
	for _, id := range ids {
		_, err := m.Launch(ctx, bgtask.Spec{ID: id, ParentSessionID: "chat", Models: models})
		require.NoError(t, err)
		_, err = m.Wait(ctx, id)
		require.NoError(t, err)
	}
	require.NoError(t, m.Shutdown(ctx))

	assert.True(t, strings.HasPrefix(ok(t, "task", dir, "01HB"), "01HBBB "), "a unique prefix")
	assert.True(t, strings.HasPrefix(ok(t, "task", dir, "t"), "t "), "an exact id wins over the ids it begins")
	assert.Contains(t, ok(t, "records", dir, "tx"), "tx")

	r := cli(t, "task", dir, "01HA")
	assert.Equal(t, 1, r.code)
	assert.Empty(t, r.stdout)
	assert.Equal(t, "bgtask: task id prefix \"01HA\" is ambiguous: 2 tasks match: 01HAAA, 01HAAB\n", r.stderr)
	r = cli(t, "records", dir, "many")
	assert.Equal(t, 1, r.code)
	assert.Contains(t, r.stderr, "7 tasks match: many-0, many-1, many-2, many-3, many-4 and 2 more", "the list is bounded")
}

func TestEveryMistakeIsAnErrorSaidOnce(t *testing.T) {
	dir := t.TempDir()
	m, _ := journaled(t, dir)
	defer m.Shutdown(context.Background())
	empty := t.TempDir()
	tests := []struct {
		args []string
		code int
		want string // in stderr
	}{
		{[]string{"tasks", filepath.Join(empty, "nope")}, 1, "is not a journal: open " + filepath.Join(empty, "nope") + ": no such file or directory"},
		{[]string{"tasks", empty}, 1, empty + " is not a journal: it holds no journal segment"},
		{[]string{"records", empty}, 1, "is not a journal"},
		{[]string{"tasks", dir, "-status", "runing"}, 2, `tasks: -status: unknown status "runing": the statuses are pending, running, completed, error, cancelled, interrupt`},
		{[]string{"tasks", dir, "-status", "running,"}, 2, `unknown status ""`},
		{[]string{"tasks", dir, "-statuss", "running"}, 2, "tasks: flag provided but not defined: -statuss"},
		{[]string{"task", "-json=maybe", dir, "task-1"}, 2, `invalid boolean value "maybe" for -json`},
		{[]string{"tasks"}, 2, "tasks: missing DIR (usage: bgtask tasks DIR)"},
		{[]string{"task", dir}, 2, "task: missing ID (usage: bgtask task DIR|URL ID)"},
		{[]string{"closures", dir, "x"}, 2, `closures: unexpected argument "x"`},
		{[]string{"follow"}, 2, "follow: missing URL"},
		{[]string{"task", dir, ""}, 2, "task: ID is blank (usage: bgtask task DIR|URL ID)"},
		{[]string{"repair", " "}, 2, "repair: DIR is blank (usage: bgtask repair DIR)"},
		{[]string{"task", dir, "nope"}, 1, `unknown task: no task of ` + dir + ` has an id that is or begins with "nope" (3 tasks`},
		{[]string{"frobnicate", dir}, 2, `unknown command "frobnicate"`},
		{nil, 2, "no command given"},
		{[]string{"follow", "not a url"}, 2, `follow: "not a url" is not an http:// or https:// URL (like http://127.0.0.1:8080)`},
		{[]string{"follow", "localhost:8080"}, 2, `follow: "localhost:8080" is not a URL: write http://localhost:8080`},
		{[]string{"follow", "ftp://localhost:8080"}, 2, `follow: "ftp://localhost:8080" is not an http:// or https:// URL`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			r := cli(t, tt.args...)
			assert.Equal(t, tt.code, r.code, r.stderr)
			assert.Contains(t, r.stderr, tt.want)
			assert.True(t, strings.HasPrefix(r.stderr, "bgtask: "), r.stderr)
			assert.Empty(t, r.stdout, "nothing that could pass for an answer")
			if tt.code == 2 {
				assert.Regexp(t, `run 'bgtask( \w+)? -h' for usage\n$`, r.stderr)
			}
		})
	}
}

func TestHelpSaysHowToUseEachCommand(t *testing.T) {
	top := ok(t, "-h")
	for _, want := range []string{"Usage:", "bgtask tasks DIR", "bgtask task DIR|URL ID", "bgtask records DIR|URL [ID]", "bgtask closures DIR", "bgtask follow URL", "Examples:"} {
		assert.Contains(t, top, want)
	}
	assert.Equal(t, top, ok(t, "help"))
	for _, c := range []struct{ name, flag string }{{"tasks", "-status"}, {"task", "-json"}, {"records", "-json"}, {"closures", "-json"}, {"follow", "-json"}} {
		h := ok(t, c.name, "-h")
		assert.True(t, strings.HasPrefix(h, "Usage: bgtask "+c.name+" "), h)
		assert.Contains(t, h, c.flag)
		assert.Contains(t, h, "Example:\n  bgtask "+c.name+" ")
		assert.Equal(t, h, ok(t, "help", c.name))
		assert.Equal(t, h, ok(t, c.name, "somewhere", "--help"), "-h anywhere")
	}
}

func TestTasksReadsAJournalACrashLeftWithoutChangingIt(t *testing.T) {
	dir := t.TempDir()
	m, tasks := journaled(t, dir)
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

	r := cli(t, "tasks", dir)
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stderr, "bgtask: note: the last record is torn")
	assert.Contains(t, r.stdout, tasks[0].ID)
	var got []bgtask.Task
	require.NoError(t, json.Unmarshal([]byte(ok(t, "tasks", dir, "-json")), &got), "the note is not in the JSON")
	after, err := os.ReadFile(last)
	require.NoError(t, err)
	assert.Equal(t, before, after, "not a byte changed")

	bad := filepath.Join(t.TempDir(), "j")
	require.NoError(t, os.MkdirAll(bad, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(bad, filepath.Base(segs[0])), append(bytes.Repeat([]byte{7}, 40), before...), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(bad, "seg-9999999999999999.log"), []byte{}, 0o644))
	r = cli(t, "tasks", bad)
	assert.Equal(t, 1, r.code, "corruption before the tail is an error")
	assert.Contains(t, r.stderr, "offset")
	assert.Empty(t, r.stdout)
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

func newLines() *lines { return &lines{ch: make(chan struct{}, 1)} }

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

func (l *lines) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// await waits until what was written matches re.
func (l *lines) await(t *testing.T, ctx context.Context, re string) {
	t.Helper()
	rx := regexp.MustCompile(re)
	for {
		got := l.String()
		if rx.MatchString(got) {
			return
		}
		select {
		case <-l.ch:
		case <-ctx.Done():
			t.Fatalf("no %q in:\n%s", re, got)
		}
	}
}

// following is the command following a service, as a process.
type following struct {
	cmd            *exec.Cmd
	stdout, stderr *lines
}

func follow(t *testing.T, ctx context.Context, args ...string) *following {
	t.Helper()
	f := &following{cmd: exec.CommandContext(ctx, bin, append([]string{"follow"}, args...)...), stdout: newLines(), stderr: newLines()}
	f.cmd.Stdout, f.cmd.Stderr = f.stdout, f.stderr
	require.NoError(t, f.cmd.Start())
	return f
}

// interrupt stops it as Ctrl-C does and returns its exit status.
func (f *following) interrupt(t *testing.T) int {
	t.Helper()
	require.NoError(t, f.cmd.Process.Signal(os.Interrupt))
	err := f.cmd.Wait()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatal(err)
	}
	return f.cmd.ProcessState.ExitCode()
}

// service serves a Manager on a test host over HTTP.
func service(t *testing.T) (*bgtask.Manager, *bgtasktest.Host, *httptest.Server) {
	t.Helper()
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	srv := httptest.NewServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	t.Cleanup(func() {
		srv.CloseClientConnections()
		srv.Close()
		_ = m.Shutdown(context.Background())
	})
	return m, host, srv
}

func TestFollowPrintsTasksAndReconnectsWhenTheConnectionDrops(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	m, host, srv := service(t)
	f := follow(t, ctx, srv.URL)

	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: models})
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	f.stdout.await(t, ctx, "task-1 running attempts=1 openai/gpt-5")

	srv.CloseClientConnections() // the connection drops mid-stream
	f.stderr.await(t, ctx, `bgtask: connection lost: .+; reconnecting in 100ms\n`)
	f.stderr.await(t, ctx, `bgtask: connection lost: .+; reconnecting in 100ms\nbgtask: reconnected; resumed after \d+:\d+\n`) // it missed nothing
	require.NoError(t, host.Idle(running.SessionID, "ok"))
	f.stdout.await(t, ctx, "task-1 completed attempts=1")
	f.stdout.await(t, ctx, "Attempt 1 — COMPLETED — openai/gpt-5 — ses-1")

	srv.Listener.Close() // the service is gone: it retries, waiting longer each time
	srv.CloseClientConnections()
	// 200ms, or 100ms if the second connection lasted longer than the
	// 200ms Follow was at (it starts again from 100ms then), before these.
	f.stderr.await(t, ctx, `connection refused; reconnecting in 400ms\n`)
	f.stderr.await(t, ctx, `connection refused; reconnecting in 800ms\n`)
	assert.Equal(t, 0, f.interrupt(t), f.stderr.String())
}

// A service that no longer holds what followed the last change the
// command saw sends a new snapshot when it reconnects: the command says so.
func TestFollowSaysItTookANewSnapshotAfterAReconnect(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var conns sync.Mutex
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conns.Lock()
		n++
		first := n == 1
		conns.Unlock()
		w.Header().Set("Content-Type", "text/event-stream")
		task := bgtask.Task{ID: "task-1", Status: bgtask.StatusRunning, Revision: 1}
		if !first {
			task.Revision, task.Progress = 2, "halfway"
		}
		b, _ := json.Marshal(bgtask.Snapshot{Epoch: 7, Seq: 1, Tasks: []bgtask.Task{task}})
		fmt.Fprintf(w, "id: 7:1\nevent: snapshot\ndata: %s\n\n", b)
		w.(http.Flusher).Flush()
		if first {
			return // the stream ends: the command reconnects with 7:1, and gets a snapshot
		}
		<-r.Context().Done()
	}))
	defer func() {
		srv.CloseClientConnections()
		srv.Close()
	}()
	f := follow(t, ctx, srv.URL)
	f.stdout.await(t, ctx, "task-1 running attempts=0 +halfway")
	f.stderr.await(t, ctx, `bgtask: connection lost: .+; reconnecting in 100ms\nbgtask: reconnected; took a new snapshot\n`)
	assert.Equal(t, 0, f.interrupt(t), f.stderr.String())
}

func TestFollowPrintsJSONLines(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	m, _, srv := service(t)
	f := follow(t, ctx, "-json", srv.URL)
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: models})
	require.NoError(t, err)
	_, err = bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	f.stdout.await(t, ctx, `"status":"running"`)
	assert.Equal(t, 0, f.interrupt(t))
	for _, l := range strings.Split(strings.TrimSpace(f.stdout.String()), "\n") {
		var got bgtask.Task
		require.NoError(t, json.Unmarshal([]byte(l), &got), "one JSON object per line: %s", l)
		assert.Equal(t, "task-1", got.ID)
	}
}

func TestFollowOfADeadOrWrongAddressFailsAtOnce(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	refused := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close())
	notFound := httptest.NewServer(http.NotFoundHandler())
	defer notFound.Close()
	page := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		_, _ = w.Write([]byte("<p>some other service</p>"))
	}))
	defer page.Close()
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusBadGateway)
		_, _ = w.Write([]byte("<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1></center>" +
			strings.Repeat("<!-- a padding comment that proxies add -->\n", 500) + "<hr><center>nginx</center></body></html>"))
	}))
	defer proxy.Close()
	for url, want := range map[string]string{
		refused:      "bgtask: cannot follow " + refused + ": Get \"" + refused + "/events\": dial tcp " + refused[len("http://"):] + ": connect: connection refused\n",
		notFound.URL: "bgtask: cannot follow " + notFound.URL + ": bgtaskhttp: the server at " + notFound.URL + " did not answer as a bgtask server (GET /events: 404 Not Found, Content-Type text/plain; charset=utf-8): \"404 page not found\"\n",
		page.URL:     "bgtask: cannot follow " + page.URL + ": bgtaskhttp: the server at " + page.URL + " did not answer as a bgtask server (GET /events: 200 OK, Content-Type text/html): not an event stream: \"some other service\"\n",
		proxy.URL:    "bgtask: cannot follow " + proxy.URL + ": bgtaskhttp: the server at " + proxy.URL + " did not answer as a bgtask server (GET /events: 502 Bad Gateway, Content-Type text/html): \"502 Bad Gateway 502 Bad Gateway nginx\"\n",
	} {
		r := cli(t, "follow", url)
		assert.Equal(t, 1, r.code, url)
		assert.Equal(t, want, r.stderr, "one line: what answered, not its page")
		assert.Empty(t, r.stdout)
	}
}

func TestTasksSaysHowManyItShowsInJSONToo(t *testing.T) {
	dir := t.TempDir()
	m, _ := journaled(t, dir)
	defer m.Shutdown(context.Background())
	r := cli(t, "tasks", dir, "-parent", "chta", "-json") // a typo
	require.Equal(t, 0, r.code, r.stderr)
	var none []bgtask.Task
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &none), "stdout is the JSON alone")
	assert.Empty(t, none)
	assert.Equal(t, "0 of 3 tasks shown\n", r.stderr, "the note says the filter hid every task")
	r = cli(t, "tasks", dir, "-parent", "chat", "-json")
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &none))
	assert.Len(t, none, 1)
	assert.Equal(t, "1 of 3 tasks shown\n", r.stderr)
}

func TestFollowOfAnAddressThatNeverAnswersFailsPromptly(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	held := make(chan struct{})
	go func() { // accepts connections, and never writes a byte
		defer close(held)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	defer func() {
		ln.Close()
		<-held
	}()
	defer func(d time.Duration) { dialTimeout = d }(dialTimeout)
	dialTimeout = 200 * time.Millisecond // the test's: 5s in use
	// Far below the 45s the stream may be silent: a timeout there would be
	// no answer to a silent address.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	url := "http://" + ln.Addr().String()
	var stdout, stderr bytes.Buffer
	err = run(ctx, []string{"follow", url}, &stdout, &stderr)
	require.NoError(t, ctx.Err(), "it waited out the test: %v", err)
	assert.ErrorContains(t, err, "cannot follow "+url+": ")
	assert.ErrorContains(t, err, "timeout awaiting response headers")
	assert.Empty(t, stdout.String())
}

// budgeted leaves in dir the journal of a tree on a budget: task-1 holds
// it (1000 tokens, 5 spawns) and launched task-2, whose first attempt
// failed over; both report usage, and task-1's report reaches the token
// limit: the budget stops the branch.
func budgeted(t *testing.T, dir string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	j, err := bgtask.OpenFileJournal(dir)
	require.NoError(t, err)
	host := bgtasktest.NewHost()
	m := testkit.MustOpen(host, bgtask.WithJournal(j), bgtask.WithIDs(bgtask.SequentialIDs()))
	host.Attach(m)
	root, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Description: "on a budget", Models: models,
		Budget: &bgtask.Budget{Tokens: 1000, Spawns: 5, SoftPercent: 100}})
	require.NoError(t, err)
	root, err = bgtasktest.WaitStatus(ctx, m, root.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	kid, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: root.SessionID, Description: "spends", Models: models})
	require.NoError(t, err)
	kid, err = bgtasktest.WaitStatus(ctx, m, kid.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	usage := func(session string, u bgtask.Usage) {
		require.NoError(t, host.Emit(bgtask.Event{SessionID: session, Kind: bgtask.SessionUsage, Usage: u}))
	}
	usage(kid.SessionID, bgtask.Usage{InputTokens: 200, Requests: 1, Cost: 100_000})
	require.NoError(t, host.Fail(kid.SessionID, errors.New("429 Too Many Requests")))
	kid, err = bgtasktest.WaitFor(ctx, m, kid.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	usage(kid.SessionID, bgtask.Usage{InputTokens: 200, CachedTokens: 100, OutputTokens: 100, Requests: 1, Cost: 150_000})
	usage(root.SessionID, bgtask.Usage{InputTokens: 500, OutputTokens: 100, Requests: 2, Cost: bgtask.CostUnit}) // 1100 tokens: the limit
	for _, id := range []string{root.ID, kid.ID} {
		_, err := bgtasktest.WaitStatus(ctx, m, id, bgtask.StatusCancelled)
		require.NoError(t, err)
	}
	require.NoError(t, m.Shutdown(ctx))
}

// A task's usage (the timeline's total, and each attempt's when several
// reported) and the budget it spends from — what its branch spent of each
// limit, what is left, the limit reached — as the journal has them.
func TestTaskShowsUsageAndBudget(t *testing.T) {
	dir := t.TempDir()
	budgeted(t, dir)

	root := ok(t, "task", dir, "task-1")
	assert.Contains(t, root, "\nUsage: 600 tokens (500 in, 100 out), 2 requests, cost 1.00\n", "the timeline's usage line")
	assert.Contains(t, root, "\nBudget (its own): spent tokens 1100 of 1000, cost 1.25, requests 4, spawns 1 of 5; left tokens 0, spawns 4\n")
	assert.Contains(t, root, "\n  EXCEEDED: its tokens limit was reached: the branch was stopped and launches in it are refused\n")
	assert.Contains(t, root, "Stopped: the budget of task task-1 ran out of tokens")
	assert.NotContains(t, root, "  attempt 1: ", "one attempt: its usage is the total")
	assert.Less(t, strings.Index(root, "Budget (its own)"), strings.Index(root, "\nRecords:"), "with the timeline, before the records")

	kid := ok(t, "task", dir, "task-2")
	assert.Contains(t, kid, "\nUsage: 500 tokens (400 in, 100 cached, 100 out), 2 requests, cost 0.25\n")
	assert.Contains(t, kid, "\n  attempt 1: 200 tokens (200 in, 0 out), 1 request, cost 0.10\n  attempt 2: 300 tokens (200 in, 100 cached, 100 out), 1 request, cost 0.15\n")
	assert.Contains(t, kid, "\nBudget (task task-1's): spent tokens 1100 of 1000")
	assert.Contains(t, kid, "EXCEEDED: its tokens limit was reached")
	_, line := lineOf(t, kid, " usage ")
	assert.Contains(t, line, "used 200 tokens (200 in, 0 out), 1 request, cost 0.10", "the usage records")

	var doc struct {
		Task bgtask.Task `json:"task"`
	}
	require.NoError(t, json.Unmarshal([]byte(ok(t, "task", dir, "task-2", "-json")), &doc))
	require.NotNil(t, doc.Task.Usage)
	assert.Equal(t, int64(500), doc.Task.Usage.Total.Tokens())
	require.NotNil(t, doc.Task.Budget)
	assert.Equal(t, "task-1", doc.Task.Budget.TaskID)
	assert.Equal(t, bgtask.LimitTokens, doc.Task.Budget.Exceeded)

	plain := t.TempDir() // a task with neither prints neither
	m, tasks := journaled(t, plain)
	require.NoError(t, m.Shutdown(context.Background()))
	one := ok(t, "task", plain, tasks[0].ID)
	assert.NotContains(t, one, "Usage:")
	assert.NotContains(t, one, "Budget")
}

// Following, a task's line carries its usage, and its budget once spent;
// the budget follows the timeline of an ended task.
func TestFollowShowsUsageAndASpentBudget(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	m, host, srv := service(t)
	f := follow(t, ctx, srv.URL)
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Models: models, Budget: &bgtask.Budget{Tokens: 400}})
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	f.stdout.await(t, ctx, "task-1 running attempts=1 openai/gpt-5\n")
	require.NoError(t, host.Emit(bgtask.Event{SessionID: running.SessionID, Kind: bgtask.SessionUsage,
		Usage: bgtask.Usage{InputTokens: 400, OutputTokens: 100, Requests: 1, Cost: 250_000}}))
	f.stdout.await(t, ctx, `task-1 cancelled attempts=1 openai/gpt-5 tokens=500 requests=1 cost=0\.25 budget=exceeded:tokens\n`)
	f.stdout.await(t, ctx, `\n  Usage: 500 tokens \(400 in, 100 out\), 1 request, cost 0\.25\n  Budget \(its own\): spent tokens 500 of 400, cost 0\.25, requests 1; left tokens 0\n  +EXCEEDED: its tokens limit`)
	assert.Equal(t, 0, f.interrupt(t), f.stderr.String())
}

// A flipped byte with complete records after it is corruption: tasks and
// records refuse it with where it is; repair -n says what a repair drops
// and changes nothing; repair says it first, keeps a copy, and cuts.
func TestACorruptJournalIsRefusedThenRepaired(t *testing.T) {
	dir := t.TempDir()
	m, tasks := journaled(t, dir)
	require.NoError(t, m.Shutdown(context.Background()))
	segs, err := filepath.Glob(filepath.Join(dir, "seg-*.log"))
	require.NoError(t, err)
	require.Len(t, segs, 1)
	data, err := os.ReadFile(segs[0])
	require.NoError(t, err)
	// The second record's payload: the first commit (the first launch)
	// is damaged, and every later one follows it.
	first := 12 + int(binary.LittleEndian.Uint32(data)&^(3<<30))
	pos := first + 12 + 5
	data[pos] ^= 0xff
	require.NoError(t, os.WriteFile(segs[0], data, 0o644))
	snapshot := func() map[string]string {
		out := map[string]string{}
		require.NoError(t, filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err == nil && !d.IsDir() && d.Name() != "LOCK" {
				b, err := os.ReadFile(p)
				out[p] = string(b)
				return err
			}
			return err
		}))
		return out
	}
	before := snapshot()

	for _, args := range [][]string{{"tasks", dir}, {"records", dir}, {"task", dir, tasks[0].ID}, {"closures", dir}} {
		r := cli(t, args...)
		assert.Equal(t, 1, r.code, "%v: a corrupt journal is an error", args)
		assert.Empty(t, r.stdout, "%v", args)
		assert.Contains(t, r.stderr, "bgtask: the journal is corrupt: "+segs[0]+" at offset", "%v", args)
		assert.Contains(t, r.stderr, "bgtask repair "+dir, "%v: it says how to repair", args)
		for _, task := range tasks {
			assert.Contains(t, r.stderr, task.ID, "%v: it names the tasks whose records follow", args)
		}
	}
	assert.Equal(t, before, snapshot(), "reading changes nothing")

	r := cli(t, "repair", dir, "-n")
	assert.Equal(t, 1, r.code, "-n repairs nothing: the journal is still corrupt")
	assert.Contains(t, r.stdout, "a repair would cut")
	for _, task := range tasks {
		assert.Contains(t, r.stdout, task.ID)
	}
	assert.Contains(t, r.stdout, "task_launched")
	assert.Equal(t, before, snapshot(), "repair -n changes nothing")

	// -json: one document, what a repair drops.
	r = cli(t, "repair", dir, "-n", "-json")
	assert.Equal(t, 1, r.code)
	var doc struct {
		Corrupt, Repaired bool
		Error             string
		Damage            struct {
			Segment string
			Cut     int64
			Tasks   []string
			Dropped []struct{ Kind, TaskID string }
		}
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &doc), "one JSON document: %s", r.stdout)
	assert.True(t, doc.Corrupt)
	assert.False(t, doc.Repaired)
	assert.Contains(t, doc.Error, "nothing changed")
	assert.Equal(t, segs[0], doc.Damage.Segment)
	assert.Equal(t, int64(first), doc.Damage.Cut)
	assert.Len(t, doc.Damage.Tasks, len(tasks))
	dropped := map[string]bool{}
	for _, d := range doc.Damage.Dropped {
		dropped[d.Kind+" "+d.TaskID] = true
	}
	assert.False(t, dropped["task_launched "+tasks[0].ID], "the first launch is before the cut")
	for _, task := range tasks[1:] {
		assert.True(t, dropped["task_launched "+task.ID], "its launch is listed as dropped: %v", dropped)
	}

	// A live process holds the journal: the repair says what it would
	// drop, and refuses.
	lock, err := os.OpenFile(filepath.Join(dir, "LOCK"), os.O_CREATE|os.O_RDWR, 0o644)
	require.NoError(t, err)
	require.NoError(t, syscall.Flock(int(lock.Fd()), syscall.LOCK_EX))
	r = cli(t, "repair", dir)
	assert.Equal(t, 1, r.code)
	assert.Contains(t, r.stdout, "a repair would cut")
	assert.Contains(t, r.stdout, tasks[1].ID)
	assert.Contains(t, r.stderr, "not repaired")
	require.NoError(t, lock.Close())
	assert.Equal(t, before, snapshot(), "a refused repair changes nothing")

	r = cli(t, "repair", dir)
	require.Equal(t, 0, r.code, r.stderr)
	report, done, found := strings.Cut(r.stdout, "repaired:")
	require.True(t, found, r.stdout)
	assert.Contains(t, report, "a repair cuts", "what it drops is said before it is done")
	assert.Contains(t, report, tasks[1].ID)
	copies, err := filepath.Glob(filepath.Join(dir, "cut-*", filepath.Base(segs[0])+".from-*"))
	require.NoError(t, err)
	require.Len(t, copies, 1, "a copy of what was cut")
	assert.Contains(t, done, filepath.Dir(copies[0]))
	kept, err := os.ReadFile(copies[0])
	require.NoError(t, err)
	assert.Equal(t, data[first:], kept[:len(data)-first], "the copy holds the bytes from the cut on")

	r = cli(t, "tasks", dir)
	require.Equal(t, 0, r.code, r.stderr)
	r = cli(t, "repair", dir)
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stdout, "not corrupt")
	assert.Contains(t, r.stdout, "earlier repairs cut is kept in "+filepath.Dir(copies[0]))
}

// task and records read a live service too: its task and its history
// (GET /tasks/{id}/history), lines of progress included; a service's
// records are read a task at a time.
func TestTaskAndRecordsOfALiveService(t *testing.T) {
	m, host, srv := service(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{Provider: "a", ID: "1"}, {Provider: "b", ID: "2"}}})
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(ctx, m, task.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.NoError(t, host.Fail(running.SessionID, errors.New("429 Too Many Requests")))
	retried, err := bgtasktest.WaitFor(ctx, m, task.ID, func(t bgtask.Task) bool { return len(t.Attempts) == 2 && t.Status == bgtask.StatusRunning })
	require.NoError(t, err)
	require.NoError(t, m.Observe(bgtask.Event{SessionID: retried.SessionID, Kind: bgtask.SessionBusy, Progress: "reading the code"}))

	r := cli(t, "task", srv.URL, task.ID)
	require.Equal(t, 0, r.code, r.stderr)
	assert.Contains(t, r.stdout, "attempt 1 created on a/1")
	assert.Contains(t, r.stdout, "attempt 2 created on b/2")
	assert.Contains(t, r.stdout, "reading the code", "its line of progress")

	r = cli(t, "records", srv.URL, task.ID, "-json")
	require.Equal(t, 0, r.code, r.stderr)
	var recs []bgtask.RecordView
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &recs))
	want, err := m.History(ctx, task.ID)
	require.NoError(t, err)
	assert.Len(t, recs, len(want))

	r = cli(t, "records", srv.URL)
	assert.Equal(t, 2, r.code, "a usage error")
	assert.Contains(t, r.stderr, "a task at a time")
	r = cli(t, "task", srv.URL, "no-such-task")
	assert.Equal(t, 1, r.code)
	assert.Contains(t, r.stderr, "no-such-task")
}
