// Package bgtaskhttp serves a bgtask Manager over HTTP — or a whole
// pgledger fleet, through any Source (pgledger/fleetview) — and is the Go
// client of what it serves:
//
//	GET  /snapshot                every task, as of a sequence (bgtask.Snapshot)
//	GET  /tasks                   a page: ?parent= &root= &status= (repeatable) &after= &limit=
//	GET  /tasks/{id}              one task
//	GET  /tasks/{id}/history      its history, oldest first (Manager.History: []bgtask.RecordView)
//	GET  /events                  the change stream, as server-sent events
//	POST /tasks/{id}/cancel       Stop of the task (Target.Task; ?token=: only that run, Target.Run)
//	POST /tasks/{id}/close        Stop with Tree: the task and everything beneath it
//	POST /sessions/{id}/close     Stop of a session: everything it started (Target.Session)
//	POST /tasks/cancel, /tasks/close  the same of every task a table's filters select (?status=…&model=…&expect=N: bulk.go)
//	POST /tasks/{id}/extend       Extend, with {"prompt": "..."} ({"invocation": n})
//	GET  /health                  model and provider health ({"kept": bool, "health": [...]})
//	GET  /processes               a Fleet's processes ({"fleet": bool, "processes": [...]})
//	POST /health/reset            ResetHealth, with {"key": "provider/id" or "provider"} (204)
//	GET  /                        the live view (View)
//	GET  /view/...                the live view's detail pages and assets
//
// Each of the three stop routes is Manager.Stop and answers 200 with its
// bgtask.ClosureReport once everything it stopped has stopped, or, with
// ?nowait=1 (Target.NoWait), once the stop is recorded and, for a close,
// its fence is up. A close in which some run did not stop answers 409
// branch_not_stopped with the report. Client.Stop takes a bgtask.Target
// and calls the route that serves it.
//
// # Who may call it
//
// Without Options.Authorize, anyone who can reach the address may read every
// task — prompts, results, errors, metadata and envelopes, through
// /snapshot, /tasks, /events and the page — and stop and extend tasks. Every
// request is checked before its route runs: its Host must be one of
// Options.Hosts (by default only loopback names: "localhost", 127.0.0.0/8
// and ::1, so a DNS-rebinding page, whose own name resolves to 127.0.0.1, is
// refused: 403 host_not_allowed), then Options.Authorize, if set, must
// return nil (401 unauthorized). Options.ReadOnly turns the actions off (403
// read_only). An action from a browser page of another origin
// (Sec-Fetch-Site, or Origin with another scheme or host) is refused (403
// cross_origin). Every answer forbids framing (Content-Security-Policy
// frame-ancestors 'none', X-Frame-Options DENY) and sniffing, and sends no
// Referer. Each action runs under Options.ActionTimeout (504
// deadline_exceeded: it may still take effect).
//
// # The event stream
//
// The event stream first sends an "event: snapshot" (a bgtask.Snapshot),
// taken after the subscription began, then an "event: change" for every
// change (a bgtask.Change) after it, in order, each with the id
// "epoch:seq". A change also says "was", the status its task had before
// (absent for a task new to the stream), and "top", the task at the top
// of its tree: what a page needs to tell by itself whether it shows the
// change, and to keep its counts. A client that reconnects with that id in Last-Event-ID (or
// in ?lastEventId=, which a page that rendered a snapshot can name on its
// first connection) gets ": resumed" and no snapshot when it missed
// nothing the server still holds, and a snapshot when it did (a
// different process, or more changes than Options.StreamBuffer).
// ": keepalive" comments keep idle connections open. A client that falls
// more than Options.StreamBuffer bytes behind gets "event: lagged" and the
// stream ends: it reconnects. Every write is under
// Options.StreamWriteTimeout, which replaces the server's WriteTimeout (a
// server's WriteTimeout and ReadTimeout do not end a stream): a client
// that does not read is dropped once the kernel's buffers are full, having
// cost the server about 35 KB (and the socket's buffers in the kernel).
// One Manager subscription serves every stream, and each snapshot and
// change is encoded once, for all; at most Options.MaxStreams streams are
// open at once (503 too_many_streams).
//
// Errors are JSON, {"error": "...", "code": "..."}, with the code naming the
// bgtask sentinel or the refusal, and the status saying what kind: 404
// unknown_task, unknown_session and forgotten; 409 branch_closing,
// not_running, key_held, unsupported (errors.ErrUnsupported: what the
// Manager's host cannot do), prompt_refused, branch_not_stopped,
// stop_pending, not_cooling and selection_changed (a bulk action whose
// filters select another count than confirmed); 400 invalid_argument (any
// bad argument: a
// Spec, an invocation, a query — an unknown status, a limit out of range
// —, a body that is not one JSON object of the route's fields); 401
// unauthorized; 403 host_not_allowed, cross_origin and read_only; 413
// too_large; 408 canceled; 504
// deadline_exceeded; 503 shutdown, journal and too_many_streams; 500
// internal otherwise; a Source's own error may name its code and status
// (a fleet's 503 owner_gone: the process that owns the task is gone).
// The Client turns the sentinels' codes back into
// errors that match them with errors.Is.
package bgtaskhttp

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/statusarg"
	"github.com/bgtask/bgtask/internal/wirecode"
)

// Options configure a Handler.
type Options struct {
	// Authorize, if set, is asked about every request (page, reads,
	// stream, actions) once its Host passed: a non-nil error refuses it,
	// 401 unauthorized (the error is not sent). Otherwise actor names who
	// asks ("": no one in particular), and the stops the request makes
	// record it (bgtask.Target.Actor: Task.Stop.Actor, a closure's
	// ClosureReport.Actor); a name that is not one line of printable text
	// is made one (its other characters dropped, cut at 200 bytes). nil:
	// every request is allowed — see the package doc for what that
	// exposes.
	Authorize func(r *http.Request) (actor string, err error)
	// ReadOnly turns the actions (cancel, close, extend) off: they answer
	// 403 read_only, and the page offers none.
	ReadOnly bool
	// Hosts are the host names (a port is ignored, case too) requests may
	// name in Host; "*" allows any. nil or empty: the loopback names only
	// ("localhost", 127.x.y.z, ::1). Others get 403 host_not_allowed:
	// list the names the service is reached by.
	Hosts []string
	// ActionTimeout bounds each action (0: 30s), and the reading of its
	// body; past it the action answers 504 deadline_exceeded.
	ActionTimeout time.Duration
	// MaxStreams caps the event streams open at once (0: 100); more get
	// 503 too_many_streams.
	MaxStreams int
	// StreamBuffer is how many bytes of changes are kept for the event
	// streams (0: 4 MiB), once for them all: a stream further behind is
	// told it lagged, and a new stream that would need older ones gets a
	// new snapshot.
	StreamBuffer int
	// StreamWriteTimeout bounds each write of an event stream, keepalives
	// too (0: 30s): a client that does not take the bytes within it is
	// dropped.
	StreamWriteTimeout time.Duration
	// Buffer is the buffer of the one Manager subscription the event
	// streams share (0: 4096, four times the default buffer of Manager.Subscribe); should the
	// Manager get that far ahead of it, every stream is told it lagged.
	Buffer int
	// Keepalive is how often an idle event stream sends a comment
	// (0: 15s).
	Keepalive time.Duration
	// Page is served at "GET /"; nil: the live view (View).
	Page http.Handler

	streamNote func(event string) // tests: what the event streams do
}

// codes maps the handler's own refusals to their wire names and
// statuses; bgtask's sentinels have theirs in wirecode.
var codes = []wirecode.Sentinel{
	{Err: errTooLarge, Code: "too_large", Status: http.StatusRequestEntityTooLarge},
	{Err: errCrossOrigin, Code: "cross_origin", Status: http.StatusForbidden},
	{Err: errUnauthorized, Code: "unauthorized", Status: http.StatusUnauthorized},
	{Err: errHostNotAllowed, Code: "host_not_allowed", Status: http.StatusForbidden},
	{Err: errReadOnly, Code: "read_only", Status: http.StatusForbidden},
	{Err: errTooManyStreams, Code: "too_many_streams", Status: http.StatusServiceUnavailable},
}

// errorBody is an error on the wire.
type errorBody struct {
	Error string `json:"error"`
	Code  string `json:"code"`
	// Report is a closure's, when some run in it did not stop.
	Report *bgtask.ClosureReport `json:"report,omitempty"`
}

func writeError(w http.ResponseWriter, err error) {
	status, code := statusOf(err)
	writeJSON(w, status, errorBody{Error: err.Error(), Code: code})
}

// statusOf is err's HTTP status and wire code (codes): 500 internal for
// an error that names none, or whose own methods panic.
func statusOf(err error) (status int, code string) {
	defer func() {
		if recover() != nil {
			status, code = http.StatusInternalServerError, "internal"
		}
	}()
	for _, c := range codes {
		if errors.Is(err, c.Err) {
			return c.Status, c.Code
		}
	}
	if code, status, ok := wirecode.Of(err); ok {
		return status, code
	}
	return http.StatusInternalServerError, "internal"
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeBig writes v as writeJSON does, gzipped when r accepts it: what
// may be large (a snapshot, a page of tasks, a history, an export).
// JSON of tasks compresses about tenfold; Go's http.Client asks for it
// and reads it back by itself.
func writeBig(w http.ResponseWriter, r *http.Request, v any) {
	if !acceptsGzip(r) {
		writeJSON(w, http.StatusOK, v)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Encoding", "gzip")
	w.Header().Add("Vary", "Accept-Encoding")
	w.WriteHeader(http.StatusOK)
	z, _ := gzip.NewWriterLevel(w, gzip.BestSpeed)
	_ = json.NewEncoder(z).Encode(v)
	_ = z.Close()
}

// acceptsGzip says whether r's Accept-Encoding takes gzip.
func acceptsGzip(r *http.Request) bool {
	for _, part := range strings.Split(r.Header.Get("Accept-Encoding"), ",") {
		name, q, _ := strings.Cut(strings.TrimSpace(part), ";")
		if strings.EqualFold(strings.TrimSpace(name), "gzip") && strings.ReplaceAll(strings.TrimSpace(q), " ", "") != "q=0" {
			return true
		}
	}
	return false
}

// Source is what a Handler serves: a *bgtask.Manager — one process's
// tasks — or a fleet's view of every process's (pgledger's Node.View).
// Its methods are the Manager's, and do what the Manager's do.
type Source interface {
	Snapshot() bgtask.Snapshot
	// Subscribe delivers every change after the Snapshot taken next: a
	// Handler subscribes, then takes the Snapshot it starts from.
	Subscribe(ctx context.Context, buffer int) (*bgtask.Subscription, error)
	Task(id string) (bgtask.Task, error)
	Tasks(q bgtask.Query) (bgtask.Page, error)
	History(ctx context.Context, id string) ([]bgtask.RecordView, error)
	Stop(ctx context.Context, t bgtask.Target) (bgtask.ClosureReport, error)
	Extend(ctx context.Context, id, prompt string) (int, error)
	// Extendable says whether the page offers extend on task id.
	Extendable(id string) bool
	Health() []bgtask.Health
	ResetHealth(ctx context.Context, key string) error
}

// Handler serves src; see the package doc for what, and for who may call
// it. Extend takes only a JSON body.
func Handler(src Source, o Options) http.Handler {
	if nilSource(src) {
		panic("bgtaskhttp: Handler of a nil Source")
	}
	m := src
	if o.Keepalive <= 0 {
		o.Keepalive = 15 * time.Second
	}
	if o.ActionTimeout <= 0 {
		o.ActionTimeout = 30 * time.Second
	}
	if o.MaxStreams <= 0 {
		o.MaxStreams = 100
	}
	if o.StreamBuffer <= 0 {
		o.StreamBuffer = 4 << 20
	}
	if o.Buffer <= 0 {
		o.Buffer = 4 * 1024 // four times a Subscribe buffer's default
	}
	if o.StreamWriteTimeout <= 0 {
		o.StreamWriteTimeout = 30 * time.Second
	}
	mux := http.NewServeMux()
	page := viewMux(m, o) // guarded with the rest, below
	if o.Page != nil {
		mux.Handle("GET /{$}", o.Page)
	} else {
		mux.Handle("GET /{$}", page)
	}
	mux.Handle("GET /view/", page)
	mux.HandleFunc("GET /snapshot", func(w http.ResponseWriter, r *http.Request) {
		writeBig(w, r, m.Snapshot())
	})
	mux.HandleFunc("GET /tasks", func(w http.ResponseWriter, r *http.Request) {
		q, err := queryOf(r)
		if err != nil {
			writeError(w, err)
			return
		}
		p, err := m.Tasks(q)
		if errors.Is(err, bgtask.ErrInvalidArgument) {
			err = badArgument{err} // a cursor of an unknown task is a bad argument, not a missing task
		}
		if err != nil {
			writeError(w, err)
			return
		}
		if p.Tasks == nil {
			p.Tasks = []bgtask.Task{}
		}
		writeBig(w, r, pageJSON{Tasks: p.Tasks, Next: p.Next})
	})
	mux.HandleFunc("GET /tasks/{id}/history", func(w http.ResponseWriter, r *http.Request) {
		h, err := m.History(r.Context(), r.PathValue("id"))
		if err != nil {
			writeError(w, err)
			return
		}
		if h == nil {
			h = []bgtask.RecordView{}
		}
		writeBig(w, r, h)
	})
	mux.HandleFunc("GET /tasks/{id}", func(w http.ResponseWriter, r *http.Request) {
		t, err := m.Task(r.PathValue("id"))
		if err != nil {
			writeError(w, err)
			return
		}
		writeJSON(w, http.StatusOK, t)
	})
	mux.HandleFunc("POST /tasks/{id}/cancel", action(o, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
		t := bgtask.Target{Task: r.PathValue("id"), NoWait: noWait(r), Actor: actorOf(r)}
		if token := r.URL.Query().Get("token"); token != "" {
			t.Run, t.Task = bgtask.RunRef{TaskID: t.Task, Token: token}, ""
		}
		rep, err := m.Stop(ctx, t)
		if err != nil {
			writeError(w, late(ctx, err))
			return
		}
		writeJSON(w, http.StatusOK, rep)
	}))
	closed := func(ctx context.Context, w http.ResponseWriter, rep bgtask.ClosureReport, err error) {
		switch err = late(ctx, err); {
		case errors.Is(err, bgtask.ErrBranchNotStopped): // some run did not stop: the report names it
			writeJSON(w, http.StatusConflict, errorBody{Error: err.Error(), Code: "branch_not_stopped", Report: &rep})
		case err != nil:
			writeError(w, err)
		default:
			writeJSON(w, http.StatusOK, rep)
		}
	}
	mux.HandleFunc("POST /tasks/cancel", action(o, bulk(m, false)))
	mux.HandleFunc("POST /tasks/close", action(o, bulk(m, true)))
	mux.HandleFunc("POST /tasks/{id}/close", action(o, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
		rep, err := m.Stop(ctx, bgtask.Target{Task: r.PathValue("id"), Tree: true, NoWait: noWait(r), Actor: actorOf(r)})
		closed(ctx, w, rep, err)
	}))
	mux.HandleFunc("POST /sessions/{id}/close", action(o, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
		rep, err := m.Stop(ctx, bgtask.Target{Session: r.PathValue("id"), NoWait: noWait(r), Actor: actorOf(r)})
		closed(ctx, w, rep, err)
	}))
	mux.HandleFunc("POST /tasks/{id}/extend", action(o, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
		var body struct {
			Prompt string `json:"prompt"`
		}
		if err := readJSON(ctx, w, r, &body); err != nil {
			writeError(w, err)
			return
		}
		n, err := m.Extend(ctx, r.PathValue("id"), body.Prompt)
		if err != nil {
			writeError(w, late(ctx, err))
			return
		}
		writeJSON(w, http.StatusOK, map[string]int{"invocation": n})
	}))
	mux.HandleFunc("GET /processes", func(w http.ResponseWriter, r *http.Request) {
		v := ProcessesView{Processes: []Process{}}
		if f, ok := m.(Fleet); ok {
			ps, err := f.Processes(r.Context())
			if err != nil {
				writeError(w, err)
				return
			}
			v.Fleet, v.Processes = true, append(v.Processes, ps...)
		}
		writeJSON(w, http.StatusOK, v)
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, healthOf(m))
	})
	mux.HandleFunc("POST /health/reset", action(o, func(ctx context.Context, w http.ResponseWriter, r *http.Request) {
		var body struct {
			Key string `json:"key"`
		}
		if err := readJSON(ctx, w, r, &body); err != nil {
			writeError(w, err)
			return
		}
		if err := m.ResetHealth(ctx, body.Key); err != nil {
			writeError(w, late(ctx, err))
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	mux.HandleFunc("GET /events", newHub(m, o).serve)
	return newGuard(mux, o)
}

// HealthView is GET /health's answer: whether the Manager keeps health
// (bgtask.WithHealth) and, if so, Manager.Health.
type HealthView struct {
	Kept   bool            `json:"kept"`
	Health []bgtask.Health `json:"health"`
}

func healthOf(m Source) HealthView {
	h := m.Health()
	v := HealthView{Kept: h != nil, Health: h}
	if v.Health == nil {
		v.Health = []bgtask.Health{}
	}
	return v
}

// pageJSON is a Page on the wire.
type pageJSON struct {
	Tasks []bgtask.Task `json:"tasks"`
	Next  string        `json:"next,omitempty"`
}

// badArgument is an error that is a bad argument and nothing else: its
// text as it is (it says "invalid argument" once already), matching
// bgtask.ErrInvalidArgument alone — not, say, the ErrUnknownTask of a
// cursor that names no task.
type badArgument struct{ err error }

func (e badArgument) Error() string        { return e.err.Error() }
func (e badArgument) Is(target error) bool { return target == bgtask.ErrInvalidArgument }

// queryOf reads a Query from the URL; an unknown status is refused, as
// the command line refuses it (statusarg).
func queryOf(r *http.Request) (bgtask.Query, error) {
	v := r.URL.Query()
	q := bgtask.Query{Parent: v.Get("parent"), Root: v.Get("root"), After: v.Get("after")}
	for _, s := range v["status"] {
		st, err := statusarg.Parse(s)
		if err != nil {
			return q, fmt.Errorf("%w: %v", bgtask.ErrInvalidArgument, err)
		}
		q.Statuses = append(q.Statuses, st)
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

// noWait reports whether a stop's request asks not to wait (?nowait=1).
func noWait(r *http.Request) bool {
	v := r.URL.Query().Get("nowait")
	return v == "1" || v == "true"
}

// nilSource reports whether src is nil, or a nil pointer in an interface.
func nilSource(src Source) bool {
	if src == nil {
		return true
	}
	v := reflect.ValueOf(src)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// Fleet is a Source that serves the tasks of several processes
// (pgledger/fleetview's View): the page lists its processes, and GET
// /processes answers them.
type Fleet interface {
	Source
	Processes(ctx context.Context) ([]Process, error)
}

// ProcessesView is GET /processes' answer: whether the Source is a Fleet
// and, if so, its processes.
type ProcessesView struct {
	Fleet     bool      `json:"fleet"`
	Processes []Process `json:"processes"`
}

// Process is one process of a Fleet: a member of a pgledger ledger, and
// the process that holds its lease.
type Process struct {
	Member  string    `json:"member"`
	Holder  string    `json:"holder"`
	Expires time.Time `json:"expires"`
	// Live says its lease has not lapsed; Idle, that it was given back
	// with nothing live. One that is neither is gone: its tasks wait for
	// another process to take it over, and actions on them answer 503
	// owner_gone.
	Live    bool `json:"live"`
	Idle    bool `json:"idle"`
	Running int  `json:"running"` // its tasks that have not ended
}
