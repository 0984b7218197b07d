package bgtaskhttp

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask"
)

func task(id, parent string, launched time.Time, sessions ...string) bgtask.Task {
	t := bgtask.Task{ID: id, ParentSessionID: parent, LaunchedAt: launched, Status: bgtask.StatusRunning}
	for i, s := range sessions {
		t.Attempts = append(t.Attempts, bgtask.Attempt{Number: i + 1, SessionID: s, StartedAt: launched})
	}
	return t
}

func parentOf(f *forest, id string) string {
	if n := f.byID[id]; n != nil && n.up != nil {
		return n.up.t.ID
	}
	return ""
}

// A loop of parent links (a journal from another writer) is cut: every
// task is shown once, and the walk ends.
func TestALoopOfParentsIsCut(t *testing.T) {
	at := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	f := grow(bgtask.Snapshot{Tasks: []bgtask.Task{
		task("a", "s-b", at, "s-a"),
		task("b", "s-a", at, "s-b"),
		task("c", "s-c", at, "s-c"), // its own session
		task("d", "s-a", at, "s-d"),
	}})
	seen := map[string]int{}
	var walk func([]*node)
	walk = func(ns []*node) {
		for _, n := range ns {
			seen[n.t.ID]++
			walk(n.kids)
		}
	}
	walk(f.roots)
	assert.Equal(t, map[string]int{"a": 1, "b": 1, "c": 1, "d": 1}, seen)
	assert.Equal(t, "", parentOf(f, "c"))
	assert.Equal(t, "a", parentOf(f, "d"))
}

// A session a continuation took over has two owners: a task launched from
// it is placed under the one that held it then.
func TestAContinuationsChildrenAreItsOwn(t *testing.T) {
	at := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	f := grow(bgtask.Snapshot{Tasks: []bgtask.Task{
		task("cont", "chat", at.Add(2*time.Minute), "s"), // listed first: order does not decide
		task("orig", "chat", at, "s"),
		task("early", "s", at.Add(time.Minute)),
		task("late", "s", at.Add(3*time.Minute)),
	}})
	assert.Equal(t, "orig", parentOf(f, "early"))
	assert.Equal(t, "cont", parentOf(f, "late"))
}

// A chain 20,000 deep is built in linear time (no walk up per task).
func BenchmarkGrowADeepChain(b *testing.B) {
	at := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	var tasks []bgtask.Task
	for i := range 20_000 {
		tasks = append(tasks, task(fmt.Sprint("t", i), fmt.Sprint("s", i-1), at, fmt.Sprint("s", i)))
	}
	snap := bgtask.Snapshot{Tasks: tasks}
	for b.Loop() {
		f := grow(snap)
		require.Len(b, f.roots, 1)
	}
}

// A budget's figures: each limit with what was spent of it, a figure no
// limit covers only once something was spent of it, and what is left of
// each limited one (the budgets above counted: -1 is no limit).
func TestBudgetFiguresNameEachLimit(t *testing.T) {
	s := bgtask.BudgetState{TaskID: "root",
		Limit:   bgtask.Budget{Tokens: 1000, Spawns: 3},
		Spent:   bgtask.Usage{InputTokens: 900, OutputTokens: 150, Requests: 2, Cost: 1_250_000},
		Spawned: 1, Reserved: 1,
		Left: bgtask.Budget{Tokens: 0, Cost: 500_000, Requests: -1, Spawns: 1},
	}
	spent, left := s.Figures()
	assert.Equal(t, "tokens 1050 of 1000, cost 1.25, requests 2, spawns 1 of 3", spent)
	assert.Equal(t, "tokens 0, cost 0.50, spawns 1", left, "cost is limited above")

	spent, left = (bgtask.BudgetState{Left: bgtask.Budget{Tokens: -1, Cost: -1, Requests: -1, Spawns: -1}}).Figures()
	assert.Equal(t, "nothing", spent)
	assert.Equal(t, "", left, "a budget of zeros limits nothing")
}

// A task's usage on its row is short; its detail lists each attempt that
// reported any, when several attempts did. A budget names its holder, unless it is the task's own.
func TestUsageAndBudgetOfATask(t *testing.T) {
	tk := bgtask.Task{ID: "kid", Usage: &bgtask.TaskUsage{
		Total:     bgtask.Usage{InputTokens: 1000, CachedTokens: 200, OutputTokens: 1, Requests: 1, Cost: 4200},
		ByAttempt: []bgtask.Usage{{}, {InputTokens: 1000, CachedTokens: 200, OutputTokens: 1, Requests: 1, Cost: 4200}},
	}, Budget: &bgtask.BudgetState{TaskID: "root", Exceeded: bgtask.LimitTokens, Left: bgtask.Budget{Tokens: 0, Cost: -1, Requests: -1, Spawns: -1}}}
	u := usageOf(&tk)
	require.NotNil(t, u)
	assert.Equal(t, "1001 tokens · 1 request · cost 0.0042", u.Short)
	assert.Equal(t, tk.Usage.Total.String(), u.Full)
	assert.Equal(t, []string{"attempt 2: " + tk.Usage.ByAttempt[1].String()}, u.ByAttempt, "attempt 1 reported nothing")
	tk.Usage.ByAttempt = tk.Usage.ByAttempt[1:]
	assert.Empty(t, usageOf(&tk).ByAttempt, "one attempt's usage is the total: not repeated")
	b := budgetOf(&tk)
	require.NotNil(t, b)
	assert.Equal(t, budgetView{Holder: "root", Spent: "nothing", Left: "tokens 0", Exceeded: bgtask.LimitTokens}, *b)
	tk.Budget.TaskID = "kid"
	assert.True(t, budgetOf(&tk).Own)
	assert.Nil(t, usageOf(&bgtask.Task{}))
	assert.Nil(t, budgetOf(&bgtask.Task{}))
}

// A time on the page: absolute in UTC whatever the time's zone, in HTML's
// datetime form to the millisecond, and relative to the render, cut to
// the unit that reads at a glance.
func TestATimeIsAbsoluteAndRelative(t *testing.T) {
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	paris := time.FixedZone("CET", 3600)
	w := whenOf(now.Add(-(3*time.Minute + 59*time.Second)).In(paris), now)
	assert.Equal(t, when{At: "2026-12-07T11:56:01.000Z", Abs: "2026-12-07 11:56:01 UTC", Ago: "3 min ago", For: "3 min"}, w)
	for d, want := range map[time.Duration]string{
		0:                             "just now",
		999 * time.Millisecond:        "just now",
		45 * time.Second:              "45 s ago",
		time.Hour:                     "1 h ago",
		2*time.Hour + 5*time.Minute:   "2 h 5 min ago",
		26*time.Hour + 59*time.Minute: "1 d 2 h ago",
		72 * time.Hour:                "3 d ago",
		-40 * time.Second:             "in 40 s",
		-90 * time.Minute:             "in 1 h 30 min",
	} {
		assert.Equal(t, want, whenOf(now.Add(-d), now).Ago, d)
	}
	assert.Equal(t, "0 s", whenOf(now.Add(time.Minute), now).For, "no span to a time to come")
	assert.Equal(t, when{}, whenOf(time.Time{}, now), "no time, nothing shown")
	assert.Equal(t, "2026-12-07T12:00:00.123Z", at(now.Add(123456789*time.Nanosecond)).At, "HTML's datetime takes three digits at most")
}
