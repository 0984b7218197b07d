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
