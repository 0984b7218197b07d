package bgtaskhttp

import (
	"strconv"

	"github.com/bgtask/bgtask"
)

// What a task spent, as the page shows it: its usage (Task.Usage) and the
// budget it spends from (Task.Budget), on its row and its detail page.

// usageView is a task's usage (Task.Usage) as the page shows it.
type usageView struct {
	Short     string   // "1500 tokens · 3 requests · cost 2.25", on its row
	Full      string   // bgtask.Usage.String of the total
	ByAttempt []string // "attempt 2: …" for each attempt that reported any, if several did
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
	v := &usageView{Full: u.String(), Short: usageShort(u)}
	for i, a := range t.Usage.ByAttempt {
		if len(t.Usage.ByAttempt) > 1 && !a.IsZero() { // one attempt's is the total
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
	spent, left := s.Figures()
	return &budgetView{Holder: s.TaskID, Own: s.TaskID == t.ID, Spent: spent, Left: left, Reserved: s.Reserved,
		Exceeded: s.Exceeded, Soft: s.SoftReached}
}

// usageShort is u as a row says it: "1500 tokens · 3 requests · cost 2.25".
func usageShort(u bgtask.Usage) string {
	return count(u.Tokens(), "token") + " · " + count(u.Requests, "request") + " · cost " + u.Cost.String()
}

// count is n and its noun, plural unless n is 1: "3 requests".
func count(n int64, noun string) string {
	if n != 1 {
		noun += "s"
	}
	return strconv.FormatInt(n, 10) + " " + noun
}

// treeView is what a task and every task below it used, as a top row and
// a detail page show it, budget or not.
type treeView struct {
	Tasks int    // the tasks it sums: the task and those below it
	Short string // "1500 tokens · 3 requests · cost 2.25"
	Full  string // bgtask.Usage.String
}

// treeOf is n's tree's usage for the page; nil when no task is below n,
// or none in its tree reported usage.
func treeOf(n *node) *treeView {
	if n.size == 0 || !n.used {
		return nil
	}
	return &treeView{Tasks: n.size + 1, Short: usageShort(n.tree), Full: n.tree.String()}
}
