// Command mcp serves background subagents to any MCP client over stdio:
// the client launches tasks as tools (launch_task, get_task, wait_task,
// list_tasks, cancel_task, close_task, extend_task) and goes on while
// they work. Each subagent here is a Go function that works through its
// prompt in steps, reports each as progress, takes further prompts
// (extend_task) while it works, and answers; with -journal DIR its tasks
// survive a restart of the server.
//
//	cd bgtaskmcp && go run ./examples/mcp
//
// Register it with a client as a stdio server, the command being
// `go run ./examples/mcp` run in the bgtaskmcp directory (or the binary
// `go build` makes): see the module's README.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskmcp"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

func main() {
	journal := flag.String("journal", "", "a directory for the tasks' journal: they survive a restart (default: in memory)")
	step := flag.Duration("step", time.Second, "how long each of a subagent's steps takes")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := serve(ctx, *journal, *step, &mcp.StdioTransport{}); err != nil {
		fmt.Fprintln(os.Stderr, "mcp:", err)
		os.Exit(1)
	}
}

// serve serves subagents over t until ctx ends or the client leaves.
func serve(ctx context.Context, journal string, step time.Duration, t mcp.Transport) error {
	opts := []bgtask.Option{}
	if journal != "" {
		j, err := bgtask.OpenFileJournal(journal)
		if err != nil {
			return err
		}
		opts = append(opts, bgtask.WithJournal(j))
	}
	m, err := bgtask.Open(ctx, bgtask.NewFuncHost(subagent(step)), opts...)
	if err != nil {
		return err
	}
	defer func() { _ = m.Shutdown(context.Background()) }()
	s, err := bgtaskmcp.New(m, bgtaskmcp.Options{Name: "bgtask-subagents", Launch: launch})
	if err != nil {
		return err
	}
	return s.Run(ctx, t)
}

// launch is what a task runs: one local subagent, on a spare model it
// falls back to.
func launch(_ context.Context, _ bgtaskmcp.Caller, in bgtaskmcp.LaunchInput) (bgtask.Spec, error) {
	return bgtask.Spec{Prompt: in.Prompt, Description: in.Description, Agent: in.Agent,
		Models: []bgtask.Model{{Provider: "local", ID: "steps"}, {Provider: "local", ID: "steps-spare"}}}, nil
}

// subagent works through its prompt in three steps, reporting each, and
// takes any further prompt into its answer.
func subagent(step time.Duration) bgtask.RunFunc {
	return func(ctx context.Context, run bgtask.Run) (string, error) {
		notes := []string{run.Prompt}
		for i := 1; i <= 3; i++ {
			run.Progress(fmt.Sprintf("step %d of 3: %s", i, []string{"reading", "thinking", "writing"}[i-1]))
			select {
			case p := <-run.Prompts():
				notes = append(notes, p.Prompt)
			case <-time.After(step):
			case <-ctx.Done():
				return "", ctx.Err()
			}
		}
		return "worked through: " + strings.Join(notes, "; then: "), nil
	}
}
