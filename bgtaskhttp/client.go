package bgtaskhttp

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/wirecode"
	"github.com/bgtask/bgtask/mirror"
)

// Client calls a Handler. Base is its URL ("http://127.0.0.1:8080");
// HTTP is the client to use (nil: http.DefaultClient).
type Client struct {
	Base string
	HTTP *http.Client
	// Reconnect, if set, is called by Follow each time the stream ends or
	// cannot be had, before Follow waits wait and reconnects: err says why
	// (never nil). An error it returns ends Follow with that error; nil
	// lets it reconnect. It is called on Follow's goroutine, so it should
	// return soon. A tool that must report a dead address at once returns
	// err when the first snapshot never came (ready not closed yet).
	Reconnect func(err error, wait time.Duration) error
	// Reconnected, if set, is called by Follow once a stream it opened
	// again (after a stream ended, lagged or could not be had) took up
	// where it had left off: snapshot is false when the service sent what
	// followed the last event applied (its id is after, "epoch:seq"), true
	// when it sent a new snapshot instead (it no longer held what
	// followed, it is another process, or no event was applied yet:
	// after is ""). It is called on Follow's goroutine, so it should
	// return soon.
	Reconnected func(after string, snapshot bool)
	// IdleTimeout, if not 0, is how long Follow lets the stream send
	// nothing — not even the keepalive the service sends while no change
	// flows (Options.Keepalive) — before it takes the connection for dead
	// and reconnects: a network that silently dropped it. 0: no limit.
	IdleTimeout time.Duration
}

// Why Follow reconnects, besides a transport error.
var (
	errLagged     = errors.New("bgtaskhttp: the stream lagged behind the service; resyncing from a new snapshot")
	errIdle       = errors.New("bgtaskhttp: the stream sent nothing for longer than Client.IdleTimeout")
	errNotAStream = errors.New("not an event stream")
)

// Error is an error the service answered with. It matches the bgtask
// sentinel its Code names (errors.Is(err, bgtask.ErrUnknownTask)).
//
// An answer no bgtask service gives (not its JSON error: another server
// at the address, a proxy's error page) is an Error with Code "http" and,
// as Message, a short excerpt of its body; its text names the server and
// what it answered.
type Error struct {
	Status  int
	Code    string
	Message string
	// Report is the closure's report when Code is branch_not_stopped.
	Report *bgtask.ClosureReport

	foreign string // what answered, when it is no bgtask service ("" if it is)
}

func (e *Error) Error() string {
	if e.foreign != "" {
		return "bgtaskhttp: " + e.foreign
	}
	return fmt.Sprintf("bgtaskhttp: %d %s: %s", e.Status, e.Code, e.Message)
}

// Is reports whether target is the sentinel e's Code names.
func (e *Error) Is(target error) bool {
	for _, c := range codes {
		if c.Code == e.Code {
			return target == c.Err
		}
	}
	return target != nil && wirecode.SentinelOf(e.Code) == target
}

func (c *Client) http() *http.Client {
	if c.HTTP != nil {
		return c.HTTP
	}
	return http.DefaultClient
}

// errorOf reads a non-2xx answer as an *Error.
func errorOf(resp *http.Response) *Error {
	var eb errorBody
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if json.Unmarshal(b, &eb) != nil || eb.Code == "" {
		ex := excerpt(b, resp.Header.Get("Content-Type"))
		return &Error{Status: resp.StatusCode, Code: "http", Message: ex, foreign: foreign(resp, ex, "")}
	}
	return &Error{Status: resp.StatusCode, Code: eb.Code, Message: eb.Error, Report: eb.Report}
}

// foreign says that the server that gave resp is no bgtask service: its
// address, the request, the status and content type it answered with, why
// (if why is not ""), and an excerpt of what it said (if ex is not "").
func foreign(resp *http.Response, ex, why string) string {
	server, what := "", ""
	if r := resp.Request; r != nil && r.URL != nil {
		server, what = r.URL.Scheme+"://"+r.URL.Host, r.Method+" "+r.URL.Path+": "
	}
	ctype := resp.Header.Get("Content-Type")
	if ctype == "" {
		ctype = "none"
	}
	s := fmt.Sprintf("the server at %s did not answer as a bgtask server (%s%s, Content-Type %s)", server, what, resp.Status, ctype)
	if why != "" {
		s += ": " + why
	}
	if ex != "" {
		s += ": " + strconv.Quote(ex)
	}
	return s
}

// excerptLen bounds what an error quotes of a foreign answer, in runes.
const excerptLen = 100

// excerpt is the start of body as text, for an error to quote: an HTML
// page's text without its tags, scripts and styles, spaces collapsed, at
// most excerptLen runes.
func excerpt(body []byte, ctype string) string {
	s := strings.ToValidUTF8(string(body), "\uFFFD")
	if strings.Contains(strings.ToLower(ctype), "html") || strings.HasPrefix(strings.TrimSpace(s), "<") {
		s = pageText(s)
	}
	s = strings.Join(strings.Fields(s), " ")
	if utf8.RuneCountInString(s) > excerptLen {
		r := []rune(s)
		s = string(r[:excerptLen]) + "…"
	}
	return s
}

// pageText is the text of an HTML page, roughly: its tags, and what its
// scripts and styles hold, left out; its entities decoded.
func pageText(s string) string {
	var b strings.Builder
	lower := strings.ToLower(s)
	for i := 0; i < len(s); {
		lt := strings.IndexByte(s[i:], '<')
		if lt < 0 {
			b.WriteString(s[i:])
			break
		}
		b.WriteString(s[i : i+lt])
		b.WriteByte(' ')
		i += lt
		for _, skip := range []string{"script", "style"} {
			if strings.HasPrefix(lower[i:], "<"+skip) {
				if end := strings.Index(lower[i:], "</"+skip); end >= 0 {
					i += end
				}
			}
		}
		gt := strings.IndexByte(s[i:], '>')
		if gt < 0 {
			break
		}
		i += gt + 1
	}
	return html.UnescapeString(b.String())
}

// checkBase says what is wrong with base as a service's address, if
// anything: it must be an http:// or https:// URL with a host.
func checkBase(base string) error {
	if u, err := url.Parse(base); err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != "" {
		return nil
	}
	msg := fmt.Sprintf("bgtaskhttp: the service's address %q is not an http:// or https:// URL", base)
	switch b := strings.TrimSpace(base); {
	case b == "":
		msg += ": write it as http://host:port"
	case !strings.Contains(b, "://") && !strings.ContainsAny(b, " \t"):
		msg += ": write http://" + b
	}
	return errors.New(msg)
}

// call sends a request (body, if not nil, as JSON) and decodes a 2xx
// answer into out (if not nil); any other answer is an *Error.
func (c *Client) call(ctx context.Context, method, path string, body, out any) error {
	if err := checkBase(c.Base); err != nil {
		return err
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimRight(c.Base, "/")+path, rd)
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := c.http().Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return errorOf(resp)
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// Health returns the Manager's model and provider health (GET /health).
func (c *Client) Health(ctx context.Context) (HealthView, error) {
	var v HealthView
	return v, c.call(ctx, http.MethodGet, "/health", nil, &v)
}

// Processes are the processes of the fleet the service serves (GET
// /processes); Fleet is false when it serves one Manager.
func (c *Client) Processes(ctx context.Context) (ProcessesView, error) {
	var v ProcessesView
	return v, c.call(ctx, http.MethodGet, "/processes", nil, &v)
}

// ResetHealth ends a cooldown by hand (POST /health/reset), as
// Manager.ResetHealth does: key is "provider/id" or "provider".
func (c *Client) ResetHealth(ctx context.Context, key string) error {
	return c.call(ctx, http.MethodPost, "/health/reset", map[string]string{"key": key}, nil)
}

// Snapshot returns every task (GET /snapshot).
func (c *Client) Snapshot(ctx context.Context) (bgtask.Snapshot, error) {
	var s bgtask.Snapshot
	return s, c.call(ctx, http.MethodGet, "/snapshot", nil, &s)
}

// Tasks returns one page of the tasks q selects (GET /tasks), as
// Manager.Tasks does. Of q's
// filters, Parent, Root, Statuses, After and Limit are sent.
func (c *Client) Tasks(ctx context.Context, q bgtask.Query) (bgtask.Page, error) {
	v := url.Values{}
	for k, s := range map[string]string{"parent": q.Parent, "root": q.Root, "after": q.After} {
		if s != "" {
			v.Set(k, s)
		}
	}
	for _, s := range q.Statuses {
		v.Add("status", string(s))
	}
	if q.Limit != 0 {
		v.Set("limit", strconv.Itoa(q.Limit))
	}
	var p pageJSON
	if err := c.call(ctx, http.MethodGet, "/tasks?"+v.Encode(), nil, &p); err != nil {
		return bgtask.Page{}, err
	}
	return bgtask.Page{Tasks: p.Tasks, Next: p.Next}, nil
}

// errNoID is the error of a call that names no task.
var errNoID = fmt.Errorf("%w: a task id is required", bgtask.ErrInvalidArgument)

// Task returns one task (GET /tasks/{id}).
func (c *Client) Task(ctx context.Context, id string) (bgtask.Task, error) {
	if strings.TrimSpace(id) == "" {
		return bgtask.Task{}, errNoID
	}
	var t bgtask.Task
	return t, c.call(ctx, http.MethodGet, "/tasks/"+url.PathEscape(id), nil, &t)
}

// History is Manager.History over HTTP: GET /tasks/{id}/history.
func (c *Client) History(ctx context.Context, id string) ([]bgtask.RecordView, error) {
	if strings.TrimSpace(id) == "" {
		return nil, errNoID
	}
	var h []bgtask.RecordView
	return h, c.call(ctx, http.MethodGet, "/tasks/"+url.PathEscape(id)+"/history", nil, &h)
}

// Stop is Manager.Stop over HTTP: POST /tasks/{id}/cancel (a task, or
// with t.Run one run of it, by token), /tasks/{id}/close (t.Tree) or
// /sessions/{id}/close (t.Session), with ?nowait=1 for t.NoWait.
func (c *Client) Stop(ctx context.Context, t bgtask.Target) (bgtask.ClosureReport, error) {
	if err := t.Validate(); err != nil {
		return bgtask.ClosureReport{}, err
	}
	if t.Cause != nil { // the server records its caller's stop as a cancel: a cause would be lost
		return bgtask.ClosureReport{}, fmt.Errorf("%w: Target.Cause cannot be sent over HTTP", bgtask.ErrInvalidArgument)
	}
	if t.Actor != "" { // the server names who acted: the identity its Authorize accepted
		return bgtask.ClosureReport{}, fmt.Errorf("%w: Target.Actor cannot be sent over HTTP: the server records the caller its Authorize accepted", bgtask.ErrInvalidArgument)
	}
	var path string
	q := url.Values{}
	switch {
	case t.Session != "":
		path = "/sessions/" + url.PathEscape(t.Session) + "/close"
	case t.Tree:
		path = "/tasks/" + url.PathEscape(t.Task) + "/close"
	case t.Task != "":
		path = "/tasks/" + url.PathEscape(t.Task) + "/cancel"
	default:
		path = "/tasks/" + url.PathEscape(t.Run.TaskID) + "/cancel"
		q.Set("token", t.Run.Token)
	}
	if t.NoWait {
		q.Set("nowait", "1")
	}
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	var rep bgtask.ClosureReport
	err := c.call(ctx, http.MethodPost, path, nil, &rep)
	if he, ok := err.(*Error); ok && he.Report != nil {
		rep = *he.Report // some run did not stop: the report says which
	}
	return rep, err
}

// Extend sends a supplemental prompt and returns its invocation number.
func (c *Client) Extend(ctx context.Context, id, prompt string) (int, error) {
	if strings.TrimSpace(id) == "" {
		return 0, errNoID
	}
	var out struct {
		Invocation int `json:"invocation"`
	}
	err := c.call(ctx, http.MethodPost, "/tasks/"+url.PathEscape(id)+"/extend", map[string]string{"prompt": prompt}, &out)
	return out.Invocation, err
}

// Follow keeps mir in sync with the service until ctx ends: it applies
// the stream's snapshot, then every change, and reconnects — with the last
// event's id, so a gap is filled by a new snapshot — when the stream ends,
// lags, goes silent for IdleTimeout, or the service is unreachable or
// unavailable (5xx), waiting longer each time (from 100ms, doubling up to
// 5s), after asking Reconnect if set. The wait starts again from 100ms
// only once a connection has lasted — from the service's answer to its
// end — longer than the wait Follow is at: what a stream sends is no proof
// it works (a keepalive, a snapshot then a lag, a proxy that closes after
// the first line), so a stream that keeps ending soon after it began is
// retried less and less often rather than pulling a new snapshot every
// 100ms. ready, if not nil, is closed once the first snapshot is applied.
// Once a stream opened again has taken up where the last left off, it
// tells Reconnected, if set. It returns ctx's error, an error the service
// answered with that retrying cannot help (4xx), the error Reconnect
// returned, or a Base that is not an http(s) URL.
func (c *Client) Follow(ctx context.Context, mir *mirror.Mirror, ready chan<- struct{}) error {
	if err := checkBase(c.Base); err != nil {
		return err
	}
	last, wait := "", 100*time.Millisecond
	for again := false; ; again = true {
		lasted, err := c.follow(ctx, mir, &last, &ready, again)
		var he *Error
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case errors.As(err, &he) && he.Status/100 == 4:
			return err // the service refused: retrying will not help
		case lasted > wait:
			wait = 100 * time.Millisecond // it worked for a while: start again from a short wait
		}
		if c.Reconnect != nil {
			if err == nil {
				err = errors.New("bgtaskhttp: the stream ended")
			}
			if rerr := c.Reconnect(err, wait); rerr != nil {
				return rerr
			}
		}
		t := time.NewTimer(wait)
		wait = min(2*wait, 5*time.Second)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
}

// follow reads one connection of the stream, the first (again false) or
// one opened again; lasted is how long it was read, from the service's
// answer to its end (0: there was no stream).
func (c *Client) follow(ctx context.Context, mir *mirror.Mirror, last *string, ready *chan<- struct{}, again bool) (lasted time.Duration, err error) {
	cctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	alive := func() {} // the stream said something: the idle clock starts again
	if d := c.IdleTimeout; d > 0 {
		idle := time.AfterFunc(d, func() { cancel(errIdle) })
		defer idle.Stop()
		alive = func() { idle.Reset(d) }
	}
	defer func() {
		if cause := context.Cause(cctx); err != nil && ctx.Err() == nil && errors.Is(cause, errIdle) {
			err = cause // the read failed because the idle clock ran out
		} else if errors.Is(err, io.EOF) {
			err = fmt.Errorf("bgtaskhttp: the service ended the stream: %w", err)
		}
	}()
	req, err := http.NewRequestWithContext(cctx, http.MethodGet, strings.TrimRight(c.Base, "/")+"/events", nil)
	if err != nil {
		return 0, err
	}
	if *last != "" {
		req.Header.Set("Last-Event-ID", *last)
	}
	resp, err := c.http().Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, errorOf(resp)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10)) // enough to quote its start
		return 0, &foreignStream{foreign(resp, excerpt(b, ct), errNotAStream.Error())}
	}
	began := time.Now()
	rd := bufio.NewReader(resp.Body)
	event, data, id := "", "", ""
	after := *last // what this stream takes up from
	resumed := func(snapshot bool) {
		if again && c.Reconnected != nil {
			c.Reconnected(after, snapshot)
		}
		again = false // once per stream
	}
	for {
		line, err := rd.ReadString('\n')
		if err != nil {
			return time.Since(began), err
		}
		alive()
		line = strings.TrimRight(line, "\r\n")
		switch {
		case strings.HasPrefix(line, "event: "):
			event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			data = strings.TrimPrefix(line, "data: ")
		case strings.HasPrefix(line, "id: "):
			id = strings.TrimPrefix(line, "id: ")
		case line == ": resumed" && after != "":
			resumed(false) // nothing was missed: what follows the last event comes next
		case line == "" && event == "lagged":
			return time.Since(began), errLagged // reconnect: the service sends a new snapshot
		case line == "" && event == "snapshot":
			var s bgtask.Snapshot
			if err := json.Unmarshal([]byte(data), &s); err != nil {
				return time.Since(began), err
			}
			mir.ApplySnapshot(s)
			*last = id
			if *ready != nil {
				close(*ready)
				*ready = nil
			}
			resumed(true)
			event, data = "", ""
		case line == "" && event == "change":
			var ch bgtask.Change
			if err := json.Unmarshal([]byte(data), &ch); err != nil {
				return time.Since(began), err
			}
			mir.ApplyChange(ch)
			*last = id
			event, data = "", ""
		}
	}
}

// foreignStream is the error of an answer to GET /events that is no event
// stream: it matches errNotAStream.
type foreignStream struct{ msg string }

func (e *foreignStream) Error() string        { return "bgtaskhttp: " + e.msg }
func (e *foreignStream) Is(target error) bool { return target == errNotAStream }
