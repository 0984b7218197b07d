// Package statusarg reads a task status a user named — on cmd/bgtask's
// command line (-status) or in a bgtaskhttp URL (?status=) — so that both
// take the same names and refuse an unknown one with the same words.
package statusarg

import (
	"fmt"
	"slices"
	"strings"

	"github.com/bgtask/bgtask"
)

// All are the task statuses, in their lifecycle's order.
var All = []bgtask.Status{bgtask.StatusPending, bgtask.StatusRunning, bgtask.StatusCompleted,
	bgtask.StatusError, bgtask.StatusCancelled, bgtask.StatusInterrupt}

// Names is All as a user reads it: "pending, running, …".
var Names = func() string {
	s := make([]string, len(All))
	for i, st := range All {
		s[i] = string(st)
	}
	return strings.Join(s, ", ")
}()

// Parse returns the status s names, exactly as written; an unknown name
// is an error that names it and every valid one. The error carries no
// sentinel: the caller says what kind of mistake it is (a usage error, a
// bad argument).
func Parse(s string) (bgtask.Status, error) {
	if st := bgtask.Status(s); slices.Contains(All, st) {
		return st, nil
	}
	return "", fmt.Errorf("unknown status %q: the statuses are %s", s, Names)
}
