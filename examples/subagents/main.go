// Command subagents re-creates the shape of a real agent harness on
// bgtask: a spawn tool that launches subagents from inside running
// subagents (three levels deep), with a depth limit of 3, at most 5 live
// subagents per parent (the sixth waits its turn), a per-task deadline,
// structured results and a per-launch completion callback. It then stops
// a branch of the tree, and lets a caller's context end.
//
//	go run ./examples/subagents
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "subagents:", err)
		os.Exit(1)
	}
}

// Result is the harness's own result type: a part for the parent model,
// a part for the user, and what the subagent's spawn tool did.
type Result struct {
	ForModel string
	ForUser  []string // one line per task of the subtree, depth first
	Refused  []string // spawns a limit refused
}

// chatKey is what the harness's tools read from their context: the chat
// the work belongs to (carried by Spec.InheritValues).
type chatKey struct{}

// Harness is the subagent manager: one bgtask.Manager, a FuncHost whose
// function plays each subagent, and the spawn tool.
type Harness struct {
	M      *bgtask.Manager
	models []bgtask.Model

	mu       sync.Mutex
	onDone   map[string]int // task id → OnDone calls
	release  chan struct{}  // "hold" subagents wait for a token
	holding  chan string    // … and say so
	launched chan int       // "fan" subagents report each launch
}

// Limits are the harness's: depth 3, 5 live per parent (a sixth waits up
// to 10s), and every task ends by its deadline.
const (
	MaxDepth     = 3
	MaxPerParent = 5
)

// New starts the harness. Shut it down with h.M.Shutdown.
func New(opts ...bgtask.Option) *Harness {
	h := &Harness{
		models:   []bgtask.Model{{ID: "gpt-primary"}, {ID: "gpt-fallback"}}, // router aliases: no provider
		onDone:   map[string]int{},
		release:  make(chan struct{}, 64),
		holding:  make(chan string, 64),
		launched: make(chan int, 64),
	}
	all := append([]bgtask.Option{bgtask.WithTreeLimits(bgtask.TreeLimits{
		MaxDepth: MaxDepth, MaxPerParent: MaxPerParent, ParentWait: 10 * time.Second,
	})}, opts...)
	var err error
	h.M, err = bgtask.Open(context.Background(), bgtask.NewFuncHost(bgtask.Returning(h.subagent, func(r Result) string { return r.ForModel })), all...)
	if err != nil {
		panic(err) // the options above always fit
	}
	return h
}

// Spawn is the spawn tool: it launches a subagent with prompt beneath
// parent (a chat, or the session of the subagent calling it) and returns
// a channel that gets the subagent's final snapshot once, after its final
// summary (Spec.OnDone). The subagent inherits ctx's values and stops when
// ctx ends.
func (h *Harness) Spawn(ctx context.Context, parent, prompt string, timeout time.Duration) (bgtask.Task, <-chan bgtask.Task, error) {
	done := make(chan bgtask.Task, 1)
	task, err := h.M.Launch(ctx, bgtask.Spec{
		ParentSessionID: parent, Description: prompt, Prompt: prompt, Models: h.models,
		Timeout: timeout, InheritValues: true, CancelWithCaller: true,
		OnDone: func(t bgtask.Task) {
			h.mu.Lock()
			h.onDone[t.ID]++
			h.mu.Unlock()
			done <- t
		},
	})
	return task, done, err
}

// OnDoneCalls returns how many times each task's OnDone ran.
func (h *Harness) OnDoneCalls() map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[string]int, len(h.onDone))
	for k, v := range h.onDone {
		out[k] = v
	}
	return out
}

// subagent plays one subagent, as its prompt says:
//
//	"tree N"  spawn N subagents that do "tree N-1" ("tree 0" is a leaf
//	          that still tries to spawn once: refused at depth 3)
//	"fan N"   spawn N "hold" subagents at once, and wait for them all
//	"hold"    wait for a release token (or the context's end)
//	"loop"    report progress until the context ends
func (h *Harness) subagent(ctx context.Context, run bgtask.Run) (Result, error) {
	chat, _ := ctx.Value(chatKey{}).(string)
	me := fmt.Sprintf("%s%s (depth %d, chat %s)", strings.Repeat("  ", run.Depth-1), run.Prompt, run.Depth, chat)
	verb, arg, _ := strings.Cut(run.Prompt, " ")
	n, _ := strconv.Atoi(arg)
	switch verb {
	case "hold":
		h.holding <- run.TaskID
		select {
		case <-h.release:
			return Result{ForModel: "held and released", ForUser: []string{me}}, nil
		case <-ctx.Done():
			return Result{}, ctx.Err()
		}
	case "loop":
		for {
			run.Busy() // chatty: the stall timeout would never catch it
			select {
			case <-ctx.Done():
				return Result{}, ctx.Err()
			case <-time.After(5 * time.Millisecond):
			}
		}
	case "fan":
		var waits []<-chan bgtask.Task
		for i := range n {
			_, done, err := h.Spawn(ctx, run.SessionID, "hold", time.Minute) // the sixth waits for a slot here
			if err != nil {
				return Result{}, err
			}
			h.launched <- i + 1
			waits = append(waits, done)
		}
		return h.collect(ctx, me, waits, nil)
	}
	// "tree N": a leaf (N = 0) tries once, and is refused past the depth.
	var waits []<-chan bgtask.Task
	var refused []string
	for range max(n, 1) {
		_, done, err := h.Spawn(ctx, run.SessionID, "tree "+strconv.Itoa(n-1), time.Minute)
		if errors.Is(err, bgtask.ErrDepthLimit) {
			refused = append(refused, fmt.Sprintf("depth %d: %v", run.Depth, err))
			continue
		}
		if err != nil {
			return Result{}, err
		}
		waits = append(waits, done)
	}
	return h.collect(ctx, me, waits, refused)
}

// collect waits for each spawned subagent's end and folds their results
// into this one's.
func (h *Harness) collect(ctx context.Context, me string, waits []<-chan bgtask.Task, refused []string) (Result, error) {
	r := Result{ForUser: []string{me}, Refused: refused}
	for _, w := range waits {
		select {
		case t := <-w:
			kid, ok := bgtask.ValueOf[Result](t)
			if !ok {
				if err := bgtask.Fence(ctx); err != nil {
					return Result{}, err // this run is being stopped: that is why its subagent ended (the stop ends it cancelled)
				}
				return Result{}, fmt.Errorf("subagent %s ended %s without a result: %s", t.ID, t.Status, t.Error)
			}
			r.ForUser = append(r.ForUser, kid.ForUser...)
			r.Refused = append(r.Refused, kid.Refused...)
		case <-ctx.Done():
			return Result{}, ctx.Err()
		}
	}
	r.ForModel = fmt.Sprintf("%d subagents answered, %d spawns refused", len(r.ForUser)-1, len(r.Refused))
	return r, nil
}

// Scenario results, for the test and the printout.
type (
	TreeRun struct {
		Root   bgtask.Task
		Result Result
		Tasks  []bgtask.Task // the whole tree, in launch order
	}
	FanRun struct {
		Launched      []int // the launches reported before the first release
		MaxLive       int   // the most live subagents under the fan's session
		Tasks         []bgtask.Task
		Fan           bgtask.Task
		Result        Result
		WaitedForSlot bool // a launch returned only after a slot was freed
	}
	StopRun struct {
		Stopped  bgtask.ClosureReport
		Branch   []bgtask.Task // the stopped branch, after
		Sibling  bgtask.Task   // the sibling branch, which ran on
		Deadline bgtask.Task   // a looping subagent past its deadline
		Caller   []bgtask.Task // the subtree whose caller's context ended
	}
)

// Tree runs a three-level tree from chat.
func (h *Harness) Tree(ctx context.Context, chat string) (TreeRun, error) {
	ctx = context.WithValue(ctx, chatKey{}, chat)
	root, done, err := h.Spawn(ctx, chat, "tree 2", time.Minute)
	if err != nil {
		return TreeRun{}, err
	}
	var t bgtask.Task
	select {
	case t = <-done:
	case <-ctx.Done():
		return TreeRun{}, ctx.Err()
	}
	r, _ := bgtask.ValueOf[Result](t)
	page, err := h.M.Tasks(bgtask.Query{Root: chat})
	return TreeRun{Root: t, Result: r, Tasks: page.Tasks}, errors.Join(err, errIf(root.ID != t.ID, "OnDone of another task"))
}

// Fan runs a subagent that spawns n "hold" subagents under a cap of 5,
// releasing them one at a time once the cap is reached.
func (h *Harness) Fan(ctx context.Context, chat string, n int) (FanRun, error) {
	fan, done, err := h.Spawn(ctx, chat, "fan "+strconv.Itoa(n), time.Minute)
	if err != nil {
		return FanRun{}, err
	}
	var out FanRun
	for range min(n, MaxPerParent) { // the first five launch at once
		out.Launched = append(out.Launched, <-h.launched)
	}
	for range min(n, MaxPerParent) {
		<-h.holding
	}
	for released := 0; released < n; released++ {
		live, err := h.live(ctx, fan.ID)
		if err != nil {
			return FanRun{}, err
		}
		out.MaxLive = max(out.MaxLive, live)
		h.release <- struct{}{}
		if released+MaxPerParent < n { // the next launch had to wait for this slot
			<-h.launched
			<-h.holding
			out.WaitedForSlot = true
		}
	}
	select {
	case out.Fan = <-done:
	case <-ctx.Done():
		return FanRun{}, ctx.Err()
	}
	out.Result, _ = bgtask.ValueOf[Result](out.Fan)
	page, err := h.M.Tasks(bgtask.Query{Parent: out.Fan.SessionID, Limit: 1000})
	out.Tasks = page.Tasks
	return out, err
}

// live counts the live subagents launched from the session of task id.
func (h *Harness) live(_ context.Context, id string) (int, error) {
	t, err := h.M.Task(id)
	if err != nil {
		return 0, err
	}
	p, err := h.M.Tasks(bgtask.Query{Parent: t.SessionID, Statuses: []bgtask.Status{bgtask.StatusPending, bgtask.StatusRunning}, Limit: 1000})
	return len(p.Tasks), err
}

// Stops stops a branch exactly (Stop with Target.Tree), lets a looping
// subagent run into its deadline, and ends a caller's context under a
// subtree.
func (h *Harness) Stops(ctx context.Context, chat string) (StopRun, error) {
	var out StopRun
	branch, branchDone, err := h.Spawn(ctx, chat, "fan 2", time.Minute)
	if err != nil {
		return out, err
	}
	_, siblingDone, err := h.Spawn(ctx, chat, "hold", time.Minute)
	if err != nil {
		return out, err
	}
	for range 3 { // the sibling and the branch's two subagents hold
		<-h.holding
	}
	<-h.launched
	<-h.launched
	if out.Stopped, err = h.M.Stop(ctx, bgtask.Target{Task: branch.ID, Tree: true}); err != nil {
		return out, err
	}
	<-branchDone
	page, err := h.M.Tasks(bgtask.Query{Root: chat, Limit: 1000})
	if err != nil {
		return out, err
	}
	for _, t := range page.Tasks {
		if t.ID == branch.ID || t.ParentSessionID != chat {
			out.Branch = append(out.Branch, t)
		}
	}
	h.release <- struct{}{}
	out.Sibling = <-siblingDone

	_, loopDone, err := h.Spawn(ctx, chat, "loop", 50*time.Millisecond)
	if err != nil {
		return out, err
	}
	out.Deadline = <-loopDone

	callerCtx, endCaller := context.WithCancel(ctx)
	caller, callerDone, err := h.Spawn(callerCtx, chat+"-caller", "fan 1", time.Minute)
	if err != nil {
		endCaller()
		return out, err
	}
	<-h.launched
	<-h.holding
	endCaller() // the caller's turn is over: its subagents stop
	<-callerDone
	page, err = h.M.Tasks(bgtask.Query{Root: caller.ParentSessionID})
	if err != nil {
		return out, err
	}
	for _, t := range page.Tasks { // the fan's end is told once it settled; its subagent may still be stopping
		done, err := h.M.Wait(ctx, t.ID)
		if err != nil {
			return out, err
		}
		out.Caller = append(out.Caller, done)
	}
	return out, nil
}

func errIf(bad bool, msg string) error {
	if bad {
		return errors.New(msg)
	}
	return nil
}

func run(ctx context.Context, out io.Writer) error {
	h := New()
	defer h.M.Shutdown(context.Background())

	tree, err := h.Tree(ctx, "chat-1")
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "tree: %s — %s\n", tree.Root.Status, tree.Result.ForModel)
	for _, line := range tree.Result.ForUser {
		fmt.Fprintln(out, "  "+line)
	}
	for _, r := range tree.Result.Refused {
		fmt.Fprintln(out, "  refused: "+r)
	}

	fan, err := h.Fan(ctx, "chat-2", 7)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "fan: %s — %s; at most %d live under one parent (cap %d); a launch waited for a slot: %v\n",
		fan.Fan.Status, fan.Result.ForModel, fan.MaxLive, MaxPerParent, fan.WaitedForSlot)

	stops, err := h.Stops(ctx, "chat-3")
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "nested stop: %d runs stopped;", len(stops.Stopped.Stopped))
	for _, t := range stops.Branch {
		fmt.Fprintf(out, " %s %s;", t.Description, t.Status)
	}
	fmt.Fprintf(out, " sibling %s\n", stops.Sibling.Status)
	fmt.Fprintf(out, "deadline: %s, reason %s\n", stops.Deadline.Status, stops.Deadline.Outcome.Reason)
	states := []string{}
	for _, t := range stops.Caller {
		states = append(states, t.Description+" "+string(t.Status))
	}
	slices.Sort(states)
	fmt.Fprintf(out, "caller's context ended: %s\n", strings.Join(states, ", "))
	return nil
}
