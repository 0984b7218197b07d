// Package fleetdemo is a fleet of harness processes on one PostgreSQL
// ledger, run for real: a coordinator starts a loopback session service
// and three worker processes (this same binary, re-executed), then plays
// a scenario against them — tasks launched in all three, events sent to
// processes that do not own their sessions, a closure in one process
// stopping runs the other two own, one worker killed mid-run and its runs
// taken over — and checks that every task ended with the evidence it had
// and every final summary was delivered once. examples/fleet runs it,
// and so does pgledger's TestFleetOfProcesses.
package fleetdemo

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
)

// service is the loopback session service: the workers' Host (start,
// abort, status, find) and their Notifier's receiver, over HTTP.
type service struct {
	mu       sync.Mutex
	n        int
	sessions map[string]*session
	byAtt    map[string]string
	byTask   map[string]string     // a task's latest session
	notes    []bgtask.Notification // delivered, in order
	changed  chan struct{}         // closed and replaced at every change
	srv      *http.Server
	addr     string
}

type session struct {
	req     bgtask.SessionRequest
	owner   string // the member that started it
	state   bgtask.SessionState
	end     bgtask.Event
	aborted bool
	asked   int       // SessionStatus calls: a takeover reconciling it
	at      time.Time // when it started
}

func newService() (*service, error) {
	s := &service{sessions: map[string]*session{}, byAtt: map[string]string{}, byTask: map[string]string{}, changed: make(chan struct{})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /start", handle(s, s.start))
	mux.HandleFunc("POST /abort", handle(s, s.abort))
	mux.HandleFunc("POST /status", handle(s, s.status))
	mux.HandleFunc("POST /find", handle(s, s.find))
	mux.HandleFunc("POST /notify", handle(s, s.notify))
	s.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	s.addr = "http://" + l.Addr().String()
	go func() { _ = s.srv.Serve(l) }()
	return s, nil
}

func (s *service) close() { _ = s.srv.Close() }

// change wakes whoever waits on the service. s.mu is held.
func (s *service) change() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// await returns once ok holds of the service (s.mu held while it runs),
// or ctx ends.
func (s *service) await(ctx context.Context, what string, ok func() bool) error {
	for {
		s.mu.Lock()
		done, ch := ok(), s.changed
		s.mu.Unlock()
		if done {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		}
	}
}

func decode(w http.ResponseWriter, r *http.Request, v any) bool {
	if err := json.NewDecoder(r.Body).Decode(v); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return false
	}
	return true
}

func reply(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// handle serves one call of the service: its argument (a T) decoded, f
// run with s.mu held and the caller's member, and f's answer sent back.
func handle[T any](s *service, f func(member string, in T) any) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var in T
		if !decode(w, r, &in) {
			return
		}
		s.mu.Lock()
		out := f(r.Header.Get("X-Member"), in)
		s.mu.Unlock()
		reply(w, out)
	}
}

type sessionArg struct {
	SessionID string `json:"sessionID"`
}

func (s *service) start(member string, req bgtask.SessionRequest) any {
	s.n++
	id := fmt.Sprintf("ses-%d", s.n)
	s.sessions[id] = &session{req: req, owner: member, state: bgtask.SessionStateAlive, at: time.Now()}
	s.byAtt[req.AttemptID] = id
	s.byTask[req.TaskID] = id
	s.change()
	return map[string]string{"sessionID": id}
}

func (s *service) abort(_ string, a sessionArg) any {
	if ses := s.sessions[a.SessionID]; ses != nil && ses.state == bgtask.SessionStateAlive {
		ses.state, ses.aborted, ses.end = bgtask.SessionStateEnded, true, bgtask.Event{Kind: bgtask.SessionInterrupted}
		s.change()
	}
	return struct{}{}
}

func (s *service) status(_ string, a sessionArg) any {
	ses := s.sessions[a.SessionID]
	if ses == nil {
		return bgtask.SessionReport{State: bgtask.SessionStateGone}
	}
	ses.asked++
	s.change()
	return bgtask.SessionReport{State: ses.state, End: ses.end}
}

func (s *service) find(_ string, req bgtask.SessionRequest) any {
	return map[string]string{"sessionID": s.byAtt[req.AttemptID]}
}

func (s *service) notify(_ string, n bgtask.Notification) any {
	s.notes = append(s.notes, n)
	s.change()
	return struct{}{}
}

// sessionOf returns task id's latest session and its owner, once it has
// one. s.mu is held.
func (s *service) sessionOf(task string) (id, owner string, ok bool) {
	id, ok = s.byTask[task]
	if ok {
		owner = s.sessions[id].owner
	}
	return id, owner, ok
}

// endWhileDown ends session id with ev while no process may hear it: a
// takeover finds it ended, with that evidence.
func (s *service) endWhileDown(id string, ev bgtask.Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ses := s.sessions[id]; ses != nil {
		ses.state, ses.end = bgtask.SessionStateEnded, ev
		s.change()
	}
}

// delivered returns the notifications delivered of kind k that keep
// says to. s.mu is held.
func (s *service) delivered(k bgtask.NotificationKind, keep func(bgtask.Notification) bool) []bgtask.Notification {
	var out []bgtask.Notification
	for _, n := range s.notes {
		if n.Kind == k && keep(n) {
			out = append(out, n)
		}
	}
	return out
}

// summaries returns the final summaries delivered for task id.
func (s *service) summaries(task string) []bgtask.Notification {
	return s.delivered(bgtask.NotifyFinalSummary, func(n bgtask.Notification) bool { return n.TaskID == task })
}

// allComplete returns the all_complete notifications delivered to parent.
func (s *service) allComplete(parent string) []bgtask.Notification {
	return s.delivered(bgtask.NotifyAllComplete, func(n bgtask.Notification) bool { return n.ParentSessionID == parent })
}
