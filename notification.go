package bgtask

import "context"

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
