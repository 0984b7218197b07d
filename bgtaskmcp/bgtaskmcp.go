// Package bgtaskmcp serves a bgtask Manager's background tasks to any
// Model Context Protocol client, as tools, on the official Go SDK
// (github.com/modelcontextprotocol/go-sdk):
//
//	launch_task   launch a task; the harness's Options.Launch says what it runs
//	get_task      one task: status, timeline, envelope, usage
//	wait_task     wait for one to end, bounded
//	list_tasks    the caller's tasks, a page at a time
//	cancel_task   stop a task (it reads cancelled once its child stopped)
//	close_task    stop a task and everything it launched, as a closure
//	extend_task   send a running task another prompt
//
// Each tool has an input and an output JSON schema; a result carries the
// task's envelope (or a line of status) as text for the model, and the
// task as structured content for the client.
//
// A task belongs to the caller that launched it — the identity an HTTP
// transport's bearer token names (auth.TokenInfo.UserID), else the MCP
// session — and no other caller sees or stops it: a task of another
// reads as unknown. Task ids are the Manager's (random UUIDs unless the
// harness chose otherwise). Options.MaxPerClient caps the tasks a caller
// has live at once.
//
// A client that speaks MCP's own tasks — the 2026-07-28 tasks extension
// (Extension) or the 2025-11-25 experimental form — gets launch_task's
// answer as a task of the protocol's, and follows it with tasks/get,
// tasks/cancel and the rest, which a layer in front of the SDK takes
// (Server's Run, Connect and Handler; see native.go and the README for
// what is supported and why).
//
// New serves a Source: a *bgtask.Manager, or a pgledger fleet's
// fleetview.View, where any process answers for any task.
//
// It is a module of its own so that the root module never requires the
// SDK.
package bgtaskmcp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// Options configure a Server.
type Options struct {
	// Launch makes the Spec of a task a caller asked for: the harness
	// decides what it runs (its models, its agent, its own function). It
	// is given the caller and the tool's arguments; an error refuses the
	// launch, and its text is what the caller reads. Required.
	Launch func(ctx context.Context, c Caller, in LaunchInput) (bgtask.Spec, error)
	// MaxPerClient caps the tasks one caller has pending or running at
	// once (0: 8); past it, launch_task is refused.
	MaxPerClient int
	// MaxWait bounds wait_task (0: 5 minutes).
	MaxWait time.Duration
	// Name and Version name the server to its clients (default "bgtask").
	Name, Version string
	// PollInterval is how often a client of the tasks extension is asked
	// to poll a task (0: 2 seconds).
	PollInterval time.Duration
}

// Caller is who called a tool: the identity its transport authenticated,
// or its MCP session.
type Caller struct {
	// ID is the identity a task is bound to: "user:" and the bearer
	// token's user id, or "session:" and the MCP session's id, or "stdio"
	// for the one client of a stdio server.
	ID string
}

// clientKey is the metadata key a task's caller is kept under.
const clientKey = "bgtaskmcp.client"

// Source is what a Server serves: the tasks of a *bgtask.Manager, or of a
// whole pgledger fleet (fleetview.View), where any process answers for
// any task. It is bgtaskhttp.Source's task methods, and Launch.
type Source interface {
	// Launch launches spec and returns once the task is durable, and
	// Task finds it: the tasks extension's durable creation.
	Launch(ctx context.Context, spec bgtask.Spec) (bgtask.Task, error)
	Task(id string) (bgtask.Task, error)
	Tasks(q bgtask.Query) (bgtask.Page, error)
	// Subscribe delivers every change after it is called.
	Subscribe(ctx context.Context, buffer int) (*bgtask.Subscription, error)
	Stop(ctx context.Context, t bgtask.Target) (bgtask.ClosureReport, error)
	Extend(ctx context.Context, id, prompt string) (int, error)
}

// Server is an MCP server of a Source's tasks: the SDK's server, with the
// task tools and the task methods (see the package doc). Serve it with its Run, Connect or Handler: they put the layer in
// front of the SDK that the 2025-11-25 form's creation and listens of
// tasks need (wire.go); Run and Connect do so for stdio and an
// mcp.IOTransport.
type Server struct {
	*mcp.Server
	t *tools
}

// Run serves one client over transport (stdio, say) until ctx ends or
// the client leaves, as mcp.Server.Run does, with the layer.
func (s *Server) Run(ctx context.Context, transport mcp.Transport) error {
	return s.Server.Run(ctx, wrap(transport))
}

// Connect is mcp.Server.Connect, with the layer.
func (s *Server) Connect(ctx context.Context, transport mcp.Transport, opts *mcp.ServerSessionOptions) (*mcp.ServerSession, error) {
	return s.Server.Connect(ctx, wrap(transport), opts)
}

// Handler serves s over streamable HTTP (mcp.NewStreamableHTTPHandler,
// with o), with the layer in front of the SDK. A call of the 2026-07-28
// protocol (sessionless) ends when its client leaves
// (o.PropagateRequestCancellation is set): a wait holds nothing for a
// client that is gone.
func (s *Server) Handler(o *mcp.StreamableHTTPOptions) http.Handler {
	var opts mcp.StreamableHTTPOptions
	if o != nil {
		opts = *o
	}
	opts.PropagateRequestCancellation = true
	return front(mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s.Server }, &opts), &opts)
}

// New returns an MCP server with the task tools, serving src.
func New(src Source, o Options) (*Server, error) {
	if src == nil || reflect.ValueOf(src).Kind() == reflect.Pointer && reflect.ValueOf(src).IsNil() {
		return nil, fmt.Errorf("%w: bgtaskmcp.New of a nil Source", bgtask.ErrInvalidArgument)
	}
	if o.Launch == nil {
		return nil, fmt.Errorf("%w: bgtaskmcp.Options.Launch is required: it says what a task runs", bgtask.ErrInvalidArgument)
	}
	o.MaxPerClient = cmp.Or(o.MaxPerClient, 8)
	o.MaxWait = cmp.Or(o.MaxWait, 5*time.Minute)
	o.PollInterval = cmp.Or(o.PollInterval, 2*time.Second)
	caps := &mcp.ServerCapabilities{} // the tools are added, and the extension
	caps.AddExtension(Extension, nil)
	s := mcp.NewServer(&mcp.Implementation{Name: cmp.Or(o.Name, "bgtask"), Version: cmp.Or(o.Version, "v0")}, &mcp.ServerOptions{Capabilities: caps})
	t := &tools{m: src, o: o}
	s.AddReceivingMiddleware(t.native)
	if err := t.addTaskMethods(s); err != nil {
		return nil, err
	}
	mcp.AddTool(s, &mcp.Tool{Name: "launch_task", Description: "Launch a background task: a subagent that works on the prompt while you go on. Returns at once with the task's id; get_task or wait_task read its answer."}, t.launch)
	mcp.AddTool(s, &mcp.Tool{Name: "get_task", Description: "Read one of your tasks: its status, attempts, and, once it ended, its answer (the envelope)."}, t.get)
	mcp.AddTool(s, &mcp.Tool{Name: "wait_task", Description: "Wait until one of your tasks ends, at most the seconds given, and read it."}, t.wait)
	mcp.AddTool(s, &mcp.Tool{Name: "list_tasks", Description: "List your tasks, a page at a time, optionally by status."}, t.list)
	mcp.AddTool(s, &mcp.Tool{Name: "cancel_task", Description: "Stop one of your tasks. It reads cancelled once its subagent really stopped."}, t.cancel)
	mcp.AddTool(s, &mcp.Tool{Name: "close_task", Description: "Stop one of your tasks and every task it launched, at any depth."}, t.close)
	mcp.AddTool(s, &mcp.Tool{Name: "extend_task", Description: "Send one of your running tasks another prompt; its answer comes with the task's."}, t.extend)
	return &Server{Server: s, t: t}, nil
}

// tools are the tools' handlers.
type tools struct {
	m         Source
	o         Options
	mu        sync.Mutex
	launching map[string]int // by caller: launches between hold and release
	listening map[string]int // by caller: listens of tasks open
}

// callerOf is who made req. A request over HTTP with neither an
// authenticated user nor a session (a stateless server with no token
// verifier) has no caller to bind a task to: it is refused, so that no
// two clients share one.
func callerOf(req mcp.Request) (Caller, error) {
	var extra *mcp.RequestExtra
	if req != nil {
		extra = req.GetExtra()
	}
	if extra != nil && extra.TokenInfo != nil && extra.TokenInfo.UserID != "" {
		return Caller{ID: "user:" + extra.TokenInfo.UserID}, nil
	}
	if req != nil {
		if ss, ok := req.GetSession().(*mcp.ServerSession); ok && ss != nil && ss.ID() != "" {
			return Caller{ID: "session:" + ss.ID()}, nil
		}
	}
	if extra != nil && extra.Header != nil {
		return Caller{}, errors.New("this server binds each task to its caller, and this request names none: serve HTTP with sessions, or with a bearer-token verifier that names the user (auth.TokenInfo.UserID)")
	}
	return Caller{ID: "stdio"}, nil
}

// errUnknown is what a caller reads of a task that is not theirs, is
// none, or was forgotten: the same, so that ids of others cannot be
// probed.
func errUnknown(id string) error {
	return fmt.Errorf("unknown task %q: no task of yours has this id (a task that ended long ago may have been forgotten)", id)
}

// own returns task id if it is c's.
func (t *tools) own(c Caller, id string) (bgtask.Task, error) {
	if id == "" {
		return bgtask.Task{}, errors.New("id is required: the task's id, as launch_task or list_tasks gave it")
	}
	task, err := t.m.Task(id)
	if err != nil || task.Metadata[clientKey] != c.ID {
		return bgtask.Task{}, errUnknown(id)
	}
	return task, nil
}

// mine is req's caller and its task id.
func (t *tools) mine(req mcp.Request, id string) (Caller, bgtask.Task, error) {
	c, err := callerOf(req)
	if err != nil {
		return Caller{}, bgtask.Task{}, err
	}
	task, err := t.own(c, id)
	return c, task, err
}
