package bgtask

import (
	"errors"
	"strings"
)

// StopKind says who asked a task to stop (StopCause).
type StopKind string

const (
	// StopCancel: Manager.Stop of a task or a run.
	StopCancel StopKind = "cancel"
	// StopCaller: the context passed to Launch ended first
	// (Spec.CancelWithCaller); StopCause.TaskID names the task whose
	// caller it was (its branch was closed with it).
	StopCaller StopKind = "caller"
	// StopClosure: a branch closure (Manager.Stop with Target.Tree or
	// Target.Session, or one of pgledger's across processes):
	// StopCause.Root names the session closed, or StopCause.TaskID the
	// task closed as a unit.
	StopClosure StopKind = "closure"
	// StopDeadline: the task's deadline (Spec.Timeout) passed; the task
	// ends in error (ReasonDeadline).
	StopDeadline StopKind = "deadline"
	// StopSessionDeleted: the child session was deleted (SessionDeleted).
	StopSessionDeleted StopKind = "session_deleted"
	// StopShutdown: Shutdown; the task ends interrupt.
	StopShutdown StopKind = "shutdown"
	// StopBudget: the budget the task spends from was spent (Budget): its
	// branch was closed. StopCause.TaskID names the task that holds the
	// budget, Limit the limit reached.
	StopBudget StopKind = "budget"
	// StopOther: a stop a journal recorded that this release does not
	// know (StopCause.Note says what it said).
	StopOther StopKind = "other"
)

// StopCause is who asked a task to stop (Task.Stop). It is recorded with
// the stop in the ledger (journaled: a restart keeps it), shown in the
// Timeline, the final summary and the envelope, and logged with the task's
// end. The first stop asked is the one kept. A stop asked of a run whose
// child then ended on its own leaves the task with the child's outcome;
// Task.Stop still says a stop was asked.
type StopCause struct {
	// Kind is who asked.
	Kind StopKind `json:"kind"`
	// Root is the session a closure closed (StopClosure).
	Root string `json:"root,omitempty"`
	// TaskID is the task a closure closed as a unit (StopClosure, by a Stop
	// with Target.Tree) or whose caller's context ended (StopCaller).
	TaskID string `json:"taskID,omitempty"`
	// Limit is the budget's limit reached (StopBudget): LimitTokens,
	// LimitCost or LimitRequests.
	Limit string `json:"limit,omitempty"`
	// Note is what the journal said, for StopOther.
	Note string `json:"note,omitempty"`
	// Actor is who acted, when the stop's caller named them
	// (Target.Actor): an operator's identity, as bgtaskhttp's Authorize
	// accepted it.
	Actor string `json:"actor,omitempty"`
}

// String says who asked, for people and parent models.
func (c StopCause) String() string {
	if c.Actor != "" {
		a := c
		a.Actor = ""
		return a.String() + " (" + c.Actor + ")"
	}
	switch c.Kind {
	case StopCancel:
		return "the caller cancelled"
	case StopCaller:
		return "the caller of task " + c.TaskID + " went away"
	case StopClosure:
		if c.TaskID != "" {
			return "task " + c.TaskID + " was stopped with everything beneath it"
		}
		return "everything session " + c.Root + " started was stopped"
	case StopDeadline:
		return "its deadline passed"
	case StopSessionDeleted:
		return "its session was deleted"
	case StopShutdown:
		return "the manager shut down"
	case StopBudget:
		return "the budget of task " + c.TaskID + " ran out of " + c.Limit
	}
	return "a stop was asked (" + c.Note + ")"
}

// The notes the stop records carry: who asked, as the ledger says it.
const (
	noteCancel         = "cancel"
	noteShutdown       = "shutdown"
	noteDeadline       = "deadline"
	noteSessionDeleted = "session deleted"
	noteCallerOf       = "caller of task "
	noteClosureOfTask  = "closure of task "
	noteClosureOf      = "closure of "
	noteBudget         = "budget "   // then the limit, noteBudgetOf and the task
	noteBudgetOf       = " of task " // see noteBudget
)

// noteActor separates a stop record's note from the actor that follows
// it (Target.Actor), if any: a byte no note and no actor has.
const noteActor = "\x1f"

// stopCauseOf reads who asked from a stop record's note.
func stopCauseOf(note string) StopCause {
	if base, actor, ok := strings.Cut(note, noteActor); ok {
		c := stopCauseOf(base)
		c.Actor = actor
		return c
	}
	switch {
	case note == noteCancel:
		return StopCause{Kind: StopCancel}
	case note == noteShutdown:
		return StopCause{Kind: StopShutdown}
	case note == noteDeadline:
		return StopCause{Kind: StopDeadline}
	case note == noteSessionDeleted:
		return StopCause{Kind: StopSessionDeleted}
	case strings.HasPrefix(note, noteCallerOf):
		return StopCause{Kind: StopCaller, TaskID: strings.TrimPrefix(note, noteCallerOf)}
	case strings.HasPrefix(note, noteClosureOfTask):
		return StopCause{Kind: StopClosure, TaskID: strings.TrimPrefix(note, noteClosureOfTask)}
	case strings.HasPrefix(note, noteClosureOf):
		return StopCause{Kind: StopClosure, Root: strings.TrimPrefix(note, noteClosureOf)}
	case strings.HasPrefix(note, noteBudget):
		if limit, task, ok := strings.Cut(strings.TrimPrefix(note, noteBudget), noteBudgetOf); ok {
			return StopCause{Kind: StopBudget, TaskID: task, Limit: limit}
		}
	}
	return StopCause{Kind: StopOther, Note: note}
}

// ErrCancelled is in the chain of Task.Cause of every cancelled task: a
// *StopError that says who asked.
var ErrCancelled = errors.New("cancelled")

// StopError is Task.Cause of a task a stop ended cancelled or interrupt:
// it says who asked (Stop), matches ErrCancelled for a cancelled task and
// ErrShutdown for one a Shutdown interrupted (errors.Is). Unlike the
// other causes it is rebuilt from the ledger, so it survives a restart.
type StopError struct {
	Status Status    // cancelled or interrupt
	Stop   StopCause // who asked
}

// Error says how the task ended and who asked.
func (e *StopError) Error() string {
	word := "stopped: "
	if e.Status == StatusInterrupt {
		word = "interrupted: "
	}
	return word + e.Stop.String()
}

// Is matches ErrCancelled (a cancelled task) and ErrShutdown (a task a
// Shutdown interrupted).
func (e *StopError) Is(target error) bool {
	return (target == ErrCancelled && e.Status == StatusCancelled) ||
		(target == ErrShutdown && e.Stop.Kind == StopShutdown)
}

// stopAskedBy is the stop record a stop that c asked carries: nil for a
// plain cancel (nil c, or a cancel no actor asked).
func stopAskedBy(c *StopCause) *recordExt {
	if c == nil || (c.Kind == StopCancel && c.Actor == "") {
		return nil
	}
	return &recordExt{stop: StatusCancelled, note: c.note()}
}

// note is c as a stop record says it (stopCauseOf reads it back).
func (c StopCause) note() string {
	if c.Actor != "" {
		a := c
		a.Actor = ""
		return a.note() + noteActor + c.Actor
	}
	switch c.Kind {
	case StopCancel:
		return noteCancel
	case StopShutdown:
		return noteShutdown
	case StopDeadline:
		return noteDeadline
	case StopSessionDeleted:
		return noteSessionDeleted
	case StopCaller:
		return noteCallerOf + c.TaskID
	case StopClosure:
		if c.TaskID != "" {
			return noteClosureOfTask + c.TaskID
		}
		return noteClosureOf + c.Root
	case StopBudget:
		return noteBudget + c.Limit + noteBudgetOf + c.TaskID
	}
	return c.Note
}
