package bgtask

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Model names a provider's model, with an optional variant.
type Model struct {
	Provider string `json:"providerID"`
	ID       string `json:"modelID"`
	Variant  string `json:"variant,omitempty"`
}

// String returns "provider/id", or "provider/id (variant)" with a variant.
func (m Model) String() string {
	s := m.Provider + "/" + m.ID
	if m.Variant != "" {
		s += " (" + m.Variant + ")"
	}
	return s
}

// ParseModel splits s at its first "/" into provider and model ID. A string
// with no "/" or an empty side is an error.
func ParseModel(s string) (Model, error) {
	provider, id, ok := strings.Cut(s, "/")
	if !ok {
		return Model{}, fmt.Errorf("bgtask: model %q has no provider: want \"provider/id\"", s)
	}
	if provider == "" || id == "" {
		return Model{}, fmt.Errorf("bgtask: model %q has an empty provider or ID", s)
	}
	return Model{Provider: provider, ID: id}, nil
}

// Status is the state of an attempt; a task's status is its current
// attempt's.
type Status string

const (
	// StatusPending: the attempt exists but its child session is not
	// running yet. Entered when the attempt is created (launch or retry);
	// left for running when StartSession returns a session bound to it, or
	// for a terminal state. Attempt.Pending says why it waits.
	StatusPending Status = "pending"
	// StatusRunning: the child session exists and was bound to this attempt.
	// Left only on evidence that the run ended (an event, or an abort the
	// host confirmed).
	StatusRunning Status = "running"
	// StatusCompleted: the child's turn ended (SessionIdle). Terminal.
	StatusCompleted Status = "completed"
	// StatusError: the child's turn failed, or its session could not be
	// started, and the task did not (or could not) retry it. Terminal.
	StatusError Status = "error"
	// StatusCancelled: the child was stopped on request (the host confirmed
	// the abort), its session was deleted, or it never started before the
	// request. Terminal.
	StatusCancelled Status = "cancelled"
	// StatusInterrupt: the child's run was interrupted (SessionInterrupted)
	// or stopped by Shutdown. Terminal.
	StatusInterrupt Status = "interrupt"
)

// Terminal reports whether s is a final state: completed, error, cancelled
// or interrupt.
func (s Status) Terminal() bool {
	switch s {
	case StatusCompleted, StatusError, StatusCancelled, StatusInterrupt:
		return true
	}
	return false
}

// PendingReason says why a pending attempt waits. It is empty for an
// attempt that is not pending.
type PendingReason string

const (
	// PendingQueued: waiting for a concurrency slot.
	PendingQueued PendingReason = "queued"
	// PendingAwaitingSession: the attempt was created (launch, or a retry
	// was chosen) and its child session is being created.
	PendingAwaitingSession PendingReason = "awaiting_session"
	// PendingSessionFailed: creating the child session failed before a
	// session existed. The attempt stays here until it is finalized.
	PendingSessionFailed PendingReason = "session_failed"
	// PendingRetryDelay: a retry was scheduled and waits out its delay
	// (WithRetryDelay) before its session is created.
	PendingRetryDelay PendingReason = "retry_delay"
)

// Attempt is one run of a task on one model in one child session. It is a
// value: the ledger never changes an Attempt you hold, and once an attempt
// is terminal no later version of it is ever recorded.
type Attempt struct {
	// ID is the attempt's immutable identity.
	ID string `json:"attemptID"`
	// Number is 1-based, in the order attempts were made.
	Number int `json:"attemptNumber"`
	// Token names this attempt's run; it is never reused, also not across
	// Managers. Operations that act on a run they observed carry it.
	Token string `json:"token"`
	// SessionID is the child session, "" until StartSession's session is
	// bound to this attempt.
	SessionID string `json:"sessionID,omitempty"`
	Model     Model  `json:"model"`
	Status    Status `json:"status"`
	// Pending says why a pending attempt waits.
	Pending PendingReason `json:"pendingReason,omitempty"`
	// Error is the failure text of an attempt that ended in error.
	Error string `json:"error,omitempty"`
	// Result is the child's final answer text of a completed attempt.
	Result      string    `json:"result,omitempty"`
	StartedAt   time.Time `json:"startedAt,omitzero"`
	CompletedAt time.Time `json:"completedAt,omitzero"`
}

// transitions is the attempt state machine: transitions[from][to] is true
// when an attempt may move from one status to the other. pending→pending is
// a change of PendingReason. Terminal states have no row: nothing leaves
// them.
var transitions = map[Status]map[Status]bool{
	StatusPending: {
		StatusPending:   true,
		StatusRunning:   true,
		StatusError:     true,
		StatusCancelled: true,
		StatusInterrupt: true,
	},
	StatusRunning: {
		StatusCompleted: true,
		StatusError:     true,
		StatusCancelled: true,
		StatusInterrupt: true,
	},
}

// canTransition reports whether the state machine allows from → to. It
// reads transitions through a dense copy: it runs on every ledger write.
func canTransition(from, to Status) bool {
	i, j := statusIndex(from), statusIndex(to)
	return i >= 0 && j >= 0 && allowed[i][j]
}

// statusList lists every Status; allowed is transitions indexed by position.
var (
	statusList = [...]Status{StatusPending, StatusRunning, StatusCompleted, StatusError, StatusCancelled, StatusInterrupt}
	allowed    = func() (t [len(statusList)][len(statusList)]bool) {
		for i, from := range statusList {
			for j, to := range statusList {
				t[i][j] = transitions[from][to]
			}
		}
		return t
	}()
)

// statusIndex is s's position in statusList, or -1.
func statusIndex(s Status) int { return slices.Index(statusList[:], s) }

// attemptJSON is Attempt's wire form: the model's fields sit on the attempt
// itself (providerID, modelID, variant), as in the retry-timeline design.
type attemptJSON struct {
	ID          string        `json:"attemptID"`
	Number      int           `json:"attemptNumber"`
	Token       string        `json:"token"`
	SessionID   string        `json:"sessionID,omitempty"`
	ProviderID  string        `json:"providerID"`
	ModelID     string        `json:"modelID"`
	Variant     string        `json:"variant,omitempty"`
	Status      Status        `json:"status"`
	Pending     PendingReason `json:"pendingReason,omitempty"`
	Error       string        `json:"error,omitempty"`
	Result      string        `json:"result,omitempty"`
	StartedAt   time.Time     `json:"startedAt,omitzero"`
	CompletedAt time.Time     `json:"completedAt,omitzero"`
}

// MarshalJSON writes the attempt with its model flattened: attemptID,
// attemptNumber, token, sessionID, providerID, modelID, variant, status,
// pendingReason, error, result, startedAt, completedAt (RFC 3339); empty
// optional fields are omitted.
func (a Attempt) MarshalJSON() ([]byte, error) {
	return json.Marshal(attemptJSON{
		ID: a.ID, Number: a.Number, Token: a.Token, SessionID: a.SessionID,
		ProviderID: a.Model.Provider, ModelID: a.Model.ID, Variant: a.Model.Variant,
		Status: a.Status, Pending: a.Pending, Error: a.Error, Result: a.Result,
		StartedAt: a.StartedAt, CompletedAt: a.CompletedAt,
	})
}

// UnmarshalJSON reads what MarshalJSON writes.
func (a *Attempt) UnmarshalJSON(data []byte) error {
	var j attemptJSON
	if err := json.Unmarshal(data, &j); err != nil {
		return err
	}
	*a = Attempt{
		ID: j.ID, Number: j.Number, Token: j.Token, SessionID: j.SessionID,
		Model:  Model{Provider: j.ProviderID, ID: j.ModelID, Variant: j.Variant},
		Status: j.Status, Pending: j.Pending, Error: j.Error, Result: j.Result,
		StartedAt: j.StartedAt, CompletedAt: j.CompletedAt,
	}
	return nil
}
