package group

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestWaitIncludesGoroutinesStartedDuringWait(t *testing.T) {
	var g Group
	release := make(chan struct{})
	second := make(chan struct{})
	require.True(t, g.Go(func() {
		<-release
		// Started while Wait is already waiting: no Add-after-Wait problem.
		g.Go(func() { <-second })
	}))
	done := make(chan error, 1)
	go func() { done <- g.Wait(context.Background()) }()
	close(release)
	select {
	case <-done:
		t.Fatal("Wait returned while a goroutine still ran")
	default:
	}
	close(second)
	require.NoError(t, <-done)
	assert.Zero(t, g.Running())
}

func TestWaitHonoursContext(t *testing.T) {
	var g Group
	block := make(chan struct{})
	g.Go(func() { <-block })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, g.Wait(ctx), context.Canceled)
	assert.Equal(t, 1, g.Running())
	close(block)
	require.NoError(t, g.Wait(context.Background()))
}

func TestCloseRefusesNewGoroutines(t *testing.T) {
	var g Group
	g.Close()
	ran := false
	assert.False(t, g.Go(func() { ran = true }))
	require.NoError(t, g.Wait(context.Background()))
	assert.False(t, ran)
}
