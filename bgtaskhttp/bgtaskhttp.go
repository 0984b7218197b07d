// Package bgtaskhttp serves a bgtask Manager over HTTP, and is the Go
// client of what it serves:
//
//	GET  /snapshot                every task, as of a sequence (bgtask.Snapshot)
//	GET  /tasks                   a page: ?parent= &root= &status= (repeatable) &after= &limit=
//	GET  /tasks/{id}              one task
//	GET  /events                  the change stream, as server-sent events
//	POST /tasks/{id}/cancel       Cancel (204 once the child stopped)
//	POST /tasks/{id}/close        CloseTask: the task and its branch (a ClosureReport)
//	POST /sessions/{id}/close     CloseBranch below a session (a ClosureReport)
//	POST /tasks/{id}/extend       Extend, with {"prompt": "..."} ({"invocation": n})
//	GET  /                        the live view (View)
//
// The event stream first sends an "event: snapshot" (a bgtask.Snapshot),
// taken after the subscription began, then an "event: change" for every
// change (a bgtask.Change), each with the id "epoch:seq". A client that
// reconnects with that id in Last-Event-ID gets no snapshot when it missed
// nothing, and a new one when it did (a different process, or changes it
// missed). ": keepalive" comments keep idle connections open. A client that
// falls behind gets "event: lagged" and the stream ends: it reconnects.
//
// Errors are JSON, {"error": "...", "code": "..."}, with the code naming the
// bgtask sentinel and the status saying what kind: 404 unknown_task and
// forgotten, 409 branch_closing, not_running and key_held, 400
// invalid_argument and invalid_spec, 503 shutdown and journal, 500
// otherwise. The Client turns them back into errors that match the
// sentinels with errors.Is.
package bgtaskhttp

import (
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
)

// Options configure a Handler.
type Options struct {
	// Buffer is each event stream's subscription buffer (0: bgtask's
	// default); a client further behind is told it lagged.
	Buffer int
	// Keepalive is how often an idle event stream sends a comment
	// (0: 15s).
	Keepalive time.Duration
	// Page is served at "GET /"; nil: the live view (View).
	Page http.Handler
}

//go:embed view.html
var viewHTML []byte

// View serves the live view: one page (HTML, CSS and a little JavaScript,
// no build step, nothing fetched from elsewhere) that shows the tasks
// grouped by parent session, each with its attempt timeline (model,
// status, session, error), activity, progress, outcome and envelope, kept
// up to date from /events, with cancel and close-branch buttons. It
// renders only the tasks that changed, so it stays usable with thousands.
// Handler serves it at "/".
func View() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Cache-Control", "no-cache")
		_, _ = w.Write(viewHTML)
	})
}

// codes maps the sentinels to their wire names and statuses, most
// specific first.
var codes = []struct {
	err    error
	code   string
	status int
}{
	{bgtask.ErrUnknownTask, "unknown_task", http.StatusNotFound},
	{bgtask.ErrUnknownSession, "unknown_session", http.StatusNotFound},
	{errTooLarge, "too_large", http.StatusRequestEntityTooLarge},
	{errCrossOrigin, "cross_origin", http.StatusForbidden},
	{bgtask.ErrForgotten, "forgotten", http.StatusNotFound},
	{bgtask.ErrBranchClosing, "branch_closing", http.StatusConflict},
	{bgtask.ErrNotRunning, "not_running", http.StatusConflict},
	{bgtask.ErrKeyHeld, "key_held", http.StatusConflict},
	{bgtask.ErrNoPrompter, "no_prompter", http.StatusConflict},
	{bgtask.ErrPromptRefused, "prompt_refused", http.StatusConflict},
	{bgtask.ErrNoInvocation, "no_invocation", http.StatusNotFound},
	{bgtask.ErrInvalidArgument, "invalid_argument", http.StatusBadRequest},
	{bgtask.ErrInvalidSpec, "invalid_spec", http.StatusBadRequest},
	{bgtask.ErrBranchNotStopped, "branch_not_stopped", http.StatusConflict},
	{bgtask.ErrStopPending, "stop_pending", http.StatusConflict},
	{bgtask.ErrShutdown, "shutdown", http.StatusServiceUnavailable},
	{bgtask.ErrJournal, "journal", http.StatusServiceUnavailable},
	{context.DeadlineExceeded, "deadline_exceeded", http.StatusGatewayTimeout},
	{context.Canceled, "canceled", http.StatusRequestTimeout},
}

// errTooLarge and errCrossOrigin are a request refused before it reached
// the Manager.
var (
	errTooLarge    = errors.New("bgtaskhttp: request body too large")
	errCrossOrigin = errors.New("bgtaskhttp: cross-origin request refused")
)

// sameOrigin refuses a state-changing request a browser sent from another
// site: one whose Sec-Fetch-Site is not same-origin (or none: typed, not
// scripted), or whose Origin is not this host. Clients that are not
// browsers send neither header, and pass.
func sameOrigin(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" && site != "none" {
			writeError(w, errCrossOrigin)
			return
		}
		if origin := r.Header.Get("Origin"); origin != "" && origin != "null" {
			if u, err := url.Parse(origin); err != nil || u.Host != r.Host {
				writeError(w, errCrossOrigin)
				return
			}
		} else if origin == "null" {
			writeError(w, errCrossOrigin)
			return
		}
		next(w, r)
	}
}

// errorBody is an error on the wire.
type errorBody struct {
	Error string `json:"error"`
	Code  string `json:"code"`
	// Report is a closure's, when some run in it did not stop.
	Report *bgtask.ClosureReport `json:"report,omitempty"`
}

func writeError(w http.ResponseWriter, err error) {
	status, code := http.StatusInternalServerError, "internal"
	for _, c := range codes {
		if errors.Is(err, c.err) {
			status, code = c.status, c.code
			break
		}
	}
	writeJSON(w, status, errorBody{Error: err.Error(), Code: code})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// Handler serves m; see the package doc for what. State-changing requests
// from a browser page of another origin are refused (403 cross_origin),
// and extend takes only a JSON body.
func Handler(m *bgtask.Manager, o Options) http.Handler {
	if m == nil {
		panic("bgtaskhttp: Handler of a nil Manager")
	}
	if o.Keepalive <= 0 {
		o.Keepalive = 15 * time.Second
	}
	mux := http.NewServeMux()
	if o.Page == nil {
		o.Page = View()
	}
	mux.Handle("GET /{$}", o.Page)
	mux.HandleFunc("GET /snapshot", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, m.Snapshot())
	})
	mux.HandleFunc("GET /tasks", func(w http.ResponseWriter, r *http.Request) {
		q, err := queryOf(r)
		if err != nil {
			writeError(w, err)
			return
		}
		p, err := m.Tasks(q)
		if err != nil {
			writeError(w, err)
			return
		}
		if p.Tasks == nil {
			p.Tasks = []bgtask.Task{}
		}
		writeJSON(w, http.StatusOK, pageJSON{Tasks: p.Tasks, Next: p.Next})
	})
	mux.HandleFunc("GET /tasks/{id}", func(w http.ResponseWriter, r *http.Request) {
		t, err := m.Task(r.PathValue("id"))
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, t)
	})
	mux.HandleFunc("POST /tasks/{id}/cancel", sameOrigin(func(w http.ResponseWriter, r *http.Request) {
		if err := m.Cancel(r.Context(), r.PathValue("id")); err != nil {
			writeError(w, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	closed := func(w http.ResponseWriter, rep bgtask.ClosureReport, err error) {
		switch {
		case errors.Is(err, bgtask.ErrBranchNotStopped): // some run did not stop: the report names it
			writeJSON(w, http.StatusConflict, errorBody{Error: err.Error(), Code: "branch_not_stopped", Report: &rep})
		case err != nil:
			writeError(w, err)
		default:
			writeJSON(w, http.StatusOK, rep)
		}
	}
	mux.HandleFunc("POST /tasks/{id}/close", sameOrigin(func(w http.ResponseWriter, r *http.Request) {
		rep, err := m.CloseTask(r.Context(), r.PathValue("id"))
		closed(w, rep, err)
	}))
	mux.HandleFunc("POST /sessions/{id}/close", sameOrigin(func(w http.ResponseWriter, r *http.Request) {
		rep, err := m.CloseBranch(r.Context(), r.PathValue("id"))
		closed(w, rep, err)
	}))
	mux.HandleFunc("POST /tasks/{id}/extend", sameOrigin(func(w http.ResponseWriter, r *http.Request) {
		if ct, _, _ := strings.Cut(r.Header.Get("Content-Type"), ";"); strings.TrimSpace(ct) != "application/json" {
			writeError(w, fmt.Errorf("%w: extend takes an application/json body", bgtask.ErrInvalidArgument))
			return
		}
		var body struct {
			Prompt string `json:"prompt"`
		}
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20)).Decode(&body); err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				writeError(w, errTooLarge)
				return
			}
			writeError(w, fmt.Errorf("%w: body: %v", bgtask.ErrInvalidArgument, err))
			return
		}
		n, err := m.Extend(r.Context(), r.PathValue("id"), body.Prompt)
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, map[string]int{"invocation": n})
	}))
	mux.HandleFunc("GET /events", func(w http.ResponseWriter, r *http.Request) { stream(w, r, m, o) })
	return mux
}

// pageJSON is a Page on the wire.
type pageJSON struct {
	Tasks []bgtask.Task `json:"tasks"`
	Next  string        `json:"next,omitempty"`
}

// queryOf reads a Query from the URL.
func queryOf(r *http.Request) (bgtask.Query, error) {
	v := r.URL.Query()
	q := bgtask.Query{Parent: v.Get("parent"), Root: v.Get("root"), After: v.Get("after")}
	for _, s := range v["status"] {
		q.Statuses = append(q.Statuses, bgtask.Status(s))
	}
	if l := v.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil {
			return q, fmt.Errorf("%w: limit %q is not a number", bgtask.ErrInvalidArgument, l)
		}
		q.Limit = n
	}
	return q, nil
}

// writeTimeout bounds one write of the event stream.
const writeTimeout = 30 * time.Second

// eventID is the SSE id of a change: its epoch and sequence.
func eventID(epoch, seq uint64) string {
	return strconv.FormatUint(epoch, 10) + ":" + strconv.FormatUint(seq, 10)
}

// parseEventID reads what eventID wrote.
func parseEventID(s string) (epoch, seq uint64, ok bool) {
	a, b, found := strings.Cut(s, ":")
	if !found {
		return 0, 0, false
	}
	e, err1 := strconv.ParseUint(a, 10, 64)
	q, err2 := strconv.ParseUint(b, 10, 64)
	return e, q, err1 == nil && err2 == nil
}

// stream serves the change stream of m to one client.
func stream(w http.ResponseWriter, r *http.Request, m *bgtask.Manager, o Options) {
	flusher, ok := w.(http.Flusher)
	if !ok {
		writeError(w, errors.New("bgtaskhttp: the connection cannot stream"))
		return
	}
	sub, err := m.Subscribe(r.Context(), o.Buffer)
	if err != nil {
		writeError(w, err)
		return
	}
	defer sub.Close()
	snap := m.Snapshot() // after subscribing: every later change is on the stream
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	deadline := func() { _ = rc.SetWriteDeadline(time.Now().Add(writeTimeout)) } // a client that stops reading is let go
	deadline()
	last := snap.Seq
	if epoch, seq, ok := parseEventID(r.Header.Get("Last-Event-ID")); !ok || epoch != snap.Epoch || seq != snap.Seq {
		b, err := json.Marshal(snap)
		if err != nil {
			return
		}
		fmt.Fprintf(w, "id: %s\nevent: snapshot\ndata: %s\n\n", eventID(snap.Epoch, snap.Seq), b)
	} else {
		last = seq // it has everything up to seq: only later changes are news
		fmt.Fprint(w, ": resumed\n\n")
	}
	flusher.Flush()
	tick := time.NewTicker(o.Keepalive)
	defer tick.Stop()
	for {
		select {
		case c, open := <-sub.C:
			if !open {
				if errors.Is(sub.Err(), bgtask.ErrLagged) {
					fmt.Fprint(w, "event: lagged\ndata: {}\n\n")
					flusher.Flush()
				}
				return
			}
			if c.Seq <= last {
				continue // the snapshot (or the client) has it
			}
			b, err := json.Marshal(c)
			if err != nil {
				return
			}
			deadline()
			if _, err := fmt.Fprintf(w, "id: %s\nevent: change\ndata: %s\n\n", eventID(c.Epoch, c.Seq), b); err != nil {
				return
			}
			flusher.Flush()
		case <-tick.C:
			deadline()
			if _, err := fmt.Fprint(w, ": keepalive\n\n"); err != nil {
				return
			}
			flusher.Flush()
		case <-r.Context().Done():
			return
		}
	}
}
