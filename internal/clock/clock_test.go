package clock

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var start = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func TestFakeTimersFireInOrderOnAdvance(t *testing.T) {
	f := NewFake(start)
	n, added := f.Created()
	assert.Zero(t, n)
	a := f.NewTimer(2 * time.Second)
	<-added
	b := f.NewTimer(time.Second)
	assert.Equal(t, 2, f.Pending())

	f.Advance(time.Second)
	select {
	case at := <-b.C():
		assert.Equal(t, start.Add(time.Second), at)
	default:
		t.Fatal("due timer did not fire")
	}
	select {
	case <-a.C():
		t.Fatal("timer fired early")
	default:
	}
	f.Advance(time.Second)
	<-a.C()
	assert.Equal(t, start.Add(2*time.Second), f.Now())
	assert.Zero(t, f.Pending())
}

func TestFakeStop(t *testing.T) {
	f := NewFake(start)
	tm := f.NewTimer(time.Second)
	assert.True(t, tm.Stop())
	assert.False(t, tm.Stop())
	f.Advance(time.Hour)
	select {
	case <-tm.C():
		t.Fatal("stopped timer fired")
	default:
	}
	z := f.NewTimer(0)
	<-z.C()
	assert.False(t, z.Stop())
}

func TestReal(t *testing.T) {
	var c Clock = Real{}
	tm := c.NewTimer(time.Hour)
	assert.True(t, tm.Stop())
	assert.False(t, c.Now().IsZero())
}
