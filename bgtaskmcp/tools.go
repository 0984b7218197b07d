package bgtaskmcp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// LaunchInput is launch_task's arguments.
type LaunchInput struct {
	Prompt      string `json:"prompt" jsonschema:"what the task is to do: the subagent's instructions"`
	Description string `json:"description,omitempty" jsonschema:"a few words that name the task for people"`
	Agent       string `json:"agent,omitempty" jsonschema:"the kind of subagent to run, if the server offers several"`
}

// IDInput names one task.
type IDInput struct {
	ID string `json:"id" jsonschema:"the task's id, as launch_task or list_tasks gave it"`
}

// WaitInput is wait_task's arguments.
type WaitInput struct {
	ID      string `json:"id" jsonschema:"the task's id"`
	Seconds int    `json:"seconds,omitempty" jsonschema:"how long to wait at most (default 30; the server bounds it)"`
}

// ListInput is list_tasks' arguments.
type ListInput struct {
	Status []string `json:"status,omitempty" jsonschema:"only tasks in these statuses: pending, running, completed, error, cancelled, interrupt"`
	After  string   `json:"after,omitempty" jsonschema:"the cursor of the previous page (its next)"`
	Limit  int      `json:"limit,omitempty" jsonschema:"at most this many tasks (1 to 100; default 20)"`
}

// ExtendInput is extend_task's arguments.
type ExtendInput struct {
	ID     string `json:"id" jsonschema:"the task's id"`
	Prompt string `json:"prompt" jsonschema:"the prompt to send the running task"`
}

// TaskView is a task as a client reads it.
type TaskView struct {
	ID          string `json:"id"`
	Status      string `json:"status" jsonschema:"pending, running, completed, error, cancelled or interrupt"`
	Description string `json:"description,omitempty"`
	Model       string `json:"model,omitempty" jsonschema:"the model of its current attempt"`
	Attempts    int    `json:"attempts"`
	Progress    string `json:"progress,omitempty" jsonschema:"its latest line of progress, while it runs"`
	Timeline    string `json:"timeline,omitempty" jsonschema:"its attempts, one a line, and how it ended (get_task and wait_task)"`
	// Envelope is what a parent model reads of an ended task: its answer
	// or why it has none.
	Envelope string  `json:"envelope,omitempty"`
	Tokens   int64   `json:"tokens,omitempty"`
	Cost     float64 `json:"cost,omitempty"`
}

// viewOf is t as a client reads it.
func viewOf(t bgtask.Task) TaskView {
	v := TaskView{ID: t.ID, Status: string(t.Status), Description: t.Description, Attempts: len(t.Attempts),
		Progress: t.Progress, Timeline: bgtask.Timeline(t)}
	if t.Model.ID != "" {
		v.Model = t.Model.String()
	}
	if t.Status.Terminal() {
		v.Envelope = bgtask.Envelope(t)
	}
	if t.Usage != nil {
		v.Tokens, v.Cost = t.Usage.Total.Tokens(), float64(t.Usage.Total.Cost)/float64(bgtask.CostUnit)
	}
	return v
}

// said is the text a model reads of v: the envelope of an ended task, or
// a line of its status.
func said(v TaskView) *mcp.CallToolResult {
	text := v.Envelope
	if text == "" {
		text = fmt.Sprintf("task %s is %s", v.ID, v.Status)
		if v.Progress != "" {
			text += ": " + v.Progress
		}
	}
	return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: text}}}
}

func (t *tools) launch(ctx context.Context, req *mcp.CallToolRequest, in LaunchInput) (*mcp.CallToolResult, TaskView, error) {
	c, err := callerOf(req)
	if err != nil {
		return nil, TaskView{}, err
	}
	if strings.TrimSpace(in.Prompt) == "" {
		return nil, TaskView{}, errors.New("prompt is required: what the task is to do")
	}
	release, err := t.hold(c)
	if err != nil {
		return nil, TaskView{}, err
	}
	defer release()
	spec, err := t.launchSpec(ctx, c, in)
	if err != nil {
		return nil, TaskView{}, err
	}
	if spec.Metadata == nil {
		spec.Metadata = map[string]string{}
	}
	spec.Metadata[clientKey] = c.ID
	if spec.ParentSessionID == "" {
		spec.ParentSessionID = c.ID
	}
	task, err := t.m.Launch(ctx, spec)
	if err != nil {
		return nil, TaskView{}, err
	}
	v := viewOf(task)
	return said(v), v, nil
}

// hold takes one of c's places under Options.MaxPerClient for a launch,
// or says why there is none. The place is taken first, then the live
// tasks counted, with the launches that had a place before it: a launch
// that ended and left its place by then is counted live (it is live
// before it leaves). Launches at once cannot together pass the cap (one
// that ends meanwhile may count twice, never none). No lock is held
// across a call of the Source's.
func (t *tools) hold(c Caller) (release func(), err error) {
	before, release := t.take(&t.launching, c)
	live, err := t.m.Tasks(bgtask.Query{Metadata: map[string]string{clientKey: c.ID}, Statuses: []bgtask.Status{bgtask.StatusPending, bgtask.StatusRunning}, Limit: t.o.MaxPerClient})
	if err != nil {
		release()
		return nil, err
	}
	if n := len(live.Tasks) + before; n >= t.o.MaxPerClient {
		release()
		return nil, fmt.Errorf("you have %d tasks live or launching, the most this server runs for one client: wait for one to end, or cancel one", n)
	}
	return release, nil
}

// holdListen takes one of c's places for a listen of tasks: as many as
// Options.MaxPerClient at once.
func (t *tools) holdListen(c Caller) (release func(), err error) {
	before, release := t.take(&t.listening, c)
	if before >= t.o.MaxPerClient {
		release()
		return nil, fmt.Errorf("you have %d listens of tasks open, the most this server keeps for one client", before)
	}
	return release, nil
}

// take counts one more of c's in counts, and returns how many there were
// before, and what gives it back.
func (t *tools) take(counts *map[string]int, c Caller) (before int, release func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if *counts == nil {
		*counts = map[string]int{}
	}
	before = (*counts)[c.ID]
	(*counts)[c.ID]++
	var once sync.Once
	return before, func() {
		once.Do(func() {
			t.mu.Lock()
			defer t.mu.Unlock()
			if (*counts)[c.ID]--; (*counts)[c.ID] <= 0 {
				delete(*counts, c.ID)
			}
		})
	}
}

// launchSpec is Options.Launch's Spec, or its error; a Launch that
// panics refuses the launch, and the server goes on.
func (t *tools) launchSpec(ctx context.Context, c Caller, in LaunchInput) (spec bgtask.Spec, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("the server could not launch the task: its launch function failed (%v)", r)
		}
	}()
	return t.o.Launch(ctx, c, in)
}

func (t *tools) get(_ context.Context, req *mcp.CallToolRequest, in IDInput) (*mcp.CallToolResult, TaskView, error) {
	_, task, err := t.mine(req, in.ID)
	if err != nil {
		return nil, TaskView{}, err
	}
	v := viewOf(task)
	return said(v), v, nil
}

func (t *tools) wait(ctx context.Context, req *mcp.CallToolRequest, in WaitInput) (*mcp.CallToolResult, TaskView, error) {
	if _, _, err := t.mine(req, in.ID); err != nil {
		return nil, TaskView{}, err
	}
	if in.Seconds < 0 {
		return nil, TaskView{}, fmt.Errorf("seconds is %d: it must be positive", in.Seconds)
	}
	d := min(time.Duration(in.Seconds)*time.Second, t.o.MaxWait)
	if in.Seconds == 0 {
		d = min(30*time.Second, t.o.MaxWait)
	}
	wctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	if tok := req.Params.GetProgressToken(); tok != nil && req.Session != nil {
		forwarded := t.progress(wctx, req.Session, tok, in.ID)
		defer func() {
			cancel()
			<-forwarded
		}()
	}
	task, err := t.waitEnd(wctx, in.ID)
	if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
		task, err = t.m.Task(in.ID) // not ended yet: as it is
	}
	if err != nil {
		return nil, TaskView{}, err
	}
	v := viewOf(task)
	return said(v), v, nil
}

// progress sends the task's lines of progress to the caller, as MCP
// progress notifications of the request whose token is tok, until ctx
// ends; the channel it returns is closed once it stopped.
func (t *tools) progress(ctx context.Context, ss *mcp.ServerSession, tok any, id string) <-chan struct{} {
	done := make(chan struct{})
	sub, err := t.m.Subscribe(ctx, 0)
	if err != nil {
		close(done)
		return done
	}
	go func() { // joined by the wait that started it
		defer close(done)
		defer sub.Close()
		last, n := "", 0
		if task, err := t.m.Task(id); err == nil && task.Progress != "" { // where it is now, first
			last, n = task.Progress, 1
			if ss.NotifyProgress(ctx, &mcp.ProgressNotificationParams{ProgressToken: tok, Message: last, Progress: 1}) != nil {
				return
			}
		}
		for c := range sub.C {
			if c.Task.ID != id || c.Task.Progress == "" || c.Task.Progress == last {
				continue
			}
			last, n = c.Task.Progress, n+1
			if ss.NotifyProgress(ctx, &mcp.ProgressNotificationParams{ProgressToken: tok, Message: last, Progress: float64(n)}) != nil {
				return
			}
		}
	}()
	return done
}

// ListOutput is list_tasks' result.
type ListOutput struct {
	Tasks []TaskView `json:"tasks"`
	Next  string     `json:"next,omitempty" jsonschema:"the cursor of the next page; absent on the last"`
}

func (t *tools) list(_ context.Context, req *mcp.CallToolRequest, in ListInput) (*mcp.CallToolResult, ListOutput, error) {
	c, err := callerOf(req)
	if err != nil {
		return nil, ListOutput{}, err
	}
	q := bgtask.Query{Metadata: map[string]string{clientKey: c.ID}, Limit: in.Limit}
	if q.Limit == 0 {
		q.Limit = 20
	}
	if q.Limit < 0 || q.Limit > 100 {
		return nil, ListOutput{}, fmt.Errorf("limit is %d: it must be between 1 and 100", in.Limit)
	}
	for _, s := range in.Status {
		q.Statuses = append(q.Statuses, bgtask.Status(s))
	}
	if in.After != "" {
		if _, err := t.own(c, in.After); err != nil {
			return nil, ListOutput{}, fmt.Errorf("after: %w", err)
		}
		q.After = in.After
	}
	p, err := t.m.Tasks(q)
	if err != nil {
		return nil, ListOutput{}, err
	}
	out := ListOutput{Tasks: []TaskView{}, Next: p.Next}
	var lines []string
	for _, task := range p.Tasks {
		v := viewOf(task)
		v.Timeline, v.Envelope = "", "" // get_task has them
		out.Tasks = append(out.Tasks, v)
		lines = append(lines, fmt.Sprintf("%s %s %s", v.ID, v.Status, v.Description))
	}
	text := strings.Join(lines, "\n")
	if text == "" {
		text = "no task"
	}
	return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: text}}}, out, nil
}

// StopOutput is what cancel_task and close_task did.
type StopOutput struct {
	Stopped []string `json:"stopped" jsonschema:"the tasks whose runs stopped"`
	Task    TaskView `json:"task"`
}

func (t *tools) stop(ctx context.Context, req *mcp.CallToolRequest, id string, tree bool) (*mcp.CallToolResult, StopOutput, error) {
	c, err := callerOf(req)
	if err != nil {
		return nil, StopOutput{}, err
	}
	if _, err := t.own(c, id); err != nil {
		return nil, StopOutput{}, err
	}
	rep, err := t.m.Stop(bgtask.WithActor(ctx, c.ID), bgtask.Target{Task: id, Tree: tree})
	if err != nil {
		return nil, StopOutput{}, err
	}
	out := StopOutput{Stopped: []string{}}
	for _, r := range rep.Stopped {
		out.Stopped = append(out.Stopped, r.TaskID)
	}
	task, err := t.m.Task(id)
	if err != nil {
		return nil, StopOutput{}, err
	}
	out.Task = viewOf(task)
	res := said(out.Task)
	return res, out, nil
}

func (t *tools) cancel(ctx context.Context, req *mcp.CallToolRequest, in IDInput) (*mcp.CallToolResult, StopOutput, error) {
	return t.stop(ctx, req, in.ID, false)
}

func (t *tools) close(ctx context.Context, req *mcp.CallToolRequest, in IDInput) (*mcp.CallToolResult, StopOutput, error) {
	return t.stop(ctx, req, in.ID, true)
}

// ExtendOutput is extend_task's result.
type ExtendOutput struct {
	Invocation int `json:"invocation" jsonschema:"the prompt's number: the launch prompt is 1"`
}

func (t *tools) extend(ctx context.Context, req *mcp.CallToolRequest, in ExtendInput) (*mcp.CallToolResult, ExtendOutput, error) {
	c, err := callerOf(req)
	if err != nil {
		return nil, ExtendOutput{}, err
	}
	if _, _, err := t.mine(req, in.ID); err != nil {
		return nil, ExtendOutput{}, err
	}
	n, err := t.m.Extend(bgtask.WithActor(ctx, c.ID), in.ID, in.Prompt)
	if err != nil {
		return nil, ExtendOutput{}, err
	}
	return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: fmt.Sprintf("task %s took the prompt as invocation %d", in.ID, n)}}}, ExtendOutput{Invocation: n}, nil
}
