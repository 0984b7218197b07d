package pgledger

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// NodeOptions configure Join.
type NodeOptions struct {
	// Ledger, Member, Lease, Heartbeat and Holder are the journal's
	// (Options): Member is this process's own member.
	Ledger, Member   string
	Lease, Heartbeat time.Duration
	Holder           string
	// Host is the session service every Manager of the node uses: this
	// process's own and those it takes over. A bgtask.StatusHost lets a
	// takeover re-adopt the runs whose sessions are alive.
	Host bgtask.Host
	// Options are passed to every Manager the node opens (a logger,
	// limits, …); the journal is the node's.
	Options []bgtask.Option
	// Notifier, if set, receives the fleet's notifications through the
	// outbox (see outbox.go): per parent session in order, from one
	// process at a time, all_complete exactly once per parent round
	// whichever processes its tasks ended in. It replaces any notifier in
	// Options. Without it each Manager delivers its own notifications
	// (WithNotifier in Options), and an all_complete counts only the
	// tasks of one process.
	Notifier bgtask.Notifier
	// Poll is how often the node looks at its inbox without being
	// notified, and for members whose lease expired (0: 1s).
	Poll time.Duration
	// Logger, if set, hears the node's own trouble (a lost listen
	// connection, a takeover).
	Logger *slog.Logger
	// Retention is what the ledger keeps of what has ended, beside what
	// each Manager keeps of its own (Options' bgtask.WithRetention): the
	// changes of ended tasks, closures and their stops, idle parents' rows
	// and dead members' data (see retention.go). MaxAge 0 is
	// DefaultRetainFor (24h), a negative MaxAge no age bound; MaxEnded 0
	// is no bound on the count of ended tasks' changes. The nodes of a
	// ledger prune it about once a minute, one at a time.
	Retention bgtask.Retention

	took     func(member string) // tests: called after each takeover
	pass     func()              // tests: called after each poll pass of the loop
	claimFor time.Duration       // tests: an outbox part's claim (0: claimFor)
	markFor  time.Duration       // tests: the deliverer's own writes' bound (0: markFor)
	drained  func(member string) // tests: called after applied events left a member's inbox
	stopped  func(task string)   // tests: called once what a stop of a run of task came to is written
	marked   func(note string)   // tests: called once a delivered notification is deleted from the outbox
	beat     func()              // tests: Options.beat of every member's journal
	away     func(error)         // tests: Options.away of every member's journal
	now      func() time.Time    // tests: Options.now of every member's journal
	prune    *pruneHook          // tests: the node's pruning passes
	keepOut  bool                // tests: the node takes no member over
}

// Node is one process of a fleet on one ledger: its own member's Manager,
// the members it took over from dead processes, and the routing of events
// to whichever process owns their session.
//
// Events: Observe applies an event here if a Manager of this node owns
// its attempt or session, and otherwise routes it, in one transaction, to
// the owner's inbox — after checking in the database that the attempt is
// its task's current one (a stale event is refused, whichever process
// received it). The owner is woken by NOTIFY, and looks at its inbox every
// Poll in case a notification was missed; it applies each event (once
// durable, the event is deleted), so an event is applied at least once
// and a repeat is refused as stale by the attempt's state machine.
//
// Takeover: every Poll the node looks for members whose lease expired
// with tasks still live, takes one over (Open, as a restart) and opens a
// Manager on it, which reconciles its runs through the Host.
type Node struct {
	pool *pgxpool.Pool
	o    NodeOptions

	mu      sync.Mutex
	members map[string]*member // this node's: its own and those taken over
	dead    []*member          // members whose lease was lost: shut down at Close
	closed  bool
	// inflight counts the launches with a parent inside Node.Launch, by
	// task: their rows of bgtask_launching are theirs to clear. leftover
	// is set while a launch that failed may have left a row behind (its
	// check, or its clearing, did not get an answer): sweepLaunching
	// clears those once they are older than the lease.
	inflight map[string]int
	leftover atomic.Bool
	asks     map[string]chan wireAnswer // the actions this node asked of other processes, by id (ask.go)

	taking    atomic.Bool                     // a takeover is running (takeOverAside)
	stops     stopper                         // the runs closures asked this node to stop
	wake      chan struct{}                   // the deliverer looks at the outbox now
	backoff   map[string]backoff              // the deliverer's: parents whose delivery failed
	rang      chan struct{}                   // the bell: the ledger's deliverers are to be woken
	heldParts atomic.Uint32                   // the outbox's parts the deliverer holds, a bit each
	stray     sync.WaitGroup                  // Notifier calls (user code that may ignore its context)
	observe   sync.WaitGroup                  // Manager.Observe calls an Observe's context let go of
	admits    *batch[admission, *int64]       // launches' fence checks, batched (admit)
	gates     *batch[admission, *int64]       // starts' fence checks, batched (gateStart)
	budgets   *batch[budgetAsk, budgetAnswer] // launches' budget admissions, batched (admitBudget)

	changesMu sync.Mutex
	changed   chan struct{}   // closed and replaced when NOTIFY tells of changes
	loopCtx   context.Context // ends at Close: the node's goroutines' context
	cancel    context.CancelFunc
	done      sync.WaitGroup // the loop, the stop writer, and each stop
}

// member is one member this node owns: its journal and its Manager.
type member struct {
	name    string
	j       *Journal
	m       *bgtask.Manager
	drainMu sync.Mutex // one drain of its inbox at a time (the loop's, a takeover's)
	unwatch func()     // ends the goroutines adopt started for it
	// releasing is set while releaseIdle asks whether it is idle: launches
	// do not go to it (it is still owned, and read, meanwhile).
	releasing atomic.Bool
}

// Join opens this process's member and its Manager, and starts listening
// for events routed to it and for members to take over.
func Join(ctx context.Context, pool *pgxpool.Pool, o NodeOptions) (*Node, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if o.Host == nil {
		return nil, errors.New("pgledger: Join with a nil Host")
	}
	if o.Poll < 0 {
		return nil, errors.New("pgledger: Poll may not be negative")
	}
	if o.Poll == 0 {
		o.Poll = time.Second
	}
	if o.Lease == 0 {
		o.Lease = defaultLease // as Open would: the node's sweep reads it too
	}
	if o.Ledger == "" {
		o.Ledger = "default"
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	} else {
		o.Logger = slog.New(guardedHandler{h: o.Logger.Handler()})
	}
	n := &Node{pool: pool, o: o, members: map[string]*member{}, wake: make(chan struct{}, 1), rang: make(chan struct{}, 1), changed: make(chan struct{}),
		backoff: map[string]backoff{}}
	n.stops.asked, n.stops.results = map[int64]map[string]bool{}, make(chan stopResult, 64)
	n.admits, n.gates = newBatch(n.admitAll, n.admitDropped), newBatch(n.gateAll, nil)
	n.admits.alone, n.gates.alone = admission.alone, admission.alone
	n.budgets = newBatch(n.budgetAll, n.budgetDropped)
	n.budgets.alone = budgetAsk.alone
	own, err := n.open(ctx, o.Member)
	if err != nil {
		return nil, err
	}
	n.loopCtx, n.cancel = context.WithCancel(context.Background())
	n.adopt(own)
	n.done.Add(2)
	go n.run(n.loopCtx)
	go n.writeStops(n.loopCtx)
	if o.Notifier != nil {
		n.done.Add(1)
		go n.deliverLoop(n.loopCtx)
	}
	return n, nil
}

// adopt makes mb one of this node's members: its changes published, and
// the member dropped (events go to whoever owns it next, closures no
// longer ask it) as soon as its lease is found lost.
func (n *Node) adopt(mb *member) {
	ctx, cancel := context.WithCancel(n.loopCtx)
	mb.unwatch = cancel
	n.mu.Lock()
	n.members[mb.name] = mb
	n.mu.Unlock()
	n.goOwned(func() { n.publish(ctx, mb) })
	n.goOwned(func() {
		defer cancel()
		select {
		case <-mb.j.Lost():
			n.mu.Lock()
			if n.members[mb.name] == mb {
				delete(n.members, mb.name)
				n.dead = append(n.dead, mb)
			}
			n.mu.Unlock()
			n.o.Logger.Warn("pgledger: the lease of a member was lost; this process no longer acts for it", "member", mb.name,
				"err", mb.j.failedErr())
			if mb.name == n.o.Member {
				n.goOwned(func() { n.reopen(n.loopCtx) })
			}
		case <-ctx.Done():
		}
	})
}

// reopen opens this process's own member again after its lease was lost
// — the database did not answer for a whole lease, or another process
// took the member over — as a new life of it (a new fence; its Manager
// replays the member and reconciles its runs, as after a restart). It
// tries every downBeat until it succeeds or the node closes; meanwhile
// Node.Launch launches on another member this node owns, or refuses with
// ErrUnavailable. A member another process holds is asked for again until
// that process releases it (it does once nothing of it is live).
func (n *Node) reopen(ctx context.Context) {
	var wait time.Duration
	for held := false; ctx.Err() == nil; {
		mb, err := n.open(ctx, n.o.Member)
		if err == nil {
			n.mu.Lock()
			if n.closed {
				n.dead = append(n.dead, mb) // Close shuts it down with the others
				n.mu.Unlock()
				return
			}
			n.mu.Unlock()
			n.adopt(mb)
			n.o.Logger.Info("pgledger: this process's member was opened again", "member", n.o.Member, "fence", mb.j.Fence())
			n.drain(ctx, mb)
			if n.o.took != nil {
				n.o.took(n.o.Member)
			}
			return
		}
		var lh *LeaseHeldError
		switch {
		case errors.As(err, &lh):
			if !held {
				n.o.Logger.Warn("pgledger: this process's member is held by another process; asking again until it is released",
					"member", n.o.Member, "holder", lh.Holder)
			}
			held, wait = true, n.o.Poll
		case errors.Is(err, ErrUnavailable):
			wait = downBeat // the database is not back yet
		default:
			// The member opened but its Manager did not (a replay or a
			// recovery that failed): each try costs a replay, so the tries
			// back off to a minute, and each is logged.
			wait = min(max(2*wait, n.o.Poll), time.Minute)
			n.o.Logger.Warn("pgledger: opening this process's member again failed; trying again", "member", n.o.Member, "in", wait, "err", err)
		}
		sleepCtx(ctx, wait)
	}
}

// launcher is the member a launch goes to: this process's own, or, while
// that one cannot write (its lease was lost and it is being opened
// again), another member this node owns that can. With none, the error
// wraps ErrUnavailable: the launch is refused at once, and may be made
// again.
func (n *Node) launcher() (*member, error) {
	n.mu.Lock()
	own := n.members[n.o.Member]
	n.mu.Unlock()
	var why error
	if own != nil {
		if why = own.j.Available(); why == nil {
			return own, nil
		}
		if errors.Is(why, ErrUnavailable) {
			return nil, why // the database is away: every member waits on it
		}
	} else {
		why = fmt.Errorf("member %s lost its lease and is being opened again", n.o.Member)
	}
	for _, mb := range n.owned() {
		if !mb.releasing.Load() && mb.j.Available() == nil {
			return mb, nil
		}
	}
	return nil, fmt.Errorf("%w: %w", ErrUnavailable, why)
}

// goOwned runs f on a goroutine the node joins at Close, unless it is
// closing (false).
func (n *Node) goOwned(f func()) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return false
	}
	n.done.Add(1)
	go func() {
		defer n.done.Done()
		f()
	}()
	return true
}

// open takes member name's lease and opens a Manager on it (which
// replays it and reconciles its live runs).
func (n *Node) open(ctx context.Context, name string) (*member, error) {
	j, err := Open(ctx, n.pool, Options{Ledger: n.o.Ledger, Member: name, Lease: n.o.Lease, Heartbeat: n.o.Heartbeat, Holder: n.o.Holder,
		Rounds: n.o.Notifier != nil, beat: n.o.beat, away: n.o.away, now: n.o.now, wrote: n.noteWritten})
	if err != nil {
		return nil, err
	}
	opts := append(slices.Clip(n.o.Options), bgtask.WithJournal(j), bgtask.WithStartGate(n.gateStart))
	if n.o.Notifier != nil {
		opts = append(opts, bgtask.WithNotifier(outboxNotifier{}))
	}
	m, err := bgtask.Open(ctx, n.o.Host, opts...)
	if err != nil {
		_ = j.Close()
		return nil, err
	}
	return &member{name: name, j: j, m: m}, nil
}

// Manager returns the Manager of this process's own member (once its
// lease was lost, the stopped one: its calls return bgtask.ErrJournal).
func (n *Node) Manager() *bgtask.Manager {
	n.mu.Lock()
	defer n.mu.Unlock()
	if mb := n.members[n.o.Member]; mb != nil {
		return mb.m
	}
	for i := len(n.dead) - 1; i >= 0; i-- {
		if n.dead[i].name == n.o.Member {
			return n.dead[i].m
		}
	}
	return nil // not reached: the own member is in one or the other
}

// owned returns the members this node owns now, its own first and the
// rest by name.
func (n *Node) owned() []*member {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.ownedLocked()
}

// live returns member name if this node owns it now (its lease not found
// lost), else nil.
func (n *Node) live(name string) *member {
	n.mu.Lock()
	mb := n.members[name]
	n.mu.Unlock()
	if mb == nil {
		return nil
	}
	select {
	case <-mb.j.Lost():
		return nil
	default:
		return mb
	}
}

// ownedLocked is owned with n.mu held. A member whose lease was found
// lost is not owned, from that instant (the watcher of adopt moves it to
// n.dead a moment later).
func (n *Node) ownedLocked() []*member {
	out := make([]*member, 0, len(n.members))
	for _, mb := range n.members {
		select {
		case <-mb.j.Lost():
			continue
		default:
		}
		out = append(out, mb)
	}
	slices.SortFunc(out, func(a, b *member) int {
		switch {
		case a.name == n.o.Member:
			return -1
		case b.name == n.o.Member:
			return 1
		}
		return strings.Compare(a.name, b.name)
	})
	return out
}

// Members names the members this node owns now, its own first.
func (n *Node) Members() []string {
	var out []string
	for _, mb := range n.owned() {
		out = append(out, mb.name)
	}
	return out
}

// Managers returns the Managers of the members this node owns, its own
// first.
func (n *Node) Managers() []*bgtask.Manager {
	var out []*bgtask.Manager
	for _, mb := range n.owned() {
		out = append(out, mb.m)
	}
	return out
}

// Task finds task id in whichever Manager of this node has it. If none
// has it, the error wraps bgtask.ErrForgotten when one of them forgot it
// under its retention rule, else bgtask.ErrUnknownTask.
func (n *Node) Task(id string) (bgtask.Task, error) {
	err := fmt.Errorf("%w: %q", bgtask.ErrUnknownTask, id)
	for _, m := range n.Managers() {
		t, e := m.Task(id)
		if e == nil {
			return t, nil
		}
		if errors.Is(e, bgtask.ErrForgotten) {
			err = e
		}
	}
	return bgtask.Task{}, err
}

// Launch launches spec on this process's own member. A Spec.Key is
// claimed in the database first: if a live task of any member holds it,
// Launch returns *bgtask.KeyHeldError naming that task, and nothing is
// launched.
func (n *Node) Launch(ctx context.Context, spec bgtask.Spec) (task bgtask.Task, err error) {
	if ctx == nil {
		ctx = context.Background()
	}
	mb, err := n.launcher()
	if err != nil {
		return bgtask.Task{}, err
	}
	m := mb.m
	if spec.Key == "" && spec.ParentSessionID == "" && spec.Budget == nil {
		return m.Launch(ctx, spec)
	}
	if spec.ID == "" {
		spec.ID = uuid.NewString()
	}
	// The budget first: a launch into a spent budget's branch is refused
	// by the budget, also while the closure that stops the branch runs. A
	// launch that brings a budget of its own is admitted to its budgets
	// here; one from a session of a budget's tree is told so by the fence
	// check (errBudgetFirst), which checks nothing else for it then; any
	// other has no budget to be admitted to.
	checked := spec.Budget != nil
	if checked {
		grant, err := n.admitBudget(ctx, spec.ID, spec.ParentSessionID, spec.Budget)
		if err != nil {
			return bgtask.Task{}, err
		}
		spec.Budget = grant
	}
	if spec.ParentSessionID != "" {
		n.launchBegins(spec.ID)
		defer func() { n.launchEnds(spec.ID, err != nil) }()
		err := n.admit(ctx, mb.name, spec.ID, spec.ParentSessionID, checked)
		if errors.Is(err, errBudgetFirst) {
			checked = true
			if spec.Budget, err = n.admitBudget(ctx, spec.ID, spec.ParentSessionID, nil); err != nil {
				return bgtask.Task{}, err
			}
			err = n.admit(ctx, mb.name, spec.ID, spec.ParentSessionID, true)
		}
		if err != nil {
			if checked {
				n.cleanUp(ctx, "launch", func(c context.Context) error { return n.undoBudget(c, spec.ID) })
			}
			return bgtask.Task{}, err
		}
	}
	admitted := spec.ParentSessionID != ""
	if spec.Key != "" {
		holder, err := n.claimKey(ctx, mb.name, spec.Key, spec.ID)
		if err == nil && holder != spec.ID {
			err = &bgtask.KeyHeldError{Key: spec.Key, TaskID: holder}
		}
		if err != nil {
			n.cleanUp(ctx, "launch", func(c context.Context) error {
				return errors.Join(n.undoBudget(c, spec.ID), n.admittedIf(c, admitted, spec.ID))
			})
			return bgtask.Task{}, err
		}
	}
	t, err := m.Launch(ctx, spec)
	if err != nil {
		var held *bgtask.KeyHeldError
		release := spec.Key != "" && (!errors.As(err, &held) || held.TaskID != spec.ID)
		n.cleanUp(ctx, "launch", func(c context.Context) error {
			var key error
			if release {
				key = n.releaseKey(c, spec.Key, spec.ID)
			}
			// The budget's admission stays if the task landed (an error past
			// its commit: bgtask_budget_undo looks). Its launch in flight goes
			// either way: a landed task's row is gone already, and a commit
			// whose outcome is unknown that lands later meets the start gate.
			return errors.Join(n.undoBudget(c, spec.ID), key, n.admittedIf(c, admitted, spec.ID))
		})
	}
	return t, err
}

// cleanUp runs f, which undoes in the database what a failed call of the
// caller's did: once within the caller's context while it lasts (10 s at
// most), and, if that did not do it, on a goroutine of the node's, tried
// until the database answers (cleanUpFor at most, and no longer than the
// node lives), so that the call still returns by its deadline and a
// stalled database leaves nothing behind once it answers again. f's steps
// are each idempotent; f returns the first that failed. What f undoes
// would also expire on its own, later (a key claim after keyClaimGrace, a
// launch in flight at retention's prune).
func (n *Node) cleanUp(ctx context.Context, what string, f func(context.Context) error) {
	if ctx.Err() == nil {
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := f(c)
		cancel()
		if err == nil || !retryable(err) {
			n.cleanedUp(what, err)
			return
		}
	}
	n.goOwned(func() {
		giveUp := time.Now().Add(cleanUpFor)
		err := untilAnswered(n.loopCtx, func() bool { return time.Now().After(giveUp) }, func() error {
			c, cancel := context.WithTimeout(n.loopCtx, 10*time.Second)
			defer cancel()
			err := f(c)
			if err != nil && n.loopCtx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("%w: %w", ErrUnavailable, err) // its own 10 s ran out: the database is away
			}
			return err
		})
		n.cleanedUp(what, err)
	})
}

// cleanUpFor bounds how long a failed call's undoing is tried for.
const cleanUpFor = 2 * time.Minute

// retryable reports whether a clean-up step that failed with err may go
// through if tried again.
func retryable(err error) bool {
	return transient(err) || errors.Is(err, context.DeadlineExceeded)
}

// cleanedUp logs a clean-up that did not go through.
func (n *Node) cleanedUp(what string, err error) {
	if err != nil {
		n.o.Logger.Warn("pgledger: undoing what a failed "+what+" did in the database", "err", err)
	}
}

// keyClaimGrace is how long a claimed key whose task was never launched
// (its process died in between) stays claimed.
const keyClaimGrace = time.Minute

// claimKeySQL claims key $2 of ledger $1 for task $4 of member $3 unless a
// task that is live (or a claim younger than $5 whose task is not
// launched yet) holds it, and returns the task that holds it.
const claimKeySQL = `
INSERT INTO bgtask_keys AS k (ledger, key, member, task_id) VALUES ($1, $2, $3, $4)
ON CONFLICT (ledger, key) DO UPDATE
   SET member = EXCLUDED.member, task_id = EXCLUDED.task_id, claimed_at = now()
 WHERE EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = k.ledger AND t.task_id = k.task_id AND t.ended)
    OR (NOT EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = k.ledger AND t.task_id = k.task_id)
        AND k.claimed_at < now() - $5::interval)
RETURNING task_id`

// claimKey claims key for task id and returns the task that holds it:
// id if the claim was won.
func (n *Node) claimKey(ctx context.Context, member, key, id string) (string, error) {
	var holder string
	err := n.pool.QueryRow(ctx, claimKeySQL, n.o.Ledger, key, member, id, keyClaimGrace).Scan(&holder)
	if errors.Is(err, pgx.ErrNoRows) {
		err = n.pool.QueryRow(ctx, `SELECT task_id FROM bgtask_keys WHERE ledger = $1 AND key = $2`, n.o.Ledger, key).Scan(&holder)
	}
	if err != nil {
		return "", dbErr(fmt.Sprintf("claiming key %q", key), err)
	}
	return holder, nil
}

// releaseKey gives up a claim whose launch failed.
func (n *Node) releaseKey(ctx context.Context, key, id string) error {
	if _, err := n.pool.Exec(ctx, `DELETE FROM bgtask_keys WHERE ledger = $1 AND key = $2 AND task_id = $3`, n.o.Ledger, key, id); err != nil {
		return fmt.Errorf("releasing the claim of key %q: %w", key, err)
	}
	return nil
}

// Observe applies ev in this node if one of its Managers owns the
// attempt or session, and otherwise routes it to the owner (see Node).
// It returns bgtask.ErrStaleEvent for an attempt that is not its task's
// current one in the database, and bgtask.ErrUnknownSession when no
// member of the ledger knows the session or attempt. An event for a
// session no member has bound yet waits, within ctx, while a start is in
// flight in the ledger, and is applied where that start binds it (no
// process keeps it in memory for a start that may not be its own). An
// event routed to another process carries its error as text: the owner
// classifies that text (DefaultRetryable reads status codes and
// phrases), not the value.
//
// ctx bounds the database's part (finding the owner, writing to its
// inbox): a database that does not answer makes Observe return ctx's
// error once ctx ends, and an event it could not route is not applied
// anywhere (the caller may send it again). A nil ctx is
// context.Background(), bounded by routeFor.
func (n *Node) Observe(ctx context.Context, ev bgtask.Event) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if ev.SessionID == "" && ev.AttemptID == "" {
		return fmt.Errorf("%w: no SessionID or AttemptID", bgtask.ErrInvalidArgument)
	}
	ctx, cancel := context.WithTimeout(ctx, routeFor)
	defer cancel()
	if ev.AttemptID != "" {
		// An attempt is known exactly where it lives: try here first.
		if err := n.observeHere(ctx, ev); !errors.Is(err, bgtask.ErrUnknownSession) {
			return err
		}
	}
	owner, current, err := n.owner(ctx, ev)
	switch {
	case err != nil:
		return err
	case owner == "" && ev.AttemptID != "":
		return fmt.Errorf("%w: no member of ledger %s knows attempt %s", bgtask.ErrUnknownSession, n.o.Ledger, ev.AttemptID)
	case owner == "":
		// No member has bound the session yet. A Manager here would hold
		// the event for a start of its own in flight, and drop it once
		// those starts returned: a session another process is binding
		// would lose it, after Observe said nil. So it waits here for
		// the binding, where the caller can see it fail.
		if owner, current, err = n.awaitBinding(ctx, ev); err != nil {
			return err
		}
	}
	if !current && ev.Usage.IsZero() {
		if ev.AttemptID == "" {
			return fmt.Errorf("%w: session %s is not its task's current run", bgtask.ErrStaleEvent, ev.SessionID)
		}
		return fmt.Errorf("%w: attempt %s is not its task's current one", bgtask.ErrStaleEvent, ev.AttemptID)
	}
	// A stale event that carries usage goes to its owner all the same: the
	// usage counts for the attempt that did the work.
	if mb := n.live(owner); mb != nil {
		return n.within(ctx, func() error { return mb.m.Observe(ev) })
	}
	return n.route(ctx, owner, ev)
}

// within runs observe, a Manager's Observe (which waits for the event's
// records to be durable: a lease at most while the database is away),
// and returns what it returns, or ctx's error once ctx ends first: the
// event may still be applied then. The call goes on by itself, and Close
// joins it.
func (n *Node) within(ctx context.Context, observe func() error) error {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return fmt.Errorf("%w: the node is closed", bgtask.ErrShutdown)
	}
	n.observe.Add(1)
	n.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		defer n.observe.Done()
		done <- observe()
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("pgledger: the event's records were not durable in time (it may still be applied): %w", ctx.Err())
	}
}

// routeFor bounds Observe's database part whatever its context: under
// the lease (a stalled database leaves a caller waiting no longer than
// a member takes to lapse).
const routeFor = 10 * time.Second

// observeHere offers ev to this node's Managers, within ctx.
func (n *Node) observeHere(ctx context.Context, ev bgtask.Event) error {
	return n.within(ctx, func() error {
		err := bgtask.ErrUnknownSession
		for _, m := range n.Managers() {
			if err = m.Observe(ev); !errors.Is(err, bgtask.ErrUnknownSession) {
				return err
			}
		}
		return err
	})
}

// owner finds the member that owns ev's attempt (or session) in the
// database, and whether the attempt (and token) is its task's current one.
func (n *Node) owner(ctx context.Context, ev bgtask.Event) (owner string, current bool, err error) {
	if ev.AttemptID != "" {
		err = n.pool.QueryRow(ctx, `
SELECT t.member, t.attempt_id = $2 AND ($3 = '' OR t.token = $3) AND NOT t.ended
  FROM bgtask_tasks t
 WHERE t.ledger = $1 AND (t.attempt_id = $2
       OR t.task_id = (SELECT s.task_id FROM bgtask_sessions s WHERE s.ledger = $1 AND s.attempt_id = $2 LIMIT 1))
 LIMIT 1`, n.o.Ledger, ev.AttemptID, ev.Token).Scan(&owner, &current)
	} else {
		err = n.pool.QueryRow(ctx, `
SELECT s.member, s.attempt_id = t.attempt_id AND ($3 = '' OR t.token = $3) AND NOT t.ended
  FROM bgtask_sessions s JOIN bgtask_tasks t ON t.ledger = s.ledger AND t.task_id = s.task_id
 WHERE s.ledger = $1 AND s.session_id = $2`, n.o.Ledger, ev.SessionID, ev.Token).Scan(&owner, &current)
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, nil
	}
	if err != nil {
		return "", false, dbErr("routing an event", err)
	}
	return owner, current, nil
}

// awaitBinding waits until a member binds ev's session, while a start is
// in flight in the ledger (a live task whose current attempt has no
// session bound: the start may be binding this one), and returns its
// owner as owner does. Once no start is in flight, or ctx ends, with the
// session still unbound, it is ErrUnknownSession: the caller may send it
// again.
func (n *Node) awaitBinding(ctx context.Context, ev bgtask.Event) (owner string, current bool, err error) {
	for wait := time.Duration(0); ; {
		var starting bool
		if err := n.pool.QueryRow(ctx, startingSQL, n.o.Ledger).Scan(&starting); err != nil {
			return "", false, dbErr("routing an event", err)
		}
		// Looked up after the check: a start that bound it in between
		// is seen.
		if owner, current, err = n.owner(ctx, ev); err != nil || owner != "" {
			return owner, current, err
		}
		if !starting {
			return "", false, fmt.Errorf("%w: no member of ledger %s has bound session %s", bgtask.ErrUnknownSession, n.o.Ledger, ev.SessionID)
		}
		if wait = min(retryWait(wait), 100*time.Millisecond); !sleepCtx(ctx, wait) {
			return "", false, fmt.Errorf("%w: no member of ledger %s bound session %s in time (starts were in flight): %w",
				bgtask.ErrUnknownSession, n.o.Ledger, ev.SessionID, ctx.Err())
		}
	}
}

// startingSQL says whether a start may be in flight in ledger $1: a live
// task whose current attempt has no session bound (a start requested, or
// about to be; queued and retrying tasks count too). It reads the live
// tasks until it finds one, all of them when none is: Observe asks it only
// for an event whose session no member has bound.
const startingSQL = `
SELECT EXISTS (SELECT 1 FROM bgtask_tasks t
                WHERE t.ledger = $1 AND NOT t.ended AND t.attempt_id <> ''
                  AND NOT EXISTS (SELECT 1 FROM bgtask_sessions s WHERE s.ledger = $1 AND s.attempt_id = t.attempt_id))`

// wireEvent is an Event as the inbox keeps it (its error as text; Value
// is process-local and not carried).
type wireEvent struct {
	SessionID   string           `json:"sessionID,omitempty"`
	AttemptID   string           `json:"attemptID,omitempty"`
	Token       string           `json:"token,omitempty"`
	Kind        bgtask.EventKind `json:"kind"`
	Text        string           `json:"text,omitempty"`
	NoFinalText bool             `json:"noFinalText,omitempty"`
	Reason      bgtask.Reason    `json:"finish,omitempty"` // the wire keeps the old name: Event.Finish
	Err         *string          `json:"err,omitempty"`
	At          time.Time        `json:"at"`
	Invocation  int              `json:"invocation,omitempty"`
	Progress    string           `json:"progress,omitempty"`
	Usage       bgtask.Usage     `json:"usage,omitzero"`
	// Ask, when set, is no event: an action asked of the member's owner
	// (ask.go); Answer is the answer to one this member's node asked.
	Ask    *wireAsk    `json:"ask,omitempty"`
	Answer *wireAnswer `json:"answer,omitempty"`
}

func toWire(ev bgtask.Event) (w wireEvent, err error) {
	w = wireEvent{SessionID: ev.SessionID, AttemptID: ev.AttemptID, Token: ev.Token, Kind: ev.Kind, Text: ev.Text,
		NoFinalText: ev.NoFinalText, Reason: ev.Reason, At: ev.At, Invocation: ev.Invocation, Progress: ev.Progress, Usage: ev.Usage}
	if w.At.IsZero() {
		w.At = time.Now()
	}
	if ev.Err != nil {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("pgledger: the event's error panicked in Error(): %v", r)
			}
		}()
		text := ev.Err.Error()
		w.Err = &text
	}
	return w, nil
}

func (w wireEvent) event() bgtask.Event {
	ev := bgtask.Event{SessionID: w.SessionID, AttemptID: w.AttemptID, Token: w.Token, Kind: w.Kind, Text: w.Text,
		NoFinalText: w.NoFinalText, Reason: w.Reason, At: w.At, Invocation: w.Invocation, Progress: w.Progress, Usage: w.Usage}
	if w.Err != nil {
		ev.Err = errors.New(*w.Err)
	}
	return ev
}

// inboxChannel is the channel NOTIFY wakes an inbox's owner on; the
// payload is "ledger\x1fmember".
const inboxChannel = "bgtask_inbox"

// route puts ev in owner's inbox and wakes it, in one transaction.
func (n *Node) route(ctx context.Context, owner string, ev bgtask.Event) error {
	w, err := toWire(ev)
	if err != nil {
		return err
	}
	if err := n.send(ctx, owner, w); err != nil {
		return fmt.Errorf("routing an event: %w", err)
	}
	return nil
}

// run is the node's loop: it listens for events routed here, and every
// Poll drains the inbox of each member it owns and looks for members to
// take over, until ctx ends.
func (n *Node) run(ctx context.Context) {
	defer n.done.Done()
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			_ = conn.Close(context.Background())
		}
	}()
	next := time.Now()
	n.startRetention(ctx)
	n.goOwned(func() { n.keepStatistics(ctx) })
	for ctx.Err() == nil {
		if conn == nil {
			conn = n.listen(ctx)
		}
		if !time.Now().Before(next) {
			n.drainAll(ctx)
			if !n.o.keepOut {
				n.takeOverAside(ctx)
			}
			n.serveAll(ctx)
			n.closeSpent(ctx)
			n.sweepLaunching(ctx)
			next = time.Now().Add(n.o.Poll)
			if n.o.pass != nil {
				n.o.pass()
			}
		}
		wait, cancel := context.WithDeadline(ctx, next)
		if conn == nil {
			<-wait.Done()
			cancel()
			continue
		}
		note, err := conn.WaitForNotification(wait)
		cancel()
		switch {
		case err == nil && note.Channel == closureChannel:
			n.serveFor(ctx, note.Payload)
		case err == nil && n.isBudgetChannel(note.Channel, note.Payload):
			n.closeSpent(ctx)
		case err == nil && note.Channel == changeChannel:
			if note.Payload == n.o.Ledger {
				n.tellChanged()
			}
		case err == nil && note.Channel == outboxChannel:
			if note.Payload == n.o.Ledger {
				n.wakeDeliverer()
			}
		case err == nil:
			n.drainFor(ctx, note.Payload)
		case ctx.Err() != nil:
		case errors.Is(err, context.DeadlineExceeded):
		default:
			n.o.Logger.Warn("pgledger: the listen connection failed; polling until it is back", "err", err)
			_ = conn.Close(context.Background())
			conn = nil
		}
	}
}

// listen opens a connection of its own (not the pool's: it is held for
// as long as the node runs) and listens on the inbox channel, or returns
// nil (the loop polls, and tries again).
func (n *Node) listen(ctx context.Context) *pgx.Conn {
	conn, err := pgx.ConnectConfig(ctx, n.pool.Config().ConnConfig)
	if err != nil {
		return nil
	}
	if _, err := conn.Exec(ctx, "LISTEN "+inboxChannel+"; LISTEN "+closureChannel+"; LISTEN "+outboxChannel+"; LISTEN "+changeChannel+"; LISTEN "+budgetChannel); err != nil {
		_ = conn.Close(context.Background())
		return nil
	}
	return conn
}

// drainFor drains the inbox a notification names, if it is one of this
// node's.
func (n *Node) drainFor(ctx context.Context, payload string) {
	ledger, name, _ := strings.Cut(payload, "\x1f")
	if mb := n.live(name); ledger == n.o.Ledger && mb != nil {
		n.drain(ctx, mb)
	}
}

func (n *Node) drainAll(ctx context.Context) {
	for _, mb := range n.owned() {
		n.drain(ctx, mb)
	}
}

// drain applies the events in mb's inbox, in the order they were routed,
// and deletes them once applied (Observe returns once durable): a crash
// in between applies them again, and a repeat is refused as stale. Only
// the node that owns mb drains it, one drain at a time (the loop's, or a
// takeover's); no transaction is held across the Manager's own writes.
func (n *Node) drain(ctx context.Context, mb *member) {
	mb.drainMu.Lock()
	defer mb.drainMu.Unlock()
	for ctx.Err() == nil {
		rows, err := n.pool.Query(ctx, `SELECT id, event FROM bgtask_inbox WHERE ledger = $1 AND member = $2
 ORDER BY id LIMIT 100`, n.o.Ledger, mb.name)
		if err != nil {
			return
		}
		var ids []int64
		var evs []wireEvent
		for rows.Next() {
			var id int64
			var w wireEvent
			if err := rows.Scan(&id, &w); err != nil {
				break
			}
			ids, evs = append(ids, id), append(evs, w)
		}
		rows.Close()
		if rows.Err() != nil || len(ids) == 0 {
			return
		}
		applied := ids[:0]
		for i, w := range evs {
			switch {
			case w.Ask != nil:
				// Taken out first: an ask is acted on at most once, even
				// if this node dies before it answers (the asker's wait
				// then ends with its context, saying so).
				if tag, err := n.pool.Exec(ctx, `DELETE FROM bgtask_inbox WHERE id = $1`, ids[i]); err == nil && tag.RowsAffected() == 1 {
					n.answerAsk(mb, *w.Ask)
				}
				continue
			case w.Answer != nil:
				n.answered(*w.Answer)
				applied = append(applied, ids[i])
				continue
			}
			if err := mb.m.Observe(w.event()); errors.Is(err, bgtask.ErrJournal) {
				break // not durable: left for whoever owns the member next
			}
			applied = append(applied, ids[i])
		}
		if _, err := n.pool.Exec(ctx, `DELETE FROM bgtask_inbox WHERE id = ANY($1)`, applied); err != nil {
			n.o.Logger.Warn("pgledger: removing applied events", "member", mb.name, "err", err)
			return
		}
		if n.o.drained != nil && len(applied) > 0 {
			n.o.drained(mb.name)
		}
		if len(applied) < len(ids) || len(ids) < 100 {
			return
		}
	}
}

// takeOverAside runs takeOver on a goroutine of the node's, unless one is
// still running: a takeover's recovery asks the Host about every live
// run, and a Host that hangs must not hold up the loop (events routed
// here, closures to serve).
func (n *Node) takeOverAside(ctx context.Context) {
	if !n.taking.CompareAndSwap(false, true) {
		return
	}
	if !n.goOwned(func() {
		defer n.taking.Store(false)
		n.takeOver(ctx)
	}) {
		n.taking.Store(false)
	}
}

// takeOver opens one member whose lease expired while it still has live
// tasks, if another process has not taken it first.
func (n *Node) takeOver(ctx context.Context) {
	n.mu.Lock()
	closed := n.closed
	n.mu.Unlock()
	if closed {
		return
	}
	n.releaseIdle(ctx)
	own := n.Members()
	rows, err := n.pool.Query(ctx, `
SELECT m.member FROM bgtask_members m
 WHERE m.ledger = $1 AND m.expires_at <= now() AND NOT m.idle AND m.member <> ALL($2)
   AND (EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = m.ledger AND t.member = m.member AND NOT t.ended)
        OR EXISTS (SELECT 1 FROM bgtask_inbox i WHERE i.ledger = m.ledger AND i.member = m.member))
 ORDER BY m.expires_at`, n.o.Ledger, own)
	if err != nil {
		return
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	for _, name := range names {
		mb, err := n.open(ctx, name)
		var held *LeaseHeldError
		if errors.As(err, &held) {
			continue // another process was first
		}
		if err != nil {
			n.o.Logger.Warn("pgledger: taking over a member", "member", name, "err", err)
			continue
		}
		n.mu.Lock()
		if n.closed {
			// Close shuts it down with the others, bounded by its context
			// (it reads n.dead once this loop has returned).
			n.dead = append(n.dead, mb)
			n.mu.Unlock()
			return
		}
		n.mu.Unlock()
		n.adopt(mb)
		n.o.Logger.Info("pgledger: took over a member whose lease expired", "member", name)
		n.drain(ctx, mb)
		if n.o.took != nil {
			n.o.took(name)
		}
	}
}

// releaseIdle gives back each member this node took over once nothing of
// it is live — no live task, no event routed to it — so that it costs no
// one anything more, and its own process (restarted, or opening it again
// after an outage) can have it back. Its Manager is shut down and its
// journal closed, which marks it idle.
func (n *Node) releaseIdle(ctx context.Context) {
	for _, mb := range n.owned() {
		if mb.name == n.o.Member {
			continue
		}
		n.mu.Lock()
		if n.closed {
			n.mu.Unlock()
			return
		}
		if n.members[mb.name] != mb { // its lease was lost: among the dead, not ours to release
			n.mu.Unlock()
			continue
		}
		// Launches no longer go to it; it stays among the members (Task,
		// Managers, events and closures find it) until it is found idle.
		mb.releasing.Store(true)
		n.mu.Unlock()
		var idle bool
		err := n.pool.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM bgtask_tasks WHERE ledger = $1 AND member = $2 AND NOT ended)
   AND NOT EXISTS (SELECT 1 FROM bgtask_inbox WHERE ledger = $1 AND member = $2)`, n.o.Ledger, mb.name).Scan(&idle)
		if err != nil || !idle {
			mb.releasing.Store(false)
			continue
		}
		n.mu.Lock()
		if n.closed { // Close shuts it down (it waits for this pass first)
			n.mu.Unlock()
			return
		}
		if n.members[mb.name] != mb { // its lease was lost meanwhile: among the dead; the others may still be idle
			n.mu.Unlock()
			continue
		}
		delete(n.members, mb.name)
		n.mu.Unlock()
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		mb.j.closeWithin(c)
		mb.unwatch()
		err = mb.m.Shutdown(c)
		_ = mb.j.Close()
		cancel()
		n.o.Logger.Info("pgledger: released a member taken over once nothing of it was live", "member", mb.name, "err", err)
	}
}

// Close stops the node's loop and goroutines, and shuts down each of its
// Managers (which closes their journals and releases their leases). ctx
// bounds the wait for a Notifier call in flight (one that ignores its
// context is left behind, with an error) and each Manager's Shutdown, as
// bgtask's does.
func (n *Node) Close(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil
	}
	n.closed = true
	n.mu.Unlock()
	n.cancel()
	n.done.Wait() // everything cancel ends
	var errs []error
	joined := make(chan struct{})
	go func() { n.stray.Wait(); close(joined) }() // ends with the last Notifier call
	select {
	case <-joined:
	case <-ctx.Done():
		// A Notifier (user code) that ignores its context is the one
		// thing of the node's that cancel cannot end.
		errs = append(errs, fmt.Errorf("pgledger: a Notifier call that ignores its context did not return: %w", ctx.Err()))
	}
	n.mu.Lock()
	all := slices.Clone(n.dead)
	for _, mb := range n.members {
		all = append(all, mb)
	}
	n.mu.Unlock()
	// The members shut down side by side, each journal's last writes and
	// lease release bounded by ctx (and closeGrace after it).
	shut := make([]error, len(all))
	var wg sync.WaitGroup
	for i, mb := range all {
		mb.j.closeWithin(ctx)
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := mb.m.Shutdown(ctx); err != nil {
				shut[i] = fmt.Errorf("member %s: %w", mb.name, err)
			}
			_ = mb.j.Close()
		}()
	}
	wg.Wait()
	n.observe.Wait() // its Managers shut down: each Observe they held has returned
	n.admits.close()
	n.gates.close()
	n.budgets.close()
	return errors.Join(append(errs, shut...)...)
}

// guardedHandler is the node's logger's handler, which is user code: a
// panic in it is swallowed (the line is lost), never passed on to a node
// goroutine or to a caller, as the Manager does with its own logger.
type guardedHandler struct{ h slog.Handler }

func (g guardedHandler) Enabled(ctx context.Context, l slog.Level) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	return g.h.Enabled(ctx, l)
}

func (g guardedHandler) Handle(ctx context.Context, r slog.Record) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("pgledger: the log handler panicked: %v", p)
		}
	}()
	return g.h.Handle(ctx, r)
}

func (g guardedHandler) WithAttrs(as []slog.Attr) (out slog.Handler) {
	defer func() {
		if recover() != nil {
			out = g
		}
	}()
	return guardedHandler{h: g.h.WithAttrs(as)}
}

func (g guardedHandler) WithGroup(name string) (out slog.Handler) {
	defer func() {
		if recover() != nil {
			out = g
		}
	}()
	return guardedHandler{h: g.h.WithGroup(name)}
}
