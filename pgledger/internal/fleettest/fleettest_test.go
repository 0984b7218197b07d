package fleettest

import (
	"context"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
	"github.com/bgtask/bgtask/pgledger"
	"github.com/bgtask/bgtask/pgledger/internal/pgtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var url string

func TestMain(m *testing.M) { pgtest.Main(m, "fleettest", &url) }

// Two processes of one ledger: each runs its task on a session whose id
// names it, so that none is bound twice, and each sees the other's.
func TestTheProcessesShareALedger(t *testing.T) {
	ps := Join(t, url, 2, pgledger.NodeOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var sessions []string
	for i, p := range ps {
		task, err := p.Node.Launch(ctx, bgtask.Spec{ParentSessionID: "chat", Prompt: "p", Models: []bgtask.Model{{ID: "m"}}})
		require.NoError(t, err)
		got, err := bgtasktest.WaitStatus(ctx, p.Node.Manager(), task.ID, bgtask.StatusRunning)
		require.NoError(t, err, "process %d", i)
		sessions = append(sessions, got.SessionID)
	}
	assert.Equal(t, []string{"w0-ses-1", "w1-ses-1"}, sessions)
	assert.Equal(t, []string{"w0"}, ps[0].Node.Members())
	assert.Equal(t, []string{"w1"}, ps[1].Node.Members())
}
