// Command service serves a bgtask Manager over HTTP with bgtaskhttp, and
// follows it from a Go client that keeps a Mirror in sync.
//
//	go run ./examples/service -addr 127.0.0.1:8080
//
// serves until interrupted (Ctrl-C): the API (GET /snapshot, /tasks,
// /tasks/{id}, the /events stream; POST cancel, close and extend — see
// bgtaskhttp) over in-process subagents that take a few seconds each, a
// new one launched every few seconds. Point curl at it:
//
//	curl -s 127.0.0.1:8080/tasks | jq
//	curl -N 127.0.0.1:8080/events
//	curl -X POST 127.0.0.1:8080/tasks/task-3/cancel
//
// Without -addr it runs the demo: a few tasks served on a loopback port,
// followed by a client whose mirror is printed at the end.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/mirror"
)

func main() {
	addr := flag.String("addr", "", "serve on this address until interrupted (e.g. 127.0.0.1:8080); empty: run the demo")
	flag.Parse()
	if *addr != "" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		if err := serve(ctx, *addr, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "service:", err)
			os.Exit(1)
		}
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "service:", err)
		os.Exit(1)
	}
}

// subagent plays an in-process subagent: "flaky" fails its first attempt,
// "wait" runs until stopped, the rest answer after step.
func subagent(step <-chan struct{}) bgtask.RunFunc {
	return func(ctx context.Context, run bgtask.Run) (string, error) {
		run.Progress("working on " + run.Prompt)
		if run.Prompt == "wait" {
			<-ctx.Done()
			return "", ctx.Err()
		}
		select {
		case <-step:
		case <-ctx.Done():
			return "", ctx.Err()
		}
		if run.Attempt == 1 && run.Prompt == "flaky" {
			return "", errors.New("503 Service Unavailable")
		}
		return "done: " + run.Prompt, nil
	}
}

var models = []bgtask.Model{{Provider: "local", ID: "a"}, {Provider: "local", ID: "b"}}

// serve serves a Manager on addr until ctx ends, launching a task every
// few seconds.
func serve(ctx context.Context, addr string, w io.Writer) error {
	tick := time.NewTicker(3 * time.Second)
	defer tick.Stop()
	steps := make(chan struct{})
	m := bgtask.New(bgtask.NewFuncHost(subagent(steps)), bgtask.WithIDs(bgtask.SequentialIDs()))
	defer m.Shutdown(context.Background())
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: bgtaskhttp.Handler(m, bgtaskhttp.Options{}), ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	prompts := []string{"steady", "flaky", "wait"}
	for i := 0; ; i++ {
		if _, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: fmt.Sprintf("chat-%d", i%2), Prompt: prompts[i%3], Description: prompts[i%3], Models: models}); err != nil && ctx.Err() == nil {
			return err
		}
		if i == 0 {
			fmt.Fprintf(w, "serving on http://%s (Ctrl-C to stop)\n", ln.Addr())
		}
		select {
		case <-tick.C:
			select {
			case steps <- struct{}{}: // one waiting subagent answers
			default:
			}
		case <-ctx.Done():
			shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(shut)
			if err := <-served; !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		case err := <-served:
			return err
		}
	}
}

// run is the demo: tasks served on a loopback port and followed by a
// client over real HTTP.
func run(ctx context.Context, w io.Writer) error {
	release := make(chan struct{})
	m := bgtask.New(bgtask.NewFuncHost(subagent(release)), bgtask.WithIDs(bgtask.SequentialIDs()))
	defer m.Shutdown(context.Background())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: bgtaskhttp.Handler(m, bgtaskhttp.Options{}), ReadHeaderTimeout: 5 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		_ = srv.Close()
		<-served
	}()
	client := &bgtaskhttp.Client{Base: "http://" + ln.Addr().String()}
	var mir mirror.Mirror
	fctx, stop := context.WithCancel(ctx)
	defer stop()
	ready := make(chan struct{})
	followed := make(chan error, 1)
	go func() { followed <- client.Follow(fctx, &mir, ready) }()
	<-ready

	var ids []string
	for _, p := range []string{"steady", "flaky", "wait"} {
		t, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "ses_ui", Prompt: p, Description: p, Models: models})
		if err != nil {
			return err
		}
		ids = append(ids, t.ID)
	}
	close(release)
	if err := client.Cancel(ctx, ids[2]); err != nil {
		return err
	}
	for _, id := range ids {
		if _, err := m.Wait(ctx, id); err != nil {
			return err
		}
	}
	want := m.Snapshot() // the mirror has caught up once it holds what the Manager holds
	if err := mir.Wait(ctx, func(got []bgtask.Task) bool { return converged(got, want) }); err != nil {
		return err
	}
	stop()
	<-followed
	for _, t := range mir.Tasks() {
		fmt.Fprintf(w, "%s %-9s attempts=%d revision=%d %s\n", t.ID, t.Status, len(t.Attempts), t.Revision, t.Result)
	}
	return nil
}

// converged reports whether got holds exactly the snapshot's tasks at their
// revisions, statuses and activities.
func converged(got []bgtask.Task, want bgtask.Snapshot) bool {
	if len(got) != len(want.Tasks) {
		return false
	}
	byID := map[string]bgtask.Task{}
	for _, t := range got {
		byID[t.ID] = t
	}
	for _, t := range want.Tasks {
		g, ok := byID[t.ID]
		if !ok || g.Revision != t.Revision || g.Status != t.Status || g.Activity != t.Activity {
			return false
		}
	}
	return true
}
