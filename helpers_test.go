package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var t0 = time.Date(2026, 4, 27, 12, 0, 0, 0, time.UTC)

// testHost is a scripted Host. By default StartSession returns "ses-N" in
// call order and AbortSession succeeds; start and abort replace that.
type testHost struct {
	mu     sync.Mutex
	n      int
	start  func(ctx context.Context, req SessionRequest, sid string) (string, error)
	abort  func(ctx context.Context, sid string) error
	starts []SessionRequest
	aborts []string
}

func (h *testHost) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	h.mu.Lock()
	h.n++
	sid := fmt.Sprintf("ses-%d", h.n)
	h.starts = append(h.starts, req)
	start := h.start
	h.mu.Unlock()
	if start != nil {
		return start(ctx, req, sid)
	}
	return sid, nil
}

func (h *testHost) AbortSession(ctx context.Context, sid string) error {
	h.mu.Lock()
	h.aborts = append(h.aborts, sid)
	abort := h.abort
	h.mu.Unlock()
	if abort != nil {
		return abort(ctx, sid)
	}
	return nil
}

func (h *testHost) Aborts() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.aborts...)
}

func (h *testHost) Starts() []SessionRequest {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]SessionRequest(nil), h.starts...)
}

// recorder is a Notifier that keeps what it was sent.
type recorder struct {
	mu   sync.Mutex
	got  []Notification
	hook func(ctx context.Context, n Notification) error
}

func (r *recorder) Notify(ctx context.Context, n Notification) error {
	r.mu.Lock()
	r.got = append(r.got, n)
	hook := r.hook
	r.mu.Unlock()
	if hook != nil {
		return hook(ctx, n)
	}
	return nil
}

func (r *recorder) All() []Notification {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Notification(nil), r.got...)
}

func (r *recorder) Kinds(taskID string) []NotificationKind {
	var out []NotificationKind
	for _, n := range r.All() {
		if taskID == "" || n.TaskID == taskID {
			out = append(out, n.Kind)
		}
	}
	return out
}

// logSink keeps log records for assertions.
type logSink struct {
	mu   sync.Mutex
	recs []map[string]string
}

func (s *logSink) Enabled(context.Context, slog.Level) bool { return true }
func (s *logSink) Handle(_ context.Context, r slog.Record) error {
	m := map[string]string{"msg": r.Message, "level": r.Level.String()}
	r.Attrs(func(a slog.Attr) bool { m[a.Key] = a.Value.String(); return true })
	s.mu.Lock()
	s.recs = append(s.recs, m)
	s.mu.Unlock()
	return nil
}
func (s *logSink) WithAttrs([]slog.Attr) slog.Handler { return s }
func (s *logSink) WithGroup(string) slog.Handler      { return s }
func (s *logSink) Records() []map[string]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]map[string]string(nil), s.recs...)
}

type harness struct {
	t     *testing.T
	m     *Manager
	host  *testHost
	rec   *recorder
	clock *clock.Fake
	logs  *logSink
}

// newHarness builds a Manager on a test host with deterministic ids, a fake
// clock, a recording notifier and a capturing logger. It is shut down when
// the test ends.
func newHarness(t *testing.T, host *testHost, opts ...Option) *harness {
	t.Helper()
	if host == nil {
		host = &testHost{}
	}
	h := harnessOn(t, host, host, opts...)
	if os.Getenv("BGTASK_TEST_NOTAP") == "" {
		h.m.recordAll() // tests read what the ledger committed (recordsOf)
	}
	return h
}

// harnessOn is newHarness with the Manager on host, which wraps th (the
// harness's test host): a host with more interfaces than testHost's.
func harnessOn(t *testing.T, host Host, th *testHost, opts ...Option) *harness {
	t.Helper()
	h := &harness{t: t, host: th, rec: &recorder{}, clock: clock.NewFake(t0), logs: &logSink{}}
	all := append([]Option{
		WithIDs(SequentialIDs()),
		WithClock(h.clock),
		WithNotifier(h.rec),
		WithLogger(slog.New(h.logs)),
	}, append(remoteJournal(t, opts), opts...)...)
	h.m = mustOpen(host, all...)
	shutdownAtCleanup(t, h.m)
	return h
}

// shutdownAtCleanup shuts m down when the test ends and fails it if that
// hangs.
func shutdownAtCleanup(t *testing.T, m *Manager) {
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := m.Shutdown(ctx); errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Shutdown hung: %v", err)
		}
	})
}

// settle waits until no goroutine of the Manager runs: every start, abort
// and delivery that was set off has finished. Tests use it only with hosts
// that do not block.
func (h *harness) settle() {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(h.t, h.m.life.group.Wait(ctx), "manager goroutines did not finish")
}

func (h *harness) launch(models ...string) Task {
	h.t.Helper()
	return h.launchSpec(Spec{ParentSessionID: "parent", Description: "look things up", Prompt: "do it", Models: mustModels(h.t, models...)})
}

func (h *harness) launchSpec(spec Spec) Task {
	h.t.Helper()
	task, err := h.m.Launch(context.Background(), spec)
	require.NoError(h.t, err)
	return task
}

func (h *harness) task(id string) Task {
	h.t.Helper()
	task, err := h.m.Task(id)
	require.NoError(h.t, err, "task %s", id)
	return task
}

func (h *harness) wait(id string) Task {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	task, err := h.m.Wait(ctx, id)
	require.NoError(h.t, err)
	return task
}

func (h *harness) observe(ev Event) error {
	h.t.Helper()
	err := h.m.Observe(ev)
	checkInvariants(h.t, h.m)
	return err
}

func mustModels(t testing.TB, ss ...string) []Model {
	t.Helper()
	out := make([]Model, len(ss))
	for i, s := range ss {
		m, err := ParseModel(s)
		require.NoError(t, err)
		out[i] = m
	}
	return out
}

// checkInvariants checks the ledger invariants on every task: at most one
// non-terminal attempt and it is current; the projection equals the current
// attempt; the revision equals the count of projection changes recorded.
func checkInvariants(t testing.TB, m *Manager) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, e := range m.order {
		live := 0
		for i, a := range e.atts() {
			if !a.Status.Terminal() {
				live++
				if i != e.current {
					t.Fatalf("task %s: non-terminal attempt %s is not current", e.info.id, a.ID)
				}
			}
			if a.Number != i+1 {
				t.Fatalf("task %s: attempt %d numbered %d", e.info.id, i+1, a.Number)
			}
		}
		if live > 1 {
			t.Fatalf("task %s: %d non-terminal attempts", e.info.id, live)
		}
		// kids is byParent over the task's sessions: the closure walk's
		// edges are the ledger's.
		want := map[*entry]int{}
		for _, s := range e.sessionList() {
			for _, k := range m.led.byParent[s] {
				want[k]++
			}
		}
		for _, k := range e.kids {
			want[k]--
		}
		for k, n := range want {
			if n != 0 {
				t.Fatalf("task %s: kids and the ledger's edges differ on task %s (%+d)", e.info.id, k.info.id, n)
			}
		}
		if e.id != e.info.id {
			t.Fatalf("task %s: entry id %q", e.info.id, e.id)
		}
		task := e.project()
		cur := e.atts()[e.current]
		if task.Status != cur.Status || task.SessionID != cur.SessionID || task.Model != cur.Model ||
			task.Error != cur.Error || !task.StartedAt.Equal(cur.StartedAt) || !task.CompletedAt.Equal(cur.CompletedAt) ||
			task.CurrentAttemptID != cur.ID {
			t.Fatalf("task %s: projection %+v differs from current attempt %+v", e.info.id, task, cur)
		}
		var changes uint64
		if !m.led.keepLog {
			continue // the Manager keeps no records (recordAll)
		}
		for _, r := range recordsOf(m.led, e.id) {
			switch r.kind {
			case recAttemptCreated, recAttemptPending, recSessionBound, recAttemptFinal, recUsage:
				changes++
			}
		}
		if changes != e.revision {
			t.Fatalf("task %s: revision %d, but %d changes recorded", e.info.id, e.revision, changes)
		}
		if e.terminal() {
			select {
			case <-e.waitDone():
			default:
				t.Fatalf("task %s is terminal but Wait is not released", e.info.id)
			}
			if done := e.rt.sig.Made(); done != nil {
				select {
				case <-done:
				default:
					t.Fatalf("task %s is terminal but a Wait made before its end is not released", e.info.id)
				}
			}
		}
	}
}

// Provider messages, verbatim as providers send them.
var (
	errForbidden   = errors.New("Forbidden: Selected provider is forbidden") //lint:ignore ST1005 a provider's own text
	errRateLimited = errors.New("Too Many Requests")                         //lint:ignore ST1005 a provider's own text
)

// needRecords skips a test that reads the ledger's records when the suite
// runs without a record tap (BGTASK_TEST_NOTAP=1, the production path).
func needRecords(t *testing.T) {
	t.Helper()
	if os.Getenv("BGTASK_TEST_NOTAP") != "" {
		t.Skip("reads the ledger's records; the suite runs without a record tap")
	}
}

// recordsOf returns the records l committed for task, in order: l must
// keep them (recordAll).
func recordsOf(l *ledger, task string) []record {
	var out []record
	for _, r := range l.log {
		if r.task == task {
			out = append(out, r)
		}
	}
	return out
}

// hangBound bounds a wait for what the code under test owes a test (a
// call into a host, a value on a channel, a channel closed): a broken
// build then fails at once, naming what never came, instead of hanging
// until go test's timeout. It is a bound on a failure, not a wait for a
// state: nothing that passes ever comes near it.
const hangBound = 20 * time.Second

// testCtx is a context for a call under test that ends after 10 s: the
// call fails the test instead of hanging it until go test's timeout.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// recv receives from c, failing the test if nothing comes within
// hangBound; what names the awaited value. Call it from the test's own
// goroutine (it calls t.Fatalf).
func recv[T any](t testing.TB, c <-chan T, what string, args ...any) T {
	t.Helper()
	v, _ := recvOK(t, c, what, args...)
	return v
}

// recvOK is recv for a channel that may be closed: ok is false once it
// is closed and drained.
func recvOK[T any](t testing.TB, c <-chan T, what string, args ...any) (v T, ok bool) {
	t.Helper()
	timer := time.NewTimer(hangBound)
	defer timer.Stop()
	select {
	case v, ok = <-c:
		return v, ok
	case <-timer.C:
		t.Fatalf("waited %v for %s: it never came", hangBound, fmt.Sprintf(what, args...))
		panic("unreachable")
	}
}

// recvAll receives from c until it is closed, failing the test if it is
// neither closed nor sent on within hangBound; it returns what it received.
func recvAll[T any](t testing.TB, c <-chan T, what string, args ...any) []T {
	t.Helper()
	var out []T
	for {
		v, ok := recvOK(t, c, what, args...)
		if !ok {
			return out
		}
		out = append(out, v)
	}
}

// send sends v on c, failing the test if nobody takes it within hangBound;
// what names the receiver. Call it from the test's own goroutine.
func send[T any](t testing.TB, c chan<- T, v T, what string, args ...any) {
	t.Helper()
	timer := time.NewTimer(hangBound)
	defer timer.Stop()
	select {
	case c <- v:
	case <-timer.C:
		t.Fatalf("waited %v for %s to take a value: it never did", hangBound, fmt.Sprintf(what, args...))
	}
}

// stopErr is the error of a Stop, for a check that wants only that.
func stopErr(_ ClosureReport, err error) error { return err }

// mustOpen is Open for a test whose options are fine: it panics on an
// error, which fails the test at once.
func mustOpen(host Host, opts ...Option) *Manager {
	m, err := Open(context.Background(), host, opts...)
	if err != nil {
		panic(err)
	}
	return m
}
