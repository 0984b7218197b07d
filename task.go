package bgtask

import (
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/bgtask/bgtask/internal/dispatch"
	"github.com/bgtask/bgtask/internal/errclass"
	"github.com/bgtask/bgtask/internal/feed"
	"github.com/bgtask/bgtask/internal/funchost"
	"github.com/bgtask/bgtask/internal/group"
	"github.com/bgtask/bgtask/internal/held"
	"github.com/bgtask/bgtask/internal/slots"
	"github.com/bgtask/bgtask/internal/textbound"
	"github.com/bgtask/bgtask/internal/wal"
	"github.com/google/uuid"
)

// Sentinel errors. Match them with errors.Is; several are wrapped with
// detail.
var (
	// ErrUnknownTask: no task has that id.
	ErrUnknownTask = errors.New("bgtask: unknown task")
	// ErrForgotten: the task existed, ended, and was forgotten under the
	// retention rule (WithRetention). It is not ErrUnknownTask.
	ErrForgotten = errors.New("bgtask: task was forgotten (retention)")
	// ErrUnknownSession: an event named a session (or attempt) that no task
	// knows and no session start in flight may be creating.
	ErrUnknownSession = errors.New("bgtask: unknown session")
	// ErrStaleEvent: an event resolved to an attempt that is superseded or
	// terminal, or carried a token that is not the current run's. It
	// changed nothing.
	ErrStaleEvent = errors.New("bgtask: stale event")
	// ErrBranchClosing: new work was refused because its parent session is
	// inside a branch being closed.
	ErrBranchClosing = errors.New("bgtask: branch is closing")
	// ErrShutdown: the Manager is shutting down or shut down.
	ErrShutdown = errors.New("bgtask: manager is shut down")
	// ErrInvalidSpec: Launch was given a bad Spec; the error is a
	// *SpecError naming the field.
	ErrInvalidSpec = errors.New("bgtask: invalid spec")
	// ErrInvalidEvent: Observe was given an event with no session or
	// attempt, or an unknown kind.
	ErrInvalidEvent = errors.New("bgtask: invalid event")
	// ErrInvalidArgument: a call was given a blank id where one is
	// required (CloseBranch with no session). Nothing changed.
	ErrInvalidArgument = errors.New("bgtask: invalid argument")
	// ErrJournal: the journal (WithJournal) failed to make records
	// durable. The Manager then stops: every input is refused with it, and
	// no host call or notification is made. Restart from the journal.
	ErrJournal = errors.New("bgtask: journal failed")
	// ErrNotRunning: Extend was given a task whose run is not running
	// (pending, ended, or being stopped). Nothing changed.
	ErrNotRunning = errors.New("bgtask: task is not running")
	// ErrNoPrompter: Extend needs a Host that implements Prompter.
	ErrNoPrompter = errors.New("bgtask: the host cannot prompt a running session (no Prompter)")
	// ErrPromptRefused: the Host's PromptSession refused a supplemental
	// prompt; the error wraps the host's. Nothing changed.
	ErrPromptRefused = errors.New("bgtask: the host refused the prompt")
	// ErrNoResumer: Spec.ContinueFrom needs a Host that implements Resumer.
	ErrNoResumer = errors.New("bgtask: the host cannot resume a session (no Resumer)")
	// ErrNoInvocation: WaitAnswer named an invocation the task never
	// admitted.
	ErrNoInvocation = errors.New("bgtask: no such invocation")
	// ErrKeyHeld: Launch was given a Spec.Key a live task holds; the error
	// is a *KeyHeldError naming it.
	ErrKeyHeld = errors.New("bgtask: key is held by a live task")
	// ErrSuperseded: Fence found that the run its context carries is no
	// longer its task's current live run (replaced by a retry, stopped, or
	// ended): a side effect it was about to make must not happen.
	ErrSuperseded = errors.New("bgtask: run superseded")
	// ErrIDTaken: Launch was given a Spec.ID that a task this Manager
	// knows has (live, ended, or forgotten lately). Nothing changed.
	ErrIDTaken = errors.New("bgtask: task id is taken")
	// ErrDepthLimit, ErrFanOutLimit, ErrTreeLimit: Launch was refused by
	// a limit of WithTreeLimits (spawn depth, live tasks per parent
	// session, live tasks per root session); the error is a *LimitError.
	// Nothing changed.
	ErrDepthLimit  = errors.New("bgtask: spawn depth limit reached")
	ErrFanOutLimit = errors.New("bgtask: live tasks per parent session limit reached")
	ErrTreeLimit   = errors.New("bgtask: live tasks per root session limit reached")
	// ErrDeadline is in the chain of Task.Err when a run was stopped at its
	// wall-clock deadline (Spec.Timeout, Spec.AttemptTimeout); the
	// outcome's reason is ReasonDeadline.
	ErrDeadline = errors.New("deadline")
	// ErrDurabilityUnknown: a call's context ended while it waited for its
	// records to be durable (WithJournal), so what it did may or may not
	// have been recorded; the error is a *DurabilityUnknownError naming the
	// task, and it also matches the context's error (errors.Is).
	ErrDurabilityUnknown = errors.New("bgtask: the context ended before the records were durable")
)

// DurabilityUnknownError is a call (Launch, Extend, Cancel, CloseBranch,
// CloseTask) whose context ended while it waited for its records to be
// durable: they may or may not become durable, and what they describe may
// or may not happen (it happens, in order, once they are: nothing runs
// before its records are durable). TaskID names the task, so the caller
// can look it up: Lookup tells the truth (an ErrUnknownTask after a
// Launch means it never happened). It matches ErrDurabilityUnknown and
// unwraps to the context's error.
type DurabilityUnknownError struct {
	Op     string // the call: "Launch", "Extend", "Cancel", "CloseBranch", "CloseTask"
	TaskID string // the task it was about ("" for a CloseBranch of a session no task owns)
	Err    error  // the context's error
}

func (e *DurabilityUnknownError) Error() string {
	s := "bgtask: " + e.Op
	if e.TaskID != "" {
		s += " of task " + e.TaskID
	}
	return s + ": the context ended before its records were durable; they may or may not be (Lookup tells): " + safeText(e.Err)
}

// Is makes errors.Is(err, ErrDurabilityUnknown) true.
func (e *DurabilityUnknownError) Is(target error) bool { return target == ErrDurabilityUnknown }

// Unwrap returns the context's error.
func (e *DurabilityUnknownError) Unwrap() error { return e.Err }

// durabilityUnknown makes err, from a call's unlock, a
// *DurabilityUnknownError of op on task when its context ended before its
// records were durable; any other err is returned as it is.
func durabilityUnknown(err error, op, task string) error {
	var nd errNotDurable
	if errors.As(err, &nd) {
		return &DurabilityUnknownError{Op: op, TaskID: task, Err: nd.err}
	}
	return err
}

// LimitError is a Launch refused by a limit of WithTreeLimits. It matches
// ErrDepthLimit, ErrFanOutLimit or ErrTreeLimit (errors.Is), as Limit says.
type LimitError struct {
	Limit   error  // ErrDepthLimit, ErrFanOutLimit or ErrTreeLimit
	Max     int    // the limit
	Session string // the session it counts under: the parent, or the root
	// Waited is how long the Launch waited for a slot (ErrFanOutLimit
	// with TreeLimits.ParentWait) before it gave up.
	Waited time.Duration
}

func (e *LimitError) Error() string {
	s := fmt.Sprintf("%v (%d) under session %s", e.Limit, e.Max, e.Session)
	if e.Waited > 0 {
		s += ", after waiting " + e.Waited.String() + " for a slot"
	}
	return s
}

// Is makes errors.Is match the limit's sentinel.
func (e *LimitError) Is(target error) bool { return target == e.Limit }

// KeyHeldError is ErrKeyHeld with the key and the live task holding it.
type KeyHeldError struct {
	// Key is the Spec.Key asked for.
	Key string
	// TaskID is the live task that holds it.
	TaskID string
}

func (e *KeyHeldError) Error() string {
	return "bgtask: key " + strconv.Quote(e.Key) + " is held by live task " + e.TaskID
}

// Is makes errors.Is(err, ErrKeyHeld) true.
func (e *KeyHeldError) Is(target error) bool { return target == ErrKeyHeld }

// orBackground treats a nil context as context.Background(), at every entry
// point that takes one: a nil context is never a crash and never leaves a
// fence or a watcher behind.
func orBackground(ctx context.Context) context.Context {
	if ctx == nil {
		return context.Background()
	}
	return ctx
}

// SpecError says which field of a Spec is wrong. It matches ErrInvalidSpec.
type SpecError struct {
	Field string // e.g. "Models[1].ID"
	// Reason says what is wrong with it.
	Reason string
}

func (e *SpecError) Error() string {
	return "bgtask: invalid spec: " + e.Field + ": " + e.Reason
}

// Is reports whether target is ErrInvalidSpec.
func (e *SpecError) Is(target error) bool { return target == ErrInvalidSpec }

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
	// Result is the completed attempt's final answer text.
	Result string `json:"result,omitempty"`

	// CurrentAttemptID names the one attempt that may still change.
	CurrentAttemptID string `json:"currentAttemptID"`
	// Attempts are every attempt, in order, each as it is now.
	Attempts []Attempt `json:"attempts"`
	// Revision grows by one for every change applied to the task.
	Revision uint64 `json:"revision"`
	// LaunchedAt is when the task was launched.
	LaunchedAt time.Time `json:"launchedAt,omitzero"`
	// Metadata is Spec.Metadata, with nothing added.
	Metadata map[string]string `json:"metadata,omitempty"`
	// Outcome is what the parent gets; set once the task is terminal
	// (computed at its first read, the same value for every reader).
	Outcome *Outcome `json:"outcome,omitempty"`
	// Activity is what the child is doing now, from its latest events:
	// process-local, never persisted, empty unless the task is running.
	Activity Activity `json:"activity,omitempty"`
	// Progress is the run's latest line of progress (Event.Progress,
	// Run.Progress), bounded to MaxProgressRunes: process-local, like
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

	// Value is the structured result of the current attempt's run
	// (Event.Value, or what a Returning function returned); Err is the
	// original error value that ended the current attempt (a SessionError's
	// Event.Err, a failed start's *StartError, a deadline or a stall), for
	// errors.Is and errors.As — Error is its text. Both are process-local:
	// never journaled, nil after a restart, and never in JSON. ValueOf
	// reads Value as the harness's type.
	Value any `json:"-"`
	// Err: see Value.
	Err error `json:"-"`
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
type PromptRequest struct {
	// TaskID, AttemptID, Token and SessionID name the run prompted.
	TaskID, AttemptID, Token, SessionID string
	Invocation                          int // its number: 2 or more
	// Prompt is the supplemental prompt's text.
	Prompt string
}

// Activity is what a running child is doing now.
type Activity string

const (
	// ActivityNone: nothing reported yet, or the task is not running.
	ActivityNone Activity = ""
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

// Spec describes a task to launch.
type Spec struct {
	// ParentSessionID is the chat session that launched the task and
	// receives its notifications. Required.
	ParentSessionID string
	// Description says what the task is for, in a line (notifications show it).
	Description string
	// Agent names the kind of subagent, for the host.
	Agent string
	// Prompt is the launch prompt: invocation 1.
	Prompt string
	// Models is the fallback chain: Models[0] first, then the rest in
	// order. Required, each with an ID; Provider may be empty (a model the
	// harness names by an alias alone).
	Models []Model
	// MaxAttempts caps the attempts. 0 means one attempt per model; a
	// larger value than len(Models) reuses the last model for the rest.
	MaxAttempts int
	// Metadata is the caller's, carried on every snapshot. Keys under the
	// "bgtask." prefix are reserved for the library; a Spec using one is
	// refused.
	Metadata map[string]string
	// Key, when set, makes this task the one start owner of the key: a
	// Launch with the key of a live task starts no second run; it fails
	// with a *KeyHeldError naming that task, or, with ExtendLive, hands
	// Prompt to it as its next invocation (Extend) and returns its
	// snapshot. Keys survive a restart with a journal.
	Key string
	// ExtendLive: see Key.
	ExtendLive bool
	// ContinueFrom, when set, names an ended task whose child session this
	// task continues: its first attempt resumes that session with Prompt
	// (the Host must implement Resumer) instead of starting a new one, and
	// its envelope reports the ended task's output once, as prior output.
	// The ended task never changes; the session's events are this task's
	// from then on. A retry starts a new session, as always.
	ContinueFrom string

	// ID, when set, is the task's id instead of one the IDGenerator makes
	// (the harness's own ids): at most 128 bytes of valid UTF-8, with no
	// white space or control characters. A Launch with the id of a task
	// the Manager knows — live, ended, or forgotten lately — is refused
	// with ErrIDTaken.
	ID string

	// Timeout is the task's wall-clock deadline, from its launch: at
	// Timeout the current attempt is stopped and the task ends error,
	// reason deadline ("deadline: ..."), whatever attempts are left.
	// AttemptTimeout bounds each attempt the same way, from the moment
	// its session runs; the attempt ends error, reason deadline, and the
	// task falls back to its next model only with RetryOnTimeout. Unlike
	// WithStallTimeout, which catches silence, these catch a chatty child
	// stuck in a loop. 0: no deadline. Both survive a restart with a
	// journal (the timers are armed again). The task reads running until
	// the child really stopped: an abort the host refuses is asked again
	// every 30 seconds.
	Timeout time.Duration
	// AttemptTimeout and RetryOnTimeout: see Timeout.
	AttemptTimeout time.Duration
	RetryOnTimeout bool

	// The fields below are process-local: they hold what only this
	// process can keep (a function, a context), are not journaled, and
	// are gone after a restart.

	// OnDone, when set, is called once the task has ended and its final
	// summary was delivered (or given up, or no Notifier is set): exactly
	// once, on a goroutine of the Manager, never under its lock, with the
	// task's final snapshot. It is how the one caller that launched a
	// task hears of its end without racing Launch's return. A panic in it
	// is recovered and logged. A Launch that ExtendLive makes an Extend
	// adds its OnDone to the extended task's (also when that Extend fails
	// with ErrNotRunning: the task is ending, and OnDone says how). It is
	// not called for an end the journal could not make durable (the
	// Manager then refuses everything with ErrJournal). Shutdown waits for
	// OnDone calls: one must not wait for Shutdown in turn.
	OnDone func(Task)
	// InheritValues makes the contexts of the task's host calls — the
	// FuncHost function's, StartSession's, PromptSession's — carry the
	// values of the context passed to Launch (a channel, a chat, turn
	// state: what tools read), never its cancellation or deadline. The
	// context is kept with the task while it is in memory.
	InheritValues bool
	// CancelWithCaller stops the task when the context passed to Launch
	// ends before the task does: the task and what its sessions launched
	// are stopped as CloseTask stops them (honestly: cancelled once the
	// host confirmed), and the close's error, if any, is logged.
	// InheritValues and CancelWithCaller apply to the task a Launch
	// creates: with ExtendLive they are refused (ErrInvalidSpec), as that
	// Launch may extend a task another caller started.
	CancelWithCaller bool
}

// Resumer is a Host that can resume an existing child session with a new
// prompt (Spec.ContinueFrom). nil means the session runs req.Prompt now, as
// attempt req.AttemptID.
type Resumer interface {
	ResumeSession(ctx context.Context, sessionID string, req SessionRequest) error
}

// ReservedMetadataPrefix starts the Metadata keys only bgtask may write.
const ReservedMetadataPrefix = "bgtask."

func (s Spec) validate() error {
	switch {
	case blank(s.ParentSessionID):
		return &SpecError{Field: "ParentSessionID", Reason: "is empty"}
	case len(s.Models) == 0:
		return &SpecError{Field: "Models", Reason: "has no model"}
	case s.MaxAttempts < 0:
		return &SpecError{Field: "MaxAttempts", Reason: "is negative (" + strconv.Itoa(s.MaxAttempts) + ")"}
	case s.Timeout < 0:
		return &SpecError{Field: "Timeout", Reason: "is negative (" + s.Timeout.String() + ")"}
	case s.AttemptTimeout < 0:
		return &SpecError{Field: "AttemptTimeout", Reason: "is negative (" + s.AttemptTimeout.String() + ")"}
	}
	if s.ID != "" {
		if reason := badID(s.ID); reason != "" {
			return &SpecError{Field: "ID", Reason: reason}
		}
	}
	if s.ExtendLive && (s.InheritValues || s.CancelWithCaller) {
		return &SpecError{Field: "ExtendLive", Reason: "cannot be used with InheritValues or CancelWithCaller: they apply to the task a Launch creates"}
	}
	for k := range s.Metadata {
		if len(k) >= len(ReservedMetadataPrefix) && strings.EqualFold(k[:len(ReservedMetadataPrefix)], ReservedMetadataPrefix) {
			return &SpecError{Field: "Metadata[" + strconv.Quote(k) + "]", Reason: "the " + ReservedMetadataPrefix + " prefix is reserved for the library"}
		}
	}
	for i, m := range s.Models {
		field := "Models[" + strconv.Itoa(i) + "]"
		if m.Provider != "" && blank(m.Provider) {
			return &SpecError{Field: field + ".Provider", Reason: "is only white space (leave it empty for a model with no provider)"}
		}
		if m.Provider == "" && strings.Contains(m.ID, "/") {
			return &SpecError{Field: field + ".ID", Reason: "has a \"/\" but no Provider: it would read as provider/id (set Provider)"}
		}
		if blank(m.ID) {
			return &SpecError{Field: field + ".ID", Reason: "is empty"}
		}
	}
	return nil
}

// badID says what is wrong with a task id a caller chose, or "".
func badID(id string) string {
	switch {
	case len(id) > maxIDBytes:
		return "is longer than " + strconv.Itoa(maxIDBytes) + " bytes"
	case !utf8.ValidString(id):
		return "is not valid UTF-8"
	}
	for _, r := range id {
		if unicode.IsSpace(r) || unicode.IsControl(r) {
			return "contains white space or a control character (" + strconv.QuoteRune(r) + ")"
		}
	}
	return ""
}

// maxIDBytes bounds a task id a caller chose (Spec.ID).
const maxIDBytes = 128

// blank reports whether s is empty or only white space.
func blank(s string) bool { return strings.TrimSpace(s) == "" }

// Host creates and stops child sessions. The Manager calls it from
// goroutines it owns, never while holding its lock, so a Host may call back
// into the Manager (Observe, Launch, Cancel, …) from inside a call. Every
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
	SessionAlive SessionState = "alive" // it runs on
	SessionEnded SessionState = "ended" // its run ended: SessionReport.End says how
	SessionGone  SessionState = "gone"  // no such session any more
)

// SessionReport is a StatusHost's answer about one session.
type SessionReport struct {
	// State is what became of the session.
	State SessionState
	// End (SessionEnded) is the event that ended the run: its Kind
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

// EventKind is what a child session reported.
type EventKind string

const (
	// SessionBusy: the child is generating. Liveness only; never ends a run.
	SessionBusy EventKind = "busy"
	// SessionIdle: the child's turn ended; Text is its final answer ("" if
	// none). The attempt completes.
	SessionIdle EventKind = "idle"
	// SessionError: the child's turn failed; Err says why. The task retries
	// on the next model or ends in error.
	SessionError EventKind = "error"
	// SessionInterrupted: the child's run was interrupted and has stopped.
	SessionInterrupted EventKind = "interrupted"
	// SessionDeleted: the child session is gone; the task is cancelled and
	// the branch beneath that session is closed (CloseBranch).
	SessionDeleted EventKind = "deleted"
	// SessionCompacted: context compaction happened. Never changes status.
	SessionCompacted EventKind = "compacted"
	// SessionWaiting: the child waits on a tool, a permission or input.
	// Liveness only; it sets Activity.
	SessionWaiting EventKind = "waiting"
)

// ends reports whether an event of kind k ends the run it reports on.
func (k EventKind) ends() bool {
	switch k {
	case SessionIdle, SessionError, SessionInterrupted, SessionDeleted:
		return true
	}
	return false
}

func (k EventKind) valid() bool {
	switch k {
	case SessionBusy, SessionIdle, SessionError, SessionInterrupted, SessionDeleted, SessionCompacted, SessionWaiting:
		return true
	}
	return false
}

// Event is a lifecycle event of a child session.
type Event struct {
	// SessionID is the child session the event is about.
	SessionID string
	// AttemptID, when set, resolves the event directly; it may be used
	// before the session is bound. The binding itself always comes from
	// StartSession's return.
	AttemptID string
	// Token, when set, must name the attempt's run, or the event is stale.
	Token string
	// Kind is what happened; see EventKind.
	Kind EventKind
	// Text is, for SessionIdle, the final answer; for any other kind, the
	// child's latest output (kept as evidence if the run does not end in
	// a clean answer).
	Text string
	// NoFinalText (SessionIdle) says the turn ended with no final message
	// at all, as opposed to an empty one.
	NoFinalText bool
	// Finish (SessionIdle) is how the turn ended, if the host knows.
	Finish FinishReason
	Err    error     // SessionError: the failure
	At     time.Time // when it happened; zero means now
	// Invocation (SessionIdle) is the last invocation the turn had seen:
	// its answer goes to every invocation up to it that has none yet. 0
	// means the latest admitted.
	Invocation int
	// Value (SessionIdle) is the turn's structured result, of the
	// harness's own type, kept beside the task while the process lives
	// (Task.Value); Text stays the answer the parent model reads.
	Value any
	// Progress (SessionBusy, SessionWaiting) is a line of progress for the
	// people watching: Task.Progress shows it while the run goes on, and
	// every change of it is a Change. It is bounded to MaxProgressRunes.
	Progress string

	last bool // SessionIdle from a FuncHost function's return: no turn follows
}

// NotificationKind says what a notification tells the parent.
type NotificationKind string

const (
	// NotifyRetryScheduled: an attempt failed and the next model was chosen.
	NotifyRetryScheduled NotificationKind = "retry_scheduled"
	// NotifyRetrySessionReady: a retry attempt's session was created.
	NotifyRetrySessionReady NotificationKind = "retry_session_ready"
	// NotifyFinalSummary: the task ended (completed, error, cancelled or
	// interrupt); sent exactly once per task, after its other notifications.
	NotifyFinalSummary NotificationKind = "final_summary"
	// NotifyAnswer: an invocation of a task that was extended was
	// answered while the task goes on (Text carries the answer's
	// envelope). The answer of the last invocation is the final summary.
	NotifyAnswer NotificationKind = "answer"
	// NotifyAllComplete: the last live task of a parent ended; Tasks holds
	// every task of that round, failures first. Exactly one per round; a
	// task launched later under the same parent starts a new round.
	NotifyAllComplete NotificationKind = "all_complete"
)

// Notification is a message for the parent chat session.
type Notification struct {
	// Kind is what it tells; see NotificationKind.
	Kind NotificationKind `json:"kind"`
	// ID names the notification for good: a notification delivered again
	// after a restart (WithJournal) carries the same ID, so a receiver can
	// drop a duplicate. Delivery is at least once across a crash, and
	// exactly once without one.
	ID string `json:"id,omitempty"`
	// Seq orders notifications as they were produced, across all parents.
	Seq uint64 `json:"seq"`
	// ParentSessionID is where it is delivered.
	ParentSessionID string `json:"parentSessionID"`
	// TaskID is the task it is about ("" for NotifyAllComplete and NotifyBranchClosed).
	TaskID string `json:"taskID"`
	Task   Task   `json:"task"`            // snapshot when it was produced
	Tasks  []Task `json:"tasks,omitempty"` // NotifyAllComplete: the round's tasks
	// Invocation (NotifyAnswer) is the invocation answered.
	Invocation int    `json:"invocation,omitempty"`
	Text       string `json:"text"` // rendered for the parent chat
}

// Notifier receives notifications. Notifications for one parent session are
// delivered one at a time in the order they were produced; the Manager's
// lock is never held during Notify, so a Notifier may call the Manager.
type Notifier interface {
	Notify(ctx context.Context, n Notification) error
}

// NotifierFunc adapts a function to Notifier.
type NotifierFunc func(ctx context.Context, n Notification) error

// Notify calls f.
func (f NotifierFunc) Notify(ctx context.Context, n Notification) error { return f(ctx, n) }

// Clock is the Manager's time source (WithClock): every timeout, delay,
// deadline and timestamp the Manager keeps is read from it, so a test can
// move time by hand (bgtasktest.Clock) and never sleeps to wait for a
// state. The default is the wall clock. A Clock must be safe for
// concurrent use, and may be called with the Manager's lock held: it must
// not block or call into the Manager.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// NewTimer returns a timer that fires once, d from now (at once for
	// d <= 0), unless it is stopped first.
	NewTimer(d time.Duration) Timer
}

// Timer is a Clock's timer: C delivers the time once when it fires, Stop
// prevents that and reports whether it did (as time.Timer's do).
type Timer = clock.Timer

// IDKind says what an id is for.
type IDKind string

const (
	// IDTask names a task (Task.ID), unless Spec.ID gives one.
	IDTask IDKind = "task"
	// IDAttempt names an attempt (Attempt.ID): one per model tried.
	IDAttempt IDKind = "attempt"
	// IDToken names a run (Attempt.Token): the exact run a stop or an
	// event means; never reused, also not across Managers and restarts.
	IDToken IDKind = "run"
	// IDNotification names a notification (Notification.ID).
	IDNotification IDKind = "notification"
)

// IDGenerator makes ids. It must be safe for concurrent use, must not call
// into the Manager, and must never return the same id twice for a kind.
type IDGenerator interface {
	NewID(kind IDKind) string
}

// uuidIDs makes random (version 4) UUIDs from a ChaCha8 stream seeded from
// crypto/rand: as unpredictable as reading crypto/rand for each id, without
// a system call per id.
type uuidIDs struct {
	mu  sync.Mutex
	src *rand.ChaCha8
}

func newUUIDs() *uuidIDs {
	var seed [32]byte
	if _, err := crand.Read(seed[:]); err != nil {
		panic("bgtask: crypto/rand: " + err.Error())
	}
	return &uuidIDs{src: rand.NewChaCha8(seed)}
}

func (g *uuidIDs) NewID(kind IDKind) string {
	var buf [len(tokenPrefix) + 36]byte
	return string(g.render(buf[:0], kind))
}

// attemptIDs makes an attempt id and its run token in one allocation: the
// two strings share one backing array, which lives as long as the attempt.
func (g *uuidIDs) attemptIDs() (id, token string) {
	var buf [36 + len(tokenPrefix) + 36]byte
	s := string(g.render(g.render(buf[:0], IDAttempt), IDToken))
	return s[:36], s[36:]
}

// tokenPrefix begins every run token the default generator makes.
const tokenPrefix = "run_"

// render appends one fresh id of kind to b.
func (g *uuidIDs) render(b []byte, kind IDKind) []byte {
	var u uuid.UUID
	g.mu.Lock()
	_, _ = g.src.Read(u[:])
	g.mu.Unlock()
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80 // RFC 9562 variant
	if kind == IDToken {
		b = append(b, tokenPrefix...)
	}
	n := len(b)
	b = b[:n+36]
	hex.Encode(b[n:], u[0:4])
	b[n+8] = '-'
	hex.Encode(b[n+9:], u[4:6])
	b[n+13] = '-'
	hex.Encode(b[n+14:], u[6:8])
	b[n+18] = '-'
	hex.Encode(b[n+19:], u[8:10])
	b[n+23] = '-'
	hex.Encode(b[n+24:], u[10:])
	return b
}

// UUIDs returns the default IDGenerator: random (version 4) UUIDs, with
// run tokens prefixed "run_". Each call returns a new generator, safe for
// concurrent use.
func UUIDs() IDGenerator { return newUUIDs() }

// SequentialIDs returns an IDGenerator making "task-1", "attempt-1",
// "run-1", … with a counter per kind: deterministic ids for tests and
// examples. Tokens from two such generators are not distinct; use it only
// where one Manager lives.
func SequentialIDs() IDGenerator { return &seqIDs{} }

type seqIDs struct{ task, attempt, run, note atomic.Uint64 }

func (s *seqIDs) NewID(kind IDKind) string {
	var n uint64
	switch kind {
	case IDTask:
		n = s.task.Add(1)
	case IDAttempt:
		n = s.attempt.Add(1)
	case IDNotification:
		n = s.note.Add(1)
	default:
		n = s.run.Add(1)
	}
	return string(kind) + "-" + strconv.FormatUint(n, 10)
}

// Option configures a Manager.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	notifyAttempts    int
	notifyBackoff     func(attempt int) time.Duration
	limits            *Limits
	queueTimeout      time.Duration
	stallTimeout      time.Duration
	gateTimeout       time.Duration
	notifier          Notifier
	logger            *slog.Logger
	silent            bool // logger discards everything: no log line is worth building
	logInfo, logDebug bool // the logger's handler takes info (debug) lines, as it said at New (the lines are built only then)
	clock             Clock
	ids               IDGenerator
	retryable         func(error) bool
	retryDelay        func(attempt int, cause error) time.Duration
	holdLimit         int
	queueLimit        int // notifications waiting per parent
	undeliveredLimit  int // notifications kept for Undelivered
	journal           Journal
	startGate         func(ctx context.Context, req SessionRequest) error // WithStartGate
	retention         Retention
	tree              TreeLimits
	metrics           Metrics                              // WithMetrics; nil: none
	classifier        func(err error, retryable bool) bool // WithRetryClassifier, composed into retryable by New

	err error // an invalid option, found by New: every Launch returns it
}

// Retention bounds the ended tasks a Manager keeps in memory
// (WithRetention). Live tasks are always kept.
type Retention struct {
	// MaxEnded is how many ended tasks are kept; the oldest ended that
	// may go (see WithRetention) is forgotten first. 0: DefaultMaxEnded;
	// < 0: no bound.
	MaxEnded int
	// MaxAge forgets a task that ended longer ago than this. 0: no age
	// bound. Age is looked at as tasks end (an idle Manager forgets
	// nothing).
	MaxAge time.Duration
}

// WithRetention sets how many ended tasks, and for how long, a Manager
// keeps. An ended task stays while its parent session has live tasks
// (they may still be reported together) and until its notifications are
// delivered. A forgotten task's id answers ErrForgotten (Lookup, Wait,
// Cancel) for the last 100,000 forgotten; with a journal, compaction drops
// it from disk too. Default: the last DefaultMaxEnded ended tasks.
func WithRetention(r Retention) Option {
	return optionFunc(func(c *config) {
		if r.MaxEnded == 0 {
			r.MaxEnded = DefaultMaxEnded
		}
		c.retention = r
	})
}

// WithJournal makes the Manager durable: every record it commits is
// appended to j, and made durable before anything it describes takes
// effect (a host call, a notification); Open replays j and recovers what
// was live. The Manager owns j from then on and closes it at the end of
// Shutdown. Default: none — the Manager is memory-only, and a restart
// forgets every task (its children keep running, unknown).
func WithJournal(j Journal) Option { return optionFunc(func(c *config) { c.journal = j }) }

// WithStartGate makes every session start (StartSession, and
// ResumeSession for Spec.ContinueFrom) ask gate first: outside the lock,
// after the start's intent is durable, with the request the host would
// get. A non-nil error refuses the start for good: the attempt fails with
// it, as a permanent error (no retry follows), and the host is not called.
// A journal shared by several processes uses it (pgledger refuses a start
// inside a branch another process is closing); a panic is a refusal.
func WithStartGate(gate func(ctx context.Context, req SessionRequest) error) Option {
	return optionFunc(func(c *config) { c.startGate = gate })
}

// WithNotifier sends notifications to n. Default: none are sent.
func WithNotifier(n Notifier) Option { return optionFunc(func(c *config) { c.notifier = n }) }

// loggerTakes asks l's handler (user code) whether it takes lines of
// level; a panic is a no.
func loggerTakes(l *slog.Logger, level slog.Level) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	return l.Enabled(context.Background(), level)
}

// WithLogger logs through l: rejected events at debug, failed host and
// notifier calls at warn and error. Default: nothing is logged.
func WithLogger(l *slog.Logger) Option { return optionFunc(func(c *config) { c.logger = l }) }

// WithClock reads time and makes timers from c. Default: the wall clock. c
// is called with the Manager's lock held: it must be fast and must not call
// into the Manager.
func WithClock(c Clock) Option { return optionFunc(func(cfg *config) { cfg.clock = c }) }

// WithIDs makes task, attempt and run ids with g. Default: random UUIDs.
func WithIDs(g IDGenerator) Option { return optionFunc(func(c *config) { c.ids = g }) }

// WithRetryable decides which errors move a task to its next model,
// replacing DefaultRetryable. A Permanent error is never retried, whatever f
// says. A failed session start reaches f as a *StartError.
func WithRetryable(f func(error) bool) Option {
	return optionFunc(func(c *config) { c.retryable = f })
}

// WithRetryClassifier extends the retry classifier instead of replacing
// it: f sees each failure and the answer the classifier gave
// (DefaultRetryable, or WithRetryable's), and its answer decides. A
// Permanent error is never retried, whatever f says. f is user code, run
// outside the Manager's lock; a panic in it makes the failure
// non-retryable, named in its text.
//
//	bgtask.WithRetryClassifier(func(err error, retry bool) bool {
//		var q *QuotaError
//		return retry || errors.As(err, &q)
//	})
func WithRetryClassifier(f func(err error, retryable bool) bool) Option {
	return optionFunc(func(c *config) { c.classifier = f })
}

// TreeLimits are the limits a tree of subagents needs (WithTreeLimits).
// A task launched from a task's session is one level deeper than that
// task (Task.Depth); the root of a tree is the session at its top
// (Task.Root). Every limit is off at 0, the default.
type TreeLimits struct {
	// MaxDepth refuses a Launch whose task would be deeper than MaxDepth
	// (ErrDepthLimit).
	MaxDepth int
	// MaxPerParent caps the live (pending or running) tasks launched from
	// one session. A Launch past it waits, first come first served, for
	// one of them to end — at most ParentWait, then it is refused
	// (ErrFanOutLimit); with ParentWait 0 it is refused at once. A waiting
	// Launch also gives up when its context ends (its error) or at
	// Shutdown (ErrShutdown).
	MaxPerParent int
	// ParentWait: see MaxPerParent.
	ParentWait time.Duration
	// MaxPerRoot caps the live tasks of one tree, at any depth: a Launch
	// past it is refused (ErrTreeLimit).
	MaxPerRoot int
}

func (t *TreeLimits) validate() error {
	if t.MaxDepth < 0 || t.MaxPerParent < 0 || t.MaxPerRoot < 0 || t.ParentWait < 0 {
		return fmt.Errorf("bgtask: invalid TreeLimits %+v: every limit is ≥ 0", *t)
	}
	return nil
}

// Metrics receives the Manager's measurements (WithMetrics): counters
// (launches, attempts started, retries by reason, outcomes by state),
// durations for histograms (queue wait, attempt duration, end to end) and
// gauges (live tasks, queue depth per concurrency key). The methods are
// called outside the Manager's lock, one at a time, in the order the
// measurements were made (so a gauge's last value is its current one):
// they must be quick and must not block or call into the Manager, which
// waits for them before its next measurements. A panic in one is recovered and counted
// as LoggerPanics are. Embed NopMetrics to implement only some; the
// otelmetrics module adapts OpenTelemetry.
type Metrics interface {
	TaskLaunched(t Task)
	AttemptStarted(t Task, a Attempt)
	// RetryScheduled: attempt failed fails over; reason is its outcome's
	// class (ReasonProviderError, ReasonDeadline, ...).
	RetryScheduled(t Task, failed Attempt, reason Reason)
	// AttemptEnded: a started attempt ended, after d running.
	AttemptEnded(t Task, a Attempt, d time.Duration)
	// TaskEnded: state is the outcome's (Outcome.State), d the time from
	// launch to end.
	TaskEnded(t Task, state Status, reason Reason, d time.Duration)
	// QueueWaited: an attempt got a slot of key after waiting d.
	QueueWaited(key string, d time.Duration)
	// LiveTasks and QueueDepth are gauges, reported as they change.
	LiveTasks(n int)
	QueueDepth(key string, queued int)
}

// NopMetrics implements Metrics and records nothing: embed it.
type NopMetrics struct{}

func (NopMetrics) TaskLaunched(Task)                             {}
func (NopMetrics) AttemptStarted(Task, Attempt)                  {}
func (NopMetrics) RetryScheduled(Task, Attempt, Reason)          {}
func (NopMetrics) AttemptEnded(Task, Attempt, time.Duration)     {}
func (NopMetrics) TaskEnded(Task, Status, Reason, time.Duration) {}
func (NopMetrics) QueueWaited(string, time.Duration)             {}
func (NopMetrics) LiveTasks(int)                                 {}
func (NopMetrics) QueueDepth(string, int)                        {}

// WithMetrics reports the Manager's measurements to mt; see Metrics.
// Default: none.
func WithMetrics(mt Metrics) Option { return optionFunc(func(c *config) { c.metrics = mt }) }

// measure queues a call of the Metrics for once m.mu is released. m.mu is
// held; call it only with m.cfg.metrics set.
func (m *Manager) measure(f func(Metrics)) {
	m.out.measures = append(m.out.measures, func() {
		defer func() {
			if recover() != nil {
				m.out.panics.Add(1)
			}
		}()
		f(m.cfg.metrics)
	})
}

// WithTreeLimits limits the depth and breadth of subagent trees; see
// TreeLimits. The limits are checked by the core as each task is
// launched, from what the ledger holds. Default: no limits.
func WithTreeLimits(t TreeLimits) Option { return optionFunc(func(c *config) { c.tree = t }) }

// WithRetryDelay waits f(n) before starting attempt n (n ≥ 2) of a retry.
// The attempt is pending with PendingRetryDelay meanwhile, and Cancel ends
// the wait. Default: no delay. Backoff returns a ready-made f. To see the
// failure that caused the retry, use WithRetryDelayFunc.
func WithRetryDelay(f func(attempt int) time.Duration) Option {
	if f == nil {
		return WithRetryDelayFunc(nil)
	}
	return WithRetryDelayFunc(func(attempt int, _ error) time.Duration { return f(attempt) })
}

// WithRetryDelayFunc is WithRetryDelay with the failure that caused the
// retry: f(n, cause) is waited before attempt n. cause is the error the
// failed attempt reported (a *StartError for a failed session start), so
// f can honour what the provider asked for:
//
//	bgtask.WithRetryDelayFunc(func(n int, cause error) time.Duration {
//		if d, ok := bgtask.RetryAfter(cause); ok {
//			return d
//		}
//		return time.Second
//	})
//
// f runs on a goroutine of the Manager, never under its lock. A panic in f
// ends the attempt it would delay in error, naming the panic. Default: no
// delay.
func WithRetryDelayFunc(f func(attempt int, cause error) time.Duration) Option {
	return optionFunc(func(c *config) { c.retryDelay = f })
}

// RetryAfter reports the delay a failure asks for before it is tried again:
// a RetryAfter() time.Duration method anywhere in err's chain, a RetryAfter
// field, or a Retry-After (or retry-after-ms) header carried by the error's
// HTTP response, as provider SDK errors carry it.
func RetryAfter(err error) (time.Duration, bool) {
	return errclass.RetryAfter(err)
}

// WithHoldLimit bounds the events held while session starts are in flight:
// at most n events for sessions not yet bound (all together), and at most n
// per attempt for events that name their AttemptID. Default: 1024. A
// liveness event (busy, waiting, compacted) beyond the bound is dropped:
// Observe refuses it with ErrUnknownSession. An event that ends a run
// (idle, error, interrupted, deleted) is never lost to the bound: it takes
// the place of the oldest held liveness event, or, when only such ends are
// held, is held past the bound (up to twice it). A session event is
// held only until every start that was in flight when it arrived has
// returned; an Event that carries AttemptID is never crowded out by events
// for other sessions, so hosts that know the attempt should send it.
func WithHoldLimit(n int) Option { return optionFunc(func(c *config) { c.holdLimit = n }) }

// classify works out a failure. It calls user code (the error's methods,
// the classifier): never with m.mu held. A panic in any of it makes the
// failure non-retryable, named in its text.
func (m *Manager) classify(err error) (f failure) {
	f = failure{err: err, text: safeText(err)}
	defer func() {
		if r := recover(); r != nil {
			f.reason, f.retry = ReasonUnknown, false
			f.text += " (bgtask: classifying this error panicked: " + panicText(r) + ")"
		}
	}()
	f.reason = reasonOf(err)
	f.retry = m.retryable(err)
	return f
}

// safeText returns err's text. An Error method that panics is user code
// failing: the text names the error's type and the panic instead.
func safeText(err error) (text string) {
	if err == nil {
		return ""
	}
	defer func() {
		if r := recover(); r != nil {
			text = fmt.Sprintf("%T (its Error method panicked: %s)", err, panicText(r))
		}
	}()
	return err.Error()
}

// panicText renders a recovered panic value; fmt survives a value whose
// own methods panic.
func panicText(r any) string { return fmt.Sprint(r) }

// safeError keeps an error from user code with its text worked out once,
// safely: its Error never calls user code again (the Manager may render it
// under its lock). errors.Is and errors.As see the original through Unwrap.
type safeError struct {
	text string
	err  error
}

func (e *safeError) Error() string { return e.text }
func (e *safeError) Unwrap() error { return e.err }

// guardError wraps err, from user code, in a safeError; nil stays nil.
func guardError(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := err.(*safeError); ok {
		return err
	}
	return &safeError{text: safeText(err), err: err}
}

// logRec is a log line queued while m.mu is held and emitted after it is
// released: the logger is user code too.
type logRec struct {
	level slog.Level
	msg   string
	attrs []slog.Attr
}

// Manager supervises background tasks. It is safe for concurrent use. Create
// it with New and stop it with Shutdown.
type Manager struct {
	host Host
	cfg  config // New's options, defaults filled in: never changed after New

	life lifetime // its context and the goroutines it owns; see lifetime

	// mu is the one lock of the core state: it guards led, order and
	// every component below that says it is guarded by m.mu.
	mu    sync.Mutex
	led   *ledger
	order []*entry // tasks in launch order

	calls    hostCalls      // starts and aborts in flight, held events; guarded by m.mu
	closures branchClosures // the closures in progress; its passMu, then m.mu
	changes  changeFeed     // change sequence, signal, subscribers; guarded by m.mu
	notes    notifications  // what parents are told; guarded by m.mu, but for lanes and counters
	out      outbox         // effects and log lines waiting for m.mu's release; guarded by m.mu, but for a counter
	hooks    testHooks      // set by tests before use, never changed after
}

// lifetime is the Manager's life and the goroutines it owns. ctx and cancel
// are set by New and never changed. group and watchers are safe for
// concurrent use; every goroutine of group is reserved under m.mu (an
// effect) or started by a goroutine of group already counted, which join
// relies on. closing is guarded by m.mu. parked has its own lock.
type lifetime struct {
	// ctx is the Manager's lifetime, not a request's: host and notifier
	// calls derive their contexts from it, and Shutdown cancels it.
	ctx    context.Context
	cancel context.CancelFunc

	group group.Group
	// watchers owns the goroutines that only wait for a subscriber's
	// context; kept apart so waiting for the work in group never waits
	// for a subscription. Shutdown joins both.
	watchers group.Group

	closing bool // Shutdown began: no new work

	// parked is the waits parked now, which the simulation harness sets
	// against the goroutines running in group.
	parked parking

	jerr          atomic.Pointer[error] // the journal's failure (poison), once it failed
	dead          chan struct{}         // closed once jerr is set: waits for what will never be recorded end
	journalClosed sync.Once             // Shutdown closes the journal, once nothing can commit
}

// hostCalls is what stands between a run and the Host, guarded by m.mu:
// the slots that admit session starts, the starts and aborts in flight
// (Shutdown waits for both), and the events held until a start in flight
// binds the session or attempt they name.
type hostCalls struct {
	pool     *slots.Pool[queued]     // concurrency slots; nil without WithConcurrency
	startSeq uint64                  // last session start issued
	inflight map[uint64]struct{}     // session starts in flight, by seq
	abortsN  int                     // aborts in flight
	held     *held.Set[observation]  // events waiting for a start in flight to bind their session
	prompts  map[*entry]*promptLane  // the Extend lanes of live tasks: one host prompt call at a time
	fanout   map[string][]*fanWaiter // Launches waiting for a live-task slot of their parent session, in arrival order
}

// fanWaiter is a Launch waiting for a slot of its parent session
// (TreeLimits.MaxPerParent): ch is closed when it may look again.
type fanWaiter struct {
	ch    chan struct{}
	woken bool
	since time.Time
}

// promptLane serializes the Extends of one task: its turn is taken, in
// arrival order, for the admission check, the host call and the record,
// then handed to the next. (The waits are close signals, as parked waits
// must be: the simulation's probe reads them.)
type promptLane struct {
	busy     bool            // an Extend holds the turn
	waiters  []chan struct{} // Extends waiting for it, in arrival order: closed when handed it
	users    int             // Extends holding or waiting for the turn
	inflight int             // host prompt calls in flight: the task does not end meanwhile
	stopCall func()          // ends the call in flight, when the run it prompts ends
	early    []turnEnd       // turn ends that came while a prompt was in flight, in order
}

// changeFeed is how changes are heard of, guarded by m.mu: the manager-wide
// change sequence and the epoch it counts in, the signal that wakes
// waiters of any change, and the subscribers.
type changeFeed struct {
	epoch     uint64        // this Manager's life: wall-clock nanoseconds at New
	seq       uint64        // manager-wide change sequence
	anyChange chan struct{} // manager-wide change signal, like runtime.changed
	subs      *feed.Feed[Change]
}

// notifications is what the parents are told. seq, rounds and lost are
// guarded by m.mu; lanes is safe for concurrent use (pushed to under
// m.mu); failures and dropped are atomic.
type notifications struct {
	lanes    *dispatch.Lanes[Notification]
	seq      uint64            // notification production sequence
	lastID   string            // the ID of the latest notification produced (kept through a compaction)
	rounds   map[string]*round // per parent: the tasks of its current round
	lost     []Notification    // notifications the Notifier never accepted
	failures atomic.Uint64     // notifications not delivered (NotifyFailures)
	dropped  atomic.Uint64     // undelivered notifications given up past the bound
}

// outbox is what the core decided while m.mu was held and the shell does
// once it is released (unlock): the effects, in the order decided, and the
// log lines (both guarded by m.mu); and the count of calls into the logger
// that panicked (panics: atomic).
type outbox struct {
	fx    []effect
	lines []logRec
	recs  []record // committed records for the journal, in order
	// spare is a records buffer an unlock is done with, for the next
	// commit's (at most one is kept; a bigger one than spareRecs goes).
	// Guarded by order: an unlock takes it while it holds both locks.
	spare    []record
	later    []func() // user callbacks (Spec.OnDone), run once the records are durable, each on a goroutine
	measures []func() // Metrics calls, run in commit order (see turns)
	// turns orders what the unlocks emit — log lines and measurements —
	// as m.mu was released, whichever goroutine emits them.
	turns   turns
	order   sync.Mutex // held from m.mu's release to a batch's append: batches stay in commit order
	panics  atomic.Uint64
	durable durableMark // with a journal: how far the committed records are durable
}

// spareRecs bounds the records buffer an unlock hands on (recycle).
const spareRecs = 64

// recycle keeps recs, encoded and no longer read, as the spare buffer.
// o.order is held.
func (o *outbox) recycle(recs []record) {
	if cap(recs) > spareRecs {
		return
	}
	clear(recs) // drop what the records point to
	o.spare = recs[:0]
}

// durableMark is the sequence of the last record known durable, and a
// channel closed when it moves on: what a wait that returns what the
// ledger holds waits on, so that what it returns survives a crash.
type durableMark struct {
	mu  sync.Mutex
	seq uint64
	ch  chan struct{}
}

// advance notes that the records up to seq are durable.
func (d *durableMark) advance(seq uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if seq > d.seq {
		d.seq = seq
		if d.ch != nil {
			close(d.ch)
			d.ch = nil
		}
	}
}

// reached reports whether the records up to seq are durable, and if not
// a channel closed when the mark next moves.
func (d *durableMark) reached(seq uint64) (bool, <-chan struct{}) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.seq >= seq {
		return true, nil
	}
	if d.ch == nil {
		d.ch = make(chan struct{})
	}
	return false, d.ch
}

// settle waits until the records up to seq — the latest of the tasks a
// wait returns, not those other tasks committed since, which may be a
// sync later — are durable (at once without a journal), so that what the
// wait returns survives a crash; or returns ctx's error, or the journal's
// once it failed. m.mu is held; it is released while waiting and held
// again on return.
func (m *Manager) settle(ctx context.Context, seq uint64) error {
	if m.cfg.journal == nil {
		return nil
	}
	target := min(seq, m.led.seq)
	for {
		ok, ch := m.out.durable.reached(target)
		if ok {
			return nil
		}
		m.mu.Unlock()
		err := m.await(ctx, ch)
		m.mu.Lock()
		if err != nil {
			return err
		}
	}
}

// New returns a Manager that runs child sessions through host. With
// WithJournal it recovers from the journal as Open does, with no deadline
// (a StatusHost that never answers holds New); a journal that cannot be
// read makes every Launch fail with the error. Use Open to bound the
// recovery and see its error at once.
func New(host Host, opts ...Option) *Manager {
	if host == nil {
		panic("bgtask: New with a nil Host")
	}
	m := newManager(host, opts)
	if m.cfg.journal != nil {
		if err := m.recover(context.Background()); err != nil {
			m.cfg.err = err
			m.logAttrs(slog.LevelError, "bgtask: recovering from the journal failed", slog.String("err", err.Error()))
		}
	}
	return m
}

// Open returns a Manager that runs child sessions through host, durable
// when opts has WithJournal: it replays the journal and recovers what was
// live before it returns. Every task comes back as committed. A run that
// may have had a child is asked about through the host (StatusHost):
// alive, it is re-adopted; ended, it ends with that evidence; gone, or with
// a host that cannot say, it ends interrupt ("lost across restart") —
// never cancelled or completed without evidence. A run that never asked
// for a child starts now. Notifications produced and not delivered are
// delivered again, in their order, with their IDs. What is owed is derived
// from the state replayed, not only from the records: a recorded retry
// starts the attempt it chose, an ended task whose final summary was never
// produced gets one, a round whose tasks all ended gets its all_complete
// once, and a run whose deadline passed while nobody ran is stopped
// through the host (found by FindSession if need be) and ends only when
// the host confirms. ctx bounds the host calls of the recovery. A journal
// Open cannot make sense of is an error (naming, for the file journal, the
// file, the offset and the record kind); Open never panics on one.
// Without a journal, Open is New.
func Open(ctx context.Context, host Host, opts ...Option) (*Manager, error) {
	if host == nil {
		return nil, errors.New("bgtask: Open with a nil Host")
	}
	m := newManager(host, opts)
	if m.cfg.journal == nil {
		return m, m.cfg.err
	}
	if err := m.recover(orBackground(ctx)); err != nil {
		m.life.cancel()
		stop, cancel := context.WithTimeout(context.Background(), ShutdownGrace)
		defer cancel()
		_ = m.Shutdown(stop)
		return nil, err
	}
	return m, m.cfg.err
}

// recover replays the journal, records the new process life's epoch, and
// reconciles what was live (reconcile), waiting for the host's answers.
func (m *Manager) recover(ctx context.Context) error {
	if t, ok := m.cfg.journal.(interface{ TornTail() string }); ok {
		var torn string
		if err := guardJournal("TornTail", func() error { torn = t.TornTail(); return nil }); err != nil {
			return err
		}
		if torn != "" {
			m.logAttrs(slog.LevelWarn, "bgtask: the journal's last record was torn (a crash mid-write) and was cut off", slog.String("where", torn))
		}
	}
	m.mu.Lock()
	rv, err := m.restore(ctx)
	if err != nil {
		// What was replayed before the failure is half a ledger (a task
		// launched without its first attempt, say): nothing of it lives in
		// this process, and the Shutdown that follows must not act on it.
		m.led, m.order = newLedger(m.cfg.ids), nil
		m.mu.Unlock()
		return err
	}
	m.out.durable.advance(m.led.seq) // what was replayed is durable
	m.led.tap = func(r record) { m.out.recs = append(m.out.recs, r) }
	m.led.emit(record{kind: recEpoch, at: m.now(), recordExt: &recordExt{epoch: m.changes.epoch, note: m.epochNote("")}})
	m.reconcile(rv)
	for before := -1; before != len(m.led.ended); { // what the journal still held past retention
		before = len(m.led.ended)
		m.sweep()
	}
	for _, e := range m.led.ended { // what stays is kept as a live Manager keeps it: frozen
		if e.notesOut == 0 {
			m.led.warm = append(m.led.warm, e)
		}
	}
	if len(m.led.warm) > freezeLag {
		m.goLater(m.freezeReplayed)
	}
	if err := m.unlock(); err != nil {
		return err
	}
	for range rv.left {
		select {
		case <-rv.pending:
		case <-ctx.Done():
			return fmt.Errorf("bgtask: recovering from the journal: %w", ctx.Err())
		}
	}
	// A closure the crash interrupted is finished: its fence up again, its
	// runs stopped, its record written.
	for _, seq := range slices.Sorted(maps.Keys(rv.closing)) {
		c := rv.closing[seq]
		var err error
		if c.task != "" {
			_, err = m.CloseTask(ctx, c.task)
		} else {
			_, err = m.CloseBranch(ctx, c.root)
		}
		if err != nil && !errors.Is(err, ErrUnknownSession) && !errors.Is(err, ErrUnknownTask) {
			m.logAttrs(slog.LevelWarn, "bgtask: finishing a closure the restart interrupted", slog.String("session", c.root), slog.String("task", c.task), slog.String("err", err.Error()))
		}
	}
	return m.poisoned()
}

func newManager(host Host, opts []Option) *Manager {
	cfg := config{holdLimit: 1024, notifyAttempts: 3, notifyBackoff: Backoff(200*time.Millisecond, 5*time.Second, 0.2),
		queueLimit: DefaultNotifyQueueLimit, undeliveredLimit: DefaultUndeliveredLimit,
		retention: Retention{MaxEnded: DefaultMaxEnded}}
	for _, o := range opts {
		o.apply(&cfg)
	}
	if cfg.logger == nil {
		cfg.logger = slog.New(slog.DiscardHandler)
	}
	cfg.silent = cfg.logger.Handler() == slog.DiscardHandler
	if !cfg.silent {
		cfg.logInfo, cfg.logDebug = loggerTakes(cfg.logger, slog.LevelInfo), loggerTakes(cfg.logger, slog.LevelDebug)
	}
	if cfg.clock == nil {
		cfg.clock = clock.Real{}
	}
	if cfg.ids == nil {
		cfg.ids = newUUIDs()
	}
	if cfg.retryable == nil {
		cfg.retryable = DefaultRetryable
	}
	if f, base := cfg.classifier, cfg.retryable; f != nil {
		cfg.retryable = func(err error) bool { return f(err, base(err)) }
	}
	if cfg.holdLimit <= 0 {
		cfg.holdLimit = 1024
	}
	if cfg.notifyAttempts < 1 {
		cfg.notifyAttempts = 1
	}
	if cfg.notifyBackoff == nil {
		cfg.notifyBackoff = func(int) time.Duration { return 0 }
	}
	m := &Manager{
		host:     host,
		cfg:      cfg,
		led:      newLedger(cfg.ids),
		closures: branchClosures{active: make(map[*closure]struct{})},
		changes:  changeFeed{subs: feed.New[Change](ErrLagged)},
		notes:    notifications{rounds: make(map[string]*round)},
		calls:    hostCalls{inflight: make(map[uint64]struct{}), held: held.New[observation](cfg.holdLimit)},
	}
	m.life.ctx, m.life.cancel = context.WithCancel(context.Background())
	m.life.dead = make(chan struct{})
	m.changes.epoch = uint64(time.Now().UnixNano()) // wall clock on purpose: it tells processes apart
	m.notes.lanes = dispatch.New(m.goLater, m.deliver)
	m.notes.lanes.SetLimit(cfg.queueLimit, lessNeeded)
	if cfg.limits != nil {
		m.calls.pool = slots.New[queued]()
		m.cfg.err = cfg.limits.validate()
	}
	if cfg.queueTimeout < 0 || cfg.stallTimeout < 0 {
		m.cfg.err = errors.New("bgtask: WithQueueTimeout and WithStallTimeout take a duration ≥ 0")
	}
	if err := cfg.tree.validate(); err != nil {
		m.cfg.err = err
	}
	if a, ok := host.(interface{ attach(*Manager) }); ok {
		a.attach(m)
	}
	return m
}

// goLocked starts f on a goroutine the Manager owns, taking m.mu so that
// the start cannot race the end of Shutdown. It reports false after
// Shutdown.
func (m *Manager) goLocked(f func()) bool {
	m.mu.Lock()
	defer m.unlock()
	return m.life.group.Go(f)
}

// unlock releases m.mu, then emits the log lines and runs the effects
// queued while it was held. With a journal, the records committed while
// it was held are appended (in commit order: under the lock) and made
// durable before any effect runs; an error is returned, and the Manager
// stops acting on the world (see poison).
func (m *Manager) unlock() error { return m.unlockOn(nil) }

// unlockOn is unlock on worker w of the Manager's group, as the last thing
// the function w runs does: the first effect may run on w once that
// function returns, instead of on a new goroutine (see group.Worker).
func (m *Manager) unlockOn(w *group.Worker) error { return m.unlockUntil(context.Background(), w) }

// unlockCtx is unlock for a caller whose wait for its records to be
// durable keeps to ctx: once ctx ends first, it returns ctx's error
// wrapped in errNotDurable, and the rest — the wait, then the effects, the
// log lines, the callbacks — goes on, on a goroutine of the Manager, in the
// order it would have.
func (m *Manager) unlockCtx(ctx context.Context) error { return m.unlockUntil(ctx, nil) }

// released is what an unlock does once m.mu is released: wait for its
// records (up to last) to be durable, then start its effects, emit its log
// lines and measurements in its turn, and run its callbacks.
type released struct {
	fx       []effect
	lines    []logRec
	later    []func()
	measures []func()
	turn     uint64
	ordered  bool
	last     uint64
}

// errNotDurable wraps ctx's error when a call's wait for its records to be
// durable ended with ctx: they may or may not be.
type errNotDurable struct{ err error }

func (e errNotDurable) Error() string {
	return "the context ended before the records were durable: " + e.err.Error()
}
func (e errNotDurable) Unwrap() error { return e.err }

func (m *Manager) unlockUntil(ctx context.Context, w *group.Worker) error {
	if len(m.led.warm) > 0 {
		m.freezeSome(freezeBudget)
	}
	if len(m.out.lines) == 0 && len(m.out.fx) == 0 && len(m.out.recs) == 0 && len(m.out.later) == 0 && len(m.out.measures) == 0 {
		m.mu.Unlock()
		return nil
	}
	r := released{lines: m.out.lines, fx: m.out.fx, later: m.out.later, measures: m.out.measures}
	recs := m.out.recs
	m.out.lines, m.out.fx, m.out.recs, m.out.later, m.out.measures = nil, nil, nil, nil, nil
	r.ordered = len(r.lines) > 0 || len(r.measures) > 0
	if r.ordered {
		r.turn = m.out.turns.take() // under m.mu: the turns follow its releases
	}
	var durable Commit
	if len(recs) > 0 {
		// Batches reach the journal in commit order: the order lock is
		// taken before m.mu is released, and the batch is encoded and
		// appended under it alone, so the encoding holds up no input.
		m.out.order.Lock()
		m.out.recs, m.out.spare = m.out.spare, nil // both locks held: the next commit's buffer
		m.mu.Unlock()
		r.last = recs[len(recs)-1].seq
		durable = m.appendBatch(recs)
		m.out.recycle(recs) // encoded: the records are done with
		m.out.order.Unlock()
	} else {
		m.mu.Unlock()
	}
	var err error
	if durable != nil {
		done, rest, werr := m.waitDurable(ctx, durable)
		if !done {
			// ctx ended first: the wait and all that follows it go on
			// without the caller (effects run only once the records are
			// durable, as ever).
			q := new(released)
			*q = r
			if !m.life.group.Go(func() { _ = m.finishRelease(q, rest(), nil) }) {
				_ = m.finishRelease(q, rest(), nil)
			}
			return errNotDurable{ctx.Err()}
		}
		err = werr
	}
	return m.finishRelease(&r, err, w)
}

// waitDurable waits for c to be durable until ctx ends (nil: without
// end). done is false when ctx ended first; rest then waits for what is
// left of the wait. A Journal's own Commit has only a blocking Wait: with
// a ctx that can end, it waits on a goroutine of the Manager.
func (m *Manager) waitDurable(ctx context.Context, c Commit) (done bool, rest func() error, err error) {
	if ctx == nil || ctx.Done() == nil {
		return true, nil, c.Wait()
	}
	switch c := c.(type) {
	case *wal.Batch:
		done, err = c.WaitContext(ctx)
		return done, c.Wait, err
	case failedCommit:
		return true, nil, c.err
	}
	ch := make(chan error, 1)
	if !m.life.group.Go(func() { ch <- c.Wait() }) {
		return true, nil, c.Wait()
	}
	select {
	case err := <-ch:
		return true, nil, err
	case <-ctx.Done():
		select {
		case err := <-ch:
			return true, nil, err
		default:
		}
		return false, func() error { return <-ch }, nil
	}
}

// finishRelease is the rest of an unlock once its records are durable
// (werr nil) or are known not to be: the Manager stops then (poison).
func (m *Manager) finishRelease(r *released, werr error, w *group.Worker) error {
	var err error
	if r.last > 0 {
		if werr != nil {
			err = m.poison(werr)
		} else {
			m.out.durable.advance(r.last)
		}
	}
	fx := r.fx
	for i := range fx {
		// fx is this call's own: &fx[i] stays valid. Worker w, if any, goes
		// on with the first host call (a start, a retry) of the chain.
		on := w
		if fx[i].kind != fxStart && fx[i].kind != fxRetry {
			on = nil
		} else {
			w = nil
		}
		m.life.group.Start(on, &fx[i])
	}
	if r.ordered { // the logger and Metrics are user code, and may be slow: after the effects start
		m.out.turns.wait(r.turn)
		for _, l := range r.lines {
			m.logAttrs(l.level, l.msg, l.attrs...)
		}
		for _, f := range r.measures {
			f()
		}
		m.out.turns.done()
	}
	for _, f := range r.later { // user callbacks: on a goroutine of their own, or here once none starts
		if err != nil {
			break // not durable: what they would be told did not happen
		}
		if !m.life.group.Go(f) {
			f()
		}
	}
	return err
}

// turns hands out turns in order and lets their holders go one at a time,
// in that order: what an unlock emits (log lines, measurements) comes out
// in the order m.mu was released, without m.mu held while an earlier
// unlock waits for its records to be durable. A turn's holder always takes
// it and gives it back: nothing between can block on a later turn.
type turns struct {
	issued uint64 // guarded by the Manager's m.mu
	mu     sync.Mutex
	next   uint64
	cond   sync.Cond
}

// take hands out the next turn. m.mu is held.
func (t *turns) take() uint64 {
	t.issued++
	return t.issued - 1
}

// wait returns once it is turn n's turn.
func (t *turns) wait(n uint64) {
	t.mu.Lock()
	if t.cond.L == nil {
		t.cond.L = &t.mu
	}
	for t.next != n {
		t.cond.Wait()
	}
	t.mu.Unlock()
}

// done ends the current turn.
func (t *turns) done() {
	t.mu.Lock()
	t.next++
	if t.cond.L != nil {
		t.cond.Broadcast()
	}
	t.mu.Unlock()
}

// appendBatch hands recs to the journal, encoded. m.out.order is held.
func (m *Manager) appendBatch(recs []record) (c Commit) {
	if fj, ok := m.cfg.journal.(*fileJournal); ok { // encoded straight into its payloads
		return fj.appendRecs(recs)
	}
	batch, err := encodeAll(recs)
	if err != nil {
		return failedCommit{err}
	}
	err = guardJournal("Append", func() error {
		c = m.cfg.journal.Append(batch)
		return nil
	})
	if err != nil || c == nil {
		if err == nil {
			err = errors.New("bgtask: Journal.Append returned no Commit")
		}
		return failedCommit{err}
	}
	return guardedCommit{c}
}

// guardedCommit is a Journal's Commit (user code) whose Wait cannot panic
// through the Manager.
type guardedCommit struct{ c Commit }

func (g guardedCommit) Wait() error {
	return guardJournal("Commit.Wait", g.c.Wait)
}

type failedCommit struct{ err error }

func (c failedCommit) Wait() error { return c.err }

// poison stops the Manager from acting on the world after its journal
// failed: what it has in memory is no longer what is durable, so no host
// call and no notification is made from then on (each fails with the
// journal's error), and every input is refused with it. A restart recovers
// from what the journal holds.
func (m *Manager) poison(err error) error {
	err = fmt.Errorf("%w: %w", ErrJournal, err)
	if m.life.jerr.CompareAndSwap(nil, &err) {
		close(m.life.dead) // whoever waits for what can no longer be recorded (await)
		m.logAttrs(slog.LevelError, "bgtask: the journal failed; the manager stops acting on the world", slog.String("err", err.Error()))
	}
	return m.poisoned()
}

// await waits until ch is closed (nil), ctx ends (its error) or the
// journal failed (its error: what is waited for will never be recorded).
// A ch already closed wins.
func (m *Manager) await(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-m.life.dead:
		select {
		case <-ch:
			return nil
		default:
			return m.poisoned()
		}
	}
}

// poisoned returns the journal's error once it failed, else nil.
func (m *Manager) poisoned() error {
	if p := m.life.jerr.Load(); p != nil {
		return *p
	}
	return nil
}

// effect is one thing the core decided to do to the world: a host call, a
// timer to wait on, a goroutine of the machinery. The core never does it
// itself: it queues the effect (m.effect) under m.mu, and unlock runs it,
// on a goroutine of the Manager, once the lock is released. What the
// effect learns comes back into the core as an input (a start returned,
// an abort returned, a timer fired).
type effect struct {
	m    *Manager
	kind effectKind
	e    *entry
	run  runOf // the run it serves
	// fxStart: the start's sequence. fxRetry: the failed run (prev),
	// whose session is aborted first when abortOld, and its failure
	// (cause), for the retry delay.
	seq      uint64
	prev     runOf
	abortOld bool
	cause    error
	session  string                // fxAbortOrphan, fxCascade: the session
	closure  *closure              // fxCascade: the closure of its branch
	rv       *recovery             // fxRecover: the restart it serves
	stopped  bool                  // fxRecover: a stop was asked before the question
	timer    Timer                 // fxQueueTimeout: made as the run queued; fxDeadline: made as it was armed
	done     <-chan struct{}       // fxStallWatch: closed when the run ends or is replaced
	waiter   *slots.Waiter[queued] // fxQueueTimeout: the run's place in the queue
	fn       func()                // fxGo: a goroutine of the machinery (a lane, abort workers)
	ctx      runCtx                // fxStart, fxRetry: the host call's context, made as it runs
}

// runOf is what identifies a run, copied from its attempt: immutable, so
// an effect reads it without the lock.
type runOf struct {
	id, token, session string
	number             int
	model              Model
}

func runOfAttempt(a Attempt) runOf {
	return runOf{id: a.ID, token: a.Token, session: a.SessionID, number: a.Number, model: a.Model}
}

// attempt is the run's identity as an Attempt (its status fields empty).
func (r runOf) attempt() Attempt {
	return Attempt{ID: r.id, Number: r.number, Token: r.token, Model: r.model, SessionID: r.session}
}

type effectKind uint8

const (
	fxStart        effectKind = iota + 1 // call StartSession for run a (start seq)
	fxRetry                              // abort the failed run's session, wait out the retry delay, admit run a
	fxAbortOrphan                        // abort a session created for a run no longer current
	fxStallWatch                         // watch run a for a stall
	fxQueueTimeout                       // end queued run a when the queue timeout fires first
	fxCascade                            // close the branch beneath a deleted session
	fxRecover                            // ask a StatusHost what became of run a after a restart
	fxDeadline                           // stop run a (or, with no run, the task) at its deadline: due
	fxGo                                 // run fn
)

// effect queues fx to run once m.mu is released, and reports true; or,
// once the Manager's goroutines are closed (after Shutdown), reports false
// and queues nothing: the caller settles what fx would have done. The
// goroutine it will run on is reserved now, under m.mu, so Shutdown's join
// never sees zero goroutines while an effect waits to run. m.mu is held.
func (m *Manager) effect(fx effect) bool {
	if !m.life.group.Reserve() {
		return false
	}
	fx.m = m
	m.out.fx = append(m.out.fx, fx)
	return true
}

// goLater runs f on a goroutine of the Manager once m.mu is released: the
// spawn of the machinery the core feeds under its lock (notification
// lanes, abort workers). m.mu is held.
func (m *Manager) goLater(f func()) bool { return m.effect(effect{kind: fxGo, fn: f}) }

// Run executes the effect, without m.mu, on worker w of the Manager's
// group: the goroutine reserved for it, or one that took it on after its
// own work (group.Worker).
func (fx *effect) Run(w *group.Worker) {
	m := fx.m
	switch fx.kind {
	case fxStart:
		m.startSession(fx, w)
	case fxRetry:
		m.retry(fx, w)
	case fxAbortOrphan:
		m.abortOrphanNow(fx.e, fx.run.attempt(), fx.session)
	case fxStallWatch:
		m.watchStallNow(fx.e, fx.run.attempt(), fx.done)
	case fxQueueTimeout:
		m.watchQueueNow(fx.e, fx.run.attempt(), fx.waiter, fx.timer)
	case fxCascade:
		m.cascadeNow(fx.closure, fx.session)
	case fxRecover:
		m.recoverRun(fx)
	case fxDeadline:
		m.watchDeadlineNow(fx)
	case fxGo:
		fx.fn()
	}
}

// logAttrs writes one line through the logger, which is user code: a panic
// in it is swallowed and counted (LoggerPanics), never passed on. m.mu must
// not be held.
func (m *Manager) logAttrs(level slog.Level, msg string, attrs ...slog.Attr) {
	defer func() {
		if r := recover(); r != nil {
			m.out.panics.Add(1)
		}
	}()
	ctx := context.Background()
	if !m.cfg.logger.Enabled(ctx, level) {
		return
	}
	m.cfg.logger.LogAttrs(ctx, level, msg, attrs...)
}

// LoggerPanics reports how many calls into the logger (WithLogger)
// panicked. Such a panic is swallowed: the line is lost, the Manager goes
// on.
func (m *Manager) LoggerPanics() uint64 { return m.out.panics.Load() }

// logLocked queues a log line; m.mu is held and released with unlock.
func (m *Manager) logLocked(level slog.Level, msg string, attrs ...slog.Attr) {
	m.out.lines = append(m.out.lines, logRec{level: level, msg: msg, attrs: attrs})
}

// Inputs. Everything that can change a task enters the core as one of the
// values below, and decide is the one place that routes each to the code
// that decides it, under m.mu. Deciding does no I/O: it commits records
// (commit, which derives every follow-up), queues effects (m.effect: host
// calls, timers, goroutines of the machinery) and log lines, and returns a
// reply; unlock then runs what was queued, outside the lock, and what an
// effect learns comes back as another input. User code that must run
// before a decision (an error's methods and the retry classifier, the
// retry delay) runs in the shell, and its answer is part of the input.
// The closure passes are the one other way in (closurePass, closure.go).
type input interface{ input() }

type (
	// launchIn: Launch, with the spec resolved and validated. (By value:
	// an input that is one pointer would make every input escape.)
	launchIn struct {
		info   taskInfo
		ticket *fanWaiter // its place in its parent's queue (TreeLimits.MaxPerParent), once it waits
		loc    *local     // what the new task keeps only in this process, if anything
		out    reply
	}
	// eventIn: Observe, a child session's event; its failure classified
	// when it needs to be (errNeedsClass asks for that first).
	eventIn struct {
		obs observation
		who resolved // the attempt a refused event resolved to
		err error    // why it was refused
	}
	// startedIn: a StartSession call returned (start seq, for attempt a).
	startedIn struct {
		e   *entry
		a   Attempt
		seq uint64
		sid string
		err error   // a *StartError, or nil
		f   failure // err, classified
	}
	// abortedIn: AbortSession calls of a batch returned (each op's err).
	abortedIn struct {
		b   *abortBatch
		ops []*abortOp
	}
	// retryReadyIn: a retry's old session was aborted and its delay (if
	// any) asked; afterDelay, the delay was also waited out.
	retryReadyIn struct {
		e          *entry
		next       Attempt
		delay      time.Duration
		delayErr   string // the retry delay function panicked
		afterDelay bool
		out        reply
	}
	// queueTimeoutIn: the queue timeout of queued run a fired.
	queueTimeoutIn struct {
		e *entry
		a Attempt
		w *slots.Waiter[queued]
	}
	// gateCheckIn: the children gate's release watch of candidate g fired.
	gateCheckIn struct {
		e *entry
		g *gateHold
	}
	// extendIn: Extend, before the host call (admit: check and reserve),
	// and after it (done: hostErr is its answer).
	extendIn struct {
		e       *entry
		prompt  string
		notice  string // rides the invocation's answer
		done    bool
		hostErr error
		req     PromptRequest      // admit: what to send
		cancel  context.CancelFunc // ends the host call (when the run prompted ends)
		values  context.Context    // admit: the Launch context whose values the call carries
		n       int
		err     error
	}
	// stallCheckIn: the stall watch of run a is due to look (retryAt: no
	// new stall abort before then).
	stallCheckIn struct {
		e       *entry
		a       Attempt
		retryAt time.Time
		out     reply
	}
	// deadlineIn: the deadline of run a of e (a.ID "": the task's) is due.
	deadlineIn struct {
		e    *entry
		a    Attempt
		wait <-chan struct{} // the abort to wait for before looking again
	}
	// stopIn: Cancel asked to stop task id (token: the run it saw, or "").
	stopIn struct {
		id, token string
		out       reply
	}
	// shutdownIn: Shutdown began.
	shutdownIn struct{}
	// runReturnedIn: a FuncHost function returned after it was asked to
	// stop, with its error text; ended: no abort in flight will confirm it.
	runReturnedIn struct {
		attemptID, token, text string
		ended                  bool
	}
	// recoveredIn: a StatusHost said, after a restart, what became of run
	// a of e (sid: its session, found by attempt id if it was not bound).
	recoveredIn struct {
		e      *entry
		a      Attempt
		sid    string
		report SessionReport
		err    error
		text   string  // err's text, worked out outside the lock
		f      failure // an ended run's error, classified outside the lock
		// stopAsked: a stop was asked of the run before the question was
		// (before the restart); one asked since is this life's own.
		stopAsked bool
		// seq is the start sequence the question stands for, when the run
		// was pending (its start's answer lost); 0 for a bound run.
		seq uint64
	}
)

func (*launchIn) input()       {}
func (*eventIn) input()        {}
func (*startedIn) input()      {}
func (*abortedIn) input()      {}
func (*retryReadyIn) input()   {}
func (*queueTimeoutIn) input() {}
func (*gateCheckIn) input()    {}
func (*extendIn) input()       {}
func (*stallCheckIn) input()   {}
func (*stopIn) input()         {}
func (*deadlineIn) input()     {}
func (*shutdownIn) input()     {}
func (*runReturnedIn) input()  {}
func (*recoveredIn) input()    {}

// reply is what deciding an input tells its caller (the out field of the
// inputs that have one).
type reply struct {
	e     *entry          // launchIn: the new task
	err   error           // launchIn, eventIn, stopIn: the input was refused
	wait  <-chan struct{} // stopIn, stallCheckIn: what to wait for next
	op    *abortOp        // stopIn: the abort the stop waits for
	token string          // stopIn: the run the stop acts on
	due   time.Time       // stallCheckIn: no new stall abort before then
	after time.Duration   // stallCheckIn: look again after that long
	done  bool            // stopIn: nothing to wait for; stallCheckIn: the watch ends
}

// decide decides one input; what it answers is left in the input's own
// result fields. m.mu is held.
func (m *Manager) decide(in input) {
	switch in := in.(type) {
	case *launchIn:
		in.out = m.onLaunch(in)
	case *eventIn:
		in.who, in.err = m.observeLocked(&in.obs)
	case *startedIn:
		m.onStarted(in)
	case *abortedIn:
		m.recordAborts(in.b, in.ops, m.now())
	case *retryReadyIn:
		in.out = m.onRetryReady(in)
	case *queueTimeoutIn:
		m.onQueueTimeout(in)
	case *gateCheckIn:
		m.onGateCheck(in)
	case *extendIn:
		in.n, in.err = m.onExtend(in)
	case *stallCheckIn:
		in.out = m.onStallCheck(in)
	case *stopIn:
		in.out = m.onStop(in)
	case *deadlineIn:
		m.onDeadline(in)
	case *shutdownIn:
		m.onShutdown()
	case *runReturnedIn:
		m.onRunReturned(in)
	case *recoveredIn:
		m.onRecovered(in)
	}
}

// step decides one input under m.mu and runs what it queued once the lock
// is released: the façade of every input that needs nothing between the
// two.
func (m *Manager) step(in input) error {
	if err := m.poisoned(); err != nil {
		return err
	}
	m.mu.Lock()
	m.decide(in)
	return m.unlock()
}

// stepCtx is step for a caller whose wait for durability keeps to ctx
// (see unlockCtx).
func (m *Manager) stepCtx(ctx context.Context, in input) error {
	if err := m.poisoned(); err != nil {
		return err
	}
	m.mu.Lock()
	m.decide(in)
	return m.unlockCtx(ctx)
}

// Launch records a task and its first attempt (pending) and returns its
// snapshot. The child session is started on a goroutine the Manager owns;
// Launch does not wait for it.
func (m *Manager) Launch(ctx context.Context, spec Spec) (Task, error) {
	ctx = orBackground(ctx)
	if err := ctx.Err(); err != nil {
		return Task{}, err
	}
	if err := spec.validate(); err != nil {
		return Task{}, err
	}
	if m.cfg.err != nil {
		return Task{}, m.cfg.err
	}
	maxAttempts := spec.MaxAttempts
	if maxAttempts == 0 {
		maxAttempts = len(spec.Models)
	}
	info := taskInfo{ // launchedAt is the core's to give, and id unless the spec has one
		id:          spec.ID,
		parent:      spec.ParentSessionID,
		description: spec.Description,
		agent:       spec.Agent,
		prompt:      spec.Prompt,
		models:      spec.Models, // the ledger keeps its own copy (chain)
		maxAttempts: maxAttempts,
		metadata:    maps.Clone(spec.Metadata),
	}
	if spec.Key != "" || spec.ContinueFrom != "" || spec.Timeout != 0 || spec.AttemptTimeout != 0 || spec.RetryOnTimeout {
		info.x = &taskExtra{key: spec.Key, continues: spec.ContinueFrom,
			timeout: spec.Timeout, attemptTimeout: spec.AttemptTimeout, retryOnTimeout: spec.RetryOnTimeout}
	}
	if spec.ContinueFrom != "" {
		if _, ok := m.host.(Resumer); !ok {
			return Task{}, ErrNoResumer
		}
	}
	if err := m.poisoned(); err != nil {
		return Task{}, err
	}
	in := launchIn{info: info}
	if spec.OnDone != nil || spec.InheritValues {
		in.loc = &local{}
		if spec.OnDone != nil {
			in.loc.onDone = []*func(Task){&spec.OnDone}
		}
		if spec.InheritValues {
			in.loc.values = ctx
		}
	}
	if err := m.launchDecide(ctx, &in); err != nil {
		return Task{}, err
	}
	if in.out.err != nil {
		_ = m.unlockCtx(ctx)
		var held *KeyHeldError
		if spec.ExtendLive && errors.As(in.out.err, &held) {
			return m.extendLive(ctx, held, &spec)
		}
		return Task{}, in.out.err
	}
	task := in.out.e.project()
	if err := m.unlockCtx(ctx); err != nil {
		return Task{}, durabilityUnknown(err, "Launch", task.ID) // not durable: it never happened, or may not have
	}
	if spec.CancelWithCaller {
		m.watchCaller(ctx, in.out.e)
	}
	return task, nil
}

// extendLive makes a Launch whose key a live task holds that task's next
// invocation (Spec.ExtendLive), and returns the task's snapshot.
func (m *Manager) extendLive(ctx context.Context, held *KeyHeldError, spec *Spec) (Task, error) {
	note := "a Launch with key " + strconv.Quote(held.Key) + ", which this task held, became this invocation (Spec.ExtendLive)"
	var hook *func(Task)
	if spec.OnDone != nil { // before the Extend: the task cannot end unseen in between
		hook = &spec.OnDone
		m.alsoOnDone(held.TaskID, hook)
	}
	if _, err := m.extend(ctx, held.TaskID, spec.Prompt, note); err != nil {
		if !errors.Is(err, ErrNotRunning) { // else the task is ending: OnDone tells of it
			m.dropOnDone(held.TaskID, hook)
		}
		return Task{}, err
	}
	return m.Lookup(held.TaskID)
}

// watchCaller stops task e when ctx ends first (Spec.CancelWithCaller).
// The caller's context is user code: it is looked at outside m.mu.
func (m *Manager) watchCaller(ctx context.Context, e *entry) {
	if ctx.Done() == nil {
		return
	}
	id := e.id
	stop := context.AfterFunc(ctx, func() { m.callerDone(id) })
	m.mu.Lock()
	if e.terminal() {
		m.unlock()
		stop()
		return
	}
	e.keep().stopWait = stop
	m.unlock()
}

// alsoOnDone adds the OnDone of a Launch that extends task id
// (Spec.ExtendLive) to the task's: it is called when the task ends, as
// the task's own is. m.mu is taken.
func (m *Manager) alsoOnDone(id string, hook *func(Task)) {
	m.mu.Lock()
	defer m.unlock()
	if e := m.led.tasks[id]; e != nil && !e.terminal() {
		l := e.keep()
		l.onDone = append(l.onDone, hook)
	}
}

// dropOnDone takes back a hook alsoOnDone added, for an Extend that
// failed (the Launch failed: it is told nothing). m.mu is taken.
func (m *Manager) dropOnDone(id string, hook *func(Task)) {
	if hook == nil {
		return
	}
	m.mu.Lock()
	defer m.unlock()
	if e := m.led.tasks[id]; e != nil && e.loc != nil {
		e.loc.onDone = slices.DeleteFunc(e.loc.onDone, func(h *func(Task)) bool { return h == hook })
	}
}

// launchDecide decides launch in, waiting in its parent's queue while
// TreeLimits.MaxPerParent says so (at most ParentWait, and never past
// ctx). It returns with m.mu held, unless it returns an error.
func (m *Manager) launchDecide(ctx context.Context, in *launchIn) error {
	var timer Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		m.mu.Lock()
		m.decide(in)
		if in.out.wait == nil {
			if in.out.err != nil && in.ticket != nil {
				m.leaveFanout(in)
			}
			return nil
		}
		wait, since := in.out.wait, in.ticket.since
		if timer == nil {
			timer = m.cfg.clock.NewTimer(m.cfg.tree.ParentWait)
		}
		m.unlock()
		var err error
		select {
		case <-wait:
			continue
		case <-ctx.Done():
			err = ctx.Err()
		case <-timer.C():
			t := m.cfg.tree
			err = &LimitError{Limit: ErrFanOutLimit, Max: t.MaxPerParent, Session: in.info.parent, Waited: m.now().Sub(since)}
		}
		m.mu.Lock()
		m.leaveFanout(in)
		m.unlock()
		return err
	}
}

// callerDone stops task id, whose caller's context ended
// (Spec.CancelWithCaller), with its branch, as CloseTask does: on a
// goroutine of the Manager, which logs the close's error.
func (m *Manager) callerDone(id string) {
	m.goLocked(func() {
		m.mu.Lock()
		e := m.led.tasks[id]
		live := e != nil && !e.terminal()
		m.unlock()
		if !live {
			return
		}
		if _, err := m.CloseTask(m.life.ctx, id); err != nil && !errors.Is(err, ErrShutdown) {
			m.logAttrs(slog.LevelWarn, "bgtask: stopping a task whose caller's context ended failed",
				slog.String("task", id), slog.String("err", err.Error()))
		}
	})
}

// continuation resolves info's Spec.ContinueFrom: an ended task that holds
// its session still (not continued by another already); the session and
// the task's output, bounded, go into info. m.mu is held.
func (m *Manager) continuation(info *taskInfo) error {
	old := m.led.tasks[info.opt().continues]
	if old == nil {
		return m.missing(info.opt().continues)
	}
	sid := old.cur().SessionID
	switch {
	case !old.terminal():
		return &SpecError{Field: "ContinueFrom", Reason: "names live task " + old.id + " (Extend it instead)"}
	case sid == "":
		return &SpecError{Field: "ContinueFrom", Reason: "names task " + old.id + ", which has no session to continue"}
	}
	if holder, ok := m.led.bySession[sid]; !ok || holder.e != old {
		if !ok { // the task that continued it was forgotten since (retention), and the session with it
			return &SpecError{Field: "ContinueFrom", Reason: "names task " + old.id + ", whose session a task since forgotten continued"}
		}
		return &SpecError{Field: "ContinueFrom", Reason: "names task " + old.id + ", whose session task " + holder.e.id + " continued: continue that one"}
	}
	o := old.project().Outcome
	prior := o.Evidence
	if o.HasAnswer {
		prior = o.Answer
	}
	info.extra().resume = sid
	info.extra().prior, _ = textbound.Middle(prior, MaxEvidenceRunes)
	return nil
}

// onLaunch decides a launch: refused while shutting down or inside a
// closing branch; else the task is recorded with its first attempt, which
// is admitted. m.mu is held.
func (m *Manager) onLaunch(in *launchIn) reply {
	info := new(taskInfo)
	*info = in.info
	if m.life.closing {
		return reply{err: ErrShutdown}
	}
	if m.closingParent(info.parent) {
		return reply{err: fmt.Errorf("%w: parent session %s is inside a branch being closed", ErrBranchClosing, info.parent)}
	}
	if o := m.led.live(info.opt().key); o != nil { // before any id is drawn: a refused launch leaves no trace
		return reply{err: &KeyHeldError{Key: info.opt().key, TaskID: o.id}}
	}
	if info.id != "" && m.led.taken(info.id) {
		return reply{err: fmt.Errorf("%w: %q", ErrIDTaken, info.id)}
	}
	if wait, err := m.treeAdmit(in); wait != nil || err != nil {
		return reply{wait: wait, err: err}
	}
	if info.opt().continues != "" {
		if err := m.continuation(info); err != nil {
			return reply{err: err}
		}
	}
	if info.id == "" {
		id, err := m.taskID()
		if err != nil {
			return reply{err: err}
		}
		info.id = id
	}
	info.launchedAt = m.now()
	e, first, err := m.led.open(info)
	if err != nil {
		return reply{err: err}
	}
	m.order = append(m.order, e)
	e.loc = in.loc
	if m.cfg.notifier != nil { // rounds exist only to tell a parent all is done
		r := m.notes.rounds[info.parent]
		if r == nil {
			r = &round{parent: info.parent}
			m.notes.rounds[info.parent] = r
		}
		r.live++
		r.tasks = append(r.tasks, e)
		e.rt.round = r
	}
	if !m.commit(e, first) { // cannot happen (open checked it): never leave a task without an attempt
		m.led.drop(e)
		m.order = m.order[:len(m.order)-1]
		if r := e.rt.round; r != nil {
			r.live--
			r.tasks = r.tasks[:len(r.tasks)-1]
		}
		return reply{err: errors.New("bgtask: the ledger refused a task's first attempt")}
	}
	m.admit(e, *e.cur())
	m.launched(e)
	if info.opt().timeout > 0 && !e.terminal() {
		m.armDeadline(e, Attempt{})
	}
	if in.ticket != nil { // it had its turn: the next in line may look
		m.leaveFanout(in)
	}
	return reply{e: e}
}

// taskID draws a task id from the IDGenerator; one that a caller already
// chose (Spec.ID) is drawn again, a few times. m.mu is held.
func (m *Manager) taskID() (string, error) {
	for range 4 {
		id, err := newID(m.cfg.ids, IDTask)
		if err != nil || !m.led.taken(id) {
			return id, err
		}
	}
	return "", errors.New("bgtask: the IDGenerator keeps returning task ids in use")
}

// treeAdmit applies WithTreeLimits to launch in: an error refuses it; a
// channel says it waits, in its parent's queue, until the channel is
// closed. m.mu is held.
func (m *Manager) treeAdmit(in *launchIn) (<-chan struct{}, error) {
	t, parent := &m.cfg.tree, in.info.parent
	root, depth := m.led.lineage(parent)
	switch {
	case t.MaxDepth > 0 && depth > t.MaxDepth:
		return nil, &LimitError{Limit: ErrDepthLimit, Max: t.MaxDepth, Session: parent}
	case t.MaxPerRoot > 0 && m.led.liveRoot[root] >= t.MaxPerRoot:
		return nil, &LimitError{Limit: ErrTreeLimit, Max: t.MaxPerRoot, Session: root}
	case t.MaxPerParent == 0:
		return nil, nil
	}
	q := m.calls.fanout[parent]
	ahead := len(q) > 0 && q[0] != in.ticket
	if !ahead && m.led.liveBy[parent] < t.MaxPerParent {
		return nil, nil
	}
	if in.ticket == nil {
		if t.ParentWait <= 0 {
			return nil, &LimitError{Limit: ErrFanOutLimit, Max: t.MaxPerParent, Session: parent}
		}
		in.ticket = &fanWaiter{ch: make(chan struct{}), since: m.now()}
		if m.calls.fanout == nil {
			m.calls.fanout = make(map[string][]*fanWaiter)
		}
		m.calls.fanout[parent] = append(q, in.ticket)
		if m.hooks.queued != nil {
			m.hooks.queued(parent)
		}
	} else if in.ticket.woken { // woken, and beaten to the slot: wait again
		in.ticket.ch, in.ticket.woken = make(chan struct{}), false
	}
	return in.ticket.ch, nil
}

// leaveFanout takes launch in out of its parent's queue, and lets the
// next one look if there is room. m.mu is held.
func (m *Manager) leaveFanout(in *launchIn) {
	parent := in.info.parent
	q := slices.DeleteFunc(m.calls.fanout[parent], func(w *fanWaiter) bool { return w == in.ticket })
	in.ticket = nil
	if len(q) == 0 {
		delete(m.calls.fanout, parent)
		return
	}
	m.calls.fanout[parent] = q
	m.wakeFanout(parent)
}

// wakeFanout lets the first Launch waiting for a slot of parent look
// again, if one is free. m.mu is held.
func (m *Manager) wakeFanout(parent string) {
	q := m.calls.fanout[parent]
	if len(q) == 0 || m.led.liveBy[parent] >= m.cfg.tree.MaxPerParent || q[0].woken {
		return
	}
	q[0].woken = true
	close(q[0].ch)
}

// Task returns a snapshot of the task with that id.
func (m *Manager) Task(id string) (Task, bool) {
	m.mu.Lock()
	defer m.unlock()
	e := m.led.tasks[id]
	if e == nil {
		return Task{}, false
	}
	return e.project(), true
}

// Lookup returns a snapshot of the task with that id, or ErrForgotten for
// a task forgotten under the retention rule, or ErrUnknownTask.
func (m *Manager) Lookup(id string) (Task, error) {
	m.mu.Lock()
	defer m.unlock()
	e := m.led.tasks[id]
	if e == nil {
		return Task{}, m.missing(id)
	}
	return e.project(), nil
}

// missing is the error for an id no task in memory has. m.mu is held.
func (m *Manager) missing(id string) error {
	if _, ok := m.led.tombs[id]; ok {
		return fmt.Errorf("%w: %q", ErrForgotten, id)
	}
	return fmt.Errorf("%w: %q", ErrUnknownTask, id)
}

// Query selects tasks for a paged read (Manager.Page).
type Query struct {
	Parent string // only tasks launched from this session; "": any
	Root   string // only tasks of the tree under this session (Task.Root), at any depth; "": any
	Status Status // only tasks in this status; "": any
	// Statuses, if set, keeps tasks in any of these statuses (with Status
	// too, in Status or any of these).
	Statuses []Status
	// Metadata keeps tasks whose Spec.Metadata has every one of these
	// key/value pairs.
	Metadata map[string]string
	// After is the cursor of the previous page (Page.Next); "": from the
	// first task launched.
	After string
	Limit int // at most this many tasks: 1..1000; 0: 100
}

// Page is one page of tasks, in launch order.
type Page struct {
	// Tasks are the page's tasks, in launch order.
	Tasks []Task
	Next  string // the cursor of the next page; "" when this is the last
}

// Page returns the tasks Query selects, one page at a time, copying only
// that page under the lock: for services that must not copy every task.
// A query by Parent, Root or Metadata reads an index of the tasks it
// names (the smallest of them), not every task.
func (m *Manager) Page(q Query) (Page, error) {
	limit := q.Limit
	switch {
	case limit == 0:
		limit = 100
	case limit < 0 || limit > 1000:
		return Page{}, fmt.Errorf("%w: Query.Limit %d is not in 1..1000", ErrInvalidArgument, q.Limit)
	}
	m.mu.Lock()
	defer m.unlock()
	from := m.candidates(&q)
	start := 0
	if q.After != "" {
		e := m.led.tasks[q.After]
		if e == nil {
			return Page{}, fmt.Errorf("%w: cursor: %w", ErrInvalidArgument, m.missing(q.After))
		}
		start = slices.Index(from, e) + 1
		if start == 0 {
			return Page{}, fmt.Errorf("%w: cursor %q is not a task of this query", ErrInvalidArgument, q.After)
		}
	}
	var p Page
	for i := start; i < len(from); i++ {
		e := from[i]
		if !q.matches(e) {
			continue
		}
		if len(p.Tasks) == limit {
			p.Next = p.Tasks[len(p.Tasks)-1].ID
			break
		}
		p.Tasks = append(p.Tasks, e.project())
	}
	return p, nil
}

// candidates returns the tasks q can select from, in launch order: the
// smallest index q names, or every task. m.mu is held.
func (m *Manager) candidates(q *Query) []*entry {
	from, l := m.order, m.led
	pick := func(c []*entry) { // an index with none of the tasks is the smallest
		if len(c) < len(from) {
			from = c
		}
	}
	if q.Parent != "" {
		pick(l.byParent[q.Parent])
	}
	if q.Root != "" {
		pick(l.byRoot[q.Root])
	}
	for k, v := range q.Metadata {
		pick(l.byMeta[metaKey(k, v)])
	}
	return from
}

// matches reports whether q selects e. m.mu is held.
func (q *Query) matches(e *entry) bool {
	switch {
	case q.Parent != "" && e.info.parent != q.Parent:
		return false
	case q.Root != "" && e.info.root != q.Root:
		return false
	case (q.Status != "" || len(q.Statuses) > 0) && e.cur().Status != q.Status && !slices.Contains(q.Statuses, e.cur().Status):
		return false
	}
	for k, v := range q.Metadata {
		if got, ok := e.info.metadata[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// Tasks returns snapshots of every task, in launch order.
func (m *Manager) Tasks() []Task { return m.Snapshot().Tasks }

// Wait blocks until the task is terminal and returns its snapshot, or
// returns ctx's error first — or ErrJournal once the journal failed (the
// Manager records nothing more, so the task will not end here). With a
// journal, it returns once the end is durable: what Wait reports, a
// restart replays.
func (m *Manager) Wait(ctx context.Context, id string) (Task, error) {
	ctx = orBackground(ctx)
	m.mu.Lock()
	e := m.led.tasks[id]
	if e == nil {
		err := m.missing(id)
		m.unlock()
		return Task{}, err
	}
	done := e.waitDone()
	m.unlock()
	if err := m.await(ctx, done); err != nil {
		return Task{}, err
	}
	m.mu.Lock()
	defer m.unlock()
	t := e.project()
	if err := m.settle(ctx, e.seq); err != nil {
		return Task{}, err
	}
	return t, nil
}

// WaitParent blocks until every task launched from parentSessionID has
// ended — also those launched while it waits — and returns their
// snapshots in launch order, or returns ctx's error first. A parent with
// no task returns at once, with none. (Tasks forgotten under retention
// are not returned.)
func (m *Manager) WaitParent(ctx context.Context, parentSessionID string) ([]Task, error) {
	ctx = orBackground(ctx)
	if blank(parentSessionID) {
		return nil, fmt.Errorf("%w: WaitParent with no session", ErrInvalidArgument)
	}
	for {
		m.mu.Lock()
		var live *entry
		for _, e := range m.led.byParent[parentSessionID] {
			if !e.terminal() {
				live = e
				break
			}
		}
		if live == nil {
			kids := m.led.byParent[parentSessionID]
			out := make([]Task, len(kids))
			var upTo uint64
			for i, e := range kids {
				out[i] = e.project()
				upTo = max(upTo, e.seq)
			}
			err := m.settle(ctx, max(upTo, 1))
			m.unlock()
			if err != nil {
				return nil, err
			}
			return out, nil
		}
		done := live.waitDone()
		m.unlock()
		if err := m.await(ctx, done); err != nil {
			return nil, err
		}
	}
}

// Extend sends prompt into the running task's child conversation as its
// next invocation and returns the invocation's number (the launch prompt
// is 1). The host must implement Prompter; the prompt is queued for the
// child's next turn, not interrupting the one in flight. Extends of one
// task are admitted one at a time, in the order they arrive, and each host
// prompt call is made only after the one before it returned. An Extend
// that cannot be admitted changes nothing and says why: ErrNotRunning (the
// task ended, has no session yet, or is being stopped), ErrShutdown,
// ErrBranchClosing, ErrNoPrompter, ErrPromptRefused (wrapping the host's
// error), ErrUnknownTask or ErrForgotten, or ctx's error while it waited
// its turn.
// An Extend never starts a run. Its answer: WaitAnswer.
func (m *Manager) Extend(ctx context.Context, taskID, prompt string) (int, error) {
	return m.extend(ctx, taskID, prompt, "")
}

// extend is Extend; notice, if set, rides the invocation's answer.
func (m *Manager) extend(ctx context.Context, taskID, prompt, notice string) (int, error) {
	ctx = orBackground(ctx)
	switch {
	case ctx.Err() != nil:
		return 0, ctx.Err()
	case blank(taskID):
		return 0, fmt.Errorf("%w: Extend with no task id", ErrInvalidArgument)
	case blank(prompt):
		return 0, fmt.Errorf("%w: Extend with an empty prompt", ErrInvalidArgument)
	}
	p, ok := m.host.(Prompter)
	if !ok {
		return 0, ErrNoPrompter
	}
	if err := m.poisoned(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	e := m.led.tasks[taskID]
	if e == nil {
		err := m.missing(taskID)
		m.unlock()
		return 0, err
	}
	if e.terminal() { // no turn to wait for
		m.unlock()
		return 0, fmt.Errorf("%w: task %s is %s", ErrNotRunning, e.id, e.state)
	}
	lane, err := m.takeTurn(ctx, e) // unlocks m.mu
	if err != nil {
		return 0, err
	}
	defer m.passTurn(e, lane)
	// The call's context ends with the caller's, when the run it prompts
	// ends (its answer could change nothing: the core cancels it then),
	// and at Shutdown, as every host call's does.
	callCtx, cancel := context.WithCancel(m.life.ctx)
	defer cancel()
	if ctx.Done() != nil { // a caller that can give up
		defer context.AfterFunc(ctx, cancel)()
	}
	in := extendIn{e: e, prompt: prompt, notice: notice, cancel: cancel}
	if err := m.step(&in); err != nil { // it records nothing: the admission is recorded once the host took the prompt
		return 0, err
	}
	if in.err != nil {
		return 0, in.err
	}
	in.done = true
	in.hostErr = m.callPrompt(withRunOf(callCtx, e, in.req, in.values), p, in.req)
	if err := m.stepCtx(ctx, &in); err != nil {
		return 0, durabilityUnknown(err, "Extend", e.id)
	}
	return in.n, in.err
}

// takeTurn waits, in arrival order, for e's Extend turn and returns the
// lane holding it; the caller passes it on (passTurn). m.mu is held, and
// released.
func (m *Manager) takeTurn(ctx context.Context, e *entry) (*promptLane, error) {
	if m.calls.prompts == nil {
		m.calls.prompts = make(map[*entry]*promptLane)
	}
	lane := m.calls.prompts[e]
	if lane == nil {
		lane = &promptLane{}
		m.calls.prompts[e] = lane
	}
	lane.users++
	if !lane.busy {
		lane.busy = true
		m.unlock()
		return lane, nil
	}
	handed := make(chan struct{})
	lane.waiters = append(lane.waiters, handed)
	m.unlock()
	err := m.parkOn(ctx, handed)
	if err == nil {
		return lane, nil
	}
	m.mu.Lock()
	if i := slices.Index(lane.waiters, handed); i >= 0 {
		lane.waiters = slices.Delete(lane.waiters, i, i+1)
		m.leaveLane(e, lane)
	} else { // handed the turn as ctx ended: on to the next
		m.handOn(e, lane)
	}
	m.unlock()
	return nil, err
}

// passTurn gives e's Extend turn to the next waiting Extend, if any.
func (m *Manager) passTurn(e *entry, lane *promptLane) {
	m.mu.Lock()
	m.handOn(e, lane)
	m.unlock()
}

// handOn passes the turn of lane, held by a leaving Extend, to the first
// waiter. m.mu is held.
func (m *Manager) handOn(e *entry, lane *promptLane) {
	if len(lane.waiters) > 0 {
		close(lane.waiters[0]) // its owner now
		lane.waiters = lane.waiters[1:]
	} else {
		lane.busy = false
	}
	m.leaveLane(e, lane)
}

// leaveLane counts an Extend out of lane; an ended task's last one takes
// the lane away (a live task keeps it for the next Extend). m.mu is held.
func (m *Manager) leaveLane(e *entry, lane *promptLane) {
	if lane.users--; lane.users == 0 && e.terminal() {
		delete(m.calls.prompts, e)
	}
}

// callPrompt calls the host's PromptSession, which is user code: a panic
// is its refusal.
func (m *Manager) callPrompt(ctx context.Context, p Prompter, req PromptRequest) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("bgtask: Host.PromptSession panicked: %s", panicText(r))
		}
	}()
	return guardError(p.PromptSession(ctx, req))
}

// WaitAnswer waits for the answer of invocation n of a task (1 is its
// launch prompt) and returns it. Answers are released in invocation order:
// n's answer is returned only once every invocation before it has its
// own. ErrNoInvocation if the task never admitted invocation n.
func (m *Manager) WaitAnswer(ctx context.Context, taskID string, n int) (Answer, error) {
	ctx = orBackground(ctx)
	for {
		m.mu.Lock()
		e := m.led.tasks[taskID]
		if e == nil {
			err := m.missing(taskID)
			m.unlock()
			return Answer{}, err
		}
		admitted := 1
		if e.inv != nil {
			admitted = len(e.inv.list)
		}
		switch {
		case n < 1 || (n > admitted && e.terminal()):
			m.unlock()
			return Answer{}, fmt.Errorf("%w: task %s has no invocation %d", ErrNoInvocation, taskID, n)
		case e.inv != nil && e.inv.released(n):
			a := *e.inv.list[n-1].Answer
			a.Notices = slices.Clone(a.Notices)
			err := m.settle(ctx, e.seq)
			m.unlock()
			if err != nil {
				return Answer{}, err
			}
			return a, nil
		case e.inv == nil && n == 1 && e.terminal():
			t := e.project()
			err := m.settle(ctx, e.seq)
			m.unlock()
			if err != nil {
				return Answer{}, err
			}
			return answerOfTask(t), nil
		}
		changed := e.waitChange()
		m.unlock()
		if err := m.await(ctx, changed); err != nil {
			return Answer{}, err
		}
	}
}

// answerOfTask is the answer of a task that was never extended: its
// outcome.
func answerOfTask(t Task) Answer {
	o := t.Outcome
	a := Answer{Invocation: 1, Status: o.State, Text: o.Error, Degraded: slices.ContainsFunc(o.Notices, isDegradedNotice),
		Notices: slices.Clone(o.Notices), At: t.CompletedAt, Envelope: o.Envelope}
	if o.HasAnswer {
		a.Text = o.Answer
	}
	return a
}

// Observe applies a child session's lifecycle event. It returns nil when the
// event was applied, or held until the session a start in flight creates is
// bound; ErrStaleEvent when it belongs to a superseded or terminal attempt,
// names an old run token, or names an attempt no child can be running for;
// ErrUnknownSession when no task knows the session (or too many events are
// held already); ErrInvalidEvent for an event with neither session nor
// attempt, or an unknown kind. Rejected events change nothing and are logged
// at debug level with the task, attempt and session ids. With a journal,
// Observe returns once what the event decided is durable, or ErrJournal if
// it could not be made so (the Manager then stops acting on the world).
func (m *Manager) Observe(ev Event) error {
	if !ev.Kind.valid() {
		return fmt.Errorf("%w: unknown kind %q", ErrInvalidEvent, ev.Kind)
	}
	if ev.SessionID == "" && ev.AttemptID == "" {
		return fmt.Errorf("%w: no SessionID or AttemptID", ErrInvalidEvent)
	}
	in := eventIn{obs: observation{ev: ev, classified: ev.Kind != SessionError}}
	durable := m.step(&in)
	if in.err == errNeedsClass {
		// An error that will be applied: classify it without the lock (the
		// classifier is user code), then resolve again from scratch.
		o := &in.obs
		if o.ev.Err == nil {
			o.ev.Err = errors.New("session error with no detail")
		}
		o.fail, o.classified = m.classify(o.ev.Err), true
		durable = m.step(&in)
	}
	if in.err != nil {
		m.logRejected(ev, in.who, in.err)
		return in.err
	}
	return durable // ErrJournal: what the event decided is not durable, and has not happened
}

// resolved names the attempt an event resolved to, for logging.
type resolved struct{ taskID, attemptID string }

// retryable applies the classifier; Permanent always wins. It runs user
// code: never call it with m.mu held.
func (m *Manager) retryable(err error) bool {
	if IsPermanent(err) {
		return false
	}
	return m.cfg.retryable(err)
}

// retry runs a retry effect on worker w: abort the failed run's session,
// ask the retry delay, wait it out, then have the next run (fx.run)
// admitted if it is still the task's current, pending run.
func (m *Manager) retry(fx *effect, w *group.Worker) {
	e, next := fx.e, fx.run.attempt()
	if fx.abortOld {
		failed := fx.prev.attempt()
		fx.ctx = runCtx{Context: m.life.ctx, v: runValue{ref: RunRef{TaskID: e.info.id, AttemptID: failed.ID, Token: failed.Token}, kind: callAbort}}
		if err := m.callAbort(&fx.ctx, failed.SessionID); err != nil {
			m.logAttrs(slog.LevelWarn, "bgtask: abort of failed attempt's session failed",
				slog.String("task", e.info.id), slog.String("attempt", failed.ID),
				slog.String("session", failed.SessionID), slog.String("err", err.Error()))
		}
	}
	in := retryReadyIn{e: e, next: next}
	in.delay, in.delayErr = m.retryDelay(next.Number, fx.cause)
	m.mu.Lock()
	m.decide(&in)
	r := in.out
	if r.wait == nil {
		m.unlockOn(w)
		return
	}
	m.unlock()
	t := m.cfg.clock.NewTimer(in.delay)
	select {
	case <-t.C():
	case <-r.wait:
		t.Stop()
	case <-m.life.ctx.Done():
		t.Stop()
	}
	in.afterDelay = true
	m.mu.Lock()
	m.decide(&in)
	m.unlockOn(w)
}

// retryDelay asks the user's retry delay function (user code: never under
// m.mu). A panic is reported as the error text that ends the attempt.
func (m *Manager) retryDelay(attempt int, cause error) (d time.Duration, panicked string) {
	if m.cfg.retryDelay == nil {
		return 0, ""
	}
	defer func() {
		if r := recover(); r != nil {
			d, panicked = 0, "bgtask: the retry delay function panicked: "+panicText(r)
		}
	}()
	return m.cfg.retryDelay(attempt, cause), ""
}

// startSession calls StartSession for run a of e (start seq) and feeds its
// answer back (started), on worker w.
func (m *Manager) startSession(fx *effect, w *group.Worker) {
	e, a := fx.e, fx.run.attempt()
	req := SessionRequest{
		TaskID:          e.info.id,
		AttemptID:       a.ID,
		AttemptNumber:   a.Number,
		Token:           a.Token,
		ParentSessionID: e.info.parent,
		Model:           a.Model,
		Agent:           e.info.agent,
		Prompt:          e.info.prompt,
		Description:     e.info.description,
		Metadata:        maps.Clone(e.info.metadata),
	}
	fx.ctx = runCtx{Context: m.life.ctx, v: runValue{ref: RunRef{TaskID: req.TaskID, AttemptID: a.ID, Token: a.Token}, kind: callStart, e: e}, values: fx.ctx.values}
	var sid string
	err := m.gateStart(&fx.ctx, req)
	switch {
	case err != nil:
	case a.Number == 1 && e.info.opt().resume != "":
		sid, err = m.callResume(&fx.ctx, e.info.opt().resume, req)
	default:
		sid, err = m.callStart(&fx.ctx, req)
	}
	var f failure
	if err != nil {
		err = &StartError{Model: a.Model, Err: err}
		f = m.classify(err)
	}
	m.mu.Lock()
	m.decide(&startedIn{e: e, a: a, seq: fx.seq, sid: sid, err: err, f: f})
	m.unlockOn(w)
}

// gateStart asks the start gate (WithStartGate) whether req may start: a
// refusal, or a gate that panics, fails the start for good.
func (m *Manager) gateStart(ctx context.Context, req SessionRequest) (err error) {
	g := m.cfg.startGate
	if g == nil {
		return nil
	}
	defer func() {
		if r := recover(); r != nil {
			err = Permanent(fmt.Errorf("bgtask: the start gate panicked: %s", panicText(r)))
		}
	}()
	if err := guardError(g(ctx, req)); err != nil {
		return Permanent(fmt.Errorf("bgtask: the start was refused: %w", err))
	}
	return nil
}

// callResume resumes session sid for req (Spec.ContinueFrom) and returns
// it; the host is user code.
func (m *Manager) callResume(ctx context.Context, sid string, req SessionRequest) (_ string, err error) {
	if err := m.poisoned(); err != nil {
		return "", Permanent(err)
	}
	defer func() {
		if r := recover(); r != nil {
			err = Permanent(fmt.Errorf("bgtask: Host.ResumeSession panicked: %s", panicText(r)))
		}
	}()
	r, _ := m.host.(Resumer) // Launch checked
	if err := guardError(r.ResumeSession(ctx, sid, req)); err != nil {
		return "", err
	}
	return sid, nil
}

func (m *Manager) callStart(ctx context.Context, req SessionRequest) (sid string, err error) {
	if err := m.poisoned(); err != nil {
		return "", Permanent(err)
	}
	defer func() {
		if r := recover(); r != nil {
			sid, err = "", Permanent(fmt.Errorf("bgtask: Host.StartSession panicked: %s", panicText(r)))
		}
	}()
	sid, err = m.host.StartSession(ctx, req)
	return sid, guardError(err)
}

// signal wakes everyone waiting on a manager-wide change.
func (m *Manager) signal() {
	if m.changes.anyChange != nil {
		close(m.changes.anyChange)
		m.changes.anyChange = nil
	}
}

// waitDone returns a channel closed when e is terminal: made only for a
// waiter. m.mu is held.
func (e *entry) waitDone() <-chan struct{} { return e.rt.sig.Done(e.terminal()) }

// waitChange returns a channel closed at e's next change. m.mu is held.
func (e *entry) waitChange() <-chan struct{} {
	return e.rt.sig.Changed()
}

// waitAny returns a channel closed at the next change of any task. m.mu is
// held.
func (m *Manager) waitAny() <-chan struct{} {
	if m.changes.anyChange == nil {
		m.changes.anyChange = make(chan struct{})
	}
	return m.changes.anyChange
}

// notify queues a notification for e's parent, in production order.
func (m *Manager) notify(e *entry, kind NotificationKind, text string) {
	m.notifyOf(e, kind, 0, text)
}

// notifyOf is notify, for the answer of invocation inv (NotifyAnswer).
// m.mu is held.
func (m *Manager) notifyOf(e *entry, kind NotificationKind, inv int, text string) {
	if m.cfg.notifier == nil {
		return
	}
	m.push(Notification{
		Kind:            kind,
		ParentSessionID: e.info.parent,
		TaskID:          e.info.id,
		Task:            e.project(),
		Text:            text,
		Invocation:      inv,
	})
}

// push numbers n and queues it on its parent's lane, in production order.
// A lane that is full (WithNotifyLimits) gives up its oldest waiting
// notification, which is kept as undelivered. m.mu is held.
func (m *Manager) push(n Notification) {
	m.notes.seq++
	n.Seq = m.notes.seq
	if n.ID == "" {
		id, err := newID(m.cfg.ids, IDNotification)
		if err != nil || id == "" {
			id = "n-" + strconv.FormatUint(m.changes.epoch, 10) + "-" + strconv.FormatUint(n.Seq, 10)
		}
		n.ID = id
	}
	m.notes.lastID = n.ID
	if m.led.recording() {
		m.led.emit(record{kind: recNotifyProduced, task: n.TaskID, at: m.now(), recordExt: &recordExt{notice: m.noticeOf(n)}})
	}
	m.queueNote(n)
}

// queueNote puts n on its parent's lane; its task counts it as out until
// it is delivered or given up. m.mu is held.
func (m *Manager) queueNote(n Notification) {
	old, evicted, ok := m.notes.lanes.Push(n.ParentSessionID, n)
	if ok {
		m.noteOut(n.TaskID, 1)
	}
	if evicted {
		m.notes.failures.Add(1)
		m.noteOut(old.TaskID, -1)
		m.keepLost(old, "its parent's queue is full (WithNotifyLimits)")
	}
	if !ok {
		m.notes.failures.Add(1)
		m.logLocked(slog.LevelError, "bgtask: notification not delivered: the manager is shut down",
			slog.String("task", n.TaskID), slog.String("parent", n.ParentSessionID), slog.String("kind", string(n.Kind)))
	}
}

// noteOut counts a notification of task id as out (d 1) or no longer
// (d -1); an ended task none is out for may be forgotten. m.mu is held.
func (m *Manager) noteOut(id string, d int) {
	e := m.led.tasks[id]
	if id == "" || e == nil {
		return
	}
	e.notesOut += d
	m.led.notesOut += d
	if d < 0 && e.notesOut == 0 && e.terminal() {
		m.taskSettled(e)
		m.sweep()
	}
}

// noticeOf is n as the ledger records it. m.mu is held.
func (m *Manager) noticeOf(n Notification) *notice {
	nt := &notice{id: n.ID, seq: n.Seq, kind: n.Kind, parent: n.ParentSessionID, text: n.Text, attempt: n.Task.CurrentAttemptID, invocation: n.Invocation}
	for _, t := range n.Tasks {
		nt.tasks = append(nt.tasks, t.ID)
	}
	if n.Kind == NotifyBranchClosed && len(m.led.closures) > 0 {
		nt.closure = m.led.closures[len(m.led.closures)-1].seq
	}
	return nt
}

// keepLost keeps n, which the Notifier will not get, for Undelivered: at
// most the WithNotifyLimits bound, the oldest given up first (counted by
// NotifyDropped). Either way it is logged at error level. m.mu is held.
func (m *Manager) keepLost(n Notification, why string) {
	// Recorded as settled: a restart does not deliver it again, out of its
	// parent's order, after what came later was delivered.
	if m.led.recording() {
		m.led.emit(record{kind: recNotifyDelivered, task: n.TaskID, at: m.now(), recordExt: &recordExt{note: "given up: " + why, notice: &notice{seq: n.Seq, kind: n.Kind, parent: n.ParentSessionID}}})
	}
	m.logLocked(slog.LevelError, "bgtask: notification not delivered", slog.String("reason", why),
		slog.String("task", n.TaskID), slog.String("parent", n.ParentSessionID), slog.String("kind", string(n.Kind)))
	if len(m.notes.lost) >= m.cfg.undeliveredLimit {
		m.notes.dropped.Add(1)
		m.logLocked(slog.LevelError, "bgtask: undelivered notification dropped: Undelivered is full (WithNotifyLimits)",
			slog.String("task", m.notes.lost[0].TaskID), slog.String("parent", m.notes.lost[0].ParentSessionID), slog.String("kind", string(m.notes.lost[0].Kind)))
		m.notes.lost[0] = Notification{}
		m.notes.lost = m.notes.lost[1:]
	}
	m.notes.lost = append(m.notes.lost, n)
}

// deliver hands n to the notifier, on the parent's lane goroutine.
// A refused Notify is retried (WithNotifyRetry) before it is given up:
// logged at error level, counted and kept (Undelivered). The lane then
// moves on, so one bad notification never blocks the next forever.
func (m *Manager) deliver(_ string, n Notification) {
	cur := n.Task.Current()
	var acked bool // guarded by m.mu
	delivered := func() {
		m.mu.Lock()
		if !acked {
			acked = true
			if m.led.recording() {
				m.led.emit(record{kind: recNotifyDelivered, task: n.TaskID, at: m.now(), recordExt: &recordExt{notice: &notice{seq: n.Seq, kind: n.Kind, parent: n.ParentSessionID}}})
			}
			m.noteOut(n.TaskID, -1)
		}
		m.unlock()
	}
	ctx := &runCtx{Context: m.life.ctx, v: runValue{ref: RunRef{TaskID: n.TaskID, AttemptID: cur.ID, Token: cur.Token}, kind: callNotify, delivered: delivered}}
	var err error
	for attempt := 1; ; attempt++ {
		if err = m.poisoned(); err != nil {
			break // not durable: never delivered
		}
		err = func() (err error) {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("bgtask: Notifier panicked: %s", panicText(r))
				}
			}()
			return m.cfg.notifier.Notify(ctx, n)
		}()
		m.mu.Lock()
		done := acked
		m.mu.Unlock()
		if err == nil || done { // a Delivered inside Notify is final
			delivered()
			return
		}
		if attempt >= m.cfg.notifyAttempts || m.life.ctx.Err() != nil {
			break
		}
		d, ok := m.notifyBackoff(attempt + 1)
		if !ok {
			err = fmt.Errorf("%w (and the WithNotifyRetry backoff panicked: no more tries)", err)
			break
		}
		if d > 0 {
			t := m.cfg.clock.NewTimer(d)
			select {
			case <-t.C():
			case <-m.life.ctx.Done():
				t.Stop()
			}
		}
	}
	m.notes.failures.Add(1)
	why := "the Notifier refused it: " + safeText(err) // user code: before the lock
	m.mu.Lock()
	if !acked { // a Delivered after this, from a Notifier that kept ctx, is too late
		acked = true
		m.noteOut(n.TaskID, -1)
		m.keepLost(n, why)
	}
	m.unlock()
}

// notifyBackoff asks the WithNotifyRetry backoff (user code) how long to
// wait before try n; ok is false if it panicked.
func (m *Manager) notifyBackoff(n int) (d time.Duration, ok bool) {
	defer func() {
		if r := recover(); r != nil {
			d, ok = 0, false
		}
	}()
	return m.cfg.notifyBackoff(n), true
}

// Undelivered returns the notifications the Notifier never accepted (after
// every retry) or that a full queue gave up, in the order they were given
// up: at most the WithNotifyLimits bound, the oldest dropped first.
func (m *Manager) Undelivered() []Notification {
	m.mu.Lock()
	defer m.unlock()
	return slices.Clone(m.notes.lost)
}

// WithNotifyRetry makes a refused Notify be tried up to attempts times in
// all, waiting backoff(n) before try n (n ≥ 2; nil: no wait). Default: 3
// tries with Backoff(200ms, 5s, 0.2). A notification refused every time is
// logged at error level, counted (NotifyFailures) and kept (Undelivered).
func WithNotifyRetry(attempts int, backoff func(attempt int) time.Duration) Option {
	return optionFunc(func(c *config) {
		c.notifyAttempts = attempts
		c.notifyBackoff = backoff
	})
}

// NotifyFailures reports how many notifications were not delivered: refused
// by the Notifier, pushed out of a full queue, or produced after Shutdown.
func (m *Manager) NotifyFailures() uint64 { return m.notes.failures.Load() }

// NotifyDropped reports how many undelivered notifications were given up
// because Undelivered was full (WithNotifyLimits): they are gone.
func (m *Manager) NotifyDropped() uint64 { return m.notes.dropped.Load() }

// lessNeeded picks the notification a full queue gives up: the oldest retry
// notification (the final summary repeats what it said), else the oldest.
func lessNeeded(waiting []Notification) int {
	for i, n := range waiting {
		if n.Kind == NotifyRetryScheduled || n.Kind == NotifyRetrySessionReady {
			return i
		}
	}
	return 0
}

// Default bounds of WithNotifyLimits.
const (
	// DefaultNotifyQueueLimit is how many notifications may wait for one
	// parent session while its Notifier is busy: room for a burst of
	// 10,000 tasks of one parent ending at once.
	DefaultNotifyQueueLimit = 10_000
	// DefaultUndeliveredLimit is how many undelivered notifications
	// Undelivered keeps.
	DefaultUndeliveredLimit = 1000
)

// WithNotifyLimits bounds the memory notifications may hold when a
// Notifier is slow or stuck: at most queue notifications wait for one
// parent session (a full queue gives up its oldest waiting retry
// notification, or else its oldest, which is then undelivered), and
// Undelivered keeps at most undelivered (the oldest is dropped first,
// counted by NotifyDropped). Each is logged at error level. A value ≤ 0
// keeps the default: DefaultNotifyQueueLimit and DefaultUndeliveredLimit.
func WithNotifyLimits(queue, undelivered int) Option {
	return optionFunc(func(c *config) {
		if queue > 0 {
			c.queueLimit = queue
		}
		if undelivered > 0 {
			c.undeliveredLimit = undelivered
		}
	})
}

func (m *Manager) now() time.Time { return m.cfg.clock.Now() }

// ledgerBug queues a log line for a write the ledger refused: a bug in the
// Manager, never trusted away. m.mu is held.
func (m *Manager) ledgerBug(e *entry, err error) {
	m.logLocked(slog.LevelError, "bgtask: ledger refused a write", slog.String("task", e.info.id), slog.String("err", err.Error()))
}

// rejectedLocked queues the debug line of an event that was not applied.
func (m *Manager) rejectedLocked(ev Event, who resolved, err error) {
	m.logLocked(slog.LevelDebug, "bgtask: event ignored", rejectedAttrs(ev, who, err)...)
}

func rejectedAttrs(ev Event, who resolved, err error) []slog.Attr {
	return []slog.Attr{
		slog.String("reason", err.Error()),
		slog.String("kind", string(ev.Kind)),
		slog.String("task", who.taskID),
		slog.String("attempt", who.attemptID),
		slog.String("session", ev.SessionID),
		slog.String("eventAttempt", ev.AttemptID),
	}
}

// logRejected logs, without the lock, an event Observe did not apply. It
// allocates nothing when debug logging is off.
func (m *Manager) logRejected(ev Event, who resolved, err error) {
	defer func() {
		if r := recover(); r != nil {
			m.out.panics.Add(1)
		}
	}()
	ctx := context.Background()
	if !m.cfg.logger.Enabled(ctx, slog.LevelDebug) {
		return
	}
	m.cfg.logger.LogAttrs(ctx, slog.LevelDebug, "bgtask: event ignored", rejectedAttrs(ev, who, err)...)
}

// Shutdown refuses new work (ErrShutdown), aborts every running child
// through the host and records it interrupt (with its final summary), waits
// for the notifications already produced to be delivered, then cancels the
// contexts of host and notifier calls still outstanding and returns once no
// goroutine of the Manager is left.
//
// ctx bounds the graceful part: when it ends, Shutdown cancels the
// outstanding contexts at once and waits at most ShutdownGrace more for the
// calls to return. Like http.Server's Shutdown, it then returns an error
// that wraps ctx's error and names what is still running: the goroutines
// still inside a Host, Notifier or FuncHost function that ignores its
// context are the user's from then on (no new goroutine starts), and the
// tasks they serve keep their live state. A child whose abort failed stays
// in its live state and is named in the returned error, as are
// notifications left undelivered. Shutdown may be called more than once;
// later calls wait like the first, also for what an earlier call left
// running.
//
// Called with the context of a Host or Notifier callback, Shutdown cannot
// wait for that callback to return: it begins the shutdown (refusing work
// and aborting children) and returns ErrStopPending at once. Call it again
// from outside any callback to wait for the end.
func (m *Manager) Shutdown(ctx context.Context) error {
	ctx = orBackground(ctx)
	m.step(&shutdownIn{})
	if _, inCallback := RunFromContext(ctx); inCallback {
		return ErrStopPending
	}

	var errs []error
	if err := m.awaitStops(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := m.poisoned(); err != nil {
		errs = append(errs, fmt.Errorf("bgtask: shutdown: nothing was recorded since: %w", err))
	}
	if err := m.notes.lanes.Wait(ctx); err != nil {
		errs = append(errs, fmt.Errorf("bgtask: shutdown: waiting for deliveries: %w", err))
	}
	m.life.cancel()
	m.closeSubscriptions(ErrShutdown)
	if err := m.join(ctx); err != nil {
		errs = append(errs, err)
	}
	m.life.watchers.Close()
	_ = m.life.watchers.Wait(context.Background())
	m.mu.Lock()
	lost := len(m.notes.lost)
	var live []string
	for _, e := range m.order {
		if !e.terminal() {
			live = append(live, e.info.id+" (session "+e.cur().SessionID+")")
		}
	}
	m.unlock()
	if len(live) > 0 {
		errs = append(errs, fmt.Errorf("bgtask: shutdown: children did not stop (their abort failed or never returned): %v", live))
	}
	if n := m.notes.lanes.Pending() + lost; n > 0 {
		errs = append(errs, fmt.Errorf("bgtask: shutdown: %d notifications not delivered (see Undelivered)", n))
	}
	if j := m.cfg.journal; j != nil && m.life.group.Running() == 0 {
		m.life.journalClosed.Do(func() {
			if err := guardJournal("Close", j.Close); err != nil {
				errs = append(errs, fmt.Errorf("bgtask: shutdown: closing the journal: %w", err))
			}
		})
	}
	return errors.Join(errs...)
}

// onShutdown decides the start of Shutdown, once: no new work from now on,
// and every live task's run is stopped (interrupt). m.mu is held.
func (m *Manager) onShutdown() {
	if m.life.closing {
		return
	}
	m.life.closing = true
	for _, q := range m.calls.fanout { // a Launch waiting for a slot looks again, and is refused
		for _, w := range q {
			if !w.woken {
				w.woken = true
				close(w.ch)
			}
		}
	}
	now := m.now()
	for _, e := range slices.Clone(m.order) { // an end here may forget an ended task (retention)
		if e.terminal() {
			continue
		}
		m.wantStop(e, stopByShutdown, now)
		m.stopRun(e, now)
	}
}

// ShutdownGrace is how long Shutdown, once its context has ended and the
// contexts of outstanding host and notifier calls are cancelled, still
// waits for those calls to return before it gives up on them.
const ShutdownGrace = time.Second

// join waits until no goroutine of the Manager runs and closes the group so
// none starts again. Every goroutine is reserved under m.mu (or started
// by one already counted), so the check and the close are one step. When ctx ends, the goroutines get ShutdownGrace to
// honour their cancelled contexts; then the group is closed anyway and the
// error names what is left.
func (m *Manager) join(ctx context.Context) error {
	var ended error // ctx's error, once it ended
	for {
		err := m.life.group.Wait(ctx)
		if err != nil && ended == nil {
			ended = err
			grace, cancel := context.WithTimeout(context.Background(), ShutdownGrace)
			defer cancel()
			ctx = grace
			continue
		}
		m.mu.Lock()
		if n := m.life.group.Running(); n == 0 || err != nil {
			m.life.group.Close()
			m.unlock()
			if n == 0 {
				return nil
			}
			return fmt.Errorf("bgtask: shutdown: %w: %d goroutines are still in Host, Notifier or FuncHost calls that ignore their cancelled context", ended, n)
		}
		m.unlock()
	}
}

// awaitStops waits until no session start or abort is in flight, or ctx
// ends. After the journal failed no answer is recorded any more, so it
// waits for none (join waits for the calls themselves).
func (m *Manager) awaitStops(ctx context.Context) error {
	for {
		m.mu.Lock()
		busy := (len(m.calls.inflight) > 0 || m.calls.abortsN > 0) && m.poisoned() == nil
		ch := m.waitAny()
		m.unlock()
		if !busy {
			return nil
		}
		if err := m.await(ctx, ch); err != nil && ctx.Err() != nil {
			return fmt.Errorf("bgtask: shutdown: %w", ctx.Err())
		} // a journal failure: busy is false from now on
	}
}

// StartError is a failed session start: StartSession returned an error
// before a child session existed. DefaultRetryable retries it unless its
// cause is permanent or not worth retrying (context overflow, validation,
// aborted).
type StartError struct {
	// Model is the attempt's model.
	Model Model
	// Err is the host's error.
	Err error
}

func (e *StartError) Error() string {
	return "session start failed on " + e.Model.String() + ": " + e.Err.Error()
}

func (e *StartError) Unwrap() error { return e.Err }

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as not retryable: a task whose attempt fails with it
// ends in error instead of moving to its next model, whatever WithRetryable
// says. The mark survives wrapping. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err or anything it wraps was marked Permanent.
func IsPermanent(err error) bool {
	_, ok := inChain[*permanentError](err)
	return ok
}

// DefaultRetryable is the classifier used unless WithRetryable replaces it.
// It retries rate limits (429), overload (503, 529, "overloaded"), other
// 5xx, a forbidden or unauthorized provider (403, 401), a model not found
// (404) and timeouts. The status is read from the first error in the chain
// that has one: a StatusCode() or HTTPStatus() int method, an int field
// such as StatusCode or HTTPStatusCode, or a Response *http.Response field
// (the provider SDKs' shapes); else from the message, where a written-out
// status ("404 Not Found") and a provider's error code (model_not_found,
// invalid_api_key, not_found_error, RESOURCE_EXHAUSTED, …) win over a
// generic type such as invalid_request_error; and a
// failed session start (*StartError) unless its cause is known not to be
// worth retrying. Context-length, validation and aborted errors, and
// anything unrecognised, are not retried.
//
// Before all of that (but after Permanent and those three sentinels), an
// error that says so itself decides: the first
// error in the chain with an IsRetryable() bool method is retried exactly
// when it returns true, and one whose Temporary() bool or Timeout() bool
// returns true is retried. To add rules of your own without losing these,
// use WithRetryClassifier.
func DefaultRetryable(err error) bool {
	if err == nil || IsPermanent(err) {
		return false
	}
	if errors.Is(err, ErrContextOverflow) || errors.Is(err, ErrOutputLimit) || errors.Is(err, ErrContentFilter) {
		return false
	}
	if retry, ok := errclass.Stated(err); ok {
		return retry
	}
	if se := startErrorIn(err); se != nil {
		switch errclass.Classify(se.Err) {
		case errclass.ContextOverflow, errclass.Validation, errclass.Aborted:
			return false
		}
		return true
	}
	return errclass.Classify(err).Retryable()
}

// startErrorIn returns the first *StartError in err's chain, or nil.
func startErrorIn(err error) *StartError {
	se, _ := inChain[*StartError](err)
	return se
}

// inChain returns the first error of type T in err's chain (Unwrap, and
// every branch of an Unwrap() []error in order): errors.As without its
// allocation. A link with an As method is left to errors.As.
func inChain[T error](err error) (T, bool) {
	for err != nil {
		switch e := err.(type) {
		case T:
			return e, true
		case interface{ As(any) bool }:
			var t T
			ok := errors.As(err, &t)
			return t, ok
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				if t, ok := inChain[T](inner); ok {
					return t, true
				}
			}
			var zero T
			return zero, false
		case interface{ Unwrap() error }:
			err = e.Unwrap()
		default:
			var zero T
			return zero, false
		}
	}
	var zero T
	return zero, false
}

// Backoff returns a retry delay for WithRetryDelay: base before attempt 2,
// doubling for each later attempt, never more than max. jitter in [0, 1]
// takes up to that fraction off each delay at random, so tasks that failed
// together do not retry together; 0 means none. A base ≤ 0 means no delay.
func Backoff(base, max time.Duration, jitter float64) func(attempt int) time.Duration {
	jitter = math.Min(math.Max(jitter, 0), 1)
	return func(attempt int) time.Duration {
		if base <= 0 {
			return 0
		}
		d := base
		for i := 2; i < attempt && d < max; i++ {
			d *= 2
		}
		if max > 0 && d > max {
			d = max
		}
		if jitter > 0 {
			d -= time.Duration(jitter * rand.Float64() * float64(d))
		}
		return d
	}
}

// RunFunc is a subagent written as a Go function: it does one attempt's
// work and returns the final answer, or an error. It must return once ctx
// ends (a Cancel, a closure or Shutdown stopped the attempt). To return a
// structured result beside the answer text, wrap a function with
// Returning.
type RunFunc func(ctx context.Context, run Run) (answer string, err error)

// Returning makes a RunFunc of a function that returns a value of the
// harness's own type: the value is kept beside the task while the
// process lives (Task.Value, ValueOf), and text(v) is the answer text the
// parent model reads (the Result, the envelope). A nil text renders the
// value with fmt.Sprint. An error is returned as it is (Task.Err keeps
// it); text is not called then. A panic in text is the run's panic.
func Returning[T any](fn func(ctx context.Context, run Run) (T, error), text func(T) string) RunFunc {
	if fn == nil {
		panic("bgtask: Returning with a nil function")
	}
	return func(ctx context.Context, run Run) (string, error) {
		v, err := fn(ctx, run)
		if err != nil {
			return "", err
		}
		if run.value != nil {
			var kept any = v
			run.value.Store(&kept)
		}
		if text == nil {
			return fmt.Sprint(v), nil
		}
		return text(v), nil
	}
}

// Run is what a RunFunc is told about the attempt it runs, and how it
// reports progress. It is a value; its methods are safe for concurrent use.
type Run struct {
	// TaskID and AttemptID name the attempt this run is.
	TaskID    string
	AttemptID string
	Attempt   int    // the attempt number, 1-based
	Token     string // the attempt's run token
	SessionID string // minted by the FuncHost for this attempt
	// ParentSessionID is the task's (Spec.ParentSessionID).
	ParentSessionID string
	// Model is the attempt's model.
	Model Model
	// Agent, Prompt and Description are the task's Spec fields.
	Agent, Prompt string
	Description   string
	Metadata      map[string]string // the task's Spec.Metadata: this run's copy
	Root          string            // the task's tree (Task.Root, Task.Depth)
	// Depth: see Root.
	Depth int

	report func(kind EventKind, progress string)
	inbox  *inbox
	value  *atomic.Pointer[any] // what a Returning function returned
	m      *Manager
}

// Manager returns the Manager running this attempt: what a function uses
// to look tasks up, wait for them, or stop them.
func (r Run) Manager() *Manager { return r.m }

// Launch launches a subagent from this run: a task whose parent session
// is this run's session (unless spec.ParentSessionID names another), one
// level deeper in the tree (WithTreeLimits counts it there). Pass the
// function's ctx: with spec.InheritValues the child's calls see its
// values, and with spec.CancelWithCaller the child stops when this run's
// context ends.
func (r Run) Launch(ctx context.Context, spec Spec) (Task, error) {
	if r.m == nil {
		return Task{}, errors.New("bgtask: Run.Launch on a Run no FuncHost made")
	}
	if spec.ParentSessionID == "" {
		spec.ParentSessionID = r.SessionID
	}
	return r.m.Launch(ctx, spec)
}

// Prompt is a supplemental prompt (Extend) handed to a running FuncHost
// function: invocation N of its task (2 or more).
type Prompt struct {
	// N is the invocation's number (2 or more).
	N int
	// Text is the prompt.
	Text string
}

// Prompts delivers the task's supplemental prompts (Extend), in invocation
// order. A prompt is admitted when the function receives it; an Extend
// waits for that (or for its context), and one the function never takes
// before it returns is refused, changing nothing. The function's return
// answers every invocation up to the last it received.
func (r Run) Prompts() <-chan Prompt {
	if r.inbox == nil {
		return nil
	}
	return r.inbox.ch
}

// Answer ends a turn without returning: text answers every invocation up
// to n (the last the function had received) that has no answer yet. When
// that answers everything admitted, the task completes with text, and the
// function should return.
func (r Run) Answer(n int, text string) {
	if r.inbox != nil {
		r.inbox.answer(n, text)
	}
}

// inbox is how a FuncHost function receives supplemental prompts.
type inbox struct {
	ch   chan Prompt   // unbuffered: a prompt is admitted when taken
	done chan struct{} // closed when the function returned
	// mu is held by PromptSession across its hand-off and the update of
	// seen, so the function's return (after done closed) reads seen only
	// once a prompt it took is counted.
	mu     sync.Mutex
	seen   int // the last invocation the function received (1: the launch prompt); guarded by mu
	answer func(n int, text string)
}

// Busy reports that the function is generating (liveness; never ends the
// run).
func (r Run) Busy() { r.report(SessionBusy, "") }

// Waiting reports that the function waits on a tool, a permission or
// input (Task.Activity waiting; never ends the run).
func (r Run) Waiting() { r.report(SessionWaiting, "") }

// Progress reports a line of progress: Task.Progress shows it (bounded to
// MaxProgressRunes, one line), and it is the evidence a later failure
// reports, as a child's latest output is.
func (r Run) Progress(text string) { r.report(SessionBusy, text) }

// Compacted reports that the function compacted its context (never changes
// status).
func (r Run) Compacted() { r.report(SessionCompacted, "") }

// FuncHost is a Host whose child sessions are Go functions running in this
// process: each attempt runs fn on its own goroutine, under a session id the
// host mints. Create it with NewFuncHost and pass it to New; one FuncHost
// serves one Manager. fn starts only once the Manager has bound the
// attempt's session, so the task reads running for as long as fn runs; an
// attempt stopped or replaced before that never runs fn.
//
// fn's return is the evidence: an answer becomes SessionIdle with that text,
// an error SessionError (so the fallback chain applies, and Permanent is
// respected), and a panic is recovered and reported as a non-retryable
// error carrying the panic value. Every report carries the attempt id and
// run token, so a function that returns late can never complete a later
// attempt.
//
// AbortSession cancels the attempt's context and returns only once fn has
// returned; the task then ends with the stop's status (cancelled, or
// interrupt at Shutdown), and an error fn returned after the stop was asked
// — other than its context's cancellation — is kept as the attempt's error
// text and evidence. An answer is still the truth (the task ends
// completed). If fn ignores its context, AbortSession waits until its own
// context ends and returns an error: the task stays running until fn
// really returns. The goroutines belong to the Manager; Shutdown waits for
// them (see its doc for a function that ignores its context).
type FuncHost struct {
	fn      RunFunc
	h       *funchost.Host // the runs, and the stop protocol (internal/funchost)
	inboxes sync.Map       // session id → *inbox, while its function may run
}

// PromptSession hands a supplemental prompt to the function running the
// session (see Run.Prompts): nil once the function received it; an error
// if it returned first, or ctx ended.
func (h *FuncHost) PromptSession(ctx context.Context, req PromptRequest) error {
	v, ok := h.inboxes.Load(req.SessionID)
	if !ok {
		return errors.New("bgtask: no function runs session " + req.SessionID)
	}
	ib := v.(*inbox)
	ib.mu.Lock()
	defer ib.mu.Unlock()
	select { // once done is closed, nobody can take the prompt: done is chosen
	case ib.ch <- Prompt{N: req.Invocation, Text: req.Prompt}:
		ib.seen = req.Invocation
		return nil
	case <-ib.done:
		return errors.New("bgtask: the function returned before it took the prompt")
	case <-ctx.Done():
		return ctx.Err()
	}
}

// NewFuncHost returns a Host that runs fn for every attempt.
func NewFuncHost(fn RunFunc) *FuncHost {
	if fn == nil {
		panic("bgtask: NewFuncHost with a nil RunFunc")
	}
	return &FuncHost{fn: fn, h: funchost.New()}
}

// attach is called by New.
func (h *FuncHost) attach(m *Manager) {
	if err := h.h.Attach(funcEnv{m}); err != nil {
		panic("bgtask: a FuncHost serves one Manager")
	}
}

// StartSession starts fn for the attempt and returns the session id it runs
// under.
func (h *FuncHost) StartSession(ctx context.Context, req SessionRequest) (string, error) {
	env, _ := h.h.Env().(funcEnv)
	m := env.m
	sid := "fn_" + req.AttemptID
	ib := &inbox{ch: make(chan Prompt), done: make(chan struct{}), seen: 1}
	ib.answer = func(n int, text string) {
		_ = m.Observe(Event{SessionID: sid, AttemptID: req.AttemptID, Token: req.Token, Kind: SessionIdle, Text: text, Invocation: n})
	}
	root, depth := m.treeOf(req.TaskID)
	run := Run{
		TaskID: req.TaskID, AttemptID: req.AttemptID, Attempt: req.AttemptNumber, Token: req.Token,
		SessionID: sid, ParentSessionID: req.ParentSessionID, Model: req.Model, Agent: req.Agent, Prompt: req.Prompt,
		Description: req.Description, Metadata: req.Metadata, Root: root, Depth: depth,
		report: func(k EventKind, progress string) {
			_ = m.Observe(Event{SessionID: sid, AttemptID: req.AttemptID, Token: req.Token, Kind: k, Text: progress, Progress: progress})
		},
		inbox: ib,
		value: new(atomic.Pointer[any]),
		m:     m,
	}
	h.inboxes.Store(sid, ib)
	seen := func() int { // called once the function returned: done is closed
		ib.mu.Lock()
		defer ib.mu.Unlock()
		return ib.seen
	}
	value := func() any {
		if v := run.value.Load(); v != nil {
			return *v
		}
		return nil
	}
	err := h.h.Start(funchost.Run{TaskID: req.TaskID, AttemptID: req.AttemptID, Token: req.Token, Seen: seen, Value: value}, sid,
		func(ctx context.Context) (string, error) {
			defer func() {
				close(ib.done) // before its answer is reported: no prompt is taken after it
				h.inboxes.Delete(sid)
			}()
			return callRunFunc(h.fn, ctx, run)
		})
	if err != nil {
		h.inboxes.Delete(sid)
	}
	switch {
	case errors.Is(err, funchost.ErrNotAttached):
		return "", Permanent(errors.New("bgtask: FuncHost used without New"))
	case err != nil:
		return "", ErrShutdown
	}
	return sid, nil
}

// treeOf returns task id's root session and depth (Task.Root, Task.Depth).
func (m *Manager) treeOf(id string) (root string, depth int) {
	m.mu.Lock()
	defer m.unlock()
	if e := m.led.tasks[id]; e != nil {
		return e.info.root, e.info.depth
	}
	return "", 0
}

// funcEnv is what a FuncHost's runs need of the Manager.
type funcEnv struct{ m *Manager }

func (f funcEnv) RunContext(taskID, attemptID, token string) context.Context {
	f.m.mu.Lock()
	e := f.m.led.tasks[taskID]
	values := e.values()
	f.m.mu.Unlock()
	return &runCtx{Context: f.m.life.ctx, v: runValue{ref: RunRef{TaskID: taskID, AttemptID: attemptID, Token: token}, kind: callRun, e: e}, values: values}
}
func (f funcEnv) Go(fn func()) bool { return f.m.goLocked(fn) }
func (f funcEnv) AwaitBound(ctx context.Context, attemptID, token, sid string) bool {
	ok := f.m.awaitBound(ctx, attemptID, token, sid) && ctx.Err() == nil
	if fh, isFunc := f.m.host.(*FuncHost); !ok && isFunc {
		fh.inboxes.Delete(sid) // the function never runs: no prompt can reach it
	}
	return ok
}
func (f funcEnv) StoppedWith(attemptID, token, text string, ended bool) {
	f.m.stoppedWith(attemptID, token, text, ended)
}
func (f funcEnv) Answered(sid, attemptID, token, answer string, seen int, value any) {
	_ = f.m.Observe(Event{SessionID: sid, AttemptID: attemptID, Token: token, Kind: SessionIdle, Text: answer, Invocation: seen, Value: value, last: true})
}
func (f funcEnv) Failed(sid, attemptID, token string, err error) {
	_ = f.m.Observe(Event{SessionID: sid, AttemptID: attemptID, Token: token, Kind: SessionError, Err: err})
}
func (f funcEnv) Text(err error) string { return safeText(err) }

// awaitBound waits until attempt attemptID's run (token) is bound to sid
// and running, and reports true; or reports false as soon as that can no
// longer happen (the run was replaced or ended, or ctx ended).
func (m *Manager) awaitBound(ctx context.Context, attemptID, token, sid string) bool {
	for {
		m.mu.Lock()
		ref, ok := m.led.attemptOf(attemptID)
		if !ok {
			m.unlock()
			return false
		}
		a := ref.attempt()
		switch {
		case a.Token != token || !ref.isCurrent() || a.Status.Terminal():
			m.unlock()
			return false
		case a.Status == StatusRunning:
			bound := a.SessionID == sid
			m.unlock()
			return bound
		}
		changed := ref.e.waitChange()
		m.unlock()
		if m.await(ctx, changed) != nil {
			return false
		}
	}
}

// stoppedWith keeps the error text a run returned after it was asked to
// stop: the stop gives the attempt's status, the text (if any) is its error
// and evidence. With ended, the run has stopped and no abort in flight will
// confirm it: the attempt ends now with the stop's status. It changes
// nothing if the run was replaced or ended.
func (m *Manager) stoppedWith(attemptID, token, text string, ended bool) {
	m.step(&runReturnedIn{attemptID: attemptID, token: token, text: text, ended: ended})
}

func callRunFunc(fn RunFunc, ctx context.Context, run Run) (answer string, err error) {
	defer func() {
		if r := recover(); r != nil {
			answer, err = "", Permanent(fmt.Errorf("bgtask: subagent function panicked: %s", panicText(r)))
		}
	}()
	return fn(ctx, run)
}

// AbortSession cancels the run's context and waits for fn to return, or for
// ctx to end (then it returns an error and the run goes on). An unknown or
// finished session is already stopped: nil.
func (h *FuncHost) AbortSession(ctx context.Context, sessionID string) error {
	if err := h.h.Abort(ctx, sessionID); err != nil {
		return fmt.Errorf("bgtask: subagent %s %w: %w", sessionID, err, ctx.Err())
	}
	return nil
}

// Limits caps how many attempts run at once. An attempt holds a slot from
// the moment its session start is requested until its run ends, whatever
// ends it; an attempt that finds no free slot waits pending (PendingQueued)
// and slots are handed over first come, first served, per key. A retry
// gives its slot back and queues under its own model's key.
//
// A model's key and limit are, in order of precedence: its entry in Models
// (that model alone), its provider's entry in Providers (every model of the
// provider together), or Default (that model alone). A limit of 0 means no
// limit; a negative one is invalid (Launch reports it).
type Limits struct {
	// Models caps single models, keyed "provider/id" (no variant), or by
	// the ID alone for a model with no provider.
	Models map[string]int
	// Providers caps all models of a provider together, keyed by provider.
	// A model with no provider is never under one: its entry in Models or
	// Default caps it.
	Providers map[string]int
	// Default caps every other model on its own. 0: no limit.
	Default int
}

func (l *Limits) validate() error {
	for k, n := range l.Models {
		if n < 0 {
			return fmt.Errorf("bgtask: invalid Limits: Models[%q] is negative (%d)", k, n)
		}
	}
	for k, n := range l.Providers {
		if n < 0 {
			return fmt.Errorf("bgtask: invalid Limits: Providers[%q] is negative (%d)", k, n)
		}
	}
	if l.Default < 0 {
		return fmt.Errorf("bgtask: invalid Limits: Default is negative (%d)", l.Default)
	}
	return nil
}

// key returns the concurrency key of model and its limit: "model:p/id"
// ("model:id" with no provider) or "provider:p".
func (l *Limits) key(model Model) (string, int) {
	id := Model{Provider: model.Provider, ID: model.ID}.String()
	if n, ok := l.Models[id]; ok {
		return "model:" + id, n
	}
	if n, ok := l.Providers[model.Provider]; ok && model.Provider != "" {
		return "provider:" + model.Provider, n
	}
	return "model:" + id, l.Default
}

// WithConcurrency caps concurrent attempts per model or provider; see
// Limits. Default: no limits.
func WithConcurrency(l Limits) Option {
	return optionFunc(func(c *config) {
		l.Models = maps.Clone(l.Models)
		l.Providers = maps.Clone(l.Providers)
		c.limits = &l
	})
}

// WithQueueTimeout ends a task in error ("timed out while queued", with its
// queue position and key) when one of its attempts waits for a concurrency
// slot longer than d. It leaves the queue at once. Default: 0, no timeout.
func WithQueueTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.queueTimeout = d })
}

// WithGateTimeout bounds how long the children gate holds a child's turn
// end once the tasks its session launched have all settled: if no further
// turn comes within d, the held turn is released as the answer, marked
// degraded with a notice. d <= 0, the default: the stall timeout if set,
// else DefaultGateTimeout.
func WithGateTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.gateTimeout = d })
}

// WithStallTimeout aborts, through the host, a running attempt that reported
// no event for d, and fails it with "stalled: no activity for d" — a
// retryable failure, so the task moves to its next model. Default: 0, no
// stall detection.
func WithStallTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.stallTimeout = d })
}

// watchQueueNow waits for queued run a of e to leave the queue, or for the
// queue timeout t to fire first (queueTimeoutIn).
func (m *Manager) watchQueueNow(e *entry, a Attempt, w *slots.Waiter[queued], t Timer) {
	select {
	case <-t.C():
	case <-w.V.stop:
		t.Stop()
		return
	case <-m.life.ctx.Done():
		t.Stop()
		return
	}
	m.step(&queueTimeoutIn{e: e, a: a, w: w})
}

// watchStallNow is the stall watch of run a of e; done closes when the run
// ends or is replaced. It asks the core (stallCheckIn) what to do, and
// waits for what it says: a timer until the run is due to be looked at
// again, or the answer to the abort a stall set off.
func (m *Manager) watchStallNow(e *entry, a Attempt, done <-chan struct{}) {
	in := stallCheckIn{e: e, a: a}
	for {
		m.step(&in)
		r := in.out
		switch {
		case r.done:
			return
		case r.wait != nil:
			if !r.due.IsZero() {
				in.retryAt = r.due // after a failed stall abort, wait before the next
			}
			unpark := m.life.parked.park(r.wait, done, m.life.ctx.Done())
			select { // the abort's answer: stopped (failed over) or still alive
			case <-r.wait:
				unpark()
				continue
			case <-done:
			case <-m.life.ctx.Done():
			}
			unpark()
			return
		}
		t := m.cfg.clock.NewTimer(r.after)
		select {
		case <-t.C():
		case <-done:
			t.Stop()
			return
		case <-m.life.ctx.Done():
			t.Stop()
			return
		}
	}
}

// QueueStat is the state of one concurrency key.
type QueueStat struct {
	Key string `json:"key"` // "model:provider/id" or "provider:name"
	// Running counts the attempts holding a slot of the key.
	Running int `json:"running"`
	// Queued counts those waiting for one.
	Queued int `json:"queued"`
	Limit  int `json:"limit"` // 0: no limit
}

// Stats reports every concurrency key with attempts running or queued, by
// key. It is empty without WithConcurrency.
func (m *Manager) Stats() []QueueStat {
	m.mu.Lock()
	defer m.unlock()
	if m.calls.pool == nil {
		return nil
	}
	var out []QueueStat
	for _, s := range m.calls.pool.Stats() {
		out = append(out, QueueStat{Key: s.Key, Running: s.Running, Queued: s.Queued, Limit: s.Limit})
	}
	return out
}

// round is one parent's batch of tasks, from the first launch after the
// parent had none live to the moment the last of them ends.
type round struct {
	parent string
	live   int
	tasks  []*entry
}

// roundEnded counts e out of its parent's round and, when it was the last
// live task, sends exactly one NotifyAllComplete. m.mu is held; the lock is
// what makes siblings ending together yield one.
func (m *Manager) roundEnded(e *entry) {
	r := e.rt.round
	if r == nil {
		return
	}
	e.rt.round = nil
	r.live--
	if r.live > 0 {
		return
	}
	if m.notes.rounds[r.parent] == r {
		delete(m.notes.rounds, r.parent)
	}
	if m.cfg.notifier == nil {
		return
	}
	tasks := make([]Task, 0, len(r.tasks))
	for _, t := range r.tasks {
		tasks = append(tasks, t.project())
	}
	m.push(AllComplete(e.info.parent, tasks))
}

// AllComplete is the NotifyAllComplete a Manager sends parent when the
// last live task of its round ended: tasks (the round's, ended; sorted in
// place) failures first, and its text. It has no ID or Seq: those are the
// producer's. A journal shared by several processes (pgledger) uses it to
// tell a round whose tasks ended in different processes.
func AllComplete(parent string, tasks []Task) Notification {
	slices.SortStableFunc(tasks, func(a, b Task) int { return failureRank(a) - failureRank(b) })
	return Notification{Kind: NotifyAllComplete, ParentSessionID: parent, Tasks: tasks, Text: allCompleteText(parent, tasks)}
}

// The ranks of an ended task in an all-complete notification: failures
// first, then tasks that were stopped, then answers.
const (
	rankFailed = iota
	rankStopped
	rankCompleted
)

// failureRank orders failures before stopped tasks before answers.
func failureRank(t Task) int {
	switch {
	case t.Outcome == nil || t.Outcome.State == StatusError:
		return rankFailed
	case t.Outcome.State == StatusCompleted:
		return rankCompleted
	}
	return rankStopped
}

// Change is one applied mutation: the task as it is after it, and the
// manager-wide sequence number of the change.
type Change struct {
	// Epoch names the Manager's process life (wall-clock nanoseconds at
	// New). It tells process lives apart but does not order them: a
	// restarted process whose clock is behind has a smaller one. Sequences
	// start again with each epoch.
	Epoch uint64 `json:"epoch,omitempty"`
	// Seq is the change's manager-wide sequence number.
	Seq uint64 `json:"seq"`
	// Task is the task as the change left it.
	Task Task `json:"task"`
}

// Snapshot is every task, complete, as of sequence Seq: what it omits is
// absent.
type Snapshot struct {
	// Epoch names the Manager's process life, as Change.Epoch does: a
	// different epoch is a different process, whether its number is larger
	// or smaller, and its sequence numbers start again.
	Epoch uint64 `json:"epoch,omitempty"`
	// Seq: every change up to it is in Tasks, none after.
	Seq uint64 `json:"seq"`
	// Tasks are the tasks in memory, in launch order.
	Tasks []Task `json:"tasks"`
}

// Snapshot returns every task, in launch order, and the change sequence it
// was taken at.
func (m *Manager) Snapshot() Snapshot {
	m.mu.Lock()
	defer m.unlock()
	out := Snapshot{Epoch: m.changes.epoch, Seq: m.changes.seq, Tasks: make([]Task, len(m.order))}
	for i, e := range m.order {
		out.Tasks[i] = e.project()
	}
	return out
}

// ErrLagged ends a Subscription whose buffer overflowed: its consumer must
// resync from a Snapshot (and subscribe again).
var ErrLagged = errors.New("bgtask: subscriber lagged behind; resync from a snapshot")

// Subscription is a stream of Changes. Receive from C until it is closed,
// then Err says why.
type Subscription struct {
	// C delivers every change in sequence order. It is closed when ctx
	// ends, on Close, at Shutdown, or when the buffer overflows (Err is
	// then ErrLagged).
	C <-chan Change

	sub *feed.Sub[Change]
	m   *Manager
}

// DefaultSubscriptionBuffer is the buffer of Subscribe(ctx, 0).
const DefaultSubscriptionBuffer = 1024

// Subscribe delivers every applied mutation from now on, with the task's
// full snapshot and a manager-wide sequence number. A slow subscriber never
// blocks the Manager: when its buffer (default DefaultSubscriptionBuffer) is
// full, the subscription ends with ErrLagged and the consumer resyncs from a
// Snapshot. Subscribe before taking the Snapshot you start from; Mirror
// orders the two by sequence within an epoch.
func (m *Manager) Subscribe(ctx context.Context, buffer int) (*Subscription, error) {
	ctx = orBackground(ctx)
	if buffer <= 0 {
		buffer = DefaultSubscriptionBuffer
	}
	m.mu.Lock()
	defer m.unlock()
	if m.life.closing {
		return nil, ErrShutdown
	}
	sub := m.changes.subs.Add(buffer)
	if !m.life.watchers.Go(func() {
		select {
		case <-ctx.Done():
			m.mu.Lock()
			m.changes.subs.End(sub, ctx.Err())
			m.unlock()
		case <-sub.Done():
		}
	}) {
		m.changes.subs.End(sub, ErrShutdown)
		return nil, ErrShutdown
	}
	return &Subscription{C: sub.C(), sub: sub, m: m}, nil
}

// Err says why C was closed; nil while it is open.
func (s *Subscription) Err() error {
	s.m.mu.Lock()
	defer s.m.unlock()
	return s.sub.Err()
}

// Close ends the subscription.
func (s *Subscription) Close() {
	s.m.mu.Lock()
	s.m.changes.subs.End(s.sub, nil)
	s.m.unlock()
}

func (m *Manager) closeSubscriptions(err error) {
	m.mu.Lock()
	defer m.unlock()
	m.changes.subs.EndAll(err)
}

// publish sends e's new state to every subscriber, without ever blocking.
// m.mu is held.
func (m *Manager) publish(e *entry) {
	m.changes.seq++
	if m.changes.subs.Len() == 0 {
		return
	}
	m.changes.subs.Publish(Change{Epoch: m.changes.epoch, Seq: m.changes.seq, Task: e.project()})
}
