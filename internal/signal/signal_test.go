package signal

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// closed reports whether c is closed, without waiting.
func closed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

func TestClosedIsClosed(t *testing.T) {
	require.NotNil(t, Closed)
	assert.True(t, closed(Closed))
}

func TestChangedSameChannelUntilChange(t *testing.T) {
	var s Set
	c1 := s.Changed()
	require.NotNil(t, c1)
	assert.False(t, closed(c1), "no change yet")
	assert.Equal(t, c1, s.Changed(), "same channel until the next change")

	s.Change()
	assert.True(t, closed(c1), "Change wakes the waiters")

	c2 := s.Changed()
	require.NotNil(t, c2)
	assert.NotEqual(t, c1, c2, "a fresh channel after the change")
	assert.False(t, closed(c2), "the fresh channel waits for the next change")
	assert.Equal(t, c2, s.Changed())

	s.Change()
	assert.True(t, closed(c2))
}

func TestChangeWithoutWaiter(t *testing.T) {
	var s Set
	assert.NotPanics(t, func() { s.Change(); s.Change() })
	c := s.Changed()
	assert.False(t, closed(c), "a change before anyone waited does not count")
	s.Change()
	assert.True(t, closed(c))
	// Nobody waits again: more changes are no-ops (no double close).
	assert.NotPanics(t, func() { s.Change() })
	assert.False(t, closed(s.Changed()))
}

func TestDoneEnded(t *testing.T) {
	var s Set
	d := s.Done(true)
	assert.Equal(t, (<-chan struct{})(Closed), d)
	assert.True(t, closed(d))
	assert.Nil(t, s.Made(), "Done(true) makes no channel")
}

func TestDoneClosedByEnd(t *testing.T) {
	var s Set
	assert.Nil(t, s.Made(), "nobody waited yet")
	d := s.Done(false)
	require.NotNil(t, d)
	assert.NotEqual(t, (<-chan struct{})(Closed), d)
	assert.False(t, closed(d), "the task has not ended")
	assert.Equal(t, d, s.Done(false), "every waiter shares one channel")
	assert.Equal(t, d, s.Made(), "Made returns the channel Done made")

	s.End()
	assert.True(t, closed(d), "End wakes the waiters of Done")
	assert.Equal(t, (<-chan struct{})(Closed), s.Made(), "the task's own channel is let go: Made names the shared closed one")
	assert.NotPanics(t, s.End, "a second End closes nothing twice")
	assert.Equal(t, (<-chan struct{})(Closed), s.Done(false))
}

func TestEndWithoutWaiter(t *testing.T) {
	var s Set
	assert.NotPanics(t, s.End)
	assert.Nil(t, s.Made())
	assert.True(t, closed(s.Done(true)))
}

func TestRunSameKeySameChannel(t *testing.T) {
	var s Set
	a := s.Run("a", false)
	require.NotNil(t, a)
	assert.False(t, closed(a))
	assert.Equal(t, a, s.Run("a", false))

	b := s.Run("b", false)
	require.NotNil(t, b)
	assert.NotEqual(t, a, b, "another run gets its own channel")
	assert.False(t, closed(b))
	assert.Equal(t, b, s.Run("b", false))
}

func TestRunOver(t *testing.T) {
	var s Set
	a := s.Run("a", false)

	var asked []string
	s.RunOver(func(key string) bool { asked = append(asked, key); return false })
	assert.Equal(t, []string{"a"}, asked, "over is asked about the run the channel was made for")
	assert.False(t, closed(a), "run a is not over")
	assert.Equal(t, a, s.Run("a", false), "still the same channel")

	asked = nil
	s.RunOver(func(key string) bool { asked = append(asked, key); return key == "a" })
	assert.Equal(t, []string{"a"}, asked)
	assert.True(t, closed(a), "run a is over: its waiters wake")

	// Nothing left to wake: no double close, whatever over says.
	assert.NotPanics(t, func() { s.RunOver(func(string) bool { return true }) })

	a2 := s.Run("a", false)
	require.NotNil(t, a2)
	assert.NotEqual(t, a, a2, "a new channel after the old one was closed")
	assert.False(t, closed(a2))
}

func TestRunOverFollowsLatestKey(t *testing.T) {
	var s Set
	s.Run("a", false)
	b := s.Run("b", false)
	var asked []string
	s.RunOver(func(key string) bool { asked = append(asked, key); return key == "b" })
	assert.Equal(t, []string{"b"}, asked)
	assert.True(t, closed(b))
}

func TestRunAlreadyOver(t *testing.T) {
	var s Set
	assert.Equal(t, (<-chan struct{})(Closed), s.Run("a", true))

	a := s.Run("a", false)
	assert.Equal(t, (<-chan struct{})(Closed), s.Run("a", true))
	assert.Equal(t, a, s.Run("a", false), "Run(key, true) leaves the live channel alone")
	assert.False(t, closed(a))
}

// Asking for another run's channel replaces the run the old one was made
// for: its waiters are released, exactly once.
func TestRunForAnotherKeyReleasesTheOldRunsWaiters(t *testing.T) {
	var s Set
	old := s.Run("run-1", false)
	next := s.Run("run-2", false)
	select {
	case <-old:
	default:
		t.Fatal("the replaced run's waiters were not released")
	}
	select {
	case <-next:
		t.Fatal("the new run's channel is closed")
	default:
	}
	s.RunOver(func(string) bool { return true }) // closes next only
	select {
	case <-next:
	default:
		t.Fatal("RunOver did not close the current run's channel")
	}
}
