package pgledger

// A hostile caller's review: ways the node and the journal hung past a
// caller's deadline, froze, or crashed. Each test below failed while the
// fault it names (the "Fault:" comment on each, with the file and line it
// was at) was in the product code; they keep it fixed.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// hostilePool is a pool of the test database whose connections can be
// made to fail at once (gone: the database is unreachable), and whose
// statements can be watched: the first statement whose SQL contains
// *match is sent on hit as it starts.
type hostilePool struct {
	*pgxpool.Pool
	gone  atomic.Bool
	match atomic.Pointer[string]
	hit   chan string
}

func newHostilePool(t *testing.T) *hostilePool {
	t.Helper()
	hp := &hostilePool{hit: make(chan string, 1)}
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = hp
	cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
		if hp.gone.Load() {
			return true, errors.New("hostile: the database is unreachable")
		}
		return true, nil
	}
	hp.Pool, err = pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(hp.Pool.Close)
	return hp
}

// watch arms the tap: the next statement containing s is sent on hit.
func (hp *hostilePool) watch(s string) { hp.match.Store(&s) }

func (hp *hostilePool) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if m := hp.match.Load(); m != nil && strings.Contains(d.SQL, *m) {
		select {
		case hp.hit <- d.SQL:
		default:
		}
	}
	return ctx
}

func (hp *hostilePool) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// hostileNode joins member on pool (Poll 50ms), closed at the test's end.
func (f *fixture) hostileNode(pool *pgxpool.Pool, host bgtask.Host, member string, lease time.Duration, logger *slog.Logger) *Node {
	f.t.Helper()
	if logger == nil {
		logger = slog.New(slog.NewTextHandler(tlog{f.t}, nil))
	}
	node, err := Join(context.Background(), pool, NodeOptions{Ledger: f.ledger, Member: member, Lease: lease, Host: host,
		Poll: 50 * time.Millisecond, Logger: logger})
	require.NoError(f.t, err)
	closeAtEnd(f.t, node)
	return node
}

// hold runs sql in a transaction of its own on the fixture's pool (a
// lock: the database stalls what needs it) until the returned release, or
// the test's end.
func (f *fixture) hold(sql string, args ...any) (release func()) {
	f.t.Helper()
	require.NoError(f.t, Migrate(context.Background(), f.pool)) // the tables are there to lock
	tx, err := f.pool.Begin(context.Background())
	require.NoError(f.t, err)
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(context.Background()) }) }
	f.t.Cleanup(release)
	_, err = tx.Exec(context.Background(), sql, args...)
	require.NoError(f.t, err)
	return release
}

// pastDeadline calls call with a context that ends in 300ms, and
// requires it to return within 3s of that (release, at the test's end,
// lets the database answer again).
func pastDeadline(t *testing.T, release func(), what string, call func(ctx context.Context) error) {
	t.Helper()
	short, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- call(short) }()
	<-short.Done()
	within(t, done, 3*time.Second, release, what)
}

// within waits up to d for done after the caller's context ended, and
// fails the test (what names the call) if it did not come. In any case,
// at the test's end, release lets the call go and it is waited for.
func within[T any](t *testing.T, done <-chan T, d time.Duration, release func(), what string) {
	t.Helper()
	returned := false
	t.Cleanup(func() {
		release()
		if !returned {
			recv(t, done, what+" to return once the database answers again")
		}
	})
	select {
	case <-done:
		returned = true
	case <-time.After(d):
		t.Fatalf("%s had not returned %s after its context ended: it is held by the database, not by its context", what, d)
	}
}

// Fault: Journal.Replay (pgledger.go:461) queries with
// context.Background() and no bound, and bgtask.Open calls it inside
// Join (and inside every takeover). A database that stalls — a lock on
// bgtask_records, a partition with no TCP reset — holds Join past its
// context, forever.
func TestHostileJoinReplayIgnoresContext(t *testing.T) {
	f := newFixture(t)
	release := f.hold(`LOCK TABLE bgtask_records IN ACCESS EXCLUSIVE MODE`)
	pastDeadline(t, release, "Join", func(short context.Context) error {
		n, err := Join(short, f.pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: newService(), Poll: 50 * time.Millisecond})
		if n != nil { // it came too late for its caller: it is closed
			c, cancel := ending()
			_ = n.Close(c)
			cancel()
		}
		return err
	})
}

// Fault: the same unbounded Replay (pgledger.go:461), reached from the
// node's loop (takeOver, fleet.go:667): Close (fleet.go:711) waits for the
// loop with no regard to its context, so Close(ctx) never returns while
// the database stalls.
func TestHostileCloseHangsOnATakeoverReplay(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	hp := newHostilePool(t)
	heir := f.hostileNode(hp.Pool, svc, "heir", longLease, nil)
	victim := f.hostileNode(f.pool, svc, "victim", longLease, nil)
	running(t, victim, "chat")
	release := f.hold(`LOCK TABLE bgtask_records IN ACCESS EXCLUSIVE MODE`)
	hp.watch("FROM bgtask_records")
	victim.kill()
	f.expire("victim") // its lease expires with a live task: the heir takes it over
	recv(t, hp.hit, "the heir's takeover to replay the victim's records")

	pastDeadline(t, release, "Node.Close", heir.Close)
}

// stallingHost is a session service whose SessionStatus, once armed,
// ignores its context until released (a Host that hangs).
type stallingHost struct {
	*service
	armed   atomic.Bool
	asked   chan struct{}
	release chan struct{}
}

func (h *stallingHost) SessionStatus(ctx context.Context, id string) (bgtask.SessionReport, error) {
	if h.armed.Load() {
		select {
		case h.asked <- struct{}{}:
		default:
		}
		<-h.release
	}
	return h.service.SessionStatus(ctx, id)
}

// Fault: a takeover runs on the node's loop (fleet.go:529 → 667:
// n.open → bgtask.Open, which reconciles the member's runs through the
// Host). While a Host call of that recovery hangs, the loop does nothing
// else: an event another process routed to this node's own member is
// never applied, closures asking this node to stop runs are never
// served. Nothing bounds it but Close.
func TestHostileTakeoverHostHangFreezesTheLoop(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	stall := &stallingHost{service: svc, asked: make(chan struct{}, 1), release: make(chan struct{})}
	heir := f.hostileNode(f.pool, stall, "heir", longLease, nil)
	victim := f.hostileNode(f.pool, svc, "victim", longLease, nil)
	mine := running(t, heir, "chat")
	running(t, victim, "chat")
	stall.armed.Store(true)
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(stall.release) }) })
	victim.kill()
	f.expire("victim")
	recv(t, stall.asked, "the heir's takeover to ask the Host about the victim's run")

	// Another process routes an event for the heir's own run.
	router := f.hostileNode(f.pool, svc, "router", longLease, nil)
	require.NoError(t, router.Observe(context.Background(), bgtask.Event{SessionID: mine.SessionID, Kind: bgtask.SessionIdle, Text: "routed"}))
	wait, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got, err := heir.Manager().Wait(wait, mine.ID)
	if err != nil {
		t.Fatalf("an event routed to the heir's own member was not applied in 5s: its loop is inside a takeover's hung Host call (%v)", err)
	}
	assert.Equal(t, bgtask.StatusCompleted, got.Status)
}

// Fault: a closure's finish (Node.Stop of a session; closure.go:376) runs on
// a context of its own (30s) and record (closure.go:417-458) retries until
// it ends: a closure whose caller's context ended returns up to 30s later
// when the database stalls its record.
func TestHostileCloseBranchOverrunsItsContext(t *testing.T) {
	f, svc, ns, br := chain(t, 1, 1)
	g := svc.hold(br[0].SessionID) // its abort waits: the closure keeps looking
	c, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := ns[0].Stop(c, bgtask.Target{Session: "chat"})
		done <- err
	}()
	recv(t, g.asked, "the closure to stop the run")
	release := f.hold(`SELECT 1 FROM bgtask_closures WHERE ledger = $1 FOR UPDATE`, f.ledger)
	var once sync.Once
	cancel()
	within(t, done, 3*time.Second, func() { release(); once.Do(func() { close(g.release) }) }, "Node.Stop of a session")
}

// Fault: Launch's clean-up after a failed key claim (fleet.go:322, →
// closure.go:109-115 admitted; likewise releaseKey, fleet.go:363-369) runs
// on context.Background() with 10s: a Launch whose context ended returns
// ~10s late when the database stalls. (admitted is also called for a
// launch that was never admitted: spec.ParentSessionID is "" here.)
func TestHostileLaunchOverrunsItsContext(t *testing.T) {
	f := newFixture(t)
	node := f.hostileNode(f.pool, newService(), "w0", 0, nil)
	release := f.hold(`LOCK TABLE bgtask_keys, bgtask_launching IN SHARE MODE`)
	pastDeadline(t, release, "Launch", func(short context.Context) error {
		_, err := node.Launch(short, bgtask.Spec{Key: "hostile", Prompt: "do it", Models: spec.Models})
		return err
	})
}

// Fault: Close(ctx) bounds neither the journal's last write nor the
// release of its lease: Journal.Close (pgledger.go:541-563, and
// appendGroup, pgledger.go:400) run each on a context of their own, a
// whole lease (15s by default) long, for each member in turn
// (fleet.go:728-733), and n.done.Wait (fleet.go:711) takes no context.
func TestHostileCloseOverrunsItsContext(t *testing.T) {
	f := newFixture(t)
	node := f.hostileNode(f.pool, newService(), "w0", 0, nil)
	release := f.hold(`SELECT 1 FROM bgtask_members WHERE ledger = $1 FOR UPDATE`, f.ledger)
	pastDeadline(t, release, "Node.Close", node.Close)
}

// panicky is a slog handler that panics while armed (bgtask's own
// Manager swallows a logger's panics: Dropped().LoggerPanics).
type panicky struct{ armed *atomic.Bool }

func (h panicky) Enabled(context.Context, slog.Level) bool {
	if h.armed.Load() {
		panic("hostile: the log handler panicked")
	}
	return true
}

func (h panicky) Handle(context.Context, slog.Record) error {
	if h.armed.Load() {
		panic("hostile: the log handler panicked")
	}
	return nil
}

func (h panicky) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h panicky) WithGroup(string) slog.Handler      { return h }

// Fault: the node calls NodeOptions.Logger unguarded (here
// closure.go:113, from Launch's clean-up): a panicking handler panics
// through Node.Launch when the database is away. (The same on the
// caller's goroutine from Launch, fleet.go:367, and from Node.Stop:
// closure.go:452, 532, 661 — a panic out of record leaves the fence up
// while this node lives.)
func TestHostileLoggerPanicEscapesLaunch(t *testing.T) {
	f := newFixture(t)
	hp := newHostilePool(t)
	var armed atomic.Bool
	node := f.hostileNode(hp.Pool, newService(), "w0", 0, slog.New(panicky{&armed}))
	hp.gone.Store(true)
	armed.Store(true)
	defer func() { armed.Store(false); hp.gone.Store(false) }()
	assert.NotPanics(t, func() {
		_, err := node.Launch(ctx(t), bgtask.Spec{Key: "hostile", Prompt: "do it", Models: spec.Models})
		assert.Error(t, err)
	})
}

const hostileChildEnv = "PGLEDGER_HOSTILE_CHILD"

// Fault: the node's own goroutines call NodeOptions.Logger unguarded —
// here the loop, when its listen connection fails (fleet.go:560); also
// fleet.go:159, 631, 673, 686, changes.go:127, 140, outbox.go:190, 332: a
// panicking handler crashes the whole process when the database drops a
// connection. The crash is shown in a child process (this binary, run as
// TestHostileLoggerPanicChild, with its own server).
func TestHostileLoggerPanicCrashesTheProcess(t *testing.T) {
	if os.Getenv("BGTASK_PG_URL") != "" {
		t.Skip("the child's TestMain would drop the shared database")
	}
	dir, err := os.MkdirTemp("", "pgledger-hostile-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(dir, 0o755)) // the child's server runs as postgres
	defer stopChildServers(t, dir)
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(c, os.Args[0], "-test.run=^TestHostileLoggerPanicChild$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), hostileChildEnv+"=1", "TMPDIR="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "SURVIVED") {
		text := string(out)
		if i := strings.Index(text, "panic:"); i >= 0 {
			text = text[i:min(len(text), i+1500)]
		}
		t.Fatalf("the process died (%v) when the database dropped the node's listen connection and the Logger panicked:\n%s", err, text)
	}
}

// TestHostileLoggerPanicChild is the child of the test above.
func TestHostileLoggerPanicChild(t *testing.T) {
	if os.Getenv(hostileChildEnv) == "" {
		t.Skip("run by TestHostileLoggerPanicCrashesTheProcess")
	}
	f := newFixture(t)
	var armed atomic.Bool
	armed.Store(true)
	passes := make(chan struct{}, 1)
	node, err := Join(ctx(t), f.pool, NodeOptions{Ledger: f.ledger, Member: "w0", Host: newService(), Poll: 50 * time.Millisecond,
		Logger: slog.New(panicky{&armed}), pass: func() {
			select {
			case passes <- struct{}{}:
			default:
			}
		}})
	require.NoError(t, err)
	defer func() {
		armed.Store(false)
		c, cancel := ending()
		defer cancel()
		_ = node.Close(c)
	}()
	recv(t, passes, "the loop's first pass (it listens by then)")
	var killed int
	require.NoError(t, f.pool.QueryRow(ctx(t), `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
 WHERE datname = current_database() AND query LIKE 'LISTEN bgtask_inbox%') k`).Scan(&killed))
	require.Equal(t, 1, killed, "the node's listen connection")
	for range 3 {
		recv(t, passes, "the loop to go on")
	}
	fmt.Println("SURVIVED")
}

// stopChildServers stops the servers a crashed child left under dir, and
// removes it.
func stopChildServers(t *testing.T, dir string) {
	defer os.RemoveAll(dir)
	datas, _ := filepath.Glob(filepath.Join(dir, "bgtask-pg-*", "data"))
	if len(datas) == 0 {
		return
	}
	ctl, err := exec.LookPath("pg_ctl")
	if err != nil {
		found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
		if len(found) == 0 {
			t.Logf("no pg_ctl to stop the child's server under %s", dir)
			return
		}
		ctl = found[len(found)-1]
	}
	for _, d := range datas {
		cmd := exec.Command(ctl, "-D", d, "-m", "immediate", "-w", "stop")
		if os.Geteuid() == 0 {
			u, err := user.Lookup("postgres")
			if err != nil {
				t.Log(err)
				continue
			}
			uid, _ := strconv.ParseUint(u.Uid, 10, 32)
			gid, _ := strconv.ParseUint(u.Gid, 10, 32)
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}}
			cmd.Dir = filepath.Dir(d)
			cmd.Env = append(os.Environ(), "HOME="+filepath.Dir(d))
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Logf("stopping the child's server: %v\n%s", err, out)
		}
	}
}

// Fault: Migrate (schema.go:408) is exported and takes a context, but
// unlike Open and Join it does not take a nil one (nor a nil pool): it
// panics.
func TestHostileMigrateNilContext(t *testing.T) {
	f := newFixture(t)
	assert.NotPanics(t, func() {
		//lint:ignore SA1012 a nil context on purpose
		assert.NoError(t, Migrate(nil, f.pool), "a nil context is context.Background()")
	})
	assert.NotPanics(t, func() { assert.Error(t, Migrate(ctx(t), nil), "a nil pool") })
}
