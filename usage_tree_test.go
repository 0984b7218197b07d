package bgtask

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TreeUsage is what a task and every task beneath it used, launched from
// any of their sessions, recursively (Manager.TreeUsage's doc): four
// levels deep, each level's usage counts for every task above it, and a
// task's tree holds neither its parent nor another tree.
func TestTreeUsageSumsTheWholeTree(t *testing.T) {
	h := newHarness(t, nil)
	root := h.running("chat")
	child := h.running(root.SessionID)
	sibling := h.running(root.SessionID)
	grand := h.running(child.SessionID)
	great := h.running(grand.SessionID)
	other := h.running("chat-2")
	for _, x := range []struct {
		task Task
		us   Usage
	}{
		{root, u(1, 0, 0, 0)},
		{child, u(10, 0, 0, 0)},
		{sibling, u(0, 0, 1, 0)},
		{grand, u(100, 0, 0, 0)},
		{great, u(1000, 0, 0, 5)},
		{other, u(0, 7, 0, 0)},
	} {
		require.NoError(t, h.observe(Event{SessionID: x.task.SessionID, Kind: SessionUsage, Usage: x.us}))
	}
	tree := func(id string) Usage {
		t.Helper()
		us, err := h.m.TreeUsage(id)
		require.NoError(t, err)
		return us
	}
	assert.Equal(t, u(1111, 0, 1, 5), tree(root.ID), "the root, its two children, its grandchild and great-grandchild")
	assert.Equal(t, u(1110, 0, 0, 5), tree(child.ID), "the child, its child and grandchild")
	assert.Equal(t, u(1100, 0, 0, 5), tree(grand.ID))
	assert.Equal(t, u(1000, 0, 0, 5), tree(great.ID))
	assert.Equal(t, u(0, 0, 1, 0), tree(sibling.ID))
	assert.Equal(t, u(0, 7, 0, 0), tree(other.ID))
}
