package sim

import (
	"errors"

	"github.com/bgtask/bgtask"
)

// Budgets in the simulation: with "budget", a root launch has a budget in
// half of the runs' draws, a child's launch now and then a narrower grant,
// and the events of bound runs carry usage. The world is honest as a
// provider is: once a budget was spent, a run it covers reports at most
// the one request it had in flight, and nothing more. The invariants:
// each attempt's usage is exactly what the world reported and the Manager
// counted (across restarts too); each budget's spent is its tree's sum;
// spent ≤ limit + what was in flight at the crossing; spawns never pass
// their limit; a spent budget has every live task in it asked to stop;
// a launch is refused with ErrBudget exactly when the tree says so.

// maxReport bounds the tokens of one usage report the world makes.
const maxReport = 600

// budgetState is the simulation's own account of usage.
type budgetState struct {
	used map[string]bgtask.Usage // attempt → what was reported and counted
	// crossed: budget holder → the runs (attempt ids) live in it when it
	// was first seen spent, each allowed one report in flight.
	crossed  map[string]map[string]bool
	inflight map[string]bool // attempts whose in-flight report was made
}

func newBudgetState() *budgetState {
	return &budgetState{used: map[string]bgtask.Usage{}, crossed: map[string]map[string]bool{}, inflight: map[string]bool{}}
}

// budgetFor is the budget a launch under parent brings, if any.
func (w *world) budgetFor(parent string) *bgtask.Budget {
	if w.bud == nil {
		return nil
	}
	root := len(parent) > 5 && parent[:5] == "root-"
	switch {
	case root && w.brng.IntN(2) == 0:
		return &bgtask.Budget{Tokens: int64(1500 + w.brng.IntN(4000)), Spawns: int64(2 + w.brng.IntN(6)), SoftPercent: 50 + w.brng.IntN(60)}
	case !root && w.brng.IntN(4) == 0:
		return &bgtask.Budget{Tokens: int64(300 + w.brng.IntN(2000))}
	}
	return nil
}

// ownerOf is the task one of whose sessions is session, if any.
func ownerOf(tasks []bgtask.Task, session string) *bgtask.Task {
	for i := range tasks {
		for _, a := range tasks[i].Attempts {
			if a.SessionID == session {
				return &tasks[i]
			}
		}
	}
	return nil
}

// budgetRefusal reports whether a launch under parent must be refused
// with ErrBudget, from the tasks alone: the budget its parent task spends
// from (or one above it) has a figure with nothing left.
func budgetRefusal(tasks []bgtask.Task, parent string) bool {
	p := ownerOf(tasks, parent)
	if p == nil || p.Budget == nil {
		return false
	}
	l := p.Budget.Left
	return p.Budget.Exceeded != "" || l.Tokens == 0 || l.Cost == 0 || l.Requests == 0 || l.Spawns == 0
}

// usageFor is the usage an event on attempt a of t carries, if any: none
// for a run not bound (a report would be held), and after a budget of t
// was spent only the run's one report in flight.
func (w *world) usageFor(tasks []bgtask.Task, t bgtask.Task, a bgtask.Attempt) bgtask.Usage {
	if w.bud == nil || a.SessionID == "" || w.brng.IntN(3) == 0 {
		return bgtask.Usage{}
	}
	for holder, live := range w.bud.crossed {
		if !inScope(tasks, t, holder) {
			continue
		}
		if !live[a.ID] || w.bud.inflight[a.ID] {
			return bgtask.Usage{} // a stopped run starts no request
		}
		w.bud.inflight[a.ID] = true
	}
	return bgtask.Usage{InputTokens: int64(50 + w.brng.IntN(maxReport-150)), OutputTokens: int64(w.brng.IntN(100)),
		CachedTokens: int64(w.brng.IntN(50)), Requests: 1, Cost: bgtask.Cost(w.brng.IntN(2000))}
}

// counted notes what an event's usage came to: counted for its attempt
// unless it was refused as unknown or contradicted its attempt.
func (w *world) counted(ev bgtask.Event, a bgtask.Attempt, err error) {
	if w.bud == nil || ev.Usage.IsZero() || errors.Is(err, bgtask.ErrUnknownSession) || ev.Token != "" {
		return
	}
	if err != nil && !errors.Is(err, bgtask.ErrStaleEvent) {
		return
	}
	w.bud.used[a.ID] = w.bud.used[a.ID].Add(ev.Usage)
}

// inScope reports whether t is in the branch of the task holder: holder
// itself, or launched from a session of a task in it.
func inScope(tasks []bgtask.Task, t bgtask.Task, holder string) bool {
	for range len(tasks) + 1 {
		if t.ID == holder {
			return true
		}
		p := ownerOf(tasks, t.ParentSessionID)
		if p == nil {
			return false
		}
		t = *p
	}
	return false
}

// checkBudgets checks the invariants above after a step.
func (w *world) checkBudgets(tasks []bgtask.Task, before []bgtask.Task) {
	for _, t := range tasks {
		for i, a := range t.Attempts {
			var got bgtask.Usage
			if t.Usage != nil && i < len(t.Usage.ByAttempt) {
				got = t.Usage.ByAttempt[i]
			}
			if want := w.bud.used[a.ID]; got != want {
				w.failf("%s attempt %d: usage %+v, but the world reported %+v", t.ID, a.Number, got, want)
			}
		}
		b := t.Budget
		if b == nil || b.TaskID != t.ID {
			continue
		}
		var sum bgtask.Usage
		var scope []bgtask.Task
		for _, x := range tasks {
			if inScope(tasks, x, t.ID) {
				scope = append(scope, x)
				if x.Usage != nil {
					sum = sum.Add(x.Usage.Total)
				}
			}
		}
		if b.Spent != sum {
			w.failf("budget of %s: spent %+v, its tree's usage %+v", t.ID, b.Spent, sum)
		}
		if b.Limit.Spawns > 0 && b.Spawned+b.Reserved > b.Limit.Spawns {
			w.failf("budget of %s: %d spawned and %d reserved past its %d", t.ID, b.Spawned, b.Reserved, b.Limit.Spawns)
		}
		if b.Exceeded == "" {
			continue
		}
		if _, seen := w.bud.crossed[t.ID]; !seen {
			live := map[string]bool{} // the runs live before this step: each had one request in flight at most
			for _, x := range before {
				if !x.Status.Terminal() && inScope(before, x, t.ID) {
					live[x.CurrentAttemptID] = true
				}
			}
			w.bud.crossed[t.ID] = live
			w.log("budget of %s spent: %+v; %d runs in flight", t.ID, b.Spent, len(live))
		}
		if bound := b.Limit.Tokens + int64(maxReport*(1+len(w.bud.crossed[t.ID]))); b.Limit.Tokens > 0 && b.Spent.Tokens() > bound {
			w.failf("budget of %s: spent %d tokens, past its limit %d and what was in flight (bound %d)", t.ID, b.Spent.Tokens(), b.Limit.Tokens, bound)
		}
		for _, x := range scope {
			if !x.Status.Terminal() && x.Stop == nil {
				w.failf("budget of %s spent, and %s in it is live with no stop asked", t.ID, x.ID)
			}
		}
	}
}
