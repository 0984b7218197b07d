package bgtask

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Spec describes a task to launch.
type Spec struct {
	// ParentSessionID is the chat session that launched the task and
	// receives its notifications. Required when the Manager has a
	// Notifier; without one it may be empty: the task then has no parent
	// (Query.Parent cannot select it, and TreeLimits count the tasks with
	// none together, as children of "").
	ParentSessionID string
	// Description says what the task is for, in a line (notifications show it).
	Description string
	// Agent names the kind of subagent, for the host.
	Agent string
	// Run, when set, runs every attempt of this task in-process, as a
	// FuncHost runs its function — whatever the Manager's Host is: bound
	// before it runs, stopped by its run token, run again with the next
	// model (Run.Model) on a retry, a panic guarded (*PanicError). It is
	// process-local: after a restart the task's run is interrupt ("lost
	// across restart"). A task with Run cannot ContinueFrom, nor be
	// continued (errors.ErrUnsupported). Use it for a harness with several kinds of
	// subagent; a FuncHost is the Manager-wide default.
	Run RunFunc
	// Prompt is the launch prompt: invocation 1. It may be empty (a host
	// that takes its work from elsewhere, a FuncHost function that needs
	// none).
	Prompt string
	// Models is the fallback chain: Models[0] first, then the rest in
	// order, each with an ID. Provider may be empty: the ID is then the
	// model's whole name, an opaque string ("openai/plain-model" is an ID
	// with a slash in it, not a provider; ParseModel splits a name when a
	// harness wants that). With no model at all the task runs once, with
	// no model (Run.Model and SessionRequest.Model are zero; the Timeline
	// says "no model").
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
	// (the harness's own ids, a tool call's joined to its message's): at
	// most 512 bytes of valid UTF-8, with no
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

	// Budget, when set, is what this task and every task beneath it may
	// spend (see Budget): on a root launch, the tree's; on a child's, a
	// narrower grant, clamped by what the budgets above it have left.
	// Journaled with the launch, as granted.
	Budget *Budget

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
	// context is kept with the task until it ends (its last host call
	// made), then let go.
	InheritValues bool
	// CancelWithCaller stops the task when the context passed to Launch
	// ends before the task does: the task and what its sessions launched
	// are stopped as Stop with Tree stops them (honestly: cancelled once
	// the host confirmed), and the close's error, if any, is logged.
	// InheritValues and CancelWithCaller apply to the task a Launch
	// creates: with ExtendLive they are refused (ErrInvalidArgument), as
	// that Launch may extend a task another caller started.
	CancelWithCaller bool

	// Detached makes a task launched beneath a run not hold that run's
	// end: the children gate lets the parent's turn end while this task
	// goes on (a framework whose parent returns at once, its background
	// child still working). A detached task is in its parent's tree all
	// the same: stopped with its branch (Stop with Tree or Session), in
	// its tree's limits and budgets. Without it, a task launched from a
	// session holds that session's answer until it ended and its final
	// summary was delivered (the session-service case of the seeds).
	Detached bool

	// Attach is a value of the harness's own, attached to the task at
	// launch and read back typed from any snapshot with Attached: the
	// origin of a spawn (its channel and chat), a tool call's context.
	// It is kept as JSON (Task.Attach): journaled with the launch, so it
	// survives a restart, and carried over HTTP and by pgledger. A value
	// that does not marshal, or whose JSON is over 64 KiB, is refused.
	Attach any
}

// Resumer is a Host that can resume an existing child session with a new
// prompt (Spec.ContinueFrom). nil means the session runs req.Prompt now, as
// attempt req.AttemptID.
type Resumer interface {
	ResumeSession(ctx context.Context, sessionID string, req SessionRequest) error
}

// reservedMetadataPrefix starts the Metadata keys only bgtask may write.
const reservedMetadataPrefix = "bgtask."

func (s Spec) validate() error {
	switch {
	case s.ParentSessionID != "" && blank(s.ParentSessionID):
		return &SpecError{Field: "ParentSessionID", Reason: "is only white space"}
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
	if s.Budget != nil {
		if err := s.Budget.validate("Budget"); err != nil {
			return err
		}
	}
	if s.Attach != nil {
		if _, err := attachJSON(s.Attach); err != nil {
			return &SpecError{Field: "Attach", Reason: err.Error()}
		}
	}
	if s.ExtendLive && (s.InheritValues || s.CancelWithCaller) {
		return &SpecError{Field: "ExtendLive", Reason: "cannot be used with InheritValues or CancelWithCaller: they apply to the task a Launch creates"}
	}
	for k := range s.Metadata {
		if len(k) >= len(reservedMetadataPrefix) && strings.EqualFold(k[:len(reservedMetadataPrefix)], reservedMetadataPrefix) {
			return &SpecError{Field: "Metadata[" + strconv.Quote(k) + "]", Reason: "the " + reservedMetadataPrefix + " prefix is reserved for the library"}
		}
	}
	for i, m := range s.Models {
		field := "Models[" + strconv.Itoa(i) + "]"
		if m.Provider != "" && blank(m.Provider) {
			return &SpecError{Field: field + ".Provider", Reason: "is only white space (leave it empty for a model with no provider)"}
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
const maxIDBytes = 512

// blank reports whether s is empty or only white space.
func blank(s string) bool { return strings.TrimSpace(s) == "" }

// taskInfo is what the ledger records of a valid spec. launchedAt is the
// core's to give, and the id unless the spec has one.
func (s *Spec) taskInfo() taskInfo {
	models := s.Models
	if len(models) == 0 {
		models = []Model{{}} // no chain: one run with no model
	}
	maxAttempts := s.MaxAttempts
	if maxAttempts == 0 {
		maxAttempts = len(models)
	}
	info := taskInfo{
		id:          s.ID,
		parent:      s.ParentSessionID,
		description: s.Description,
		agent:       s.Agent,
		prompt:      s.Prompt,
		models:      models, // the ledger keeps its own copy (chain)
		maxAttempts: maxAttempts,
		metadata:    maps.Clone(s.Metadata),
		inProcess:   s.Run != nil,
	}
	if s.Key != "" || s.ContinueFrom != "" || s.Timeout != 0 || s.AttemptTimeout != 0 || s.RetryOnTimeout || s.Budget != nil || s.Detached || s.Attach != nil {
		info.x = &taskExtra{key: s.Key, continues: s.ContinueFrom,
			timeout: s.Timeout, attemptTimeout: s.AttemptTimeout, retryOnTimeout: s.RetryOnTimeout, detached: s.Detached}
		if s.Budget != nil {
			b := *s.Budget
			info.x.budget = &b
		}
		if s.Attach != nil {
			info.x.attach, _ = attachJSON(s.Attach) // validate checked it
		}
	}
	return info
}

// maxAttachBytes bounds Spec.Attach's JSON.
const maxAttachBytes = 64 << 10

// attachJSON is v as Task.Attach keeps it, or why it cannot be kept.
func attachJSON(v any) (_ json.RawMessage, err error) {
	defer func() { // a MarshalJSON of the harness's may panic
		if r := recover(); r != nil {
			err = fmt.Errorf("marshalling it panicked: %s", panicText(r))
		}
	}()
	b, err := json.Marshal(v)
	switch {
	case err != nil:
		return nil, fmt.Errorf("does not marshal to JSON: %s", safeText(err))
	case len(b) > maxAttachBytes:
		return nil, fmt.Errorf("is %d bytes of JSON, over the bound of %d", len(b), maxAttachBytes)
	}
	return b, nil
}
