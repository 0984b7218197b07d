package bgtaskhttp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
)

// Refusals made before a request reaches the Manager.
var (
	errTooLarge       = errors.New("bgtaskhttp: request body too large")
	errCrossOrigin    = errors.New("bgtaskhttp: cross-origin request refused")
	errUnauthorized   = errors.New("bgtaskhttp: unauthorized")
	errHostNotAllowed = errors.New("bgtaskhttp: host not allowed")
	errReadOnly       = errors.New("bgtaskhttp: read-only: actions are turned off (Options.ReadOnly)")
	errTooManyStreams = errors.New("bgtaskhttp: too many event streams (Options.MaxStreams); try again later")
)

// guard checks every request before its route runs — its Host, then
// Authorize — and sets the security headers on every answer.
type guard struct {
	next      http.Handler
	authorize func(*http.Request) (string, error)
	anyHost   bool
	hosts     map[string]bool // nil: the loopback names
}

func newGuard(next http.Handler, o Options) *guard {
	g := &guard{next: next, authorize: o.Authorize}
	for _, h := range o.Hosts {
		if h == "*" {
			g.anyHost = true
		}
		if g.hosts == nil {
			g.hosts = make(map[string]bool)
		}
		g.hosts[hostname(h)] = true
	}
	return g
}

func (g *guard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	// A page may set a fuller policy; none of it may be framed.
	h.Set("Content-Security-Policy", "frame-ancestors 'none'")
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	if name := hostname(r.Host); !g.allows(name) {
		writeError(w, fmt.Errorf("%w: %q is not in Options.Hosts (nil: loopback names only); set Options.Hosts to the names this service is reached by", errHostNotAllowed, name))
		return
	}
	if g.authorize != nil {
		actor, err := g.authorize(r)
		if err != nil {
			writeError(w, errUnauthorized) // the reason stays on the server
			return
		}
		if ctx := bgtask.WithActor(r.Context(), actor); bgtask.ActorOf(ctx) != "" {
			r = r.WithContext(ctx) // every action records it: a stop's Target.Actor, an Extend's Invocation.Actor
		}
	}
	g.next.ServeHTTP(w, r)
}

// actorOf is who asks request r, as Options.Authorize named them ("":
// no one in particular), made one line of printable text (WithActor).
func actorOf(r *http.Request) string { return bgtask.ActorOf(r.Context()) }

// allows reports whether a request to the host name may be served.
func (g *guard) allows(name string) bool {
	switch {
	case g.anyHost:
		return true
	case g.hosts != nil:
		return g.hosts[name]
	case name == "localhost":
		return true
	}
	a, err := netip.ParseAddr(name)
	return err == nil && a.IsLoopback()
}

// hostname is the name in a Host header (or an Options.Hosts entry):
// without its port or IPv6 brackets, lower case, without a final dot.
func hostname(host string) string {
	if strings.HasPrefix(host, "[") {
		if i := strings.IndexByte(host, ']'); i > 0 {
			host = host[1:i]
		}
	} else if i := strings.LastIndexByte(host, ':'); i >= 0 && strings.Count(host, ":") == 1 {
		host = host[:i]
	}
	return strings.TrimSuffix(strings.ToLower(host), ".")
}

// sameOrigin reports whether a state-changing request may be from a
// browser page of this server: its Sec-Fetch-Site, if sent, is
// same-origin (or none: typed, not scripted), and its Origin, if sent,
// has this server's scheme (https when the connection is TLS) and host.
// Clients that are not browsers send neither header, and pass.
// Forwarding headers (X-Forwarded-Proto, Forwarded) are not read.
func sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" && site != "none" {
		return false
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		return true
	}
	u, err := url.Parse(origin) // "null" parses with no scheme, and fails
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	return err == nil && u.Scheme == scheme && strings.EqualFold(u.Host, r.Host)
}

// action serves a state-changing route: refused when read-only or from
// another origin, and run under ActionTimeout.
func action(o Options, run func(ctx context.Context, w http.ResponseWriter, r *http.Request)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if o.ReadOnly {
			writeError(w, errReadOnly)
			return
		}
		if !sameOrigin(r) {
			writeError(w, errCrossOrigin)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), o.ActionTimeout)
		defer cancel()
		run(ctx, w, r)
	}
}

// late is err, or, once the action's deadline passed, a deadline_exceeded
// that says what the action may still do.
func late(ctx context.Context, err error) error {
	if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("%w: the action did not finish within Options.ActionTimeout and may still take effect (%v)", context.DeadlineExceeded, err)
	}
	return err
}

// readJSON reads an action's JSON body into v: at most 1 MiB, one value
// with no field v does not have ({"promt": …} is refused, not read as no
// prompt) and nothing after it, read before the action's deadline.
func readJSON(ctx context.Context, w http.ResponseWriter, r *http.Request, v any) error {
	if ct, _, _ := strings.Cut(r.Header.Get("Content-Type"), ";"); strings.TrimSpace(ct) != "application/json" {
		return fmt.Errorf("%w: the body must be application/json", bgtask.ErrInvalidArgument)
	}
	if d, ok := ctx.Deadline(); ok { // a body trickled in holds no connection past it
		rc := http.NewResponseController(w)
		if rc.SetReadDeadline(d) == nil {
			defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
		}
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<20))
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	if err == nil {
		if dec.Decode(&struct{}{}) != io.EOF {
			return fmt.Errorf("%w: the body has more after its JSON object", bgtask.ErrInvalidArgument)
		}
	}
	var tooBig *http.MaxBytesError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &tooBig):
		return errTooLarge
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("%w: the body did not arrive within Options.ActionTimeout", context.DeadlineExceeded)
	}
	if field, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok { // encoding/json's words: it has no type for it
		return fmt.Errorf("%w: the body has an unknown field %s; this route takes %s", bgtask.ErrInvalidArgument, field, strings.Join(fieldsOf(v), ", "))
	}
	return fmt.Errorf("%w: body: %v", bgtask.ErrInvalidArgument, err)
}

// fieldsOf lists the JSON fields of the struct v points to, quoted.
func fieldsOf(v any) []string {
	t := reflect.TypeOf(v)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil || t.Kind() != reflect.Struct {
		return nil
	}
	var names []string
	for i := range t.NumField() {
		if name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ","); name != "" && name != "-" {
			names = append(names, strconv.Quote(name))
		}
	}
	return names
}
