package bgtask

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/clock"
)

// gatedStore is a HealthStore whose read takes what it holds as it is
// called, tells entered, then answers only once gate is closed; its
// writes land at once and are told to written.
type gatedStore struct {
	*memJournal
	mu      sync.Mutex
	of      map[string]Cooldown
	entered chan struct{}
	gate    chan struct{}
	written chan Cooldown
}

func (g *gatedStore) CoolDown(_ context.Context, c Cooldown) error {
	g.mu.Lock()
	g.of[c.Key] = c
	g.mu.Unlock()
	g.written <- c
	return nil
}

func (g *gatedStore) Cooldowns(context.Context) ([]Cooldown, error) {
	g.mu.Lock()
	var out []Cooldown
	for _, c := range g.of {
		out = append(out, c)
	}
	g.mu.Unlock()
	g.entered <- struct{}{}
	<-g.gate
	return out, nil
}

// A read of the store that began before a cooldown begun here was written
// there does not take its absence for a reset elsewhere: the cooldown
// goes on.
func TestHealthAReadBegunBeforeTheWriteEndsNothing(t *testing.T) {
	store := &gatedStore{memJournal: &memJournal{}, of: map[string]Cooldown{},
		entered: make(chan struct{}, 1), gate: make(chan struct{}), written: make(chan Cooldown, 1)}
	w := &cooldownWorld{runs: map[string]int{}, errs: map[string]error{"p/one": throttledErr{after: time.Minute}}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := Open(ctx, w.host(), WithJournal(store), WithHealth(HealthPolicy{}),
		WithClock(clock.NewFake(time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC))))
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Shutdown(ctx)) }()

	m.mu.Lock()
	read := make(chan struct{})
	require.True(t, m.healthReadLater(read))
	require.NoError(t, m.unlock())
	recv(t, store.entered, "the health read") // it holds nothing yet

	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "p/one", "p/two")})
	require.NoError(t, err)
	_, err = m.Wait(ctx, task.ID)
	require.NoError(t, err)
	assert.Equal(t, "p/one", recv(t, store.written, "the cooldown write").Key)
	close(store.gate)
	recv(t, read, "the health read to finish")

	assert.Equal(t, map[string]string{"p/one": "rate_limited until 2026-12-02T10:01:00Z, 1 in a row"}, cooling(m),
		"the read began before the write: what it missed is no reset")
}
