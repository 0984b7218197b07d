package bgtask

import (
	"errors"
	"fmt"
	"strconv"
	"time"
)

// Sentinel errors. Match them with errors.Is; several are wrapped with
// detail.
var (
	// ErrUnknownTask: no task has that id.
	ErrUnknownTask = errors.New("unknown task")
	// ErrForgotten: the task existed, ended, and was forgotten under the
	// retention rule (WithRetention). It is not ErrUnknownTask.
	ErrForgotten = errors.New("task was forgotten (retention)")
	// ErrUnknownSession: an event named a session (or attempt) that no task
	// knows and no session start in flight may be creating.
	ErrUnknownSession = errors.New("unknown session")
	// ErrStaleEvent: an event resolved to an attempt that is superseded or
	// terminal, or carried a token that is not the current run's. It
	// changed nothing.
	ErrStaleEvent = errors.New("stale event")
	// ErrBranchClosing: new work was refused because its parent session is
	// inside a branch being closed.
	ErrBranchClosing = errors.New("branch is closing")
	// ErrShutdown: the Manager is shutting down or shut down.
	ErrShutdown = errors.New("manager is shut down")
	// ErrInvalidArgument: a call was given something it cannot take, and
	// nothing changed: Launch a bad Spec (the error is a *SpecError
	// naming the field), Observe an event with no session or attempt or
	// an unknown kind, Open options that do not fit, Stop a Target that
	// names nothing, a blank id where one is required.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrJournal: the journal (WithJournal) failed to make records
	// durable. The Manager then stops: every input is refused with it, and
	// no host call or notification is made. Restart from the journal.
	ErrJournal = errors.New("journal failed")
	// ErrNotRunning: Extend was given a task whose run is not running
	// (pending, ended, or being stopped). Nothing changed.
	ErrNotRunning = errors.New("task is not running")
	// ErrPromptRefused: the Host's PromptSession refused a supplemental
	// prompt; the error wraps the host's. Nothing changed.
	ErrPromptRefused = errors.New("the host refused the prompt")
	// ErrKeyHeld: Launch was given a Spec.Key a live task holds; the error
	// is a *KeyHeldError naming it.
	ErrKeyHeld = errors.New("key is held by a live task")
	// ErrSuperseded: Fence found that the run its context carries is no
	// longer its task's current live run (replaced by a retry, stopped, or
	// ended): a side effect it was about to make must not happen.
	ErrSuperseded = errors.New("run superseded")
	// ErrIDTaken: Launch was given a Spec.ID that a task this Manager
	// knows has (live, ended, or forgotten lately). Nothing changed.
	ErrIDTaken = errors.New("task id is taken")
	// ErrDepthLimit, ErrFanOutLimit, ErrTreeLimit: Launch was refused by
	// a limit of WithTreeLimits (spawn depth, live tasks per parent
	// session, live tasks per root session); the error is a *LimitError.
	// Nothing changed.
	ErrDepthLimit  = errors.New("spawn depth limit reached")
	ErrFanOutLimit = errors.New("live tasks per parent session limit reached")
	ErrTreeLimit   = errors.New("live tasks per root session limit reached")
	// ErrDurabilityUnknown: a call's context ended while it waited for its
	// records to be durable (WithJournal), so what it did may or may not
	// have been recorded; the error is a *DurabilityUnknownError naming the
	// task, and it also matches the context's error (errors.Is).
	ErrDurabilityUnknown = errors.New("the context ended before the records were durable")
	// ErrCorrupt: a file journal holds damage no crash explains (a bad
	// record that complete records follow); OpenFileJournal and
	// ReadFileJournal refuse it, and nothing changed. The error is a
	// *CorruptError saying where and what a repair (WithRepair, bgtask
	// repair DIR) would drop.
	ErrCorrupt = errors.New("the journal is corrupt")
)

// DurabilityUnknownError is a call (Launch, Extend, Stop) whose context
// ended while it waited for its records to be durable: they may or may not
// become durable, and what they describe may or may not happen (it happens,
// in order, once they are: nothing runs before its records are durable).
// TaskID names the task, so the caller can look it up: Manager.Task tells
// the truth (an ErrUnknownTask after a Launch means it never happened). It
// matches ErrDurabilityUnknown and unwraps to the context's error.
type DurabilityUnknownError struct {
	Op     string // the call: "Launch", "Extend" or "Stop"
	TaskID string // the task it was about ("" for a Stop of a session no task owns)
	Err    error  // the context's error
}

// Error says what was being made durable and the context's error.
func (e *DurabilityUnknownError) Error() string {
	s := "" + e.Op
	if e.TaskID != "" {
		s += " of task " + e.TaskID
	}
	return s + ": the context ended before its records were durable; they may or may not be (Manager.Task tells): " + safeText(e.Err)
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

// Error names the limit and the figures.
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

// Error names the key and the task that holds it.
func (e *KeyHeldError) Error() string {
	return "key " + strconv.Quote(e.Key) + " is held by live task " + e.TaskID
}

// Is makes errors.Is(err, ErrKeyHeld) true.
func (e *KeyHeldError) Is(target error) bool { return target == ErrKeyHeld }

// SpecError says which field of a Spec is wrong. It matches ErrInvalidArgument.
type SpecError struct {
	Field string // e.g. "Models[1].ID"
	// Reason says what is wrong with it.
	Reason string
}

// Error names the field and what is wrong with it.
func (e *SpecError) Error() string {
	return "invalid spec: " + e.Field + ": " + e.Reason
}

// Is reports whether target is ErrInvalidArgument.
func (e *SpecError) Is(target error) bool { return target == ErrInvalidArgument }

// ErrNilResult ends an attempt whose Returning function returned a nil
// result and a nil error: there is no answer to give the parent. It is
// the attempt's Task.Cause itself (t.Cause == ErrNilResult), never
// retried; the result's type is logged.
var ErrNilResult = errors.New("the subagent function returned a nil result and no error")

// PanicError is a panic in user code the Manager ran for a run (a FuncHost
// function, Returning's text): the attempt ends in error with it as its
// Cause itself (t.Cause.(*PanicError) holds; never retried; Task.Error is
// its text), and it is logged at error level with the stack. It is process-local, as Cause is: after a
// restart only the text remains.
type PanicError struct {
	// Where names the code that panicked: "subagent function".
	Where string
	// Value is what was passed to panic.
	Value any
	// Stack is the panicking goroutine's stack (runtime/debug.Stack).
	Stack []byte
}

// Error says where the panic was and its value (without the stack).
func (e *PanicError) Error() string { return e.Where + " panicked: " + panicText(e.Value) }

// Unwrap returns the panic's value when it is an error, so that
// errors.Is and errors.As see it.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return err
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

// What a Host cannot do: errors.ErrUnsupported, with what is missing.
var (
	errNoPrompter = fmt.Errorf("%w: the host cannot prompt a running session (no Prompter)", errors.ErrUnsupported)
	errNoResumer  = fmt.Errorf("%w: the host cannot resume a session (no Resumer)", errors.ErrUnsupported)
	errNoHealth   = fmt.Errorf("%w: the Manager keeps no health (WithHealth)", errors.ErrUnsupported)
)
