package fleetview

import (
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/stretchr/testify/assert"
)

// The View keeps what the ledger keeps: every live task, and the ended
// ones within MaxAge and among the MaxEnded newest.
func TestTheViewKeepsWhatTheLedgerKeeps(t *testing.T) {
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	ended := func(id string, ago time.Duration) bgtask.Task {
		return bgtask.Task{ID: id, Status: bgtask.StatusCompleted, CompletedAt: now.Add(-ago)}
	}
	all := func() []bgtask.Task {
		return []bgtask.Task{ended("old", 3*time.Hour), {ID: "live", Status: bgtask.StatusRunning}, ended("mid", time.Hour), ended("new", time.Minute)}
	}
	ids := func(ts []bgtask.Task) []string {
		var out []string
		for _, t := range ts {
			out = append(out, t.ID)
		}
		return out
	}
	assert.Equal(t, []string{"old", "live", "mid", "new"}, ids(retained(all(), bgtask.Retention{MaxEnded: -1}, now)), "no bound")
	assert.Equal(t, []string{"live", "mid", "new"}, ids(retained(all(), bgtask.Retention{MaxAge: 2 * time.Hour, MaxEnded: -1}, now)))
	assert.Equal(t, []string{"live", "new"}, ids(retained(all(), bgtask.Retention{MaxEnded: 1}, now)))
	assert.Equal(t, []string{"live"}, ids(retained(all(), bgtask.Retention{MaxEnded: 0}, now)), "none ended kept")
	assert.Equal(t, []string{"live", "new"}, ids(retained(all(), bgtask.Retention{MaxAge: 30 * time.Minute, MaxEnded: 2}, now)), "the stricter bound")
}
