package bgtask

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/bgtask/bgtask/internal/signal"
	"github.com/bgtask/bgtask/internal/slots"
	"github.com/bgtask/bgtask/internal/textbound"
)

// Model names a provider's model, with an optional variant. Provider may
// be empty: a harness's own name for a model (an alias such as
// "gpt-primary", a router's name) is a Model with only an ID, rendered as
// the ID alone.
type Model struct {
	// Provider names the provider ("openai"); empty for a harness's own alias.
	Provider string `json:"providerID"`
	// ID is the model's id at the provider, or the alias.
	ID string `json:"modelID"`
	// Variant is an optional variant ("thinking"), rendered in parentheses.
	Variant string `json:"variant,omitempty"`
}

// String returns "provider/id" ("id" with no provider), and a variant in
// parentheses after it: "provider/id (variant)".
func (m Model) String() string {
	s := m.ID
	if m.Provider != "" {
		s = m.Provider + "/" + m.ID
	}
	if m.Variant != "" {
		s += " (" + m.Variant + ")"
	}
	return s
}

// ParseModel splits s at its first "/" into provider and model ID; a
// string with no "/" is a model with no provider (its ID is s). An empty
// side, or an empty s, is an error.
func ParseModel(s string) (Model, error) {
	provider, id, ok := strings.Cut(s, "/")
	if !ok {
		if blank(s) {
			return Model{}, fmt.Errorf("model %q is empty", s)
		}
		return Model{ID: s}, nil
	}
	if provider == "" || id == "" {
		return Model{}, fmt.Errorf("model %q has an empty provider or ID", s)
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

// Live reports whether s is a state that may still change: pending or
// running. A harness maps bgtask's states onto its own with a switch on
// these two and Terminal; an unknown Status is neither.
//
//	switch {
//	case t.Status.Live():
//		return "in progress"
//	case t.Status == bgtask.StatusCompleted:
//		return "done"
//	default: // error, cancelled, interrupt
//		return "failed: " + t.Outcome.Error
//	}
func (s Status) Live() bool { return s == StatusPending || s == StatusRunning }

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
	// PendingCooldown: every model left in the task's chain is cooling
	// (WithHealth); the attempt waits for the earliest cooldown to end,
	// at most HealthPolicy.MaxWait.
	PendingCooldown PendingReason = "cooldown"
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
	// Model is the model this attempt runs on.
	Model Model `json:"model"`
	// Status is the attempt's state; see Status.
	Status Status `json:"status"`
	// Pending says why a pending attempt waits.
	Pending PendingReason `json:"pendingReason,omitempty"`
	// Error is the failure text of an attempt that ended in error.
	Error string `json:"error,omitempty"`
	// Result is the child's final answer text of a completed attempt.
	Result string `json:"result,omitempty"`
	// StartedAt is when its session was bound (zero while pending).
	StartedAt time.Time `json:"startedAt,omitzero"`
	// CompletedAt is when it became terminal (zero until then).
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

// UnmarshalJSON reads an attempt as MarshalJSON writes it (its model
// nested under "model", as a task's is), and also the flat form of earlier
// versions (providerID, modelID, variant on the attempt itself).
func (a *Attempt) UnmarshalJSON(data []byte) error {
	type plain Attempt // no methods: no recursion
	var j struct {
		plain
		ProviderID string `json:"providerID"`
		ModelID    string `json:"modelID"`
		Variant    string `json:"variant"`
	}
	if err := json.Unmarshal(data, &j); err != nil {
		return err
	}
	if j.Model == (Model{}) {
		j.Model = Model{Provider: j.ProviderID, ID: j.ModelID, Variant: j.Variant}
	}
	*a = Attempt(j.plain)
	return nil
}

// runSeen is what the current run reported: process-local, never in the
// ledger, and kept apart from runtime because a closure never reads it.
type runSeen struct {
	lastEvent time.Time // when the current run last reported anything
	stopped   string    // a run whose session the host confirmed stopped (a stall)
	out       runOutput // what the current run said last
}

func (rt *runtime) starting() bool { return rt.startSeq != 0 }

// observation is an event with what was decided about it before the lock
// was taken: whether its error is retryable (the classifier is user code
// and never runs under the lock).
type observation struct {
	ev         Event
	fail       failure // SessionError: the failure, classified before the lock
	classified bool    // fail was filled in (only SessionError needs it)
}

// failure is an attempt's failure with everything that calls user code — the
// error's own methods, the retry classifier — worked out before the lock.
type failure struct {
	err    error // the failure itself, for a retry delay that reads it
	text   string
	reason Reason
	retry  bool
	// health is the failure's class as model health sees it (0: none it
	// acts on), and after the Retry-After the provider asked for (0: none).
	health healthClass
	after  time.Duration
}

// errNeedsClass is observeLocked asking Observe to classify the event's
// error outside the lock and come back.
var errNeedsClass = errors.New("classify first")

// output returns what e's current run reported, started afresh when the
// run is new. m.mu is held.
func (e *entry) output() *runOutput {
	if e.hot == nil {
		return new(runOutput) // frozen: its run is over, and nothing reads what is written here
	}
	if tok := e.cur().Token; e.seen.out.token != tok {
		e.seen.out = runOutput{token: tok}
	}
	return &e.seen.out
}

// runOutput is what a run reported last, kept to compute its outcome.
type runOutput struct {
	token    string // the run it belongs to
	output   string // latest output text
	finish   string
	noText   bool
	reason   Reason // of the failure that ended it, worked out outside the lock
	stopErr  string // the error the run returned after it was asked to stop
	returned bool   // the run said it has stopped (an in-process function returned after an abort gave up on it)
	notice   string // a fact that rides its answer (a degraded children gate)
	progress string // its latest line of progress (Task.Progress)
}

// setProgress keeps p, bounded, as e's run's latest progress; a change
// is published. m.mu is held.
func (m *Manager) setProgress(e *entry, p string) {
	if p == "" {
		return
	}
	if p = textbound.OneLine(p, maxProgressRunes); e.output().progress != p {
		e.output().progress = p
		m.keepProgress(e, p)
		m.publish(e)
	}
}

// setActivity records what the current run is doing; a change is published.
func (m *Manager) setActivity(e *entry, a Activity) {
	if e.activity != a {
		e.activity = a
		m.publish(e)
	}
}

// runtime is the process-local state of a task's current run. It is not in
// the ledger and is never persisted.
type runtime struct {
	// What a closure pass and the end of a run touch comes first: these
	// share the entry's first cache lines.
	scanGen  uint64     // the last closure walk that visited this task
	abort    *abortOp   // the abort in flight for the current run, shared by all who ask
	startSeq uint64     // the StartSession in flight for the current attempt; 0: none
	sig      signal.Set // the waiters' channels: next change, task end, run end
	round    *round     // the parent's round the task counts in
	// Model health (WithHealth): the count of cooldowns begun when the
	// current run was admitted (a cooldown begun later is one the run was
	// sent before), and since when it waits for a cooldown (unix nanos of
	// the Manager's clock; 0: it does not).
	admitted  uint64
	coolSince int64
}

// slotHold is a run's claim on a concurrency slot (WithModelLimits): its
// place in the queue while it waits, then the slot it holds.
type slotHold struct {
	waiter *slots.Waiter[queued]
	token  string // the run holding the slot
	key    string // the concurrency key whose slot it holds
}
