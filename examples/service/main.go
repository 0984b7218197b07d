// Command service wraps a bgtask Manager in a small HTTP service and keeps a
// client-side Mirror in sync with it:
//
//	GET  /tasks              the complete snapshot (JSON)
//	GET  /events             server-sent events, one per change; an
//	                         "event: lagged" tells the client to resync
//	POST /tasks/{id}/cancel  cancel a task
//
// The demo launches a few in-process tasks, follows them from a client over
// real loopback HTTP, and prints what the client's mirror holds at the end.
//
//	go run ./examples/service
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/mirror"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "service:", err)
		os.Exit(1)
	}
}

// Handler serves a Manager over HTTP. buffer is each event stream's
// subscription buffer (0: the default); a client that falls further behind
// is told it lagged.
func Handler(m *bgtask.Manager, buffer int) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /tasks", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(m.Snapshot())
	})
	mux.HandleFunc("POST /tasks/{id}/cancel", func(w http.ResponseWriter, r *http.Request) {
		err := m.Cancel(r.Context(), r.PathValue("id"))
		switch {
		case errors.Is(err, bgtask.ErrUnknownTask):
			http.Error(w, err.Error(), http.StatusNotFound)
		case err != nil:
			http.Error(w, err.Error(), http.StatusConflict)
		default:
			w.WriteHeader(http.StatusNoContent)
		}
	})
	mux.HandleFunc("GET /events", func(w http.ResponseWriter, r *http.Request) {
		flusher, ok := w.(http.Flusher)
		if !ok {
			http.Error(w, "streaming unsupported", http.StatusInternalServerError)
			return
		}
		sub, err := m.Subscribe(r.Context(), buffer)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer sub.Close()
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-cache")
		fmt.Fprint(w, ": subscribed\n\n") // the client may take its snapshot now
		flusher.Flush()
		for c := range sub.C {
			b, _ := json.Marshal(c)
			fmt.Fprintf(w, "id: %d\nevent: change\ndata: %s\n\n", c.Seq, b)
			flusher.Flush()
		}
		if errors.Is(sub.Err(), bgtask.ErrLagged) {
			fmt.Fprint(w, "event: lagged\ndata: {}\n\n")
			flusher.Flush()
		}
	})
	return mux
}

// Client keeps a Mirror in sync with a service: it subscribes to /events
// first, then applies the /tasks snapshot, and applies every change as it
// comes; the Mirror orders them by sequence. On "lagged" it resyncs.
type Client struct {
	Base   string
	HTTP   *http.Client
	Mirror mirror.Mirror
}

// Follow runs until ctx ends or the stream closes. ready, if not nil, is
// closed once the first snapshot is applied.
func (c *Client) Follow(ctx context.Context, ready chan<- struct{}) error {
	for {
		lagged, err := c.follow(ctx, ready)
		ready = nil
		if err != nil || !lagged {
			return err
		}
	}
}

func (c *Client) follow(ctx context.Context, ready chan<- struct{}) (lagged bool, err error) {
	resp, err := c.do(ctx, http.MethodGet, "/events")
	if err != nil {
		if ctx.Err() != nil {
			return false, nil // asked to stop
		}
		return false, err
	}
	defer resp.Body.Close()
	rd := bufio.NewReader(resp.Body)
	if _, err := rd.ReadString('\n'); err != nil { // ": subscribed"
		return false, err
	}
	// Fetch the snapshot while the events keep coming: changes newer than
	// the snapshot may be applied before it, and the Mirror keeps them.
	snapped := make(chan error, 1)
	go func() {
		err := c.Resync(ctx)
		if err == nil && ready != nil {
			close(ready)
		}
		snapped <- err
	}()
	defer func() {
		if serr := <-snapped; err == nil && serr != nil && ctx.Err() == nil {
			err = serr
		}
	}()
	event, data := "", ""
	for {
		line, err := rd.ReadString('\n')
		if err != nil {
			if errors.Is(err, io.EOF) || ctx.Err() != nil {
				return false, nil
			}
			return false, err
		}
		line = strings.TrimRight(line, "\r\n")
		switch {
		case strings.HasPrefix(line, "event: "):
			event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			data = strings.TrimPrefix(line, "data: ")
		case line == "" && event == "lagged":
			return true, nil
		case line == "" && event == "change":
			var ch bgtask.Change
			if err := json.Unmarshal([]byte(data), &ch); err != nil {
				return false, err
			}
			c.Mirror.ApplyChange(ch)
			event, data = "", ""
		}
	}
}

// Resync fetches and applies a complete snapshot.
func (c *Client) Resync(ctx context.Context) error {
	resp, err := c.do(ctx, http.MethodGet, "/tasks")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var snap bgtask.Snapshot
	if err := json.NewDecoder(resp.Body).Decode(&snap); err != nil {
		return err
	}
	c.Mirror.ApplySnapshot(snap)
	return nil
}

// Cancel asks the service to cancel a task.
func (c *Client) Cancel(ctx context.Context, id string) error {
	resp, err := c.do(ctx, http.MethodPost, "/tasks/"+id+"/cancel")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("cancel %s: %s: %s", id, resp.Status, strings.TrimSpace(string(b)))
	}
	return nil
}

// do sends a request with no body to the service.
func (c *Client) do(ctx context.Context, method, path string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, c.Base+path, nil)
	if err != nil {
		return nil, err
	}
	return c.HTTP.Do(req)
}

func run(ctx context.Context, w io.Writer) error {
	release := make(chan struct{})
	m := bgtask.New(bgtask.NewFuncHost(func(ctx context.Context, run bgtask.Run) (string, error) {
		run.Busy()
		if run.Prompt == "wait" {
			<-ctx.Done()
			return "", ctx.Err()
		}
		select {
		case <-release:
		case <-ctx.Done():
			return "", ctx.Err()
		}
		if run.Attempt == 1 && run.Prompt == "flaky" {
			return "", errors.New("503 Service Unavailable")
		}
		return "done: " + run.Prompt, nil
	}), bgtask.WithIDs(bgtask.SequentialIDs()))
	defer m.Shutdown(context.Background())

	srv := httptest.NewServer(Handler(m, 0))
	defer srv.Close()
	client := &Client{Base: srv.URL, HTTP: srv.Client()}
	fctx, stop := context.WithCancel(ctx)
	defer stop()
	ready := make(chan struct{})
	followed := make(chan error, 1)
	go func() { followed <- client.Follow(fctx, ready) }()
	<-ready

	models := []bgtask.Model{{Provider: "local", ID: "a"}, {Provider: "local", ID: "b"}}
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
	// The mirror has caught up once it holds what the Manager holds.
	want := m.Snapshot()
	if err := client.Mirror.Wait(ctx, func(got []bgtask.Task) bool { return converged(got, want) }); err != nil {
		return err
	}
	stop()
	<-followed
	for _, t := range client.Mirror.Tasks() {
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
