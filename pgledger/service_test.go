package pgledger

import (
	"context"
	"fmt"
	"sync"

	"github.com/bgtask/bgtask"
)

// service is a loopback session service that outlives the Managers (and
// the processes) using it: sessions are made by StartSession, tagged with
// their attempt, and keep running until the test ends or aborts them. It
// is a bgtask.StatusHost, so a Manager recovering a member asks it what
// became of the runs.
type service struct {
	mu       sync.Mutex
	n        int
	sessions map[string]*session
	byAtt    map[string]string
	gates    map[string]*gate // sessions whose abort waits
	prompts  []bgtask.PromptRequest
}

// gate holds the abort of one session until release is closed (or the
// abort's context ends, with that error); asked is closed when it is called.
type gate struct {
	asked, release chan struct{}
	once           sync.Once
}

type session struct {
	req     bgtask.SessionRequest
	state   bgtask.SessionState
	end     bgtask.Event
	aborted bool
}

func newService() *service {
	return &service{sessions: map[string]*session{}, byAtt: map[string]string{}, gates: map[string]*gate{}}
}

// hold makes the abort of session id wait for the gate it returns.
func (s *service) hold(id string) *gate {
	g := &gate{asked: make(chan struct{}), release: make(chan struct{})}
	s.mu.Lock()
	s.gates[id] = g
	s.mu.Unlock()
	return g
}

func (s *service) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	s.mu.Lock()
	s.n++
	id := fmt.Sprintf("s-%d", s.n)
	s.sessions[id] = &session{req: req, state: bgtask.SessionStateAlive}
	s.byAtt[req.AttemptID] = id
	s.mu.Unlock()
	return id, nil
}

func (s *service) AbortSession(ctx context.Context, id string) error {
	s.mu.Lock()
	g := s.gates[id]
	s.mu.Unlock()
	if g != nil {
		g.once.Do(func() { close(g.asked) })
		select {
		case <-g.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if ses := s.sessions[id]; ses != nil && ses.state == bgtask.SessionStateAlive {
		ses.state, ses.aborted = bgtask.SessionStateEnded, true
		ses.end = bgtask.Event{Kind: bgtask.SessionInterrupted}
	}
	return nil
}

func (s *service) SessionStatus(ctx context.Context, id string) (bgtask.SessionReport, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ses := s.sessions[id]
	if ses == nil {
		return bgtask.SessionReport{State: bgtask.SessionStateGone}, nil
	}
	return bgtask.SessionReport{State: ses.state, End: ses.end}, nil
}

func (s *service) FindSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byAtt[req.AttemptID], nil
}

// end ends session id's run while no Manager may be listening: it is what
// SessionStatus reports from now on.
func (s *service) end(id string, ev bgtask.Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ses := s.sessions[id]; ses != nil {
		ses.state, ses.end = bgtask.SessionStateEnded, ev
	}
}

// forget makes session id gone.
func (s *service) forget(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.sessions, id)
}

// sessionOf returns the session made for attempt id.
func (s *service) sessionOf(attempt string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byAtt[attempt]
}

// aborted reports whether session id was aborted.
func (s *service) aborted(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	ses := s.sessions[id]
	return ses != nil && ses.aborted
}

// PromptSession takes a prompt for a live session (bgtask.Prompter).
func (s *service) PromptSession(ctx context.Context, req bgtask.PromptRequest) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if se := s.sessions[req.SessionID]; se == nil || se.state != bgtask.SessionStateAlive {
		return fmt.Errorf("session %s is not alive", req.SessionID)
	}
	s.prompts = append(s.prompts, req)
	return nil
}

// promptsTo are the prompts session id was given, in order.
func (s *service) promptsTo(id string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, p := range s.prompts {
		if p.SessionID == id {
			out = append(out, p.Prompt)
		}
	}
	return out
}
