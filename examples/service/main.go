// Command service serves a bgtask Manager over HTTP with bgtaskhttp, and
// follows it from a Go client that keeps a Mirror in sync.
//
//	go run ./examples/service -addr 127.0.0.1:8080 [-journal DIR]
//
// serves until interrupted (Ctrl-C): the live page at /, the API (GET
// /snapshot, /tasks, /tasks/{id}, the /events stream; POST cancel, close
// and extend — see bgtaskhttp) over in-process subagents. Every few
// seconds a round begins under a parent session of its own: a task that
// answers, one that fails on its first model and answers on the next, one
// that fails on every model, a tree (a task that launches two subagents and
// answers with theirs), and one that runs until the next round cancels it.
// The population stays bounded: a round starts only while at most
// maxLive tasks would be live, and ended tasks past the last maxEnded are
// forgotten. With -journal the Manager is durable: restart it on the same
// DIR and its tasks are still there (those that ran when it stopped ended
// interrupt), and the rounds go on; `go run ./cmd/bgtask tasks DIR` reads
// the journal meanwhile. Point curl, or cmd/bgtask, at it:
//
//	curl -s 127.0.0.1:8080/tasks | jq
//	curl -N 127.0.0.1:8080/events
//	curl -X POST 127.0.0.1:8080/tasks/task-3/cancel
//	go run ./cmd/bgtask follow http://127.0.0.1:8080
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
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtaskhttp"
	"github.com/bgtask/bgtask/mirror"
)

func main() {
	addr := flag.String("addr", "", "serve on this address until interrupted (e.g. 127.0.0.1:8080); empty: run the demo")
	journal := flag.String("journal", "", "with -addr: keep the tasks in a file journal in this directory (made if need be), so they survive a restart")
	flag.Parse()
	if *addr != "" {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		if err := serve(ctx, *addr, *journal, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "service:", err)
			os.Exit(1)
		}
		return
	}
	if *journal != "" {
		fmt.Fprintln(os.Stderr, "service: -journal needs -addr")
		os.Exit(2)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "service:", err)
		os.Exit(1)
	}
}

// subagent plays an in-process subagent. pause is its work: it returns
// when the work is done, or ctx's error. "flaky" fails its first attempt,
// "broken" every attempt; "tree", after its work, launches two subagents
// and answers with their answers; "wait" runs until stopped; the rest
// answer.
func subagent(pause func(ctx context.Context, run bgtask.Run) error) bgtask.RunFunc {
	return func(ctx context.Context, run bgtask.Run) (string, error) {
		run.Progress(fmt.Sprintf("working on %s (attempt %d, %s)", run.Prompt, run.Attempt, run.Model))
		switch run.Prompt {
		case "wait":
			<-ctx.Done()
			return "", ctx.Err()
		}
		if err := pause(ctx, run); err != nil {
			return "", err
		}
		if run.Prompt == "tree" {
			return tree(ctx, run)
		}
		if run.Prompt == "broken" || (run.Prompt == "flaky" && run.Attempt == 1) {
			return "", errors.New("503 Service Unavailable")
		}
		return "done: " + run.Prompt, nil
	}
}

// tree launches two subagents under its own session, waits for them and
// answers with their answers. They stop with it (CancelWithCaller).
func tree(ctx context.Context, run bgtask.Run) (string, error) {
	m := run.Manager()
	var ids []string
	for _, p := range []string{"leaf", "leaf"} {
		child, err := run.Manager().Launch(ctx, bgtask.Spec{Prompt: p, Description: "a subagent's subagent", Models: models, CancelWithCaller: true})
		if err != nil {
			return "", err
		}
		ids = append(ids, child.ID)
	}
	answer := "children:"
	for _, id := range ids {
		t, err := m.Wait(ctx, id)
		if err != nil {
			return "", err
		}
		answer += fmt.Sprintf(" %s %s;", t.ID, t.Status)
	}
	return answer, nil
}

// models is the fallback chain: a, then b, then c.
var models = []bgtask.Model{{Provider: "local", ID: "a"}, {Provider: "local", ID: "b"}, {Provider: "local", ID: "c"}}

// The population serve keeps: at most maxLive live tasks, and the last
// maxEnded ended ones (older ones are forgotten, and compacted out of a
// journal).
const (
	maxLive   = 20
	maxEnded  = 40
	roundSize = 7 // a round's tasks: steady, flaky, broken, wait, and a tree of three
	treeKids  = 2 // the subagents a tree launches
)

// population launches serve's rounds on m.
type population struct {
	m      *bgtask.Manager
	rounds int    // the next round's number
	waiter string // the last round's "wait" task: the next round cancels it
}

// newPopulation launches rounds on m, numbered on from the rounds m
// recovered from a journal.
func newPopulation(m *bgtask.Manager) *population {
	p := &population{m: m}
	for _, t := range m.Snapshot().Tasks {
		if n, err := strconv.Atoi(t.Metadata["round"]); err == nil && n >= p.rounds {
			p.rounds = n + 1
		}
	}
	return p
}

// round cancels the last round's waiter and launches a round, if the
// bound allows it: it returns the ids launched (nil for a round skipped).
func (p *population) round(ctx context.Context) ([]string, error) {
	if p.waiter != "" {
		if _, err := p.m.Stop(ctx, bgtask.Target{Task: p.waiter}); err != nil && !errors.Is(err, bgtask.ErrForgotten) && !errors.Is(err, bgtask.ErrUnknownTask) {
			return nil, err
		}
		p.waiter = ""
	}
	if p.live()+roundSize > maxLive {
		return nil, nil // it would be too many: wait for some to end
	}
	round := strconv.Itoa(p.rounds)
	p.rounds++
	var ids []string
	for _, prompt := range []string{"steady", "flaky", "broken", "tree", "wait"} {
		t, err := p.m.Launch(ctx, bgtask.Spec{ParentSessionID: "chat-" + round, Prompt: prompt, Description: prompt, Models: models,
			Metadata: map[string]string{"round": round}})
		if err != nil {
			return ids, err
		}
		ids = append(ids, t.ID)
		if prompt == "wait" {
			p.waiter = t.ID
		}
	}
	return ids, nil
}

// live counts the tasks that are live or will be: a live tree's children
// not launched yet count.
func (p *population) live() int {
	tasks := p.m.Snapshot().Tasks
	children := map[string]int{} // session → its live or ended children
	for _, t := range tasks {
		children[t.ParentSessionID]++
	}
	n := 0
	for _, t := range tasks {
		if !t.Status.Live() {
			continue
		}
		n++
		if t.Description == "tree" {
			n += max(0, treeKids-children[t.SessionID])
		}
	}
	return n
}

// options are the Manager's, serving: the retention that forgets old
// tasks, and a second's wait before a retry (the page shows it pending).
func options(extra ...bgtask.Option) []bgtask.Option {
	return append([]bgtask.Option{
		bgtask.WithIDs(bgtask.SequentialIDs()),
		bgtask.WithRetention(bgtask.Retention{MaxEnded: maxEnded}),
	}, extra...)
}

// newServer is the http.Server serve and the demo use. ReadTimeout bounds
// a request's body as well as its header (a trickled body cannot hold a
// connection); WriteTimeout stays 0 because /events is a stream that
// lasts as long as its client: the handler lets a client that stops
// reading go on its own.
func newServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		IdleTimeout:       60 * time.Second,
	}
}

// serve serves a Manager on addr until ctx ends, launching a round every
// few seconds; with journal, on a file journal in that directory.
func serve(ctx context.Context, addr, journal string, w io.Writer) error {
	work := func(ctx context.Context, run bgtask.Run) error { // one to four seconds
		t := time.NewTimer(time.Second + rand.N(3*time.Second))
		defer t.Stop()
		select {
		case <-t.C:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	opts := options(bgtask.WithRetryDelay(func(int, error) time.Duration { return time.Second }))
	var view bgtaskhttp.Options
	if journal != "" {
		j, err := bgtask.OpenFileJournal(journal)
		if err != nil {
			return err
		}
		opts = append(opts, bgtask.WithJournal(j)) // the detail page shows each of a task's records (Manager.History)
	}
	m, err := bgtask.Open(ctx, bgtask.NewFuncHost(subagent(work)), opts...)
	if err != nil {
		return err
	}
	defer m.Shutdown(context.Background()) // on an early return; else done below, before the server's
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := newServer(bgtaskhttp.Handler(m, view))
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	p := newPopulation(m)
	_, err = p.round(ctx) // the first round is there when the address is printed
	if ctx.Err() != nil {
		err = nil // interrupted at once
	}
	if err == nil {
		fmt.Fprintf(w, "serving on http://%s (Ctrl-C to stop)\n", ln.Addr())
		if journal != "" {
			fmt.Fprintf(w, "journal in %s: go run ./cmd/bgtask tasks %s\n", journal, journal)
		}
		err = rounds(ctx, p, served)
	}
	if err != nil {
		_ = srv.Close()
		if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
			return serr
		}
		return err
	}
	// The Manager first: its shutdown ends the /events streams, which
	// would otherwise hold srv.Shutdown for its whole timeout (a stream
	// lasts as long as the Manager or its client).
	shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = m.Shutdown(shut)
	_ = srv.Shutdown(shut)
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// rounds launches a round every few seconds until ctx ends (nil) or the
// server fails (its error, and a value sent back on served).
func rounds(ctx context.Context, p *population, served chan error) error {
	tick := time.NewTicker(3 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			if _, err := p.round(ctx); err != nil && ctx.Err() == nil {
				return err
			}
		case <-ctx.Done():
			return nil
		case err := <-served:
			served <- err // for serve to read as it ends
			return err
		}
	}
}

// run is the demo: tasks served on a loopback port and followed by a
// client over real HTTP.
func run(ctx context.Context, w io.Writer) error {
	release := make(chan struct{})
	pause := func(ctx context.Context, _ bgtask.Run) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	m, err := bgtask.Open(context.Background(), bgtask.NewFuncHost(subagent(pause)), bgtask.WithIDs(bgtask.SequentialIDs()))
	if err != nil {
		return err
	}
	defer m.Shutdown(context.Background())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := newServer(bgtaskhttp.Handler(m, bgtaskhttp.Options{}))
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	defer func() {
		_ = srv.Close()
		<-served
	}()
	client := &bgtaskhttp.Client{Base: "http://" + ln.Addr().String()}
	var mir mirror.Mirror
	fctx, stop := context.WithCancel(ctx)
	ready := make(chan struct{})
	followed := make(chan error, 1)
	go func() { followed <- client.Follow(fctx, &mir, ready) }()
	defer func() {
		stop()
		<-followed
	}()
	select {
	case <-ready:
	case err := <-followed:
		followed <- err // for the deferred join
		return err
	}

	var ids []string
	for _, p := range []string{"steady", "flaky", "wait"} {
		t, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "ses_ui", Prompt: p, Description: p, Models: models})
		if err != nil {
			return err
		}
		ids = append(ids, t.ID)
	}
	close(release)
	if _, err := client.Stop(ctx, bgtask.Target{Task: ids[2]}); err != nil {
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
