// Package pgledger keeps a bgtask Manager's ledger in PostgreSQL: a
// bgtask.Journal whose every write is a transaction that holds the
// Manager's lease (a fencing token) and checks each record against the
// database's identity tables — the task's current attempt and run token,
// and a session bound to at most one attempt in the whole database.
//
// Each Manager writes the records of its own member (a name the caller
// picks, stable across restarts). A member is owned through a lease in
// the database, renewed by every write and by a heartbeat: a second
// process opening a member whose lease is live is refused; once a dead
// owner's lease has expired, another process may open the member, and
// the Manager it opens replays the records and reconciles the live runs
// exactly as a restart does (bgtask.StatusHost). An owner that lost its
// lease — paused past its expiry, partitioned — has every later write
// refused, and its Manager stops (fail-stop): no write of a stale owner
// lands.
//
//	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	j, err := pgledger.Open(ctx, pool, pgledger.Options{Member: "worker-1"})
//	m, err := bgtask.Open(ctx, host, bgtask.WithJournal(j))
//	defer j.Close()
//
// See the module's README for the schema, leases and failure behaviour.
package pgledger

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Options configure Open.
type Options struct {
	// Ledger names the ledger within the database ("" is "default"):
	// several ledgers may share one database.
	Ledger string
	// Member names the stream of records this journal writes: one per
	// Manager, the same after a restart. Required.
	Member string
	// Lease is how long the member stays owned without a write or a
	// heartbeat (0: 15s). Heartbeat is how often it is renewed (0: a
	// third of Lease).
	Lease, Heartbeat time.Duration
	// Wait is how long Open waits for a member whose lease another
	// process holds (0: it is refused at once, with *LeaseHeldError).
	Wait time.Duration
	// Holder names this process in the members table (""
	// host:pid:random), so an operator can tell who holds a lease.
	Holder string
	// Rounds makes the database count each parent session's live tasks
	// and write the all_complete of every parent round to the outbox
	// (a Node with a Notifier sets it, on every member it opens: the
	// members of one ledger must agree). It costs a row update per
	// parent per commit that launches or ends its tasks.
	Rounds bool

	beat func()           // tests: called after each heartbeat that renewed the lease
	away func(error)      // tests: called with each error of the database's absence
	now  func() time.Time // tests: the clock this process keeps its lease by (nil: time.Now)
	// wrote is called after each commit that wrote notes to the outbox,
	// with their parts (a bit each): a Node's, to wake their deliverers.
	wrote func(parts uint32)
}

// Errors a Journal's writes fail with (wrapped in the Manager's
// bgtask.ErrJournal).
var (
	// ErrLeaseLost: the member's lease expired or was taken over; this
	// journal writes nothing more.
	ErrLeaseLost = errors.New("pgledger: the member's lease was lost")
	// ErrStale: a record named an attempt that is not its task's current
	// one, or a task of another member.
	ErrStale = errors.New("pgledger: a record disagrees with the ledger in the database")
	// ErrSessionTaken: a session is bound by another member's attempt.
	ErrSessionTaken = errors.New("pgledger: the session is bound by another member")
	// ErrClosed: the journal was closed.
	ErrClosed = errors.New("pgledger: the journal is closed")
)

// LeaseHeldError is Open's refusal of a member whose lease another
// process holds.
type LeaseHeldError struct {
	Ledger, Member string
	Holder         string    // who holds it
	Expires        time.Time // when its lease expires unless renewed
}

func (e *LeaseHeldError) Error() string {
	return fmt.Sprintf("pgledger: member %q of ledger %q is held by %s until %s", e.Member, e.Ledger, e.Holder, e.Expires.Format(time.RFC3339Nano))
}

// Journal is a bgtask.Journal in PostgreSQL for one member. Appends
// are group-committed: the batches queued while a commit is in flight
// are written together by the next, in one round trip.
type Journal struct {
	rounds bool               // Options.Rounds
	wrote  func(parts uint32) // Options.wrote
	pool   *pgxpool.Pool
	ledger string
	member string
	holder string
	fence  int64
	lease  time.Duration
	now    func() time.Time // Options.now: the clock of leaseLeft and the renewals

	mu      sync.Mutex
	queue   []*commit // appended, not yet taken by the writer
	wake    chan struct{}
	failed  error // set once: every later append fails with it
	closed  bool
	lost    chan struct{} // closed when the lease is found lost
	stop    chan struct{} // closed by Close: the writer and heartbeat end
	done    sync.WaitGroup
	closeMu sync.Mutex
	// renewedAt (UnixNano) is when the last renewal that succeeded (a
	// write or a heartbeat) was asked.
	renewedAt atomic.Int64
	// closing, once set (Node.Close), bounds the journal's last writes and
	// the release of its lease: closeGrace after it ends, at most.
	closing atomic.Pointer[context.Context]
	// away is why the database did not answer the journal's last
	// statement (nil once one was answered): while it is set, the journal
	// retries its writes and Available reports ErrUnavailable.
	away   atomic.Pointer[error]
	onAway func(error) // Options.away
	// ops is the context of every statement of the journal's own: it ends
	// closeGrace after the context of a Close that bounds the journal
	// (closeWithin), or once Close returns.
	ops    context.Context
	opsEnd context.CancelFunc
}

// defaultLease is a member's lease when Options.Lease is 0.
const defaultLease = 15 * time.Second

// closeGrace is how long a journal's last writes may take once the
// context of the Close that ends it has ended (as bgtask.shutdownGrace).
const closeGrace = time.Second

// closeWithin bounds the rest of the journal's work, its last writes and
// the release of its lease, by ctx and closeGrace after it: the
// statements in flight then are cancelled too.
func (j *Journal) closeWithin(ctx context.Context) {
	if j.closing.Swap(&ctx) != nil {
		return
	}
	context.AfterFunc(ctx, func() { time.AfterFunc(closeGrace, j.opsEnd) })
}

// opCtx is the context of one statement of the journal's own: d long,
// and no later than closeGrace after the closing context ended (ops).
func (j *Journal) opCtx(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(j.ops, d)
}

// renewed notes a renewal of the lease asked at at.
func (j *Journal) renewed(at time.Time) {
	for {
		old := j.renewedAt.Load()
		if old >= at.UnixNano() || j.renewedAt.CompareAndSwap(old, at.UnixNano()) {
			return
		}
	}
}

// commit is one appended batch on its way to the database.
type commit struct {
	recs []bgtask.Record
	err  error
	done chan struct{}
}

func (c *commit) Wait() error { <-c.done; return c.err }

// Open migrates the schema (Migrate), takes member's lease and returns
// its journal. The pool is the caller's: Close does not close it.
func Open(ctx context.Context, pool *pgxpool.Pool, o Options) (*Journal, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if pool == nil {
		return nil, errors.New("pgledger: Open with a nil pool")
	}
	if strings.TrimSpace(o.Member) == "" {
		return nil, errors.New("pgledger: Options.Member is required: the name of this Manager's stream, the same after a restart")
	}
	if o.Ledger == "" {
		o.Ledger = "default"
	}
	if o.Lease < 0 || o.Heartbeat < 0 || o.Wait < 0 {
		return nil, errors.New("pgledger: Lease, Heartbeat and Wait may not be negative")
	}
	if o.Lease == 0 {
		o.Lease = defaultLease
	}
	if o.Lease < 100*time.Millisecond {
		return nil, fmt.Errorf("pgledger: a lease of %s is too short to renew", o.Lease)
	}
	if o.Heartbeat == 0 {
		o.Heartbeat = o.Lease / 3
	}
	if o.Heartbeat >= o.Lease {
		return nil, fmt.Errorf("pgledger: a heartbeat of %s does not renew a lease of %s in time", o.Heartbeat, o.Lease)
	}
	if o.Holder == "" {
		o.Holder = defaultHolder()
	}
	if err := Migrate(ctx, pool); err != nil {
		if transient(err) {
			return nil, fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		return nil, err
	}
	j := newJournal(pool, o)
	asked := j.now()
	if err := j.acquire(ctx, o.Wait); err != nil {
		return nil, err
	}
	j.renewed(asked)
	j.done.Add(2)
	go j.writer()
	go j.heartbeat(o.Heartbeat, o.beat)
	return j, nil
}

// newJournal is the journal of o.Member, not yet holding its lease and
// with no goroutine running.
func newJournal(pool *pgxpool.Pool, o Options) *Journal {
	ops, end := context.WithCancel(context.Background())
	now := o.now
	if now == nil {
		now = time.Now
	}
	return &Journal{ops: ops, opsEnd: end, now: now, pool: pool, ledger: o.Ledger, member: o.Member, holder: o.Holder, lease: o.Lease, rounds: o.Rounds, wrote: o.wrote, onAway: o.away,
		wake: make(chan struct{}, 1), lost: make(chan struct{}), stop: make(chan struct{})}
}

// defaultHolder names this process: host, pid and a random suffix.
func defaultHolder() string {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// acquireLease takes member $2's lease of ledger $1 for holder $3, for $4,
// with a new fence, if it is free or expired; what the member's previous
// life left in flight ends with it: its launches past the fence check
// (none of them can land now) and the closures it opened (their fence held
// only while it lived).
const acquireLease = `
WITH m AS (
INSERT INTO bgtask_members AS m (ledger, member, fence, holder, expires_at)
VALUES ($1, $2, 1, $3, now() + $4::interval)
ON CONFLICT (ledger, member) DO UPDATE
   SET fence = m.fence + 1, holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at, idle = false
 WHERE m.expires_at <= now()
RETURNING fence),
l AS (DELETE FROM bgtask_launching WHERE ledger = $1 AND member = $2 AND EXISTS (SELECT 1 FROM m)),
c AS (UPDATE bgtask_closures SET closed_at = now() WHERE ledger = $1 AND member = $2 AND closed_at IS NULL AND EXISTS (SELECT 1 FROM m))
SELECT fence FROM m`

// acquire takes the member's lease, a new fence with it, waiting up to
// wait for a live lease of another holder to expire.
func (j *Journal) acquire(ctx context.Context, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for {
		err := j.pool.QueryRow(ctx, acquireLease, j.ledger, j.member, j.holder, j.lease).Scan(&j.fence)
		if err == nil {
			return nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return dbErr(fmt.Sprintf("taking the lease of member %q", j.member), err)
		}
		held := &LeaseHeldError{Ledger: j.ledger, Member: j.member}
		var left time.Duration
		if err := j.pool.QueryRow(ctx, `SELECT holder, expires_at, greatest(expires_at - now(), '0') FROM bgtask_members WHERE ledger = $1 AND member = $2`,
			j.ledger, j.member).Scan(&held.Holder, &held.Expires, &left); err != nil {
			return dbErr(fmt.Sprintf("reading the lease of member %q", j.member), err)
		}
		// Wait for the expiry (a little past it, the database's clock
		// deciding), in steps, until the deadline.
		pause := min(left+10*time.Millisecond, time.Until(deadline), 250*time.Millisecond)
		if pause <= 0 {
			return held
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Fence is the fencing token of this journal's lease: it grows at every
// Open of the member, and every write is conditional on it.
func (j *Journal) Fence() int64 { return j.fence }

// Lost is closed when the lease is found lost (a write or a heartbeat was
// refused): the journal writes nothing more, and the Manager on it has
// stopped or is stopping.
func (j *Journal) Lost() <-chan struct{} { return j.lost }

// Append queues batch for the next group commit.
func (j *Journal) Append(batch []bgtask.Record) bgtask.Commit {
	c := &commit{recs: batch, done: make(chan struct{})}
	j.mu.Lock()
	switch {
	case j.failed != nil:
		c.err = j.failed
	case j.closed:
		c.err = ErrClosed
	default:
		j.queue = append(j.queue, c)
		j.mu.Unlock()
		select {
		case j.wake <- struct{}{}:
		default:
		}
		return c
	}
	j.mu.Unlock()
	close(c.done)
	return c
}

// writer commits what was queued, one group at a time, until Close; what
// is queued when Close comes is still written.
func (j *Journal) writer() {
	defer j.done.Done()
	for {
		j.mu.Lock()
		group := j.queue
		j.queue = nil
		closing := j.closed
		j.mu.Unlock()
		if len(group) > 0 {
			j.write(group)
			continue
		}
		if closing {
			return
		}
		select {
		case <-j.wake:
		case <-j.stop:
		}
	}
}

// write commits group in one statement, and tells each batch how it went.
// A database that does not answer is asked again (see persist): the
// batches wait, and so do the Manager's commits behind them.
func (j *Journal) write(group []*commit) {
	err := j.failedErr()
	var notes outboxNotes
	if err == nil {
		// The notifications the group carries, encoded once for all tries;
		// one that cannot be is no outage: the journal fails with it.
		for _, c := range group {
			for i := range c.recs {
				if e := notes.add(&c.recs[i]); e != nil && err == nil {
					err = j.fail(e)
				}
			}
		}
	}
	if err == nil {
		err = j.persist(0, func(ctx context.Context) error { return j.appendGroup(ctx, group, &notes) })
	}
	for _, c := range group {
		c.err = err
		close(c.done)
	}
}

// persist runs op, one idempotent write of the journal's, until it lands
// (nil), the database refuses it (the journal fails with that), or the
// lease may have run out: unrenewed for a whole lease, another process may
// own the member by now, so the journal fails with ErrLeaseLost rather
// than act for it (the Node opens the member again once the database
// answers). A try whose outcome is unknown — the connection dropped around
// its commit — is resolved by the next: op is idempotent. Each try is
// bounded by tryFor (0: a lease), and once the journal is closing, the
// tries end with the close's context.
func (j *Journal) persist(tryFor time.Duration, op func(ctx context.Context) error) error {
	var wait time.Duration
	var first time.Time // the first try that failed
	for {
		left := j.leaseLeft()
		if left <= 0 {
			return j.fail(j.leaseLost("not renewed for %s while the database did not answer: %v", j.lease, j.awayErr()))
		}
		if tryFor == 0 {
			// A try may outlast what is left of the lease: if it lands, the
			// database found the lease still this journal's.
			tryFor = j.lease
		}
		ctx, cancel := j.opCtx(tryFor)
		err := op(ctx)
		cancel()
		if err == nil {
			j.answered()
			return nil
		}
		if !transient(err) {
			return j.fail(err)
		}
		j.unanswered(err)
		if first.IsZero() {
			first = j.now()
		}
		if j.now().Sub(first) >= j.lease {
			// Tried for a whole lease (a heartbeat may have renewed it
			// meanwhile, but this write never lands: a statement timeout
			// shorter than it, a server out of memory): the journal gives
			// this life up, as if the lease had run out.
			return j.fail(j.leaseLost("a write was not taken for %s: %v", j.lease, err))
		}
		wait = retryWait(wait)
		if !sleepCtx(j.ops, min(wait, max(j.leaseLeft(), 0))) {
			return j.fail(fmt.Errorf("%w: the journal of member %s closed before the database answered: %w", ErrUnavailable, j.member, err))
		}
	}
}

// leaseLeft is how long the lease lasts, as this process can be sure of
// it: from when the last renewal that succeeded was asked.
func (j *Journal) leaseLeft() time.Duration {
	return time.Unix(0, j.renewedAt.Load()).Add(j.lease).Sub(j.now())
}

// unanswered notes that the database did not answer a statement: until
// one is answered, Available reports it. A standby's refusal of a write
// (a failover left the pool's connections on the old server) drops the
// pool's connections, so the next are made to whichever server answers
// at the address now.
func (j *Journal) unanswered(err error) {
	j.away.Store(&err)
	if readOnly(err) {
		j.pool.Reset()
	}
	if j.onAway != nil {
		j.onAway(err)
	}
}

// answered notes that the database answered a statement.
func (j *Journal) answered() { j.away.Store(nil) }

func (j *Journal) awayErr() error {
	if p := j.away.Load(); p != nil {
		return *p
	}
	return nil
}

// Available reports whether the journal can write now: nil, an error that
// wraps ErrUnavailable while the database does not answer its statements
// (writes wait and are retried; they may still land), or the error the
// journal failed with (ErrLeaseLost, ErrStale, …: it writes nothing
// more). Node.Launch refuses a launch with it at once rather than wait.
func (j *Journal) Available() error {
	if err := j.failedErr(); err != nil {
		return err
	}
	if err := j.awayErr(); err != nil {
		return fmt.Errorf("%w: member %s: %w", ErrUnavailable, j.member, err)
	}
	return nil
}

func (j *Journal) failedErr() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.failed
}

// fail records the journal's first write error (every later append gets
// it) and closes Lost if the lease is gone.
func (j *Journal) fail(err error) error {
	err = classify(err)
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.failed == nil {
		j.failed = err
		if errors.Is(err, ErrLeaseLost) {
			close(j.lost)
		}
	}
	return j.failed
}

// classify maps the append function's errors to this package's.
func classify(err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch pe.Code {
		case "BT001":
			return fmt.Errorf("%w: %s", ErrLeaseLost, pe.Message)
		case "BT002", "BT003":
			return fmt.Errorf("%w: %s", ErrStale, pe.Message)
		case "BT004":
			return fmt.Errorf("%w: %s", ErrSessionTaken, pe.Message)
		}
	}
	for _, known := range [...]error{ErrLeaseLost, ErrStale, ErrSessionTaken, ErrClosed} {
		if errors.Is(err, known) {
			return err
		}
	}
	return fmt.Errorf("pgledger: append: %w", err)
}

// leaseLost is the error of a lease found lost by this process (a
// heartbeat, a compaction), as the database reports its own (BT001).
func (j *Journal) leaseLost(format string, args ...any) error {
	return fmt.Errorf("%w: member %s (fence %d): %s", ErrLeaseLost, j.member, j.fence, fmt.Sprintf(format, args...))
}

// appendGroup writes the records of group, and the notifications they
// carry (notes), through bgtask_write, which is idempotent: a group that
// landed already (its first record is in the table, under this fence) is
// not written again.
func (j *Journal) appendGroup(ctx context.Context, group []*commit, notes *outboxNotes) (err error) {
	n := 0
	for _, c := range group {
		n += len(c.recs)
	}
	seq := make([]int64, 0, n)
	kind := make([]string, 0, n)
	task := make([]string, 0, n)
	attempt := make([]string, 0, n)
	token := make([]string, 0, n)
	session := make([]string, 0, n)
	parent := make([]string, 0, n)
	data := make([][]byte, 0, n)
	var use [5][]int64 // each record's usage: input, output, cached, requests, cost (0 but for a usage record)
	for i := range use {
		use[i] = make([]int64, n)
	}
	k := 0
	for _, c := range group {
		for i := range c.recs {
			r := &c.recs[i]
			if u := r.Usage; u != nil {
				use[0][k], use[1][k], use[2][k], use[3][k], use[4][k] = u.InputTokens, u.OutputTokens, u.CachedTokens, u.Requests, int64(u.Cost)
			}
			k++
			seq = append(seq, int64(r.Seq))
			kind = append(kind, r.Kind)
			task = append(task, r.TaskID)
			attempt = append(attempt, r.AttemptID)
			token = append(token, r.Token)
			session = append(session, r.SessionID)
			parent = append(parent, r.ParentSessionID)
			data = append(data, r.Data)
		}
	}
	asked := j.now()
	defer func() {
		if err == nil {
			j.renewed(asked)
		}
	}()
	var parts int32
	err = j.pool.QueryRow(ctx, appendSQL, j.ledger, j.member, j.fence, j.lease, seq, kind, task, attempt, token, session, parent, data, j.rounds,
		use[0], use[1], use[2], use[3], use[4], notes.parent, notes.id, notes.kind, notes.task, notes.body).Scan(&parts)
	if err == nil && parts != 0 && j.wrote != nil {
		j.wrote(uint32(parts))
	}
	return err
}

// renewLease renews member $2's lease of ledger $1 by $4 if it is still
// held with fence $3 and unexpired: no row changed means it was lost.
const renewLease = `UPDATE bgtask_members SET expires_at = now() + $4::interval
 WHERE ledger = $1 AND member = $2 AND fence = $3 AND expires_at > now()`

// heartbeat renews the lease every interval until Close; a renewal that
// finds the lease gone fails the journal. While the database does not
// answer, it asks every downBeat, so the journal knows soon after the
// database is back (Available), and fails the journal once the lease
// could have run out.
func (j *Journal) heartbeat(every time.Duration, beat func()) {
	defer j.done.Done()
	t := time.NewTimer(every)
	defer t.Stop()
	for {
		select {
		case <-j.stop:
			return
		case <-t.C:
		}
		if j.failedErr() != nil {
			return
		}
		if j.leaseLeft() <= 0 {
			j.fail(j.leaseLost("not renewed for %s while the database did not answer: %v", j.lease, j.awayErr()))
			return
		}
		asked := j.now()
		ctx, cancel := j.opCtx(every)
		tag, err := j.pool.Exec(ctx, renewLease, j.ledger, j.member, j.fence, j.lease)
		cancel()
		next := every
		switch {
		case err == nil && tag.RowsAffected() == 0:
			j.fail(j.leaseLost("the heartbeat found it taken or expired"))
			return
		case err == nil:
			j.renewed(asked)
			j.answered()
			if beat != nil {
				beat()
			}
		default:
			// Tried again soon; the next pass fails the journal once the
			// lease could have run out.
			j.unanswered(err)
			next = min(every, downBeat)
		}
		t.Reset(next)
	}
}

// downBeat is how often the heartbeat asks while the database does not
// answer.
const downBeat = 200 * time.Millisecond

// A Journal is a bgtask.Journal whose replay a context can end.
var (
	_ bgtask.Journal = (*Journal)(nil)
)

// Replay calls fn with the member's records in sequence order; Close
// ends a replay in progress.
func (j *Journal) Replay(fn func(bgtask.Record) error) error {
	return j.ReplayContext(context.Background(), fn)
}

// ReplayContext is Replay, ended by ctx as well (the optional method of bgtask.Journal:
// bgtask.Open replays with its own context, and so a Join or takeover
// with its own).
func (j *Journal) ReplayContext(ctx context.Context, fn func(bgtask.Record) error) error {
	if err := j.failedErr(); err != nil {
		return err
	}
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // ends with the replay: cancel is deferred
		select {
		case <-j.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	rows, err := j.pool.Query(ctx, `SELECT seq, kind, task_id, attempt_id, token, data FROM bgtask_records
 WHERE ledger = $1 AND member = $2 ORDER BY seq`, j.ledger, j.member)
	if err != nil {
		return dbErr("replay", err)
	}
	defer rows.Close()
	for rows.Next() {
		var r bgtask.Record
		var seq int64
		if err := rows.Scan(&seq, &r.Kind, &r.TaskID, &r.AttemptID, &r.Token, &r.Data); err != nil {
			return fmt.Errorf("pgledger: replay: %w", err)
		}
		r.Seq = uint64(seq)
		if err := fn(r); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return dbErr("replay", err)
	}
	return nil
}

// Compact replaces the member's records with keep in one transaction
// (holding the lease), and drops the identity rows of tasks keep no
// longer has.
func (j *Journal) Compact(keep []bgtask.Record) error {
	if err := j.failedErr(); err != nil {
		return err
	}
	// Writes queued before the compaction land first: the Manager calls
	// Compact with a snapshot that includes them.
	if err := j.Append(nil).Wait(); err != nil {
		return err
	}
	// A compaction is idempotent (the whole set is replaced): one that the
	// database did not answer is tried again, as an append is. It may take
	// longer than a lease: it holds the member's row from its first
	// statement, so no other process can take the member meanwhile.
	return j.persist(10*j.lease, func(ctx context.Context) error { return j.compact(ctx, keep) })
}

// compact is one try of Compact.
func (j *Journal) compact(ctx context.Context, keep []bgtask.Record) error {
	asked := j.now()
	err := pgx.BeginFunc(ctx, j.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, renewLease, j.ledger, j.member, j.fence, j.lease)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return j.leaseLost("lost before a compaction")
		}
		if _, err := tx.Exec(ctx, `DELETE FROM bgtask_records WHERE ledger = $1 AND member = $2`, j.ledger, j.member); err != nil {
			return err
		}
		tasks := map[string]struct{}{}
		rows := make([][]any, len(keep))
		for i, r := range keep {
			rows[i] = []any{j.ledger, j.member, int64(r.Seq), r.Kind, r.TaskID, r.AttemptID, r.Token, r.Data}
			if r.TaskID != "" {
				tasks[r.TaskID] = struct{}{}
			}
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"bgtask_records"},
			[]string{"ledger", "member", "seq", "kind", "task_id", "attempt_id", "token", "data"}, pgx.CopyFromRows(rows)); err != nil {
			return err
		}
		ids := make([]string, 0, len(tasks))
		for id := range tasks {
			ids = append(ids, id)
		}
		// An anti-join on the kept ids (hashed), by the member's index.
		if _, err := tx.Exec(ctx, `DELETE FROM bgtask_sessions s WHERE s.ledger = $1 AND s.member = $2
   AND NOT EXISTS (SELECT 1 FROM unnest($3::text[]) k(id) WHERE k.id = s.task_id)`, j.ledger, j.member, ids); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `DELETE FROM bgtask_tasks t WHERE t.ledger = $1 AND t.member = $2
   AND NOT EXISTS (SELECT 1 FROM unnest($3::text[]) k(id) WHERE k.id = t.task_id)`, j.ledger, j.member, ids)
		return err
	})
	if err == nil {
		j.renewed(asked)
	}
	return err
}

// Close writes what was appended, stops the heartbeat and releases the
// lease (another process may open the member at once). It does not close
// the pool.
func (j *Journal) Close() error {
	j.closeMu.Lock()
	defer j.closeMu.Unlock()
	j.mu.Lock()
	if j.closed {
		j.mu.Unlock()
		return nil
	}
	j.closed = true
	j.mu.Unlock()
	defer j.opsEnd()
	close(j.stop)
	j.done.Wait()
	if j.failedErr() != nil {
		return nil // the lease is not ours to release
	}
	ctx, cancel := j.opCtx(j.lease)
	defer cancel()
	// A member left with nothing live (no live task, no event routed to it)
	// is idle: the takeover poll passes it by until it is opened again.
	_, err := j.pool.Exec(ctx, `UPDATE bgtask_members m SET expires_at = now(),
       idle = NOT EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = m.ledger AND t.member = m.member AND NOT t.ended)
          AND NOT EXISTS (SELECT 1 FROM bgtask_inbox i WHERE i.ledger = m.ledger AND i.member = m.member)
 WHERE ledger = $1 AND member = $2 AND fence = $3`, j.ledger, j.member, j.fence)
	if err != nil {
		return fmt.Errorf("pgledger: releasing the lease of member %q: %w", j.member, err)
	}
	return nil
}
