package riverbench

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ledgers numbers the ledgers of this binary's runs: each run a fresh one.
var ledgers atomic.Int64

// runLedger is pgledger with nodes nodes (each a pool of its own, as
// processes would have, in this one process) and a Notifier: a lifecycle
// is a Node.Launch of a task with a parent session of its own and one
// model (lifecycle i on node i mod nodes), whose session answers at once
// (idleHost), the Manager's Wait for its end, and both its final summary
// and its parent's all_complete delivered to the Notifier: the
// measurement ends once every one was.
func runLedger(nodes int) func(ctx context.Context, s *server, p plan) (figures, error) {
	return func(ctx context.Context, s *server, p plan) (_ figures, rerr error) {
		c := &counter{}
		pools := make([]*pgxpool.Pool, nodes)
		for i := range pools {
			pool, err := s.pool(ctx, ledgerDB(), p.conns, c)
			if err != nil {
				return figures{}, err
			}
			defer pool.Close()
			pools[i] = pool
		}
		if err := pgledger.Migrate(ctx, pools[0]); err != nil {
			return figures{}, err
		}
		ledger := "riverbench-" + strconv.FormatInt(ledgers.Add(1), 10)
		box := newTally()
		ns := make([]*pgledger.Node, nodes)
		for i := range ns {
			member := "w" + strconv.Itoa(i)
			host := &idleHost{prefix: member + "-s-"}
			n, err := pgledger.Join(ctx, pools[i], pgledger.NodeOptions{Ledger: ledger, Member: member, Host: host, Notifier: box})
			if err != nil {
				return figures{}, err
			}
			host.m.Store(n.Manager())
			ns[i] = n
			defer func() {
				end, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				if err := n.Close(end); err != nil && rerr == nil {
					rerr = fmt.Errorf("closing node %s: %w", member, err)
				}
			}()
		}
		lifecycles := func(phase string) func(ctx context.Context, i int) error {
			return func(ctx context.Context, i int) error {
				n := ns[i%nodes]
				spec := bgtask.Spec{ParentSessionID: ledger + "-" + phase + "-" + strconv.Itoa(i), Models: []bgtask.Model{{Provider: "a", ID: "1"}}}
				task, err := n.Launch(ctx, spec)
				if err != nil {
					return err
				}
				end, err := n.Manager().Wait(ctx, task.ID)
				if err != nil {
					return err
				}
				if end.Status != bgtask.StatusCompleted {
					return fmt.Errorf("pgledger: task %s ended %s", task.ID, end.Status)
				}
				return nil
			}
		}
		// all runs count lifecycles of phase and waits until each one's
		// notifications were delivered; tail is how long that took after
		// the last task ended.
		var tail time.Duration
		all := func(phase string, count, before int) error {
			if _, err := drive(ctx, count, p.inflight, lifecycles(phase)); err != nil {
				return err
			}
			ended := time.Now()
			select {
			case <-box.reached(before + count):
				tail = time.Since(ended)
				return nil
			case <-ctx.Done():
				return fmt.Errorf("pgledger: not everything was delivered (%s): %w", box, ctx.Err())
			}
		}
		if err := all("warm", p.warm, 0); err != nil {
			return figures{}, fmt.Errorf("warming up: %w", err)
		}
		f, err := s.measure(ctx, p.count, c, func() error { return all("run", p.count, p.warm) })
		if err != nil {
			return figures{}, err
		}
		done, dups, other := box.counts()
		if other > 0 {
			return figures{}, fmt.Errorf("pgledger: notifications of a kind no lifecycle makes: %s", box)
		}
		f.ended, f.dups, f.tail = done-p.warm, dups, tail
		return f, nil
	}
}

// idleHost is a Host whose sessions answer at once: StartSession observes
// the attempt's SessionIdle before it returns (the Manager holds the event
// until the start has returned, as it does for any event that overtakes
// its start).
type idleHost struct {
	prefix string
	m      atomic.Pointer[bgtask.Manager] // set once Join returned, before the first launch
	n      atomic.Int64
}

func (h *idleHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	if err := h.m.Load().Observe(bgtask.Event{AttemptID: req.AttemptID, Kind: bgtask.SessionIdle, Text: "done"}); err != nil {
		return "", err
	}
	return h.prefix + strconv.FormatInt(h.n.Add(1), 10), nil
}

func (h *idleHost) AbortSession(context.Context, string) error { return nil }

// tally is the nodes' Notifier: it counts the parents whose final summary
// and all_complete were both delivered (each lifecycle has a parent of its
// own), and the notifications delivered twice (an ID seen again, or a
// second final summary or all_complete for a parent).
type tally struct {
	mu      sync.Mutex       // guards the fields below
	ids     map[string]bool  // the IDs delivered
	parents map[string]uint8 // by parent: the kinds delivered (summaryBit, roundBit)
	done    int              // parents with both
	dups    int
	want    int           // done that reach waits for
	reach   chan struct{} // closed once done >= want
	closed  bool          // reach is closed
	strange []string      // notifications of another kind (none expected)
}

const (
	summaryBit = 1 << iota
	roundBit
)

var _ bgtask.Notifier = (*tally)(nil)

func newTally() *tally {
	return &tally{ids: map[string]bool{}, parents: map[string]uint8{}, reach: make(chan struct{})}
}

func (t *tally) Notify(_ context.Context, n bgtask.Notification) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ids[n.ID] {
		t.dups++
		return nil
	}
	t.ids[n.ID] = true
	var bit uint8
	switch n.Kind {
	case bgtask.NotifyFinalSummary:
		bit = summaryBit
	case bgtask.NotifyAllComplete:
		bit = roundBit
	default:
		t.strange = append(t.strange, string(n.Kind))
		return nil
	}
	had := t.parents[n.ParentSessionID]
	if had&bit != 0 {
		t.dups++
		return nil
	}
	t.parents[n.ParentSessionID] = had | bit
	if had|bit == summaryBit|roundBit {
		t.done++
		t.check()
	}
	return nil
}

// check closes reach once done is what it waits for (under mu).
func (t *tally) check() {
	if !t.closed && t.done >= t.want {
		close(t.reach)
		t.closed = true
	}
}

// reached returns a channel closed once want lifecycles were delivered in
// all (since the tally began). One wait at a time.
func (t *tally) reached(want int) <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		t.reach, t.closed = make(chan struct{}), false
	}
	t.want = want
	t.check()
	return t.reach
}

// counts is the lifecycles delivered so far, the duplicates, and the
// notifications of another kind.
func (t *tally) counts() (done, dups, other int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.done, t.dups, len(t.strange)
}

func (t *tally) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return fmt.Sprintf("%d of %d lifecycles delivered, %d duplicates, other kinds %v", t.done, t.want, t.dups, t.strange)
}
