package bgtask

import (
	"context"
	"encoding/json"
	"time"
)

// Task is a snapshot of one background task: a copy, safe to keep and to
// hand to other goroutines. Status, Pending, SessionID, Model, StartedAt,
// CompletedAt, Error and Result are the current attempt's.
type Task struct {
	// ID is the task's id (Spec.ID, or one the IDGenerator made).
	ID string `json:"id"`
	// ParentSessionID is the session that launched the task: it is told of it.
	ParentSessionID string `json:"parentSessionID"`
	// Description and Agent are the Spec's.
	Description string `json:"description,omitempty"`
	Agent       string `json:"agent,omitempty"`

	// Status is the current attempt's status.
	Status Status `json:"status"`
	// Pending says why a pending current attempt waits.
	Pending PendingReason `json:"pendingReason,omitempty"`
	// SessionID is the current attempt's child session.
	SessionID string `json:"sessionID,omitempty"`
	// Model is the current attempt's model.
	Model Model `json:"model"`
	// StartedAt and CompletedAt are the current attempt's.
	StartedAt   time.Time `json:"startedAt,omitzero"`
	CompletedAt time.Time `json:"completedAt,omitzero"`
	// Error is the current attempt's failure text.
	Error string `json:"error,omitempty"`
	// Stop says who asked the task to stop, once a stop was asked (nil
	// before): Stop, the caller's context, a closure, a deadline, a
	// deleted session, a shutdown. For a task the stop ended cancelled or
	// interrupt, Cause is a *StopError that says so (errors.Is matches
	// ErrCancelled; never nil, also after a restart).
	Stop *StopCause `json:"stop,omitempty"`
	// Result is the completed attempt's final answer text.
	Result string `json:"result,omitempty"`

	// CurrentAttemptID names the one attempt that may still change.
	CurrentAttemptID string `json:"currentAttemptID"`
	// Attempts are every attempt, in order, each as it is now.
	Attempts []Attempt `json:"attempts"`
	// Skips are the models the chain skipped because they were cooling
	// (WithHealth), in order; nil when none was.
	Skips []Skip `json:"skips,omitempty"`
	// Revision grows by one for every change applied to the task.
	Revision uint64 `json:"revision"`
	// LaunchedAt is when the task was launched.
	LaunchedAt time.Time `json:"launchedAt,omitzero"`
	// Metadata is Spec.Metadata, with nothing added.
	Metadata map[string]string `json:"metadata,omitempty"`
	// Attach is Spec.Attach as JSON (read it typed with Attached); nil
	// when the launch attached nothing. A copy.
	Attach json.RawMessage `json:"attach,omitempty"`
	// Detached is Spec.Detached: the task does not hold its parent's end.
	Detached bool `json:"detached,omitempty"`
	// Outcome is what the parent gets; set once the task is terminal
	// (computed at its first read, the same value for every reader).
	Outcome *Outcome `json:"outcome,omitempty"`
	// Activity is what the child is doing now, from its latest events:
	// process-local, never persisted, empty unless the task is running.
	Activity Activity `json:"activity,omitempty"`
	// Progress is the run's latest line of progress (Event.Progress,
	// Run.Progress), bounded to maxProgressRunes: process-local, like
	// Activity, and empty unless the task is running.
	Progress string `json:"progress,omitempty"`
	// Key is Spec.Key: while the task is live, no other task with it starts.
	Key string `json:"key,omitempty"`
	// ContinuedFrom is Spec.ContinueFrom: the ended task whose session this
	// task continues.
	ContinuedFrom string `json:"continuedFrom,omitempty"`
	// Invocations are the prompts sent into the child conversation, in
	// admission order, with their answers: set once the task was extended
	// (Extend); a task that only had its launch prompt has none.
	Invocations []Invocation `json:"invocations,omitempty"`
	// Prompt is Spec.Prompt: the launch prompt (invocation 1).
	Prompt string `json:"prompt,omitempty"`
	// Root is the session at the top of the task's tree: its parent
	// session, or, for a task launched from a task's session, that task's
	// Root. Depth is its level in the tree: 1 when launched from a session
	// no task owns, one more for each task session above it.
	Root string `json:"root,omitempty"`
	// Depth: see Root.
	Depth int `json:"depth,omitempty"`
	// Usage is what its attempts used (Event.Usage, Run.Usage); nil while
	// none reported any. Budget is the budget it spends from (its own,
	// Spec.Budget, or the innermost above it), as it stands; nil if none.
	Usage  *TaskUsage   `json:"usage,omitempty"`
	Budget *BudgetState `json:"budget,omitempty"`

	// Value is the structured result of the current attempt's run
	// (Event.Value, or what a Returning function returned); Cause is the
	// original error value that ended the current attempt (a SessionError's
	// Event.Err, a failed start's *StartError, a deadline or a stall), for
	// errors.Is and errors.As — Error is its text. Both are process-local:
	// never journaled, nil after a restart, and never in JSON. ValueOf
	// reads Value as the harness's type.
	Value any `json:"-"`
	// Cause: see Value.
	Cause error `json:"-"`
}

// Attached returns the value attached at launch (Spec.Attach) as a T, from
// any snapshot: in the process that launched it, after a restart, or one
// decoded from JSON (bgtaskhttp, pgledger). It returns false when nothing
// was attached or the JSON does not decode into a T.
func Attached[T any](t Task) (T, bool) {
	var v T
	if len(t.Attach) == 0 {
		return v, false
	}
	if err := json.Unmarshal(t.Attach, &v); err != nil {
		var zero T
		return zero, false
	}
	return v, true
}

// ValueOf returns t.Value as a T, and whether it is one.
func ValueOf[T any](t Task) (T, bool) {
	v, ok := t.Value.(T)
	return v, ok
}

// Invocation is one prompt sent into a task's child conversation. The
// launch prompt is invocation 1; Extend admits the next ones.
type Invocation struct {
	// N is its number: 1 for the launch prompt, then in admission order.
	N int `json:"n"`
	// Prompt is the text sent into the child conversation.
	Prompt string `json:"prompt"`
	// AdmittedAt is when the child took it.
	AdmittedAt time.Time `json:"admittedAt"`
	// Notice is a fact of its admission that rides its answer (a Launch
	// whose key the task held, made an Extend by ExtendLive).
	Notice string `json:"notice,omitempty"`
	// Actor is who asked for it, when the Extend's context named them
	// (WithActor): an operator's identity.
	Actor string `json:"actor,omitempty"`
	// Answer is set once the invocation was answered; answers are released
	// in invocation order, each exactly once.
	Answer *Answer `json:"answer,omitempty"`
}

// Answer is what an invocation got: the turn that answered it, or the
// outcome of the run's failure or stop.
type Answer struct {
	// Invocation is the number of the invocation it answers.
	Invocation int    `json:"invocation"`
	Status     Status `json:"status"` // completed, error, cancelled or interrupt
	// Text is the answer (completed) or the error.
	Text string `json:"text,omitempty"`
	// Degraded: the children gate released this answer without a turn
	// after the children settled (see Notices).
	Degraded bool `json:"degraded,omitempty"`
	// Notices are the facts that ride the answer (Outcome.Notices).
	Notices []string `json:"notices,omitempty"`
	// At is when the turn that answered it ended.
	At time.Time `json:"at"`
	// Envelope is the <task> block the parent model reads for it.
	Envelope string `json:"envelope"`
}

// Prompter is a Host that can hand a supplemental prompt to a running child
// session (Extend). PromptSession must queue the prompt for the session's
// next turn, not interrupt the one in flight; nil means it was accepted.
// The Manager makes at most one PromptSession call per task at a time, in
// invocation order. A turn end that answers it says so with
// Event.Invocation.
type Prompter interface {
	PromptSession(ctx context.Context, req PromptRequest) error
}

// PromptRequest is one supplemental prompt for a running child session.
//
// A FuncHost function gets the same (Run.Prompts).
type PromptRequest struct {
	// TaskID, AttemptID, Token and SessionID name the run prompted.
	TaskID, AttemptID, Token, SessionID string
	Invocation                          int // its number: 2 or more
	// Prompt is the supplemental prompt's text.
	Prompt string
}

// Activity is what a running child is doing now.
type Activity string

// activityNone: nothing reported yet, or the task is not running (the
// zero Activity).
const activityNone Activity = ""

const (
	// ActivityGenerating: the child is producing output (SessionBusy,
	// SessionCompacted).
	ActivityGenerating Activity = "generating"
	// ActivityWaiting: the child waits — on a tool, a permission, input
	// (SessionWaiting).
	ActivityWaiting Activity = "waiting"
	// ActivityAwaitingChildren: the child ended a turn while tasks its
	// session launched were still running (or their results undelivered):
	// the turn is held as a candidate, and the task answers once they
	// settled (the children gate).
	ActivityAwaitingChildren Activity = "awaiting_children"
)

// Current returns the current attempt.
func (t Task) Current() Attempt {
	for _, a := range t.Attempts {
		if a.ID == t.CurrentAttemptID {
			return a
		}
	}
	return Attempt{}
}
