package bgtask_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fleetHealth is a HealthStore shared by the journals of several Managers
// (what pgledger keeps in a table), counting the calls each kind got.
type fleetHealth struct {
	mu     sync.Mutex
	of     map[string]bgtask.Cooldown
	now    func() time.Time
	writes int
	reads  int
}

func (f *fleetHealth) CoolDown(_ context.Context, c bgtask.Cooldown) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.writes++
	f.of[c.Key] = c
	return nil
}

func (f *fleetHealth) Cooldowns(context.Context) ([]bgtask.Cooldown, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reads++
	var out []bgtask.Cooldown
	for _, c := range f.of {
		if f.now().Before(c.Until) {
			out = append(out, c)
		}
	}
	return out, nil
}

func (f *fleetHealth) counts() (writes, reads int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.writes, f.reads
}

// sharingJournal is a file journal whose health is the fleet's.
type sharingJournal struct {
	bgtask.Journal
	*fleetHealth
}

// A 429 one Manager of a fleet sees cools the model for the others: the
// next launch elsewhere skips it. A success costs the store nothing, a
// cooldown one write, and a Manager reads the store at most once per
// HealthPolicy.Shared.
func TestHealthSharedAcrossAFleet(t *testing.T) {
	store := &fleetHealth{of: map[string]bgtask.Cooldown{}}
	rig := func() *healthRig {
		j, err := bgtask.OpenFileJournal(t.TempDir())
		require.NoError(t, err)
		return newHealthRig(t, &bgtask.HealthPolicy{Shared: time.Second}, bgtask.WithJournal(sharingJournal{j, store}))
	}
	a, b := rig(), rig()
	store.now = a.clock.Now

	// Successes: reads (one per launch past Shared), no writes.
	a.run(t, "p/one", "p/two")
	a.run(t, "p/one", "p/two")
	w, r := store.counts()
	assert.Equal(t, 0, w, "a success writes nothing")
	assert.Equal(t, 1, r, "two launches within Shared read the store once")

	a.set("p/one", throttled{after: time.Minute})
	a.clock.Advance(2 * time.Second)
	b.clock.Advance(2 * time.Second)
	failed := a.run(t, "p/one", "p/two")
	require.Len(t, failed.Attempts, 2)
	require.Eventually(t, func() bool { w, _ := store.counts(); return w == 1 }, 5*time.Second, time.Millisecond,
		"the cooldown was written once")

	skipped := b.run(t, "p/one", "p/two")
	require.Len(t, skipped.Skips, 1, "b skips what a saw throttled")
	assert.Equal(t, "rate_limited", skipped.Skips[0].Why)
	assert.Equal(t, 0, b.ran("p/one"))
	h, ok := healthOf(b.m, "p/one")
	require.True(t, ok)
	assert.Equal(t, bgtask.HealthCooling, h.State)
	assert.Equal(t, a.clock.Now().Add(time.Minute), h.Until, "the cooldown a saw, as it saw it")

	// A reset by hand is written too (its Until now: over).
	require.NoError(t, a.m.ResetHealth(context.Background(), "p/one"))
	require.Eventually(t, func() bool { w, _ := store.counts(); return w == 2 }, 5*time.Second, time.Millisecond)
	b.clock.Advance(2 * time.Second)
	_, r0 := store.counts()
	ran := b.run(t, "p/one", "p/two")
	_, r1 := store.counts()
	assert.Equal(t, r0+1, r1)
	assert.Empty(t, ran.Skips, "a's reset ended the fleet's cooldown at b's next read")
	assert.Equal(t, 1, b.ran("p/one"))
	h, _ = healthOf(b.m, "p/one")
	assert.Equal(t, bgtask.HealthHealthy, h.State)
}

// A store that fails, or panics, is logged: launches go on, health is the
// Manager's own.
func TestHealthStoreAwayIsOnlyLogged(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail func()
	}{
		{"error", nil},
		{"panic", func() { panic("boom") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j, err := bgtask.OpenFileJournal(t.TempDir())
			require.NoError(t, err)
			r := newHealthRig(t, &bgtask.HealthPolicy{}, bgtask.WithJournal(brokenStore{j, tc.fail}))
			r.set("p/one", throttled{after: time.Minute})
			r.run(t, "p/one", "p/two")
			skipped := r.run(t, "p/one", "p/two")
			require.Len(t, skipped.Skips, 1, "its own health still holds")
		})
	}
}

type brokenStore struct {
	bgtask.Journal
	fail func()
}

func (b brokenStore) CoolDown(context.Context, bgtask.Cooldown) error {
	if b.fail != nil {
		b.fail()
	}
	return errors.New("the store is away")
}

func (b brokenStore) Cooldowns(context.Context) ([]bgtask.Cooldown, error) {
	if b.fail != nil {
		b.fail()
	}
	return nil, errors.New("the store is away")
}

// hangingStore is a HealthStore whose calls block, ignoring their
// context, until release is closed.
type hangingStore struct {
	bgtask.Journal
	release chan struct{}
}

func (h hangingStore) CoolDown(context.Context, bgtask.Cooldown) error {
	<-h.release
	return nil
}

func (h hangingStore) Cooldowns(context.Context) ([]bgtask.Cooldown, error) {
	<-h.release
	return nil, nil
}

// A store that hangs, ignoring its context, holds a Launch a bounded
// while (healthLaunchWait), not for ever: the task launches and runs on
// the Manager's own health.
func TestHealthStoreThatHangsHoldsNoLaunch(t *testing.T) {
	j, err := bgtask.OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	release := make(chan struct{})
	host := bgtask.NewFuncHost(func(context.Context, bgtask.Run) (string, error) { return "ok", nil })
	m := bgtask.New(host, bgtask.WithJournal(hangingStore{j, release}), bgtask.WithHealth(bgtask.HealthPolicy{}))
	launched := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		task, err := m.Launch(ctx, bgtask.Spec{ParentSessionID: "p", Models: []bgtask.Model{{Provider: "p", ID: "one"}}})
		if err == nil {
			_, err = m.Wait(context.Background(), task.ID)
		}
		launched <- err
	}()
	select {
	case err := <-launched:
		require.NoError(t, err)
	case <-time.After(10 * time.Second): // failure detection only
		t.Fatal("a hanging health store holds the Launch")
	}
	close(release)
	require.NoError(t, m.Shutdown(context.Background()))
}
