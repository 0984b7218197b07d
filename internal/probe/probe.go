// Package probe lets the simulation harness (internal/sim) see what the
// Manager does not export: how many of its goroutines run. The root package
// fills it in at init; nothing outside this module can reach it.
package probe

// Running returns how many goroutines of the Manager m (a *bgtask.Manager)
// run now, and a channel closed the next time that number changes.
var Running func(m any) (int, <-chan struct{})

// Parked returns how many goroutines of m (or callers inside its methods)
// are parked on an internal wait (a shared abort, a closure pass) and so
// make no progress on their own, and a channel closed when that changes.
var Parked func(m any) (int, <-chan struct{})

// Record makes m keep every ledger record it commits from now on; call it
// right after New, before m is used.
var Record func(m any)

// Replay replays the records m kept (Record) into a fresh ledger and
// reports the first way the result differs from m.
var Replay func(m any) error
