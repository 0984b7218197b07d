package fleetdemo

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Config is what a coordinator needs.
type Config struct {
	DB     string        // the database's URL; migrated by Run
	Ledger string        // the ledger the fleet shares (a fresh one per run)
	Worker string        // the binary to re-execute as a worker (os.Executable())
	Lease  time.Duration // each member's lease (a killed worker is taken over once it expires)
	// Heartbeat, if set, is how often a lease is renewed (0: a third of
	// Lease).
	Heartbeat time.Duration
	Out       io.Writer // where the scenario tells what it does
}

// Report is what a run saw. Every task launched is counted once, by how
// it ended, or as still live: Completed + Cancelled + BudgetStopped +
// Interrupted + Live is Tasks.
type Report struct {
	Tasks      int // tasks launched (a launch refused is none)
	Completed  int // ended completed, each with the answer its session gave
	Cancelled  int // stopped by the closure
	TakenOver  int // of Completed, runs of the killed worker another process finished
	Duplicates int // final summaries delivered again after the crash (same ID)
	// BudgetStopped counts the tasks of the tree whose budget two
	// processes spent, stopped by it; BudgetRefused the launches in it
	// refused after.
	BudgetStopped, BudgetRefused int
	// Interrupted is 1 when the kill cut the start of the barrier w1
	// launched last (the takeover cannot tell whether its session began:
	// "start outcome unknown after restart"), 0 when its session had
	// started; Live counts the barriers still running at the end (never
	// answered).
	Interrupted, Live int
	Took              time.Duration // the whole scenario
}

// proc is one worker process.
type proc struct {
	member string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	addr   string
	done   chan error
}

// Run plays the scenario on three workers and returns what it saw, or
// the first promise it found broken.
func Run(ctx context.Context, cfg Config) (rep Report, err error) {
	began := time.Now()
	if cfg.Out == nil {
		cfg.Out = io.Discard
	}
	svc, err := begin(ctx, cfg)
	if err != nil {
		return rep, err
	}
	defer svc.close()
	var ws []*proc
	defer func() {
		for _, w := range ws {
			w.stop()
		}
	}()
	for i := range 3 {
		w, err := spawn(ctx, cfg, svc, fmt.Sprintf("w%d", i))
		if err != nil {
			return rep, err
		}
		ws = append(ws, w)
	}
	say := func(format string, args ...any) { fmt.Fprintf(cfg.Out, format+"\n", args...) }
	say("three workers share ledger %s: %s, %s, %s", cfg.Ledger, ws[0].addr, ws[1].addr, ws[2].addr)
	sc := &scenario{ctx: ctx, svc: svc, ws: ws, http: &http.Client{Timeout: 30 * time.Second}}

	// 1. Tasks in all three; each answer sent to a process that does not own it.
	var answered []string
	for _, w := range ws {
		for range 2 {
			t, err := sc.launch(w, "chat-a")
			if err != nil {
				return rep, err
			}
			answered = append(answered, t)
		}
	}
	for _, id := range answered {
		ses, owner, err := sc.session(id)
		if err != nil {
			return rep, err
		}
		to := sc.other(owner)
		if err := sc.observe(to, bgtask.Event{SessionID: ses, Kind: bgtask.SessionIdle, Text: "answer of " + ses}); err != nil {
			return rep, err
		}
	}
	say("6 tasks launched in w0, w1, w2; each answer sent to a process that does not own its session")

	// 2. A branch across the three; closed from the one that owns its leaf.
	root, err := sc.launch(ws[0], "chat-b")
	if err != nil {
		return rep, err
	}
	rootSes, _, err := sc.session(root)
	if err != nil {
		return rep, err
	}
	kid, err := sc.launch(ws[1], rootSes)
	if err != nil {
		return rep, err
	}
	kidSes, _, err := sc.session(kid)
	if err != nil {
		return rep, err
	}
	leaf, err := sc.launch(ws[2], kidSes)
	if err != nil {
		return rep, err
	}
	if _, _, err := sc.session(leaf); err != nil {
		return rep, err
	}
	closed, err := sc.close(ws[2], "chat-b")
	if err != nil {
		return rep, err
	}
	var stopped []string
	for _, r := range closed.Stopped {
		stopped = append(stopped, r.TaskID)
	}
	if want := []string{root, kid, leaf}; !sameSet(stopped, want) {
		return rep, fmt.Errorf("the closure in w2 stopped %v, want %v", stopped, want)
	}
	say("a branch of w0 → w1 → w2 closed from w2: %d runs stopped in %d passes", len(closed.Stopped), closed.Passes)

	// 3. w1 dies mid-run; its runs are taken over and end with their evidence.
	var doomed []string
	for range 3 {
		t, err := sc.launch(ws[1], "chat-c")
		if err != nil {
			return rep, err
		}
		doomed = append(doomed, t)
	}
	var sessions []string
	for _, id := range doomed {
		ses, _, err := sc.session(id)
		if err != nil {
			return rep, err
		}
		sessions = append(sessions, ses)
	}
	// Every binding is durable before the kill: the tasks' next step is a
	// launch of w1 that returned.
	if _, err := sc.launch(ws[1], barrier); err != nil {
		return rep, err
	}
	ws[1].kill()
	say("w1 killed with %d runs live", len(doomed))
	// Two end while nobody owns them: the takeover finds their evidence.
	svc.endWhileDown(sessions[0], bgtask.Event{Kind: bgtask.SessionIdle, Text: "answer of " + sessions[0]})
	svc.endWhileDown(sessions[1], bgtask.Event{Kind: bgtask.SessionIdle, Text: "answer of " + sessions[1]})
	if err := svc.await(ctx, "the takeover of w1", func() bool {
		for _, id := range sessions {
			if s := svc.sessions[id]; s == nil || s.asked == 0 {
				return false
			}
		}
		return true
	}); err != nil {
		return rep, err
	}
	// The third answers after the takeover, at w0 (which may or may not be
	// the new owner).
	if err := sc.observe(ws[0], bgtask.Event{SessionID: sessions[2], Kind: bgtask.SessionIdle, Text: "answer of " + sessions[2]}); err != nil {
		return rep, err
	}
	say("w1's member taken over; its runs reconciled through the session service")
	answered = append(answered, doomed...)

	// 5. One tree's budget, spent by two processes: a root in w0 and a
	// child in w2 report usage; the report that reaches the limit refuses
	// the next launch in the tree and stops both runs, each in its own
	// process.
	if err := sc.budget(ws[0], ws[2], &rep); err != nil {
		return rep, err
	}
	say("a tree in w0 and w2 spent its budget: its %d runs stopped by it, %d launch refused after", len(sc.budgeted), rep.BudgetRefused)

	// The barriers (launches whose return says only that what came before
	// them is in the database) are left running, unanswered: w1's, whose
	// start the kill may have cut, is live once its session is found, or
	// ended (interrupt: the takeover cannot tell whether it began).
	var live []string
	for _, id := range sc.barriers {
		var ses string
		if err := svc.await(ctx, "the session or the end of barrier "+id, func() bool {
			ses, _, _ = svc.sessionOf(id)
			return ses != "" || len(svc.summaries(id)) > 0
		}); err != nil {
			return rep, err
		}
		if ses != "" {
			live = append(live, id)
		}
	}

	// 4. Every task but the live barriers ended with its evidence; every
	// final summary once.
	rep.Tasks, rep.Live = len(sc.launched), len(live)
	var all []string
	for _, id := range sc.launched {
		if !slices.Contains(live, id) {
			all = append(all, id)
		}
	}
	rounds := map[string]int{"chat-a": 6, "chat-b": 1, "chat-c": 3} // each parent's round: its tasks
	if err := svc.await(ctx, "every final summary and all_complete", func() bool {
		for _, id := range all {
			if len(svc.summaries(id)) == 0 {
				return false
			}
		}
		for parent := range rounds {
			if len(svc.allComplete(parent)) == 0 {
				return false
			}
		}
		return true
	}); err != nil {
		return rep, err
	}
	svc.mu.Lock()
	defer svc.mu.Unlock()
	for _, id := range all {
		sums := svc.summaries(id)
		t := sums[0].Task
		for _, d := range sums[1:] {
			if d.ID != sums[0].ID {
				return rep, fmt.Errorf("task %s: two different final summaries (%s, %s)", id, sums[0].ID, d.ID)
			}
			if !slices.Contains(doomed, id) {
				return rep, fmt.Errorf("task %s: its final summary was delivered %d times without a crash", id, len(sums))
			}
			rep.Duplicates++
		}
		ses := svc.byTask[id]
		switch {
		case slices.Contains(stopped, id):
			if t.Status != bgtask.StatusCancelled || !svc.sessions[ses].aborted {
				return rep, fmt.Errorf("task %s: %s (aborted %v), want cancelled and its session aborted", id, t.Status, svc.sessions[ses].aborted)
			}
			rep.Cancelled++
		case slices.Contains(sc.budgeted, id):
			if t.Status != bgtask.StatusCancelled || t.Stop == nil || t.Stop.Kind != bgtask.StopBudget || !svc.sessions[ses].aborted {
				return rep, fmt.Errorf("task %s: %s (stop %v, aborted %v), want cancelled by its budget and its session aborted", id, t.Status, t.Stop, svc.sessions[ses].aborted)
			}
			rep.BudgetStopped++
		case slices.Contains(sc.barriers, id) && t.Status == bgtask.StatusInterrupt && len(t.Attempts) == 1 && t.Attempts[0].SessionID == "":
			rep.Interrupted++ // w1's barrier, its start cut by the kill: the takeover cannot tell whether a session began
		case !slices.Contains(answered, id):
			return rep, fmt.Errorf("task %s: %s, and the scenario neither answered nor stopped it", id, t.Status)
		case t.Status != bgtask.StatusCompleted || t.Result != "answer of "+ses:
			return rep, fmt.Errorf("task %s: %s with %q, want completed with %q", id, t.Status, t.Result, "answer of "+ses)
		default:
			rep.Completed++
			if slices.Contains(doomed, id) {
				rep.TakenOver++
			}
		}
	}
	for parent, want := range rounds {
		told := svc.allComplete(parent)
		if len(told[0].Tasks) != want {
			return rep, fmt.Errorf("parent %s: an all_complete of %d tasks, want %d", parent, len(told[0].Tasks), want)
		}
		for _, r := range told[1:] {
			if r.ID != told[0].ID {
				return rep, fmt.Errorf("parent %s: two all_complete notifications for one round", parent)
			}
			rep.Duplicates++
		}
	}
	if n := rep.Completed + rep.Cancelled + rep.BudgetStopped + rep.Interrupted + rep.Live; n != rep.Tasks {
		return rep, fmt.Errorf("%d tasks launched, %d counted by how they ended", rep.Tasks, n)
	}
	say("%d tasks: %d completed with their answers (%d of them finished by another process after the kill), %d cancelled by the closure, %d by their tree's spent budget, %d interrupted (a barrier whose start the kill cut), %d still running (the barriers, never answered: %s); every final summary and all_complete delivered once (%d again after the crash, same ID)",
		rep.Tasks, rep.Completed, rep.TakenOver, rep.Cancelled, rep.BudgetStopped, rep.Interrupted, rep.Live, strings.Join(live, ", "), rep.Duplicates)
	rep.Took = time.Since(began)
	return rep, nil
}

// begin migrates the database and starts the session service, before
// the workers start.
func begin(ctx context.Context, cfg Config) (*service, error) {
	if err := migrate(ctx, cfg.DB); err != nil {
		return nil, err
	}
	return newService()
}

// migrate brings the database's schema up to date, once, before the
// workers start.
func migrate(ctx context.Context, url string) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	return pgledger.Migrate(ctx, pool)
}

func sameSet(a, b []string) bool {
	a, b = slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b))
	return slices.Equal(a, b)
}

// spawn starts worker member and waits for its address.
func spawn(ctx context.Context, cfg Config, svc *service, member string) (*proc, error) {
	cmd := exec.CommandContext(ctx, cfg.Worker)
	cmd.Env = append(os.Environ(), WorkerEnv+"="+member, dbEnv+"="+cfg.DB, ledgerEnv+"="+cfg.Ledger,
		serviceEnv+"="+svc.addr, leaseEnv+"="+cfg.Lease.String())
	if cfg.Heartbeat > 0 {
		cmd.Env = append(cmd.Env, beatEnv+"="+cfg.Heartbeat.String())
	}
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting worker %s: %w", member, err)
	}
	p := &proc{member: member, cmd: cmd, stdin: stdin, done: make(chan error, 1)}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if addr, ok := strings.CutPrefix(sc.Text(), "ready "); ok {
				ready <- addr
			}
		}
		p.done <- cmd.Wait()
	}()
	select {
	case p.addr = <-ready:
		return p, nil
	case err := <-p.done:
		return nil, fmt.Errorf("worker %s exited before it was ready: %v", member, err)
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		return nil, fmt.Errorf("worker %s was not ready in a minute", member)
	}
}

// stop ends the worker as a shutdown does (its stdin closes), or kills it
// if it takes too long.
func (p *proc) stop() {
	if p.cmd == nil {
		return
	}
	_ = p.stdin.Close()
	select {
	case <-p.done:
	case <-time.After(20 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	p.cmd = nil
}

// kill ends the worker as a crash does.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
	p.cmd = nil
}

// scenario is the coordinator's side of the workers' API.
type scenario struct {
	ctx  context.Context
	svc  *service
	ws   []*proc
	http *http.Client
	// launched are the tasks launched, in order; of them, barriers are
	// the launches made only to know that what came before is in the
	// database, and budgeted the tree the budget stops.
	launched, barriers, budgeted []string
}

func (sc *scenario) call(w *proc, path string, in any) (answer, error) {
	c := client{base: w.addr, member: "coordinator", http: sc.http}
	var a answer
	err := c.call(sc.ctx, path, in, &a)
	return a, err
}

// launch launches a task at w from parent and returns its id.
func (sc *scenario) launch(w *proc, parent string) (string, error) {
	a, err := sc.call(w, "/launch", launchArg{Parent: parent, Prompt: "look it up"})
	if err == nil && a.Err != "" {
		err = errors.New(a.Err)
	}
	if err != nil {
		return "", fmt.Errorf("launching at %s: %w", w.member, err)
	}
	sc.launched = append(sc.launched, a.Task.ID)
	if parent == barrier {
		sc.barriers = append(sc.barriers, a.Task.ID)
	}
	return a.Task.ID, nil
}

// barrier is the parent of the barriers (scenario.barriers).
const barrier = "barrier"

// session waits for task id's session and returns it and its owner.
func (sc *scenario) session(id string) (ses, owner string, err error) {
	err = sc.svc.await(sc.ctx, "the session of "+id, func() bool {
		var ok bool
		ses, owner, ok = sc.svc.sessionOf(id)
		return ok
	})
	return ses, owner, err
}

// other returns a live worker that is not member's.
func (sc *scenario) other(member string) *proc {
	for i, w := range sc.ws {
		if w.member == member {
			for j := 1; j < len(sc.ws); j++ {
				if o := sc.ws[(i+j)%len(sc.ws)]; o.cmd != nil {
					return o
				}
			}
		}
	}
	return sc.ws[0]
}

// observe sends ev to w. An event that reaches a process before its
// session's binding is durable in the database is unknown there for a
// moment (or, while a dead process's member waits to be taken over, is
// routed to an inbox nobody drains yet): it is sent again, as a session
// service retries a delivery.
func (sc *scenario) observe(w *proc, ev bgtask.Event) error {
	for try := 0; ; try++ {
		a, err := sc.call(w, "/observe", ev)
		if err == nil && a.Err == "" {
			return nil
		}
		if err == nil && a.Kind != "unknown" || try == 100 {
			if err == nil {
				err = errors.New(a.Err)
			}
			return fmt.Errorf("an event for %s at %s: %w", ev.SessionID, w.member, err)
		}
		select {
		case <-time.After(20 * time.Millisecond):
		case <-sc.ctx.Done():
			return sc.ctx.Err()
		}
	}
}

// budget runs step 5 of Run: a tree rooted at a, with a child at b,
// spends a budget of 1,000 tokens.
func (sc *scenario) budget(a, b *proc, rep *Report) error {
	ans, err := sc.call(a, "/launch", launchArg{Parent: "chat-d", Prompt: "research", Budget: &bgtask.Budget{Tokens: 1000}})
	if err == nil && ans.Err != "" {
		err = errors.New(ans.Err)
	}
	if err != nil {
		return fmt.Errorf("launching the budgeted root: %w", err)
	}
	root := ans.Task.ID
	sc.launched = append(sc.launched, root)
	sc.budgeted = append(sc.budgeted, root)
	rootSes, _, err := sc.session(root)
	if err != nil {
		return err
	}
	// A launch from a session is admitted to its tree's budget once the
	// session's binding is in the database: a later launch of the same
	// process says it is (its commits land in order).
	if _, err := sc.launch(a, barrier); err != nil {
		return err
	}
	kid, err := sc.launch(b, rootSes)
	if err != nil {
		return err
	}
	sc.budgeted = append(sc.budgeted, kid)
	kidSes, _, err := sc.session(kid)
	if err != nil {
		return err
	}
	if _, err := sc.launch(b, barrier); err != nil {
		return err
	}
	spend := func(w *proc, ses string, tokens int64) error {
		return sc.observe(w, bgtask.Event{SessionID: ses, Kind: bgtask.SessionUsage, Usage: bgtask.Usage{InputTokens: tokens, Requests: 1}})
	}
	if err := spend(b, kidSes, 600); err != nil {
		return err
	}
	if err := spend(a, rootSes, 450); err != nil { // 1,050: the limit is reached
		return err
	}
	refused, err := sc.call(b, "/launch", launchArg{Parent: kidSes, Prompt: "more"})
	if err != nil {
		return err
	}
	if refused.Kind != "budget" {
		return fmt.Errorf("a launch in the spent tree at %s: %+v, want refused by the budget", b.member, refused)
	}
	rep.BudgetRefused++
	if err := sc.svc.await(sc.ctx, "the budget's stops", func() bool {
		return sc.svc.sessions[rootSes].aborted && sc.svc.sessions[kidSes].aborted
	}); err != nil {
		return err
	}
	return nil
}

// close closes the branch of session at w.
func (sc *scenario) close(w *proc, session string) (bgtask.ClosureReport, error) {
	a, err := sc.call(w, "/close", closeArg{Session: session})
	if err == nil && a.Err != "" {
		err = errors.New(a.Err)
	}
	if err != nil {
		return bgtask.ClosureReport{}, fmt.Errorf("closing %s at %s: %w", session, w.member, err)
	}
	return *a.Report, nil
}
