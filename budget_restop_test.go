package bgtask

import (
	"testing"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// kindsJournal is a memJournal that tells the kind of each record it
// keeps, in order.
type kindsJournal struct {
	memJournal
	kinds chan string
}

func (j *kindsJournal) Append(batch []Record) Commit {
	c := j.memJournal.Append(batch)
	for _, r := range batch {
		j.kinds <- r.Kind
	}
	return c
}

// A restart closes again a spent budget's branch that still has a live
// run (README "Exact across restarts"), also when the one run left is the
// budget holder's own: here its budget closure ended in the first life
// with the abort refused, the run alive; the next life closes the branch
// again (a closure of the holder).
func TestARestartClosesAgainASpentBudgetsBranchWhoseHolderStillRuns(t *testing.T) {
	ctx := testCtx(t)
	j := &kindsJournal{kinds: make(chan string, 4096)}
	host1 := newDLAliveHost() // refuses every abort
	m1, err := Open(ctx, host1, WithJournal(j), WithClock(clock.NewFake(t0)), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	root, err := m1.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "p", Models: oneModel, Budget: &Budget{Tokens: 100, SoftPercent: 100}})
	require.NoError(t, err)
	root = waitStatus(t, m1, root.ID, StatusRunning)
	require.NoError(t, m1.Observe(Event{SessionID: root.SessionID, Kind: SessionUsage, Usage: u(100, 0, 1, 0)}))
	recv(t, host1.aborts, "the budget closure's abort") // refused: the run goes on
	for kind := ""; kind != "branch_closed"; {
		kind = recv(t, j.kinds, "the budget closure's end")
	}
	crashed := j.copyRecs()
	host1.accept.Store(true)
	_ = m1.Shutdown(ctx) // the first life's end is no part of the test

	host2 := newDLAliveHost() // refuses every abort too, until the end
	j2 := &kindsJournal{memJournal: memJournal{recs: crashed}, kinds: make(chan string, 4096)}
	m2, err := Open(ctx, host2, WithJournal(j2), WithClock(clock.NewFake(t0)), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	defer func() {
		host2.accept.Store(true)
		_ = m2.Shutdown(ctx)
	}()
	for kind := ""; kind != "branch_closed"; {
		kind = recv(t, j2.kinds, "a closure of the spent budget's branch in the new life")
	}
	closures := m2.Snapshot().Closures
	require.Len(t, closures, 2, "the first life's closure, and the new life's")
	assert.Equal(t, root.ID, closures[1].TaskID)
	now, err := m2.Task(root.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusRunning, now.Status, "alive: its abort was refused again")
	require.NotNil(t, now.Stop)
	assert.Equal(t, StopCause{Kind: StopBudget, TaskID: root.ID, Limit: LimitTokens}, *now.Stop)
}
