package bgtask_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/internal/testkit"
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
	// written, if set, is told each write as it lands.
	written chan bgtask.Cooldown
}

func (f *fleetHealth) CoolDown(_ context.Context, c bgtask.Cooldown) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.writes++
	if old, ok := f.of[c.Key]; !ok || c.Why == "reset" || old.Why == "reset" || c.Until.After(old.Until) {
		f.of[c.Key] = c
	}
	if f.written != nil {
		f.written <- c
	}
	return nil
}

func (f *fleetHealth) Cooldowns(context.Context) ([]bgtask.Cooldown, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reads++
	var out []bgtask.Cooldown
	for _, c := range f.of {
		if f.now().Before(c.Until) && c.Why != "reset" {
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
	m := testkit.MustOpen(host, bgtask.WithJournal(hangingStore{j, release}), bgtask.WithHealth(bgtask.HealthPolicy{}))
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

// wrote waits for the store to be told a write, and returns it.
func (f *fleetHealth) wrote(t *testing.T) bgtask.Cooldown {
	t.Helper()
	select {
	case c := <-f.written:
		return c
	case <-time.After(10 * time.Second): // failure detection only
		t.Fatal("no write reached the store")
		return bgtask.Cooldown{}
	}
}

// sharedPair is two Managers on one fleet store, on one hand-moved clock
// each (moved together by advance).
func sharedPair(t *testing.T) (a, b *healthRig, store *fleetHealth, advance func(time.Duration)) {
	t.Helper()
	store = &fleetHealth{of: map[string]bgtask.Cooldown{}, written: make(chan bgtask.Cooldown, 16)}
	rig := func() *healthRig {
		j, err := bgtask.OpenFileJournal(t.TempDir())
		require.NoError(t, err)
		return newHealthRig(t, &bgtask.HealthPolicy{Shared: time.Second}, bgtask.WithJournal(sharingJournal{j, store}))
	}
	a, b = rig(), rig()
	store.now = a.clock.Now
	return a, b, store, func(d time.Duration) { a.clock.Advance(d); b.clock.Advance(d) }
}

// Once a cooldown of the fleet is over, a Manager that took it from the
// store lets one probe through, as the one that began it does: not every
// attempt.
func TestHealthAFleetsCooldownOverIsProbedOnce(t *testing.T) {
	a, b, store, advance := sharedPair(t)
	a.set("p/one", throttled{after: 30 * time.Second})
	a.run(t, "p/one", "p/two")
	store.wrote(t)
	advance(2 * time.Second)
	require.Len(t, b.run(t, "p/one", "p/two").Skips, 1, "b took the fleet's cooldown")

	advance(30 * time.Second) // over; the store no longer returns it
	hold := make(chan struct{})
	b.mu.Lock()
	b.hold["p/one"] = hold
	b.mu.Unlock()
	for len(b.start) > 0 {
		<-b.start
	}
	probe := b.launch(t, "p/one", "p/two")
	require.Equal(t, "p/one", bgtask.RecvForTest(t, b.start, "the probe's start"))
	for range 2 {
		other := b.run(t, "p/one", "p/two")
		require.Len(t, other.Skips, 1)
		assert.Contains(t, other.Skips[0].Why, "probe in flight")
	}
	assert.Equal(t, 1, b.ran("p/one"), "one probe")
	close(hold)
	assert.Equal(t, bgtask.StatusCompleted, waitEnd(t, b.m, probe.ID).Status)
	h, _ := healthOf(b.m, "p/one")
	assert.Equal(t, bgtask.HealthHealthy, h.State)
}

// A reset by hand on any Manager of the fleet ends the cooldown on the
// one that began it too, at its next read.
func TestHealthAResetElsewhereEndsTheCooldownWhereItBegan(t *testing.T) {
	a, b, store, advance := sharedPair(t)
	a.set("p/one", throttled{after: time.Minute})
	a.run(t, "p/one", "p/two")
	store.wrote(t)
	a.set("p/one", nil)
	advance(2 * time.Second)
	require.Len(t, b.run(t, "p/one", "p/two").Skips, 1)
	require.Len(t, a.run(t, "p/one", "p/two").Skips, 1, "a read the store since its write: its own cooldown is there")

	require.NoError(t, b.m.ResetHealth(context.Background(), "p/one"))
	assert.Equal(t, "reset", store.wrote(t).Why)
	advance(2 * time.Second)
	ran := a.run(t, "p/one", "p/two")
	assert.Empty(t, ran.Skips, "b's reset ended a's own cooldown at a's next read")
	assert.Equal(t, "p/one", ran.Model.String())
	h, _ := healthOf(a.m, "p/one")
	assert.Equal(t, bgtask.HealthHealthy, h.State)
}

// slowStore is a HealthStore whose writes wait for release (ignoring
// their context), telling entered as each begins; it keeps every write.
type slowStore struct {
	bgtask.Journal
	release chan struct{}
	entered chan struct{}
	mu      sync.Mutex
	got     []bgtask.Cooldown
}

func (s *slowStore) CoolDown(_ context.Context, c bgtask.Cooldown) error {
	s.entered <- struct{}{}
	<-s.release
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, c)
	return nil
}

func (s *slowStore) Cooldowns(context.Context) ([]bgtask.Cooldown, error) { return nil, nil }

// Writes to a store that is slow (or hangs) do not pile up: one writer
// is in flight, and while it waits only the latest write of each key is
// kept, so the store ends as it should have, in order.
func TestHealthWritesToASlowStoreDoNotPileUp(t *testing.T) {
	j, err := bgtask.OpenFileJournal(t.TempDir())
	require.NoError(t, err)
	store := &slowStore{Journal: j, release: make(chan struct{}), entered: make(chan struct{}, 16)}
	r := newHealthRig(t, &bgtask.HealthPolicy{}, bgtask.WithJournal(store))
	r.set("p/one", throttled{after: time.Minute})
	ctx := context.Background()
	r.run(t, "p/one", "p/two")
	bgtask.RecvForTest(t, store.entered, "the first cooldown write") // the first write is in flight, and hangs
	for range 3 {
		require.NoError(t, r.m.ResetHealth(ctx, "p/one"))
		r.clock.Advance(time.Second)
		r.run(t, "p/one", "p/two") // a new cooldown
	}
	assert.Empty(t, store.entered, "no second write while the first hangs")
	close(store.release)
	require.NoError(t, r.m.Shutdown(ctx))
	store.mu.Lock()
	defer store.mu.Unlock()
	require.Len(t, store.got, 2, "the first, then the latest: %+v", store.got)
	assert.Equal(t, "rate_limited", store.got[0].Why)
	assert.Equal(t, "rate_limited", store.got[1].Why)
	assert.Equal(t, r.clock.Now(), store.got[1].Since, "the latest cooldown")
}
