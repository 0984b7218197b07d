package fleet_test

import (
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/fleet"
	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Importing the root fills the hooks in, with the root's own texts.
func TestTheRootFillsTheHooksIn(t *testing.T) {
	n := fleet.AllComplete("chat", []bgtask.Task{{ID: "t1", Status: bgtask.StatusCompleted}}).(bgtask.Notification)
	assert.Equal(t, bgtask.NotifyAllComplete, n.Kind)
	assert.Equal(t, "chat", n.ParentSessionID)
	assert.NotEmpty(t, n.Text)
	b := fleet.BranchClosed("chat", "t1", bgtask.Task{ID: "t1"}, bgtask.ClosureReport{}).(bgtask.Notification)
	assert.Equal(t, bgtask.NotifyBranchClosed, b.Kind)
	assert.Equal(t, "t1", b.TaskID)
}
