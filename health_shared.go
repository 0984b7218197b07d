package bgtask

import (
	"context"
	"log/slog"
	"slices"
	"time"
)

// Health shared by a fleet: a journal that is a HealthStore keeps the
// cooldowns every Manager on its storage reads (WithHealth).

// HealthStore is a Journal that keeps cooldowns shared by every Manager
// on its storage (a fleet of processes on one ledger). With WithHealth,
// a cooldown one Manager begins is told to CoolDown, and a Launch reads
// Cooldowns (at most once per HealthPolicy.Shared) so that a model a
// 429 cooled in one process is skipped by the others too. A success
// costs the store nothing. The Manager calls both without its lock, on
// goroutines it owns (CoolDown) or the Launch's (Cooldowns); an error is
// logged and otherwise ignored: health is then this Manager's own.
//
// pgledger's Journal implements it.
type HealthStore interface {
	// CoolDown sets the cooldown of c.Key to c when c ends later than
	// the one kept (a shorter one never cuts a longer one short), when
	// the one kept was reset, or when c.Why is "reset": the
	// cooldown ended early (ResetHealth, or a success with
	// HealthPolicy.EarlySuccess), whatever it was.
	CoolDown(ctx context.Context, c Cooldown) error
	// Cooldowns returns the cooldowns whose Until is not yet past, by the
	// store's clock, less those ended early (Why "reset").
	Cooldowns(ctx context.Context) ([]Cooldown, error)
}

// healthResetWhy is the Cooldown.Why of a cooldown ended early: a
// HealthStore keeps it in place of the cooldown, and Cooldowns leaves it
// out. A Manager that began the cooldown, or took it from the store,
// ends it at its next read of the store.
const healthResetWhy = "reset"

// Cooldown is a model's or provider's cooldown as a HealthStore keeps it.
type Cooldown struct {
	// Key is Health.Key: "provider/id" for a model ("/id" for one with
	// no provider), "provider" for a provider. Never empty.
	Key string `json:"key"`
	// Since is when it began, Until when it ends; Why is the class of the
	// failure (Health.Why).
	Since time.Time `json:"since"`
	Until time.Time `json:"until"`
	Why   string    `json:"why"`
}

// healthShare tells the HealthStore (if any) of x's cooldown. m.mu is held.
func (m *Manager) healthShare(x *healthOf) {
	if m.calls.health.store != nil {
		m.healthPut(Cooldown{Key: x.pub.Key(), Since: x.pub.Since, Until: x.pub.Until, Why: x.pub.Why})
	}
}

// healthShareEnd tells the HealthStore (if any) that x's cooldown ended
// early, here (a reset, an early success). m.mu is held.
func (m *Manager) healthShareEnd(x *healthOf) {
	if m.calls.health.store != nil {
		m.healthPut(Cooldown{Key: x.pub.Key(), Since: x.pub.Since, Until: m.now(), Why: healthResetWhy})
	}
}

// healthWriteTimeout is the context deadline of a write to the HealthStore.
const healthWriteTimeout = 10 * time.Second

// healthPut has c written to the HealthStore by the Manager's one writer
// goroutine, in order, once m.mu is released: a write of a key still
// waiting is replaced by c (only the latest matters), so a store that is
// slow, or hangs, holds one goroutine and a write per key, never more.
// m.mu is held.
func (m *Manager) healthPut(c Cooldown) {
	h := m.calls.health
	if i := slices.IndexFunc(h.writes, func(w Cooldown) bool { return w.Key == c.Key }); i >= 0 {
		h.writes[i] = c
	} else {
		h.writes = append(h.writes, c)
	}
	if h.writing {
		return
	}
	h.writing = true
	if !m.goLater(m.healthWriter) {
		h.writing, h.writes = false, nil // shut down: nothing more is shared
	}
}

// healthWriter writes the cooldowns healthPut queued until none is left.
// It runs without m.mu, on a goroutine of the Manager.
func (m *Manager) healthWriter() {
	h := m.calls.health
	m.mu.Lock()
	for len(h.writes) > 0 {
		c := h.writes[0]
		h.writes = h.writes[1:]
		m.mu.Unlock()
		ctx, cancel := context.WithTimeout(m.life.ctx, healthWriteTimeout)
		err := guardJournal("CoolDown", func() error { return h.store.CoolDown(ctx, c) })
		cancel()
		m.mu.Lock()
		if err != nil {
			m.logLocked(slog.LevelWarn, "the fleet's health store refused a cooldown", slog.String("key", c.Key), slog.String("error", err.Error()))
			continue
		}
		if x := h.of[healthKeyOf(c.Key)]; x != nil && !x.shared && x.pub.State != HealthHealthy && x.pub.Since.Equal(c.Since) && c.Why != healthResetWhy {
			x.stored = h.reads + 1 // the reads begun from now on see it
		}
	}
	h.writing = false
	_ = m.unlock()
}

// healthReadTimeout is the context deadline of a read of the HealthStore
// (a store that honours it answers within it).
const healthReadTimeout = 2 * time.Second

// healthLaunchWait bounds how long a Launch waits for a read of the
// HealthStore before it goes on with what this Manager knows.
const healthLaunchWait = time.Second

// healthSync reads the fleet's cooldowns from the HealthStore when the
// last read is older than the policy's Shared (and none is in flight),
// and takes those that end later than what this Manager knows. It runs
// without m.mu (a Launch's goroutine), and waits for the read (on a
// goroutine of the Manager) at most healthLaunchWait, or until ctx ends:
// a store that is slow, or hangs ignoring its context, holds no Launch
// longer (the read goes on, for the launches after it; one that hangs is
// logged, once, and no other read begins while it does).
func (m *Manager) healthSync(ctx context.Context) {
	h := m.calls.health
	if h == nil || h.store == nil {
		return
	}
	m.mu.Lock()
	now := m.now()
	if h.syncing || now.Sub(h.syncedAt) < h.pol.Shared {
		if h.syncing && !h.slowSaid && now.Sub(h.syncFrom) > 2*healthReadTimeout {
			h.slowSaid = true
			m.logLocked(slog.LevelWarn, "the fleet's health store does not answer a read; health is this Manager's own until it does",
				slog.Duration("waited", now.Sub(h.syncFrom)))
		}
		_ = m.unlock() // the line, if any, is written now
		return
	}
	done := make(chan struct{})
	if !m.healthReadLater(done) {
		_ = m.unlock()
		return
	}
	if m.unlock() != nil {
		return
	}
	t := time.NewTimer(healthLaunchWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	case <-ctx.Done():
	}
}

// healthReadLater begins a read of the HealthStore on a goroutine of the
// Manager (healthRead), which closes done (if not nil) when it is over.
// It reports whether the read began. m.mu is held.
func (m *Manager) healthReadLater(done chan struct{}) bool {
	h := m.calls.health
	h.reads++
	h.syncing, h.syncFrom = true, m.now()
	n := h.reads
	if !m.goLater(func() {
		if done != nil {
			defer close(done)
		}
		m.healthRead(m.life.ctx, n)
	}) {
		h.syncing = false
		return false
	}
	return true
}

// healthRead is read number n of the HealthStore, begun by
// healthReadLater. It runs without m.mu, on a goroutine of the Manager.
func (m *Manager) healthRead(ctx context.Context, n uint64) {
	h := m.calls.health
	var cs []Cooldown
	ctx, cancel := context.WithTimeout(ctx, healthReadTimeout)
	err := guardJournal("Cooldowns", func() (err error) { cs, err = h.store.Cooldowns(ctx); return err })
	cancel()
	m.mu.Lock()
	h.syncing, h.slowSaid = false, false
	now := m.now()
	h.syncedAt = now // after an error too: not again at once, the store is away
	if err != nil {
		m.logLocked(slog.LevelWarn, "the fleet's health store could not be read", slog.String("error", err.Error()))
		_ = m.unlock()
		return
	}
	seen := make(map[string]bool, len(cs))
	for _, c := range cs {
		if c.Why == healthResetWhy {
			continue // ended early; a store should not return it
		}
		seen[c.Key] = true
		m.healthTakeShared(c, now)
	}
	// A cooldown not yet over that the store should hold and does not
	// was ended elsewhere (ResetHealth, an early success): it ends here
	// too. One that is over is left to its probe.
	for _, x := range h.of {
		if x.pub.State == HealthHealthy || seen[x.pub.Key()] || !now.Before(x.pub.Until) {
			continue
		}
		if x.shared || (x.stored != 0 && n >= x.stored) {
			m.healthy(x)
		}
	}
	_ = m.unlock()
}

// healthTakeShared has a cooldown of the fleet cool its model or provider
// here, unless this Manager began one itself that ends no sooner (one of
// the fleet's it took before is replaced). m.mu is held.
func (m *Manager) healthTakeShared(c Cooldown, now time.Time) {
	h := m.calls.health
	if !now.Before(c.Until) || c.Key == "" || c.Key == "/" {
		return
	}
	x := h.healthAt(c.Key)
	switch {
	case x.pub.State != HealthHealthy && !x.shared && !x.pub.Until.Before(c.Until):
		return
	case x.shared && x.pub.State != HealthHealthy && x.pub.Until.Equal(c.Until) && x.pub.Why == c.Why:
		return // known
	}
	h.gen++
	x.window, x.gen, x.shared, x.stored = c.Until.Sub(c.Since), h.gen, true, 0
	x.pub.State, x.pub.Since, x.pub.Until, x.pub.Why = HealthCooling, c.Since, c.Until, c.Why
	x.pub.Cooldowns++
	m.healthChanged(x)
}
