package fleetdemo

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/jackc/pgx/v5/pgxpool"
)

// WorkerEnv names the environment variable that makes this binary a
// worker: its value is the worker's member. The coordinator sets it, and
// the worker's database, ledger and service in the variables below.
const (
	WorkerEnv  = "BGTASK_FLEET_WORKER"
	dbEnv      = "BGTASK_FLEET_DB"
	ledgerEnv  = "BGTASK_FLEET_LEDGER"
	serviceEnv = "BGTASK_FLEET_SERVICE"
	leaseEnv   = "BGTASK_FLEET_LEASE"
	beatEnv    = "BGTASK_FLEET_HEARTBEAT" // optional: the lease's heartbeat
)

// IsWorker reports whether this process was started as a worker.
func IsWorker() bool { return os.Getenv(WorkerEnv) != "" }

// WorkerMain runs this process as a worker until its stdin closes or it
// is signalled, and exits.
func WorkerMain() {
	if err := worker(); err != nil {
		fmt.Fprintf(os.Stderr, "worker %s: %v\n", os.Getenv(WorkerEnv), err)
		os.Exit(1)
	}
	os.Exit(0)
}

// client calls the service for one member.
type client struct {
	base, member string
	http         *http.Client
}

func (c client) call(ctx context.Context, path string, in, out any) error {
	body, err := json.Marshal(in)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("X-Member", c.member)
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
		return fmt.Errorf("%s: %s: %s", path, resp.Status, strings.TrimSpace(string(msg)))
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// host is the service as a bgtask.StatusHost.
type host struct{ c client }

func (h host) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	var out struct{ SessionID string }
	err := h.c.call(ctx, "/start", req, &out)
	return out.SessionID, err
}

func (h host) AbortSession(ctx context.Context, id string) error {
	return h.c.call(ctx, "/abort", sessionArg{id}, nil)
}

func (h host) SessionStatus(ctx context.Context, id string) (bgtask.SessionReport, error) {
	var out bgtask.SessionReport
	err := h.c.call(ctx, "/status", sessionArg{id}, &out)
	return out, err
}

func (h host) FindSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	var out struct{ SessionID string }
	err := h.c.call(ctx, "/find", req, &out)
	return out.SessionID, err
}

// notifier delivers to the service.
type notifier struct{ c client }

func (n notifier) Notify(ctx context.Context, note bgtask.Notification) error {
	return n.c.call(ctx, "/notify", note, nil)
}

func worker() error {
	member := os.Getenv(WorkerEnv)
	lease, err := time.ParseDuration(os.Getenv(leaseEnv))
	if err != nil {
		return fmt.Errorf("%s: %w", leaseEnv, err)
	}
	var beat time.Duration
	if v := os.Getenv(beatEnv); v != "" {
		if beat, err = time.ParseDuration(v); err != nil {
			return fmt.Errorf("%s: %w", beatEnv, err)
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv(dbEnv))
	if err != nil {
		return err
	}
	defer pool.Close()
	c := client{base: os.Getenv(serviceEnv), member: member, http: &http.Client{Timeout: 30 * time.Second}}
	node, err := pgledger.Join(ctx, pool, pgledger.NodeOptions{
		Ledger: os.Getenv(ledgerEnv), Member: member, Lease: lease, Heartbeat: beat, Holder: "worker " + member + fmt.Sprintf(" (pid %d)", os.Getpid()),
		Host: host{c}, Notifier: notifier{c}, Poll: 100 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = node.Close(context.Background())
		return err
	}
	srv := &http.Server{Handler: api(node), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(l) }()
	fmt.Printf("ready http://%s\n", l.Addr())
	go func() { // the coordinator closing our stdin is the end
		_, _ = io.Copy(io.Discard, bufio.NewReader(os.Stdin))
		stop()
	}()
	<-ctx.Done()
	_ = srv.Close()
	<-served
	done, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return node.Close(done)
}

// launchArg, observeArg and closeArg are the worker API's requests.
type launchArg struct {
	Parent string `json:"parent"`
	Prompt string `json:"prompt"`
	// Within, if set, is the launch's deadline (the caller's context).
	Within time.Duration `json:"within,omitempty"`
	// Budget, if set, is the task's (Spec.Budget).
	Budget *bgtask.Budget `json:"budget,omitempty"`
}

type closeArg struct {
	Session string `json:"session"`
}

type answer struct {
	Task   *bgtask.Task          `json:"task,omitempty"`
	Report *bgtask.ClosureReport `json:"report,omitempty"`
	Err    string                `json:"error,omitempty"`
	Kind   string                `json:"kind,omitempty"` // "unknown", "stale", "closing", "unavailable", "undecided", "budget" for errors the caller may act on
	Took   time.Duration         `json:"took,omitempty"` // how long the call took in the worker
}

func errAnswer(err error) answer {
	a := answer{Err: err.Error()}
	switch {
	case errors.Is(err, bgtask.ErrUnknownSession):
		a.Kind = "unknown"
	case errors.Is(err, bgtask.ErrStaleEvent):
		a.Kind = "stale"
	case errors.Is(err, bgtask.ErrBranchClosing):
		a.Kind = "closing"
	case errors.Is(err, pgledger.ErrUnavailable):
		a.Kind = "unavailable"
	case errors.Is(err, bgtask.ErrDurabilityUnknown):
		a.Kind = "undecided"
	case errors.Is(err, bgtask.ErrBudget):
		a.Kind = "budget"
	}
	return a
}

// models is every task's fallback chain.
var models = []bgtask.Model{{Provider: "a", ID: "one"}, {Provider: "b", ID: "two"}}

func api(node *pgledger.Node) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /launch", func(w http.ResponseWriter, r *http.Request) {
		var a launchArg
		if !decode(w, r, &a) {
			return
		}
		ctx := r.Context()
		if a.Within > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, a.Within)
			defer cancel()
		}
		began := time.Now()
		t, err := node.Launch(ctx, bgtask.Spec{ParentSessionID: a.Parent, Prompt: a.Prompt, Models: models, Budget: a.Budget})
		if err != nil {
			out := errAnswer(err)
			out.Took = time.Since(began)
			reply(w, out)
			return
		}
		reply(w, answer{Task: &t, Took: time.Since(began)})
	})
	mux.HandleFunc("POST /observe", func(w http.ResponseWriter, r *http.Request) {
		var ev bgtask.Event
		if !decode(w, r, &ev) {
			return
		}
		if err := node.Observe(context.Background(), ev); err != nil {
			reply(w, errAnswer(err))
			return
		}
		reply(w, answer{})
	})
	mux.HandleFunc("POST /close", func(w http.ResponseWriter, r *http.Request) {
		var a closeArg
		if !decode(w, r, &a) {
			return
		}
		rep, err := node.Stop(r.Context(), bgtask.Target{Session: a.Session})
		out := answer{Report: &rep}
		if err != nil {
			out.Err = err.Error()
		}
		reply(w, out)
	})
	return mux
}
