package bgtask

import "time"

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
	// the branch beneath that session is closed (as Stop with
	// Target.Session closes it).
	SessionDeleted EventKind = "deleted"
	// SessionCompacted: context compaction happened. Never changes status.
	SessionCompacted EventKind = "compacted"
	// SessionWaiting: the child waits on a tool, a permission or input.
	// Liveness only; it sets Activity.
	SessionWaiting EventKind = "waiting"
	// SessionUsage: the child reports usage (Event.Usage) and nothing
	// else. It is counted for the attempt it resolves to even when that
	// run was replaced or ended (Observe then returns nil): the work was
	// done.
	SessionUsage EventKind = "usage"
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
	case SessionBusy, SessionIdle, SessionError, SessionInterrupted, SessionDeleted, SessionCompacted, SessionWaiting, SessionUsage:
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
	// Reason (SessionIdle) says why the turn's answer is not a clean one,
	// if the host knows: ReasonOutputLimit (cut off), ReasonContentFilter,
	// ReasonUnconsumedToolCall (it ended on a tool call). Empty: a clean
	// answer. (A SessionError names its reason by its Err: a Reason,
	// wrapped or not.)
	Reason Reason
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
	// every change of it is a Change. It is bounded to maxProgressRunes.
	Progress string
	// Usage is what the child used since its previous report (a delta),
	// on an event of any kind: counted for the attempt the event resolves
	// to, and kept in the ledger (see Usage). A stale event's usage still
	// counts for the attempt that did the work, never moving its task
	// (Observe returns ErrStaleEvent all the same, but for SessionUsage);
	// one whose token or session contradicts its attempt counts nowhere.
	// An event held until its session is bound carries its usage with it:
	// one given up (WithHoldLimit, or no start claimed its session) counts
	// nowhere either.
	Usage Usage

	last bool // SessionIdle from a FuncHost function's return: no turn follows
}
