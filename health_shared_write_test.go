package bgtask

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/clock"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// slowWriteStore is a HealthStore whose reads answer at once with what
// it holds, and whose writes tell entered and then wait for gate (or
// their context) before they land.
type slowWriteStore struct {
	memJournal
	mu      sync.Mutex
	of      map[string]Cooldown
	reads   int
	entered chan Cooldown
	gate    chan struct{}
}

func (s *slowWriteStore) CoolDown(ctx context.Context, c Cooldown) error {
	s.entered <- c
	select {
	case <-s.gate:
	case <-ctx.Done():
		return ctx.Err()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.of[c.Key] = c
	return nil
}

func (s *slowWriteStore) Cooldowns(context.Context) ([]Cooldown, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reads++
	var out []Cooldown
	for _, c := range s.of {
		out = append(out, c)
	}
	return out, nil
}

func (s *slowWriteStore) readCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.reads
}

// A cooldown begun here whose write to the store has not landed yet is
// missing from a read of the store; that is no reset elsewhere (only "a
// cooldown ... the store should hold and does not was ended elsewhere"):
// it goes on, and the next task skips the model.
func TestHealthACooldownNotYetWrittenIsNotEndedByARead(t *testing.T) {
	ctx := testCtx(t)
	store := &slowWriteStore{of: map[string]Cooldown{}, entered: make(chan Cooldown, 4), gate: make(chan struct{})}
	clk := clock.NewFake(t0)
	m, err := Open(ctx, &testHost{}, WithJournal(store), WithHealth(HealthPolicy{}), WithClock(clk), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	defer func() {
		close(store.gate)
		require.NoError(t, m.Shutdown(ctx))
	}()

	cdFailOn(t, m, "a/one", cdRetryAfter{time.Minute})
	c := recv(t, store.entered, "the cooldown's write") // held: the store does not have it yet
	require.Equal(t, "a/one", c.Key)
	reads := store.readCount()

	clk.Advance(time.Second) // HealthPolicy.Shared's default: the next Launch reads the store
	task, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/two")})
	require.NoError(t, err)
	require.Greater(t, store.readCount(), reads, "the Launch read the store")
	task = waitStatus(t, m, task.ID, StatusRunning)
	assert.Equal(t, "b/two", task.Model.String(), "a/one still cools")
	require.Len(t, task.Skips, 1)
	assert.Equal(t, "a/one", task.Skips[0].Model.String())
	x := cdHealth(t, m, "a/one")
	assert.Equal(t, HealthCooling, x.State)
	assert.Equal(t, t0.Add(time.Minute), x.Until)
}

// A store's longer cooldown of a model replaces a shorter one begun here
// (HealthStore: "the store keeps the longest cooldown of a key", and a
// Launch takes "those that end later than what this Manager knows").
func TestHealthTheFleetsLongerCooldownReplacesAShorterOneBegunHere(t *testing.T) {
	ctx := testCtx(t)
	gate := make(chan struct{})
	close(gate) // writes land at once
	store := &slowWriteStore{of: map[string]Cooldown{}, entered: make(chan Cooldown, 16), gate: gate}
	clk := clock.NewFake(t0)
	m, err := Open(ctx, &testHost{}, WithJournal(store), WithHealth(HealthPolicy{}), WithClock(clk), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Shutdown(ctx)) }()

	cdFailOn(t, m, "a/one", cdRetryAfter{time.Minute})
	recv(t, store.entered, "the cooldown's write")
	require.Equal(t, t0.Add(time.Minute), cdHealth(t, m, "a/one").Until)
	store.mu.Lock() // another process saw a longer one
	store.of["a/one"] = Cooldown{Key: "a/one", Since: t0, Until: t0.Add(10 * time.Minute), Why: "rate_limited"}
	store.mu.Unlock()

	clk.Advance(time.Minute) // this Manager's own is over; the fleet's is not
	task, err := m.Launch(ctx, Spec{ParentSessionID: "chat", Prompt: "p", Models: mustModels(t, "a/one", "b/two")})
	require.NoError(t, err)
	task = waitStatus(t, m, task.ID, StatusRunning)
	assert.Equal(t, "b/two", task.Model.String(), "the fleet's cooldown of a/one goes on")
	x := cdHealth(t, m, "a/one")
	assert.Equal(t, HealthCooling, x.State)
	assert.Equal(t, t0.Add(10*time.Minute), x.Until)
}
