// Package fleet holds what pgledger needs of the root package and no other
// importer should: the texts of the notifications a fleet sends for work
// that spanned processes. The root package fills these in as it is
// initialized; they are typed loosely (any) because this package cannot
// import the root, which imports it.
package fleet

// AllComplete is the all_complete notification (a bgtask.Notification)
// for parent, from tasks (a []bgtask.Task, the round's, ended).
var AllComplete func(parent string, tasks any) any

// BranchClosed is the branch_closed notification (a bgtask.Notification)
// for parent, of a closure of task taskID's branch (snap, a bgtask.Task,
// as it was) that ended as rec (a bgtask.ClosureReport) says.
var BranchClosed func(parent, taskID string, snap, rec any) any

// AtCommit is a Notifier that takes a Manager's notifications with the
// commits that produce them, rather than one by one as the lanes deliver
// them: a journal that writes each notification's record also writes
// the notification (NoteOf), in the same commit, and something else
// delivers it from there. A Manager with a journal and such a Notifier
// calls it for nothing: a notification is delivered, for the Manager,
// once its commit is durable (so it writes no notification_delivered
// record, and a restart owes none of them again).
type AtCommit interface{ NotesAtCommit() }

// NoteOf is the notification a record (a *bgtask.Record, of kind
// notification_produced) carries to an AtCommit journal — a
// *bgtask.Notification, or nil.
var NoteOf func(rec any) any

// History is the history (a []bgtask.RecordView, as Manager.History
// gives it) that recs (a []bgtask.Record: a journal's TaskRecords of task
// id) tell, for a task no Manager of the process holds.
var History func(recs any, id string) (any, error)

// Subscription is a *bgtask.Subscription whose C is c (a <-chan
// bgtask.Change), whose Done, Err and Close are done, err and close: a
// fleet's change stream, served as the type Manager.Subscribe serves.
var Subscription func(c any, done <-chan struct{}, err func() error, close func()) any
