package bgtaskhttp

import (
	"strconv"
	"strings"

	"github.com/bgtask/bgtask"
)

// What a task spent, as the page shows it: its usage (Task.Usage) and the
// budget it spends from (Task.Budget), on its row and its detail page.

// usageView is a task's usage (Task.Usage) as the page shows it.
type usageView struct {
	Short     string   // "1500 tokens · 3 requests · cost 2.25", on its row
	Full      string   // bgtask.Usage.String of the total
	ByAttempt []string // "attempt 2: …" for each attempt that reported any
}

// budgetView is the budget a task spends from (Task.Budget) as the page
// shows it.
type budgetView struct {
	Holder   string // the task that holds it
	Own      bool   // it is the task's own (Spec.Budget)
	Spent    string // "tokens 1050 of 1000, requests 2": each limit, and any figure spent
	Left     string // "tokens 0, spawns 1": what may still be spent; "" when nothing is limited
	Reserved int64  // launches that hold a spawn and have not started
	Exceeded string // the hard limit reached ("" while none is): the branch was stopped
	Soft     bool   // a figure reached the soft threshold
}

// usageOf is t's usage for the page; nil if it reported none.
func usageOf(t *bgtask.Task) *usageView {
	if t.Usage == nil {
		return nil
	}
	u := t.Usage.Total
	v := &usageView{Full: u.String(),
		Short: count(u.Tokens(), "token") + " · " + count(u.Requests, "request") + " · cost " + u.Cost.String()}
	for i, a := range t.Usage.ByAttempt {
		if !a.IsZero() {
			v.ByAttempt = append(v.ByAttempt, "attempt "+strconv.Itoa(i+1)+": "+a.String())
		}
	}
	return v
}

// budgetOf is the budget t spends from, for the page; nil if none.
func budgetOf(t *bgtask.Task) *budgetView {
	s := t.Budget
	if s == nil {
		return nil
	}
	spent, left := budgetFigures(*s)
	return &budgetView{Holder: s.TaskID, Own: s.TaskID == t.ID, Spent: spent, Left: left, Reserved: s.Reserved,
		Exceeded: s.Exceeded, Soft: s.SoftReached}
}

// budgetFigures says what s's branch spent ("tokens 1050 of 1000,
// requests 2": each figure limited or spent, "nothing" if none) and what
// it has left ("tokens 0": each limited figure, the budgets above
// counted; "" if none is), figures named as BudgetError names them.
func budgetFigures(s bgtask.BudgetState) (spent, left string) {
	figs := [...]struct {
		name              string
		used, limit, rest int64
	}{
		{bgtask.LimitTokens, s.Spent.Tokens(), s.Limit.Tokens, s.Left.Tokens},
		{bgtask.LimitCost, int64(s.Spent.Cost), int64(s.Limit.Cost), int64(s.Left.Cost)},
		{bgtask.LimitRequests, s.Spent.Requests, s.Limit.Requests, s.Left.Requests},
		{bgtask.LimitSpawns, s.Spawned, s.Limit.Spawns, s.Left.Spawns},
	}
	num := func(name string, n int64) string {
		if name == bgtask.LimitCost {
			return bgtask.Cost(n).String()
		}
		return strconv.FormatInt(n, 10)
	}
	var sp, lf []string
	for _, f := range figs {
		switch {
		case f.limit > 0:
			sp = append(sp, f.name+" "+num(f.name, f.used)+" of "+num(f.name, f.limit))
		case f.used > 0:
			sp = append(sp, f.name+" "+num(f.name, f.used))
		}
		if f.rest >= 0 {
			lf = append(lf, f.name+" "+num(f.name, f.rest))
		}
	}
	if len(sp) == 0 {
		sp = []string{"nothing"}
	}
	return strings.Join(sp, ", "), strings.Join(lf, ", ")
}

// count is n and its noun, plural unless n is 1: "3 requests".
func count(n int64, noun string) string {
	if n != 1 {
		noun += "s"
	}
	return strconv.FormatInt(n, 10) + " " + noun
}
