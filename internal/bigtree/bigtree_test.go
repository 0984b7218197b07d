package bigtree

import (
	"testing"

	"github.com/bgtask/bgtask"
	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Two trees: 200 tasks, every one launched, the grandchildren of the
// first root (every third) ended, the rest running.
func TestBuildMakesTheTreesItSays(t *testing.T) {
	m, _ := Build(t, 2)
	counts := map[bgtask.Status]int{}
	depths := map[int]int{}
	for _, task := range m.Snapshot().Tasks {
		counts[task.Status]++
		depths[task.Depth]++
	}
	assert.Equal(t, map[bgtask.Status]int{bgtask.StatusCompleted: 90, bgtask.StatusRunning: 110}, counts)
	assert.Equal(t, map[int]int{1: 2, 2: 18, 3: 180}, depths)
}
