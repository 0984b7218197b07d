// Command restart shows a harness that survives being killed mid-flight.
//
// Three processes: a session service that outlives the harness (a loopback
// HTTP server holding the child sessions), and the harness twice. The first
// harness launches three tasks on a file journal and is killed (os.Exit)
// while they run. One child finishes while no harness is up. The second
// harness opens the same journal directory: it re-adopts the two live
// children (asking the service through bgtask.StatusHost), finishes the
// third with the answer it left while nobody listened, and sees the others
// through. Every parent gets its final summary exactly once.
//
//	go run ./examples/restart
//
// The journal lives in a temporary directory, deleted at the end; with
// -keep DIR (a new or empty directory) it is kept there, for cmd/bgtask to
// read: the restart shows in its records.
//
//	go run ./examples/restart -keep /tmp/bgtask-demo
//	go run ./cmd/bgtask tasks /tmp/bgtask-demo
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
)

// role selects what this process is: the service, a harness, or (unset)
// the demo that runs them.
const role = "BGTASK_RESTART_ROLE"

func main() {
	keep := flag.String("keep", "", "keep the journal in this directory (new or empty) instead of deleting it, for cmd/bgtask to read")
	flag.Parse()
	if err := dispatch(*keep); err != nil {
		fmt.Fprintln(os.Stderr, "restart:", err)
		os.Exit(1)
	}
}

func dispatch(keep string) error {
	switch os.Getenv(role) {
	case "service":
		return serve(os.Stdin, os.Stdout)
	case "harness":
		return harness(os.Getenv("BGTASK_SERVICE"), os.Getenv("BGTASK_DIR"), os.Getenv("BGTASK_PHASE"), os.Stdout)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return run(ctx, os.Stdout, keep)
}

// journalDir is the directory the demo's journal goes in: keep, which must
// be new or empty, or a temporary one; done removes a temporary one.
func journalDir(keep string) (dir string, done func(), err error) {
	if keep == "" {
		dir, err := os.MkdirTemp("", "bgtask-restart-")
		return dir, func() { os.RemoveAll(dir) }, err
	}
	if err := os.MkdirAll(keep, 0o755); err != nil {
		return "", nil, err
	}
	ents, err := os.ReadDir(keep)
	if err != nil {
		return "", nil, err
	}
	if len(ents) > 0 {
		return "", nil, fmt.Errorf("-keep %s: the directory is not empty (the demo starts from no journal): give a new or empty one", keep)
	}
	return keep, func() {}, nil
}

// run is the demo: it starts the service, runs the harness, kills it,
// finishes a child meanwhile, runs the harness again, and checks that every
// task ended once. The journal is kept in keep if it is not "".
func run(ctx context.Context, w io.Writer, keep string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	dir, done, err := journalDir(keep)
	if err != nil {
		return err
	}
	defer done()

	svc := exec.CommandContext(ctx, self)
	svc.Env = append(os.Environ(), role+"=service")
	stdin, err := svc.StdinPipe()
	if err != nil {
		return err
	}
	out, err := svc.StdoutPipe()
	if err != nil {
		return err
	}
	svc.Stderr = os.Stderr
	if err := svc.Start(); err != nil {
		return err
	}
	defer func() { _ = stdin.Close(); _ = svc.Wait() }() // closing stdin stops it
	addr, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		return fmt.Errorf("the session service did not start: %w", err)
	}
	addr = strings.TrimSpace(addr)
	fmt.Fprintln(w, "session service at", addr)

	first, code, err := runHarness(ctx, self, addr, dir, "1")
	if err != nil {
		return err
	}
	fmt.Fprint(w, first)
	fmt.Fprintf(w, "harness 1 killed mid-flight (exit %d)\n", code)

	// While no harness is up, one child finishes.
	running := linesWith(first, "running ")
	if len(running) != 3 {
		return fmt.Errorf("harness 1 left %d tasks running, want 3", len(running))
	}
	sid := strings.Fields(running[0])[2]
	if err := call(ctx, addr, "finish", url.Values{"sid": {sid}, "text": {"finished while the harness was down"}}, nil); err != nil {
		return err
	}
	fmt.Fprintln(w, "child", sid, "finished while no harness was up")

	second, code, err := runHarness(ctx, self, addr, dir, "2")
	if err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("harness 2 exited %d:\n%s", code, second)
	}
	fmt.Fprint(w, second)

	// Every task's final summary reaches its parent exactly once, by ID.
	seen := map[string]bool{}
	per := map[string]int{}
	for _, l := range linesWith(first+second, "final ") {
		f := strings.Fields(l) // final <task> <notification id> <status>
		if !seen[f[2]] {
			seen[f[2]] = true
			per[f[1]]++
		}
	}
	var ids []string
	for _, l := range running {
		ids = append(ids, strings.Fields(l)[1])
	}
	for _, id := range ids {
		if per[id] != 1 {
			return fmt.Errorf("task %s: %d final summaries, want 1", id, per[id])
		}
	}
	fmt.Fprintln(w, "every parent got its final summary exactly once")
	if keep != "" {
		fmt.Fprintf(w, "the journal is kept in %s; look inside:\n  go run ./cmd/bgtask tasks %s\n  go run ./cmd/bgtask records %s %s\n", dir, dir, dir, ids[0][:min(8, len(ids[0]))])
	}
	return nil
}

// runHarness runs one harness process and returns its output and exit
// code.
func runHarness(ctx context.Context, self, addr, dir, phase string) (string, int, error) {
	cmd := exec.CommandContext(ctx, self)
	cmd.Env = append(os.Environ(), role+"=harness", "BGTASK_SERVICE="+addr, "BGTASK_DIR="+dir, "BGTASK_PHASE="+phase)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return string(out), exit.ExitCode(), nil
	}
	return string(out), 0, err
}

func linesWith(s, prefix string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.HasPrefix(l, prefix) {
			out = append(out, l)
		}
	}
	return out
}

// harness is one life of the harness process. Phase 1 launches three
// tasks and dies once they run; phase 2 recovers them and sees them
// through.
func harness(addr, dir, phase string, w io.Writer) error {
	ctx := context.Background()
	var mu sync.Mutex
	say := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(w, format+"\n", args...)
	}
	j, err := bgtask.OpenFileJournal(dir)
	if err != nil {
		return err
	}
	host := &httpHost{addr: addr}
	notify := bgtask.NotifierFunc(func(ctx context.Context, n bgtask.Notification) error {
		if n.Kind == bgtask.NotifyFinalSummary {
			say("final %s %s %s", n.TaskID, n.ID, n.Task.Status)
		}
		return nil
	})
	m, err := bgtask.Open(ctx, host, bgtask.WithJournal(j), bgtask.WithNotifier(notify))
	if err != nil {
		return err
	}
	host.m = m
	if phase == "1" {
		for i := range 3 {
			task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: fmt.Sprintf("chat-%d", i+1), Prompt: "work", Description: fmt.Sprintf("the work of chat-%d", i+1),
				Models: []bgtask.Model{{Provider: "svc", ID: "model"}}})
			if err != nil {
				return err
			}
			running, err := waitFor(ctx, m, task.ID, bgtask.StatusRunning)
			if err != nil {
				return err
			}
			say("running %s %s", task.ID, running.SessionID)
		}
		os.Exit(3) // killed: no Shutdown, nothing flushed but what was durable
	}
	// Phase 2: what Open recovered, then the children finish.
	for _, t := range m.Snapshot().Tasks {
		say("recovered %s %s (%s)", t.ID, t.Status, t.SessionID)
		if t.Status != bgtask.StatusRunning {
			continue
		}
		if err := call(ctx, addr, "finish", url.Values{"sid": {t.SessionID}, "text": {"done after the restart"}}, nil); err != nil {
			return err
		}
		// The service reports the turn's end as an event, as a real one would.
		if err := m.Observe(bgtask.Event{SessionID: t.SessionID, Kind: bgtask.SessionIdle, Text: "done after the restart"}); err != nil {
			return err
		}
	}
	for _, t := range m.Snapshot().Tasks {
		done, err := m.Wait(ctx, t.ID)
		if err != nil {
			return err
		}
		say("ended %s %s: %q", done.ID, done.Status, done.Result)
	}
	return m.Shutdown(ctx)
}

// waitFor waits, through the change stream, until task id has status.
func waitFor(ctx context.Context, m *bgtask.Manager, id string, status bgtask.Status) (bgtask.Task, error) {
	sub, err := m.Subscribe(ctx, 0)
	if err != nil {
		return bgtask.Task{}, err
	}
	defer sub.Close()
	if t, err := m.Task(id); err == nil && t.Status == status {
		return t, nil
	}
	for c := range sub.C {
		if c.Task.ID == id && c.Task.Status == status {
			return c.Task, nil
		}
	}
	return bgtask.Task{}, fmt.Errorf("task %s never became %s: %v", id, status, sub.Err())
}

// httpHost is the harness's connection to the session service: a Host,
// and a StatusHost so that a restarted harness can ask what became of the
// children.
type httpHost struct {
	addr string
	m    *bgtask.Manager
}

func (h *httpHost) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	var sid string
	err := call(ctx, h.addr, "start", url.Values{"attempt": {req.AttemptID}}, &sid) // tagged with the attempt
	return sid, err
}

func (h *httpHost) AbortSession(ctx context.Context, sid string) error {
	return call(ctx, h.addr, "abort", url.Values{"sid": {sid}}, nil)
}

func (h *httpHost) SessionStatus(ctx context.Context, sid string) (bgtask.SessionReport, error) {
	var st session
	if err := call(ctx, h.addr, "status", url.Values{"sid": {sid}}, &st); err != nil {
		return bgtask.SessionReport{}, err
	}
	r := bgtask.SessionReport{State: bgtask.SessionState(st.State)}
	if r.State == bgtask.SessionStateEnded {
		r.End = bgtask.Event{Kind: bgtask.SessionIdle, Text: st.Text}
	}
	return r, nil
}

func (h *httpHost) FindSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	var sid string
	err := call(ctx, h.addr, "find", url.Values{"attempt": {req.AttemptID}}, &sid)
	return sid, err
}

// call posts to the service and decodes its JSON answer into out.
func call(ctx context.Context, addr, op string, args url.Values, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/"+op+"?"+args.Encode(), nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("session service: %s: %s", op, strings.TrimSpace(string(b)))
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// session is a child session as the service keeps it.
type session struct {
	State string `json:"state"` // alive, ended, gone
	Text  string `json:"text,omitempty"`
}

// serve runs the session service until stop is closed (its stdin), after
// printing its address.
func serve(stop io.Reader, w io.Writer) error {
	var mu sync.Mutex
	sessions := map[string]*session{}
	byAttempt := map[string]string{}
	reply := func(rw http.ResponseWriter, v any) { _ = json.NewEncoder(rw).Encode(v) }
	mux := http.NewServeMux()
	mux.HandleFunc("POST /start", func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		a := r.URL.Query().Get("attempt")
		sid := "ses-" + a
		sessions[sid], byAttempt[a] = &session{State: "alive"}, sid
		reply(rw, sid)
	})
	mux.HandleFunc("POST /status", func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if s := sessions[r.URL.Query().Get("sid")]; s != nil {
			reply(rw, s)
			return
		}
		reply(rw, session{State: "gone"})
	})
	mux.HandleFunc("POST /find", func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		reply(rw, byAttempt[r.URL.Query().Get("attempt")])
	})
	mux.HandleFunc("POST /finish", func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		s := sessions[r.URL.Query().Get("sid")]
		if s == nil {
			http.Error(rw, "no such session", http.StatusNotFound)
			return
		}
		s.State, s.Text = "ended", r.URL.Query().Get("text")
	})
	mux.HandleFunc("POST /abort", func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		delete(sessions, r.URL.Query().Get("sid"))
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	fmt.Fprintln(w, ln.Addr().String())
	go func() { _, _ = io.Copy(io.Discard, stop); _ = srv.Close() }()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
