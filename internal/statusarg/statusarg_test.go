package statusarg

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bgtask/bgtask"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Every status reads as itself; anything else is refused with its name
// and the valid ones, exactly as written (no case folding).
func TestParse(t *testing.T) {
	for _, s := range All {
		got, err := Parse(string(s))
		require.NoError(t, err)
		assert.Equal(t, s, got)
	}
	for _, bad := range []string{"", "bogus", "Running", " running"} {
		_, err := Parse(bad)
		require.Error(t, err, "%q", bad)
		assert.Contains(t, err.Error(), Names)
	}
	assert.Equal(t, "pending, running, completed, error, cancelled, interrupt", Names)
	assert.Equal(t, bgtask.StatusPending, All[0])
}
