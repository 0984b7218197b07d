package pgledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/jackc/pgx/v5"
)

// changeChannel is the channel NOTIFY tells of new changes on; the
// payload is the ledger.
const changeChannel = "bgtask_change"

// The change stream across processes. Each member's Manager's changes
// are published by the node that owns it into bgtask_changes (its latest
// per task, replacing the older ones), under an advisory lock per ledger,
// so that ids become visible in order. Node.Subscribe reads them from any
// process, woken by NOTIFY and polling every Poll, as bgtask.Change
// values whose Epoch is the ledger's (LedgerEpoch: one for the life of the
// ledger, as the ids go on across restarts) and whose Seq is the row's id;
// Node.Snapshot is every task's latest change. A mirror.Mirror fed with
// both converges on the fleet's tasks, as it does on one Manager's.

// LedgerEpoch is the Epoch of the changes and snapshots of ledger: fixed
// for the ledger, since its change ids never start again.
func LedgerEpoch(ledger string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte("bgtask ledger " + ledger))
	return h.Sum64()
}

// publish publishes member mb's changes until ctx ends or its Manager
// shuts down: a snapshot first (what a restart or takeover holds), then
// every change; a subscription that lagged is taken again, with a new
// snapshot.
func (n *Node) publish(ctx context.Context, mb *member) {
	for ctx.Err() == nil {
		sub, err := mb.m.Subscribe(ctx, 4096)
		if err != nil {
			return // shut down
		}
		snap := mb.m.Snapshot()
		if !n.writeChanges(ctx, mb, snap.Tasks) {
			sub.Close()
			return
		}
		for open := true; open; {
			var b changeBatch
			b, open = gather(sub.C, snap.Seq)
			if len(b.tasks) > 0 && !n.writeChanges(ctx, mb, b.tasks) {
				sub.Close()
				return
			}
		}
		if !errors.Is(sub.Err(), bgtask.ErrLagged) {
			return
		}
	}
}

// gather waits for the next change after sequence after, and takes with
// it what comes in the next publishGather (each task's latest state only:
// a lifecycle makes several changes); open is false once c is closed.
func gather(c <-chan bgtask.Change, after uint64) (b changeBatch, open bool) {
	var moment <-chan time.Time // nil, so waits, until the first change
	for len(b.tasks) < 256 {
		select {
		case ch, ok := <-c:
			if !ok {
				return b, false
			}
			if ch.Seq > after {
				b.add(ch.Task)
			}
			if moment == nil {
				t := time.NewTimer(publishGather)
				defer t.Stop()
				moment = t.C
			}
		case <-moment:
			return b, true
		}
	}
	return b, true
}

// publishGather is how long the publisher gathers changes into one write
// after the first: what a subscriber waits at most, for fewer writes.
const publishGather = 2 * time.Millisecond

// changeBatch is the tasks of one write, each once, at its latest state.
type changeBatch struct {
	tasks []bgtask.Task
	at    map[string]int
}

func (b *changeBatch) add(t bgtask.Task) {
	if i, ok := b.at[t.ID]; ok {
		b.tasks[i] = t
		return
	}
	if b.at == nil {
		b.at = map[string]int{}
	}
	b.at[t.ID] = len(b.tasks)
	b.tasks = append(b.tasks, t)
}

// writeChanges writes tasks' latest states as mb's changes, keeping only
// the newest row per task, and tells the subscribers; false if ctx ended
// or mb's lease was lost.
func (n *Node) writeChanges(ctx context.Context, mb *member, tasks []bgtask.Task) bool {
	if len(tasks) == 0 {
		return true
	}
	ids := make([]string, 0, len(tasks))
	bodies := make([][]byte, 0, len(tasks))
	for i := range tasks {
		body, err := json.Marshal(tasks[i])
		if err != nil {
			n.o.Logger.Warn("pgledger: a change that would not encode", "task", tasks[i].ID, "err", err)
			continue
		}
		ids, bodies = append(ids, tasks[i].ID), append(bodies, body)
	}
	for tries := 0; ctx.Err() == nil; tries++ {
		_, err := n.pool.Exec(ctx, `SELECT bgtask_publish($1, $2, $3, $4, $5::jsonb[])`, n.o.Ledger, mb.name, mb.j.Fence(), ids, bodies)
		if err == nil {
			if tries > 0 {
				n.o.Logger.Info("pgledger: publishing changes again", "member", mb.name, "tries", tries+1)
			}
			return true
		}
		if errors.Is(classify(err), ErrLeaseLost) {
			return false // no longer this process's to publish
		}
		if tries == 0 { // once per outage, not at every try
			n.o.Logger.Warn("pgledger: publishing changes failed; trying again until the database answers", "member", mb.name, "err", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(n.o.Poll):
		}
	}
	return false
}

// Snapshot returns every task of the ledger as its latest change left it,
// and the sequence it was taken at (Change.Seq of the newest change it
// holds): feed it and Subscribe's changes to a mirror.Mirror. It holds
// the live tasks and the ended ones the ledger retains
// (NodeOptions.Retention): not those that ended longer ago than MaxAge,
// even before they are pruned. Its Closures are the records of the
// ledger's closures that have ended, in the order they were opened.
func (n *Node) Snapshot(ctx context.Context) (bgtask.Snapshot, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	snap := bgtask.Snapshot{Epoch: LedgerEpoch(n.o.Ledger)}
	err := pgx.BeginTxFunc(ctx, n.pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM bgtask_changes WHERE ledger = $1`, n.o.Ledger).Scan(&snap.Seq); err != nil {
			return err
		}
		// In id order, by the ledger's index; a task has one row (each
		// publish replaces its older ones), and if it had more the newest
		// would count.
		rows, err := tx.Query(ctx, `SELECT task_id, body FROM bgtask_changes
 WHERE ledger = $1 AND (ended_at IS NULL OR $2::interval IS NULL OR ended_at >= now() - $2::interval) ORDER BY id`,
			n.o.Ledger, retentionOf(n.o.Retention).ageArg())
		if err != nil {
			return err
		}
		at := map[string]int{}
		var id string
		var task bgtask.Task
		_, err = pgx.ForEachRow(rows, []any{&id, &task}, func() error {
			if i, ok := at[id]; ok {
				snap.Tasks[i] = task
			} else {
				at[id] = len(snap.Tasks)
				snap.Tasks = append(snap.Tasks, task)
			}
			task = bgtask.Task{}
			return nil
		})
		if err != nil {
			return err
		}
		snap.Closures, err = n.closures(ctx, tx)
		return err
	})
	if err != nil {
		return bgtask.Snapshot{}, fmt.Errorf("pgledger: snapshot: %w", err)
	}
	return snap, nil
}

// Published is task id as the ledger last published it, whichever
// process owns it: what every process's fleet view holds once the change
// reaches it, read from the database. It keeps what Snapshot keeps; a
// task it has none of wraps bgtask.ErrUnknownTask.
func (n *Node) Published(ctx context.Context, id string) (bgtask.Task, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	var task bgtask.Task
	err := n.pool.QueryRow(ctx, `SELECT body FROM bgtask_changes
 WHERE ledger = $1 AND task_id = $2 AND (ended_at IS NULL OR $3::interval IS NULL OR ended_at >= now() - $3::interval) ORDER BY id DESC LIMIT 1`,
		n.o.Ledger, id, retentionOf(n.o.Retention).ageArg()).Scan(&task)
	if errors.Is(err, pgx.ErrNoRows) {
		return bgtask.Task{}, fmt.Errorf("%w: %q", bgtask.ErrUnknownTask, id)
	}
	if err != nil {
		return bgtask.Task{}, fmt.Errorf("pgledger: task %q: %w", id, err)
	}
	return task, nil
}

// Closures are the records of the ledger's closures that have ended, in
// the order they were opened: a Snapshot's Closures, alone.
func (n *Node) Closures(ctx context.Context) ([]bgtask.ClosureReport, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	c, err := n.closures(ctx, n.pool)
	if err != nil {
		return nil, fmt.Errorf("pgledger: closures: %w", err)
	}
	return c, nil
}

func (n *Node) closures(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) ([]bgtask.ClosureReport, error) {
	rows, err := q.Query(ctx, `SELECT record FROM bgtask_closures WHERE ledger = $1 AND closed_at IS NOT NULL AND record IS NOT NULL ORDER BY id`, n.o.Ledger)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[bgtask.ClosureReport])
}

// Subscribe delivers the ledger's changes from now on, whichever process
// made them. Subscribe before taking the Snapshot you start from, as with
// bgtask.Manager.Subscribe. buffer 0 is 1024, as for Manager.Subscribe.
func (n *Node) Subscribe(ctx context.Context, buffer int) (*bgtask.Subscription, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if buffer <= 0 {
		buffer = 1024
	}
	var from int64
	if err := n.pool.QueryRow(ctx, `SELECT coalesce(max(id), 0) FROM bgtask_changes WHERE ledger = $1`, n.o.Ledger).Scan(&from); err != nil {
		return nil, fmt.Errorf("pgledger: subscribe: %w", err)
	}
	ch := make(chan bgtask.Change, buffer)
	sctx, cancel := context.WithCancel(ctx)
	var mu sync.Mutex
	var ended error
	done := make(chan struct{})
	end := func(err error) {
		mu.Lock()
		ended = err
		mu.Unlock()
		close(done)
		close(ch)
	}
	if !n.goOwned(func() {
		stop := context.AfterFunc(n.loopCtx, cancel)
		defer stop()
		end(n.follow(sctx, from, ch))
	}) {
		cancel()
		return nil, ErrClosed
	}
	return subscription(ch, done, func() error {
		mu.Lock()
		defer mu.Unlock()
		return ended
	}, cancel), nil
}

// subscription is a *bgtask.Subscription whose C is ch.
func subscription(ch <-chan bgtask.Change, done <-chan struct{}, err func() error, close func()) *bgtask.Subscription {
	return fleet.Subscription(ch, done, err, close).(*bgtask.Subscription)
}

// follow sends the changes after id from to ch until ctx ends (nil) or
// ch is full (bgtask.ErrLagged).
func (n *Node) follow(ctx context.Context, from int64, ch chan<- bgtask.Change) error {
	epoch := LedgerEpoch(n.o.Ledger)
	t := time.NewTicker(n.o.Poll)
	defer t.Stop()
	for {
		wake := n.nextChange()
		rows, err := n.pool.Query(ctx, `SELECT id, body FROM bgtask_changes WHERE ledger = $1 AND id > $2 ORDER BY id LIMIT 1000`, n.o.Ledger, from)
		if err == nil {
			var id int64
			var task bgtask.Task
			_, err = pgx.ForEachRow(rows, []any{&id, &task}, func() error {
				select {
				case ch <- bgtask.Change{Epoch: epoch, Seq: uint64(id), Task: task}:
				default:
					return bgtask.ErrLagged
				}
				from, task = id, bgtask.Task{}
				return nil
			})
			if errors.Is(err, bgtask.ErrLagged) {
				return err
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-t.C:
		}
	}
}

// nextChange is closed when NOTIFY next tells of changes: take it before
// reading them, so that none told of meanwhile is missed.
func (n *Node) nextChange() <-chan struct{} {
	n.changesMu.Lock()
	defer n.changesMu.Unlock()
	return n.changed
}

// tellChanged wakes the subscriptions of this node.
func (n *Node) tellChanged() {
	n.changesMu.Lock()
	close(n.changed)
	n.changed = make(chan struct{})
	n.changesMu.Unlock()
}
