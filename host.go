package bgtask

import "context"

// Host creates and stops child sessions. The Manager calls it from
// goroutines it owns, never while holding its lock, so a Host may call back
// into the Manager (Observe, Launch, Stop, …) from inside a call. Every
// call gets a context that ends when the Manager shuts down and that carries
// the run it serves (RunFromContext); a Host must return once it ends.
type Host interface {
	// StartSession creates the child session for one attempt and starts its
	// prompt. The returned session is bound to exactly req.AttemptID.
	StartSession(ctx context.Context, req SessionRequest) (sessionID string, err error)
	// AbortSession stops a child session. nil means it has stopped.
	AbortSession(ctx context.Context, sessionID string) error
}

// StatusHost is a Host that can say, after a restart (WithJournal), what
// became of the child sessions a previous process started. Without it
// (and with FuncHost, whose functions died with the process) every run
// that may have had a child ends interrupt ("lost across restart").
type StatusHost interface {
	Host
	// SessionStatus reports what became of a child session: alive (it
	// runs on, and its events are applied again), ended with the event that
	// ended it (SessionIdle with its answer, SessionError with its error,
	// SessionInterrupted), or gone.
	SessionStatus(ctx context.Context, sessionID string) (SessionReport, error)
	// FindSession returns the session a StartSession for req created
	// before the restart, or "" if there is none: for a start whose answer
	// was lost. Tag child sessions with req.AttemptID so they can be found.
	FindSession(ctx context.Context, req SessionRequest) (sessionID string, err error)
}

// SessionState is what became of a child session (StatusHost).
type SessionState string

const (
	SessionStateAlive SessionState = "alive" // it runs on
	SessionStateEnded SessionState = "ended" // its run ended: SessionReport.End says how
	SessionStateGone  SessionState = "gone"  // no such session any more
)

// SessionReport is a StatusHost's answer about one session.
type SessionReport struct {
	// State is what became of the session.
	State SessionState
	// End (SessionStateEnded) is the event that ended the run: its Kind
	// (SessionIdle, SessionError, SessionInterrupted), Text, Err, Finish,
	// NoFinalText. Its ids are filled in by the Manager.
	End Event
}

// SessionRequest is what StartSession is asked to run.
type SessionRequest struct {
	// TaskID, AttemptID and AttemptNumber name the attempt to run.
	TaskID        string
	AttemptID     string
	AttemptNumber int
	Token         string // the run token of the attempt
	// ParentSessionID is the task's (Spec.ParentSessionID).
	ParentSessionID string
	// Model is the attempt's model.
	Model Model
	// Agent, Prompt and Description are the task's Spec fields.
	Agent, Prompt string
	Description   string
	Metadata      map[string]string // the task's Spec.Metadata: the host's copy
}

// sessionKind is what the Manager's host can do with a child session once
// its task ended: what the envelope may offer the parent model.
type sessionKind uint8

const (
	// sessionsResumable: a Resumer; the session can be inspected, or
	// resumed by task id (Spec.ContinueFrom). The zero value.
	sessionsResumable sessionKind = iota
	// sessionsKept: a session service with no Resumer: the session can be
	// inspected, not resumed.
	sessionsKept
	// sessionsGone: a FuncHost: nothing remains of a run once its function
	// returned.
	sessionsGone
)

// sessionKindOf says what host can do with an ended task's session.
func sessionKindOf(host Host) sessionKind {
	switch host.(type) {
	case *FuncHost:
		return sessionsGone
	case Resumer:
		return sessionsResumable
	}
	return sessionsKept
}
