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
