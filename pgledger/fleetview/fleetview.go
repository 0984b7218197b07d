// Package fleetview serves a whole pgledger fleet through bgtaskhttp: the
// live page, the JSON API and the event stream show every process's
// tasks, and an action on any task reaches the process that owns it.
//
//	view, err := fleetview.Open(ctx, node)
//	…
//	defer view.Close()
//	http.Handle("/", bgtaskhttp.Handler(view, bgtaskhttp.Options{}))
//
// A View follows the ledger's change stream (Node.Subscribe) from a
// snapshot (Node.Snapshot) on a goroutine of its own, and answers reads
// from what it holds; the closures' records are read again when a change
// shows a closure or a budget stopped a task. Actions are the Node's:
// Stop (a closure reaches every process; a stop of one task is asked of
// its owner) and Extend (asked of the owner), a task whose process is
// gone failing with pgledger.ErrOwnerGone (503 owner_gone over HTTP).
// History is Node.History: the ledger's records of any task. Health is
// the node's own Manager's (shared across the fleet when the Managers
// share a health store).
//
// It lives in a package of its own so that pgledger does not import
// bgtaskhttp.
package fleetview

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/internal/feed"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/bgtask/bgtask/pgledger"
)

// View is a whole fleet as a bgtaskhttp.Source (and bgtaskhttp.Fleet).
// Its methods are safe for concurrent use.
type View struct {
	node *pgledger.Node

	mu       sync.Mutex
	tasks    []bgtask.Task  // as the latest change left each, in the order first seen
	at       map[string]int // index in tasks, by id
	epoch    uint64
	seq      uint64
	closures []bgtask.ClosureReport
	subs     *feed.Feed[bgtask.Change]
	dirty    bool          // a closure may have ended since closures was read
	ended    error         // why the View stopped following (Close, or the node closed)
	read     chan struct{} // tests: hears each read of the closures

	cancel context.CancelFunc
	done   chan struct{}
}

// retry is how long the View waits before it follows the ledger again
// after its subscription ended (it lagged, or the database was away).
const retry = time.Second

// closuresEvery bounds how often the View reads the closures' records
// again.
const closuresEvery = 2 * time.Second

// pruneEvery is how often the View lets go of the ended tasks the
// ledger no longer keeps (Node.Retention).
const pruneEvery = time.Minute

// Open takes a snapshot of node's ledger and follows its changes until
// Close (or until the node closes). ctx bounds the first snapshot.
func Open(ctx context.Context, node *pgledger.Node) (*View, error) {
	if node == nil {
		return nil, fmt.Errorf("%w: fleetview.Open of a nil Node", bgtask.ErrInvalidArgument)
	}
	if ctx == nil {
		ctx = context.Background()
	}
	v := &View{node: node, at: map[string]int{}, subs: feed.New[bgtask.Change](bgtask.ErrLagged), done: make(chan struct{})}
	// The View follows the ledger until Close, whatever becomes of ctx:
	// ctx bounds the first snapshot only.
	loop, cancel := context.WithCancel(context.Background())
	sub, err := v.sync(loop, ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	v.cancel = cancel
	go v.follow(loop, sub) // owned by the View: Close ends and joins it
	return v, nil
}

// Close stops following the ledger and ends the View's subscriptions. It
// does not close the node.
func (v *View) Close() {
	v.cancel()
	<-v.done
}

// sync subscribes to the ledger, for as long as loop lasts, and replaces
// what the View holds with a snapshot taken after, within ctx; a
// subscriber of the View is ended (lagged) if the View missed changes it
// would have had.
func (v *View) sync(loop, ctx context.Context) (*bgtask.Subscription, error) {
	sub, err := v.node.Subscribe(loop, 1<<16)
	if err != nil {
		return nil, err
	}
	snap, err := v.node.Snapshot(ctx)
	if err != nil {
		sub.Close()
		return nil, err
	}
	tasks := snap.Tasks
	// The ledger keeps a task by its latest change: launch order is what
	// a page and a cursor read in.
	slices.SortStableFunc(tasks, func(a, b bgtask.Task) int { return a.LaunchedAt.Compare(b.LaunchedAt) })
	v.mu.Lock()
	defer v.mu.Unlock()
	v.subs.EndAll(bgtask.ErrLagged)
	v.tasks, v.at = tasks, make(map[string]int, len(tasks))
	for i, t := range tasks {
		v.at[t.ID] = i
	}
	v.epoch, v.seq, v.closures, v.dirty = snap.Epoch, snap.Seq, snap.Closures, false
	return sub, nil
}

// follow applies the ledger's changes until ctx ends, following again
// from a new snapshot when its subscription ends early.
func (v *View) follow(ctx context.Context, sub *bgtask.Subscription) {
	defer close(v.done)
	tick := time.NewTicker(closuresEvery)
	defer tick.Stop()
	for {
		err := v.apply(ctx, sub, tick.C)
		sub.Close()
		for sub = nil; sub == nil && ctx.Err() == nil && !errors.Is(err, pgledger.ErrClosed); {
			select {
			case <-ctx.Done():
			case <-time.After(retry):
				sub, err = v.sync(ctx, ctx)
			}
		}
		if sub == nil {
			if ctx.Err() != nil {
				err = fmt.Errorf("%w: the fleet view was closed", bgtask.ErrShutdown)
			}
			v.mu.Lock()
			v.ended = err
			v.subs.EndAll(err)
			v.mu.Unlock()
			return
		}
	}
}

// apply applies sub's changes, and reads the closures again now and then,
// until sub or ctx ends; it returns why sub ended.
func (v *View) apply(ctx context.Context, sub *bgtask.Subscription, tick <-chan time.Time) error {
	pruned := time.Now()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case now := <-tick:
			v.readClosures(ctx)
			if now.Sub(pruned) >= pruneEvery {
				v.prune(now)
				pruned = now
			}
		case c, open := <-sub.C:
			if !open {
				if err := sub.Err(); err != nil {
					return err
				}
				return pgledger.ErrClosed // the node closed
			}
			v.change(c)
		}
	}
}

// change applies c and hands it to the View's subscribers.
func (v *View) change(c bgtask.Change) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if c.Seq <= v.seq {
		return // the snapshot has it
	}
	if i, ok := v.at[c.Task.ID]; ok {
		v.tasks[i] = c.Task
	} else {
		v.at[c.Task.ID] = len(v.tasks)
		v.tasks = append(v.tasks, c.Task)
	}
	v.seq = c.Seq
	if s := c.Task.Stop; s != nil && (s.Kind == bgtask.StopClosure || s.Kind == bgtask.StopBudget) {
		v.dirty = true
	}
	v.subs.Publish(c)
}

// prune lets go of the ended tasks the ledger keeps no longer: ended
// longer ago than its MaxAge, or older than its MaxEnded newest ended.
func (v *View) prune(now time.Time) {
	r := v.node.Retention()
	v.mu.Lock()
	defer v.mu.Unlock()
	v.tasks = retained(v.tasks, r, now)
	clear(v.at)
	for i, t := range v.tasks {
		v.at[t.ID] = i
	}
}

// retained are the tasks r keeps at now, in their order.
func retained(tasks []bgtask.Task, r bgtask.Retention, now time.Time) []bgtask.Task {
	var ended []time.Time
	for _, t := range tasks {
		if t.Status.Terminal() {
			ended = append(ended, t.CompletedAt)
		}
	}
	var edge time.Time // an ended task that ended before it goes
	if r.MaxAge > 0 {
		edge = now.Add(-r.MaxAge)
	}
	if r.MaxEnded >= 0 && len(ended) > r.MaxEnded {
		slices.SortFunc(ended, func(a, b time.Time) int { return b.Compare(a) })
		if e := ended[r.MaxEnded]; e.After(edge) {
			edge = e.Add(time.Nanosecond) // the MaxEnded newest stay
		}
	}
	if edge.IsZero() {
		return tasks
	}
	out := tasks[:0]
	for _, t := range tasks {
		if !t.Status.Terminal() || !t.CompletedAt.Before(edge) {
			out = append(out, t)
		}
	}
	clear(tasks[len(out):]) // let the dropped go
	return out
}

// readClosures reads the closures' records again if a change showed one
// may have ended.
func (v *View) readClosures(ctx context.Context) {
	v.mu.Lock()
	dirty := v.dirty
	v.dirty = false
	v.mu.Unlock()
	if !dirty {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, closuresEvery)
	defer cancel()
	c, err := v.node.Closures(ctx)
	v.mu.Lock()
	defer v.mu.Unlock()
	if err != nil {
		v.dirty = true // again at the next tick
		return
	}
	v.closures = c
	if v.read != nil {
		select {
		case v.read <- struct{}{}:
		default:
		}
	}
}

// Snapshot is every task of the fleet as the View holds it: the ledger's
// tasks as of Seq, in launch order, and its closures' records.
func (v *View) Snapshot() bgtask.Snapshot {
	v.mu.Lock()
	defer v.mu.Unlock()
	return bgtask.Snapshot{Epoch: v.epoch, Seq: v.seq, Tasks: slices.Clone(v.tasks), Closures: slices.Clone(v.closures)}
}

// Subscribe delivers every change the View applies after now, as
// Manager.Subscribe does: subscribe, then take the Snapshot to start
// from. A subscription ends with bgtask.ErrLagged when its buffer (0:
// 1024) fills, or when the View had to follow the ledger again from a
// new snapshot.
func (v *View) Subscribe(ctx context.Context, buffer int) (*bgtask.Subscription, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if buffer <= 0 {
		buffer = 1024
	}
	v.mu.Lock()
	if v.ended != nil {
		err := v.ended
		v.mu.Unlock()
		return nil, err
	}
	s := v.subs.Add(buffer)
	v.mu.Unlock()
	end := func(err error) {
		v.mu.Lock()
		v.subs.End(s, err)
		v.mu.Unlock()
	}
	stop := context.AfterFunc(ctx, func() { end(ctx.Err()) })
	return fleet.Subscription(s.C(), s.Done(), func() error {
		v.mu.Lock()
		defer v.mu.Unlock()
		return s.Err()
	}, func() {
		stop()
		end(nil)
	}).(*bgtask.Subscription), nil
}

// Task is task id as the View holds it; one it does not hold yet (its
// change is on the way) is read from the ledger (Node.Published), so
// that a task launched at any process is found at every one once its
// Launch returned. Else the error wraps bgtask.ErrUnknownTask.
func (v *View) Task(id string) (bgtask.Task, error) {
	if t, ok := v.held(id); ok {
		return t, nil
	}
	if id == "" {
		return bgtask.Task{}, fmt.Errorf("%w: %q", bgtask.ErrUnknownTask, id)
	}
	ctx, cancel := context.WithTimeout(context.Background(), readFor)
	defer cancel()
	return v.node.Published(ctx, id)
}

// readFor bounds a read of one task from the ledger.
const readFor = 10 * time.Second

// held is task id as the View holds it.
func (v *View) held(id string) (bgtask.Task, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if i, ok := v.at[id]; ok {
		return v.tasks[i], true
	}
	return bgtask.Task{}, false
}

// Launch is Node.Launch, at this process, and returns once the ledger
// has published the task and this View holds it: a Task of it at any
// process of the fleet then finds it (the MCP tasks extension's durable
// creation, bgtaskmcp.Source). If ctx ends first, the task was launched
// (and runs): the error says so and names it.
func (v *View) Launch(ctx context.Context, spec bgtask.Spec) (bgtask.Task, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	sub, err := v.Subscribe(ctx, 0)
	if err != nil {
		return bgtask.Task{}, err
	}
	defer sub.Close()
	task, err := v.node.Launch(ctx, spec)
	if err != nil {
		return task, err
	}
	for {
		if t, ok := v.held(task.ID); ok {
			return t, nil
		}
		select {
		case _, open := <-sub.C:
			if open {
				continue
			}
			if t, err := v.node.Published(ctx, task.ID); err == nil { // the subscription ended: the ledger says
				return t, nil
			}
			if ctx.Err() == nil {
				return task, fmt.Errorf("fleetview: task %s was launched, and this view stopped following the ledger before it saw it: %w", task.ID, cmpErr(sub.Err()))
			}
		case <-ctx.Done():
		}
		return task, fmt.Errorf("fleetview: task %s was launched and runs, and the ledger had not published it yet: %w", task.ID, ctx.Err())
	}
}

// cmpErr is err, or one that says there is none.
func cmpErr(err error) error {
	if err == nil {
		return errors.New("the view closed")
	}
	return err
}

// Tasks is a page of the tasks q selects, in launch order (bgtask.Query.Select).
func (v *View) Tasks(q bgtask.Query) (bgtask.Page, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return q.Select(v.tasks)
}

// History is Node.History: the ledger's records of any task of the fleet.
func (v *View) History(ctx context.Context, id string) ([]bgtask.RecordView, error) {
	return v.node.History(ctx, id)
}

// Stop is Node.Stop.
func (v *View) Stop(ctx context.Context, t bgtask.Target) (bgtask.ClosureReport, error) {
	return v.node.Stop(ctx, t)
}

// Extend is Node.Extend.
func (v *View) Extend(ctx context.Context, id, prompt string) (int, error) {
	return v.node.Extend(ctx, id, prompt)
}

// Extendable says whether task id could take a prompt now: its owner's
// Manager says so for a task of this process; another process's task
// must run, on a session, with no stop asked, and this process's host
// take prompts (Node.TakesPrompts: a fleet runs one kind of host).
func (v *View) Extendable(id string) bool {
	for _, m := range v.node.Managers() {
		if _, err := m.Task(id); err == nil {
			return m.Extendable(id)
		}
	}
	t, err := v.Task(id)
	return err == nil && t.Status == bgtask.StatusRunning && t.SessionID != "" && t.Stop == nil && v.node.TakesPrompts()
}

// Health is the node's own Manager's.
func (v *View) Health() []bgtask.Health { return v.node.Manager().Health() }

// ResetHealth is the node's own Manager's.
func (v *View) ResetHealth(ctx context.Context, key string) error {
	return v.node.Manager().ResetHealth(ctx, key)
}

// Processes are the fleet's members (Node.Processes).
func (v *View) Processes(ctx context.Context) ([]bgtaskhttp.Process, error) {
	ps, err := v.node.Processes(ctx)
	out := make([]bgtaskhttp.Process, len(ps))
	for i, p := range ps {
		out[i] = bgtaskhttp.Process(p)
	}
	return out, err
}
