package fleetdemo

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
)

// Faults are what a chaos run does to the fleet's database server.
type Faults struct {
	Restart func() error // as pg_ctl restart -m fast
	Halt    func() error // as pg_ctl stop -m fast
	Resume  func() error // as pg_ctl start, after Halt
	// Freeze and Thaw stall the server (SIGSTOP of its processes, then
	// SIGCONT); ReadOnly turns it read-only (SQLSTATE 25006) and back.
	// With ChaosConfig.Stalls these are the run's faults.
	Freeze   func() ([]int, error)
	Thaw     func([]int) error
	ReadOnly func(ctx context.Context, on bool) error
}

// ChaosConfig is a chaos run's.
type ChaosConfig struct {
	Config
	Faults Faults
	Wave   int           // tasks launched around each fault (0: 120)
	Within time.Duration // each launch's deadline (0: 2s)
	Down   time.Duration // how long the server stays stopped (0: 10s)
	Lock   time.Duration // how long the members table is locked (0: twice Within)
	// Stalls makes the faults four stalls of the server (Faults.Freeze for
	// Down, then Thaw) and Down of it read-only, and nothing may be
	// delivered twice: nothing crashes, so every delivery is exactly once.
	Stalls bool
}

// ChaosReport is what a chaos run saw.
type ChaosReport struct {
	Launched  int // launches that returned a task
	Refused   int // refused as retryable (pgledger.ErrUnavailable) while the database was away
	Undecided int // returned at their deadline with their durability unknown
	Lost      int // calls to a worker killed under them
	Tasks     int // tasks in the ledger at the end, every one ended
	Completed int // completed with their session's answer
	Other     int // ended otherwise (a start the kill or an outage cut short), with a reason
	// Duplicates counts final summaries and all_complete delivered again
	// with the same ID (at least once across a fault).
	Duplicates int
	Worst      time.Duration            // the longest overrun of a launch's deadline
	Back       map[string]time.Duration // per fault: from its end until every live worker launched again
	Took       time.Duration
}

// Chaos runs three workers and several hundred tasks and, mid-run, in
// turn: kills one worker (kill -9; a new worker with a new member takes its
// place), restarts the server, stops it for Down, and holds a lock on the
// members table for longer than a launch's deadline (with Stalls instead:
// stalls the server four times, SIGSTOP for Down, then makes it read-only
// for Down, and no delivery may come twice). Sessions are answered
// by the service a moment after they start, each answer sent to a random
// live worker. Then it checks, and returns the first broken promise:
// every launch kept to its deadline (a second over at most) and failed, if
// it did, as retryable; launches worked again after each fault; every task
// in the ledger ended, once, with one final summary ID delivered (again
// only with the same ID) and its session's answer if it completed; every
// parent's tasks were told in its all_complete rounds, each once; nothing
// was left in the inbox, outbox or launching tables.
func Chaos(ctx context.Context, cfg ChaosConfig) (rep ChaosReport, err error) {
	began := time.Now()
	if cfg.Wave == 0 {
		cfg.Wave = 120
	}
	if cfg.Within == 0 {
		cfg.Within = 2 * time.Second
	}
	if cfg.Down == 0 {
		cfg.Down = 10 * time.Second
	}
	if cfg.Lock == 0 {
		cfg.Lock = 2 * cfg.Within
	}
	say := func(format string, args ...any) { fmt.Fprintf(cfg.Out, format+"\n", args...) }
	svc, err := begin(ctx, cfg.Config)
	if err != nil {
		return rep, err
	}
	defer svc.close()
	c := &chaos{cfg: cfg, svc: svc, http: &http.Client{Timeout: cfg.Within + 10*time.Second}, back: map[string]time.Duration{}, told: map[string]bool{}}
	defer c.stopAll()
	for i := range 3 {
		if err := c.spawn(ctx, fmt.Sprintf("w%d", i)); err != nil {
			return rep, err
		}
	}
	answering, stopAnswering := context.WithCancel(ctx)
	var answerer sync.WaitGroup
	answerer.Add(1)
	go func() { defer answerer.Done(); c.answer(answering) }()
	defer func() { stopAnswering(); answerer.Wait() }()

	faults := []struct {
		name string
		do   func() error
	}{
		{"kill -9 of a worker", func() error { return c.killOne(ctx) }},
		{"pg_ctl restart -m fast", cfg.Faults.Restart},
		{fmt.Sprintf("server stopped for %s", cfg.Down), func() error {
			if err := cfg.Faults.Halt(); err != nil {
				return err
			}
			pause(ctx, cfg.Down)
			return cfg.Faults.Resume()
		}},
		{fmt.Sprintf("bgtask_members locked for %s", cfg.Lock), func() error { return c.lockMembers(ctx, cfg.Lock) }},
	}
	if cfg.Stalls {
		faults = faults[:0]
		for i := range 4 {
			faults = append(faults, struct {
				name string
				do   func() error
			}{fmt.Sprintf("server stalled (SIGSTOP) for %s, #%d", cfg.Down, i+1), func() error {
				stopped, err := cfg.Faults.Freeze()
				if err != nil {
					return err
				}
				pause(ctx, cfg.Down)
				return cfg.Faults.Thaw(stopped)
			}})
		}
		faults = append(faults, struct {
			name string
			do   func() error
		}{fmt.Sprintf("server read-only for %s", cfg.Down), func() error {
			if err := cfg.Faults.ReadOnly(ctx, true); err != nil {
				return err
			}
			pause(ctx, cfg.Down)
			// Writable again whatever ctx says: the server outlives the run.
			back, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			return cfg.Faults.ReadOnly(back, false)
		}})
	}
	for i, f := range faults {
		if err := c.wave(ctx, i, func() error { return f.do() }); err != nil {
			return rep, fmt.Errorf("%s: %w", f.name, err)
		}
		back, err := c.launchesAgain(ctx)
		if err != nil {
			return rep, fmt.Errorf("after %s: %w", f.name, err)
		}
		c.back[f.name] = back
		say("%s: launches worked again in every live worker %s after it", f.name, back.Round(time.Millisecond))
	}
	if err := c.settle(ctx); err != nil {
		return rep, err
	}
	rep, err = c.check(ctx)
	rep.Took = time.Since(began)
	if err == nil && cfg.Stalls && rep.Duplicates > 0 {
		err = fmt.Errorf("%d deliveries again with the same ID across stalls, where nothing crashed: exactly once is promised", rep.Duplicates)
	}
	if err == nil {
		say("%d launched, %d refused as unavailable, %d undecided at their deadline, %d lost with a killed worker; worst overrun of a deadline %s",
			rep.Launched, rep.Refused, rep.Undecided, rep.Lost, rep.Worst.Round(time.Millisecond))
		say("%d tasks ended once: %d completed with their answers, %d otherwise; %d deliveries again with the same ID; in %s",
			rep.Tasks, rep.Completed, rep.Other, rep.Duplicates, rep.Took.Round(time.Second))
	}
	return rep, err
}

// chaos is a chaos run's state.
type chaos struct {
	cfg  ChaosConfig
	svc  *service
	http *http.Client
	back map[string]time.Duration

	mu     sync.Mutex
	ws     []*proc // live workers
	dead   []*proc
	next   int // the next worker's number
	counts struct{ launched, refused, undecided, lost int }
	worst  time.Duration
	failed error           // the first launch that failed as no launch may
	told   map[string]bool // sessions whose answer a worker took (or found stale)
	// c.mu is taken with c.svc.mu held (answer, stuck), never the other
	// way round.
}

// sent reports whether a worker took session id's answer.
func (c *chaos) sent(id string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.told[id]
}

func (c *chaos) spawn(ctx context.Context, member string) error {
	w, err := spawn(ctx, c.cfg.Config, c.svc, member)
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.ws = append(c.ws, w)
	c.next++
	c.mu.Unlock()
	return nil
}

func (c *chaos) live() []*proc {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.ws)
}

func (c *chaos) stopAll() {
	for _, w := range c.live() {
		w.stop()
	}
}

// killOne kills a worker as a crash does, and starts a new one (a new
// member: the dead one's is taken over once its lease expires).
func (c *chaos) killOne(ctx context.Context) error {
	c.mu.Lock()
	w := c.ws[1]
	c.ws = slices.Delete(c.ws, 1, 2)
	c.dead = append(c.dead, w)
	next := c.next
	c.mu.Unlock()
	w.kill()
	return c.spawn(ctx, fmt.Sprintf("w%d", next))
}

// lockMembers holds an ACCESS EXCLUSIVE lock on bgtask_members for d.
func (c *chaos) lockMembers(ctx context.Context, d time.Duration) error {
	conn, err := pgx.Connect(ctx, c.cfg.DB)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, "LOCK TABLE bgtask_members IN ACCESS EXCLUSIVE MODE"); err != nil {
		return err
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
	}
	return tx.Rollback(ctx)
}

// pause waits d, or until ctx ends.
func pause(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// wave launches Wave tasks from four launchers at random live workers,
// and does fault once half of them were launched.
func (c *chaos) wave(ctx context.Context, n int, fault func() error) error {
	var launched atomic.Int64
	half := make(chan struct{})
	var once sync.Once
	var wg sync.WaitGroup
	for l := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := l; i < c.cfg.Wave; i += 4 {
				if ctx.Err() != nil {
					return
				}
				c.launch(ctx, fmt.Sprintf("chat-%d-%d", n, i%8))
				if launched.Add(1) >= int64(c.cfg.Wave/2) {
					once.Do(func() { close(half) })
				}
			}
		}()
	}
	select {
	case <-half:
	case <-ctx.Done():
	}
	err := fault()
	wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	return errors.Join(err, c.failed)
}

// launch launches one task from parent at a random live worker, and
// counts how it went.
func (c *chaos) launch(ctx context.Context, parent string) bool {
	ws := c.live()
	w := ws[rand.IntN(len(ws))]
	cl := client{base: w.addr, member: "coordinator", http: c.http}
	var a answer
	err := cl.call(ctx, "/launch", launchArg{Parent: parent, Prompt: "look it up", Within: c.cfg.Within}, &a)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.worst = max(c.worst, a.Took-c.cfg.Within)
	switch {
	case err != nil:
		c.counts.lost++ // its worker was killed under it
	case a.Err == "":
		c.counts.launched++
		return true
	case a.Kind == "unavailable":
		c.counts.refused++
	case a.Kind == "undecided":
		c.counts.undecided++
	default:
		if c.failed == nil {
			c.failed = fmt.Errorf("a launch at %s failed as no launch may: %s", w.member, a.Err)
		}
	}
	return false
}

// launchesAgain launches at every live worker until each has launched
// once, and returns how long that took.
func (c *chaos) launchesAgain(ctx context.Context) (time.Duration, error) {
	from := time.Now()
	for _, w := range c.live() {
		for {
			cl := client{base: w.addr, member: "coordinator", http: c.http}
			var a answer
			err := cl.call(ctx, "/launch", launchArg{Parent: "probe", Prompt: "are you back?", Within: c.cfg.Within}, &a)
			if err == nil && a.Err == "" {
				c.mu.Lock()
				c.counts.launched++
				c.mu.Unlock()
				break
			}
			if time.Since(from) > time.Minute {
				return 0, fmt.Errorf("worker %s launches nothing a minute on: %v %s", w.member, err, a.Err)
			}
			t := time.NewTimer(100 * time.Millisecond)
			select {
			case <-ctx.Done():
				t.Stop()
				return 0, ctx.Err()
			case <-t.C:
			}
		}
	}
	return time.Since(from), nil
}

// answer ends each session a moment after it started, with its answer,
// and sends the answer to a random live worker until one takes it (or
// finds it stale), until ctx ends.
func (c *chaos) answer(ctx context.Context) {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		var due []string
		c.svc.mu.Lock()
		for id, s := range c.svc.sessions {
			if s.state == bgtask.SessionStateAlive && time.Since(s.at) >= 150*time.Millisecond {
				s.state, s.end = bgtask.SessionStateEnded, bgtask.Event{Kind: bgtask.SessionIdle, Text: "answer of " + id}
				c.svc.change()
			}
			if s.state == bgtask.SessionStateEnded && !s.aborted && !c.sent(id) {
				due = append(due, id)
			}
		}
		c.svc.mu.Unlock()
		ws := c.live()
		for _, id := range due {
			w := ws[rand.IntN(len(ws))]
			cl := client{base: w.addr, member: "service", http: c.http}
			var a answer
			err := cl.call(ctx, "/observe", bgtask.Event{SessionID: id, Kind: bgtask.SessionIdle, Text: "answer of " + id}, &a)
			if err == nil && (a.Err == "" || a.Kind == "stale") {
				c.mu.Lock()
				c.told[id] = true
				c.mu.Unlock()
			}
		}
	}
}

// settle waits until every task of the ledger ended and every
// notification was delivered: no live task, nothing in the outbox, inbox
// or launching tables.
func (c *chaos) settle(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, c.cfg.DB)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	deadline := time.Now().Add(90 * time.Second)
	for {
		var left int
		err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM bgtask_tasks WHERE ledger = $1 AND NOT ended)
     + (SELECT count(*) FROM bgtask_notes WHERE ledger = $1)
     + (SELECT count(*) FROM bgtask_inbox WHERE ledger = $1)
     + (SELECT count(*) FROM bgtask_launching WHERE ledger = $1)`, c.cfg.Ledger).Scan(&left)
		if err != nil {
			return err
		}
		if left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			var what string
			_ = conn.QueryRow(ctx, `SELECT concat_ws('; ',
  (SELECT 'live tasks: ' || string_agg(t.task_id || ' of ' || t.member || coalesce(' (lease ' || CASE WHEN m.expires_at > now() THEN 'held by ' || m.holder ELSE 'expired' END || ')', ''), ', ')
     FROM bgtask_tasks t LEFT JOIN bgtask_members m ON m.ledger = t.ledger AND m.member = t.member WHERE t.ledger = $1 AND NOT t.ended),
  (SELECT 'outbox: ' || string_agg(kind || ' ' || note_id, ', ') FROM bgtask_notes WHERE ledger = $1),
  (SELECT 'inbox: ' || count(*) || ' for ' || string_agg(DISTINCT member, ', ') FROM bgtask_inbox WHERE ledger = $1 HAVING count(*) > 0),
  (SELECT 'launching: ' || string_agg(task_id || ' of ' || member, ', ') FROM bgtask_launching WHERE ledger = $1))`, c.cfg.Ledger).Scan(&what)
			return fmt.Errorf("the fleet did not settle in 90s: %s%s", what, c.stuck(ctx, conn))
		}
		t := time.NewTimer(200 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

// stuck describes the first few tasks left live, for a run that did not
// settle: their records in the ledger, their sessions' bindings, and what
// the service and the answerer know of their sessions.
func (c *chaos) stuck(ctx context.Context, conn *pgx.Conn) string {
	rows, err := conn.Query(ctx, `SELECT task_id FROM bgtask_tasks WHERE ledger = $1 AND NOT ended ORDER BY task_id LIMIT 3`, c.cfg.Ledger)
	if err != nil {
		return "; " + err.Error()
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "; " + err.Error()
	}
	var b strings.Builder
	for _, id := range ids {
		var recs, binds string
		_ = conn.QueryRow(ctx, `SELECT coalesce(string_agg(member || '#' || seq || ' ' || kind || ' ' || attempt_id, ', ' ORDER BY member, seq), '')
  FROM bgtask_records WHERE ledger = $1 AND task_id = $2`, c.cfg.Ledger, id).Scan(&recs)
		_ = conn.QueryRow(ctx, `SELECT coalesce(string_agg(session_id || ' of ' || member || ' for ' || attempt_id, ', '), '')
  FROM bgtask_sessions WHERE ledger = $1 AND task_id = $2`, c.cfg.Ledger, id).Scan(&binds)
		fmt.Fprintf(&b, "\ntask %s: records [%s]; sessions bound [%s]", id, recs, binds)
		c.svc.mu.Lock()
		for sid, s := range c.svc.sessions {
			if s.req.TaskID == id {
				fmt.Fprintf(&b, "; the service's %s (attempt %s, started by %s %s ago): %s, aborted %t, asked %d, answer sent %t",
					sid, s.req.AttemptID, s.owner, time.Since(s.at).Round(time.Millisecond), s.state, s.aborted, s.asked, c.sent(sid))
			}
		}
		c.svc.mu.Unlock()
	}
	return b.String()
}

// check checks every promise of a settled run.
func (c *chaos) check(ctx context.Context) (rep ChaosReport, err error) {
	c.mu.Lock()
	rep.Launched, rep.Refused, rep.Undecided, rep.Lost = c.counts.launched, c.counts.refused, c.counts.undecided, c.counts.lost
	rep.Worst, rep.Back = c.worst, c.back
	c.mu.Unlock()
	if rep.Worst > time.Second {
		return rep, fmt.Errorf("a launch overran its deadline by %s", rep.Worst)
	}
	conn, err := pgx.Connect(ctx, c.cfg.DB)
	if err != nil {
		return rep, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT task_id, parent_session FROM bgtask_tasks WHERE ledger = $1`, c.cfg.Ledger)
	if err != nil {
		return rep, err
	}
	byParent := map[string][]string{}
	var tasks []string
	for rows.Next() {
		var id, parent string
		if err := rows.Scan(&id, &parent); err != nil {
			return rep, err
		}
		tasks = append(tasks, id)
		byParent[parent] = append(byParent[parent], id)
	}
	if err := rows.Err(); err != nil {
		return rep, err
	}
	rep.Tasks = len(tasks)
	if rep.Tasks < rep.Launched {
		return rep, fmt.Errorf("%d launches returned a task, but the ledger has %d", rep.Launched, rep.Tasks)
	}
	c.svc.mu.Lock()
	defer c.svc.mu.Unlock()
	for _, id := range tasks {
		sums := c.svc.summaries(id)
		if len(sums) == 0 {
			return rep, fmt.Errorf("task %s: no final summary delivered", id)
		}
		for _, d := range sums[1:] {
			if d.ID != sums[0].ID {
				return rep, fmt.Errorf("task %s: two different final summaries (%s, %s): it ended twice", id, sums[0].ID, d.ID)
			}
			rep.Duplicates++
		}
		t := sums[0].Task
		ses := c.svc.byTask[id]
		switch {
		case t.Status == bgtask.StatusCompleted && t.Result == "answer of "+ses:
			rep.Completed++
		case t.Status == bgtask.StatusCompleted:
			return rep, fmt.Errorf("task %s: completed with %q, want %q", id, t.Result, "answer of "+ses)
		case t.Status == bgtask.StatusCancelled:
			return rep, fmt.Errorf("task %s: cancelled, and nobody cancelled it", id)
		case t.Error == "":
			return rep, fmt.Errorf("task %s: %s without a reason", id, t.Status)
		default:
			rep.Other++
		}
	}
	for parent, want := range byParent {
		told := map[string]int{} // task → the rounds (distinct all_complete IDs) that told it
		seen := map[string]bool{}
		for _, n := range c.svc.allComplete(parent) {
			if seen[n.ID] {
				rep.Duplicates++
				continue
			}
			seen[n.ID] = true
			for _, t := range n.Tasks {
				told[t.ID]++
			}
		}
		for _, id := range want {
			if told[id] != 1 {
				return rep, fmt.Errorf("parent %s: task %s was told in %d all_complete rounds, want 1", parent, id, told[id])
			}
		}
		if len(told) != len(want) {
			return rep, fmt.Errorf("parent %s: its all_complete rounds told %d tasks, it has %d", parent, len(told), len(want))
		}
	}
	return rep, nil
}
