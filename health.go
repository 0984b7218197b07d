package bgtask

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/bgtask/bgtask/internal/errclass"
)

// HealthPolicy is how a Manager keeps model and provider health
// (WithHealth). A failure the classifier calls a rate limit, an overload
// or a model that does not exist (404, "model not found", "not
// supported") cools the model; a forbidden or unauthorized provider (403,
// 401), or OutageAfter server errors in a row, cool the provider (each of
// its models). A cooldown lasts what the provider's Retry-After asked
// for, else Cooldown (Unavailable for a model not found or a provider
// refused), doubling with each failure in a row, at most MaxCooldown. A
// success ends the failures in a row. Once a cooldown is over, one
// attempt (the probe) is let through before others; its failure starts a
// cooldown at least twice as long as the last.
//
// While a model (or its provider) cools, a task's attempt skips it for
// the chain's next model, and the skip is recorded (Task.Skips, the
// Timeline). When every model left in the chain cools, the attempt waits
// (PendingCooldown) for the earliest cooldown to end; a wait that would
// last longer than MaxWait ends the task in error, naming the cooldowns.
//
// The zero value of each field is its default.
type HealthPolicy struct {
	// Off keeps no health: no cooldown, no skip (a harness's switch).
	Off bool
	// Cooldown is the first cooldown of a rate limit or an overload that
	// gave no Retry-After. Default 30s.
	Cooldown time.Duration
	// Unavailable is the first cooldown of a model not found or a
	// provider refused (403, 401) with no Retry-After. Default 5m.
	Unavailable time.Duration
	// MaxCooldown bounds a cooldown the policy works out (a Retry-After
	// is honoured as given, up to it too). Default 10m.
	MaxCooldown time.Duration
	// MaxWait bounds how long an attempt waits for a cooldown to end when
	// every model left in its chain cools. Default 2m; < 0: no wait (the
	// task ends in error at once).
	MaxWait time.Duration
	// OutageAfter is how many server errors (500, 502) in a row from a
	// provider's models cool the provider. Default 3.
	OutageAfter int
	// ProbeTimeout is how long a probe may go unanswered before another
	// attempt may probe instead. Default 5m.
	ProbeTimeout time.Duration
	// EarlySuccess lets a success of an attempt admitted before a
	// cooldown began end that cooldown. Default false: only a request
	// sent after the failure (the probe) says the model recovered.
	EarlySuccess bool
	// Shared is how old a Manager's view of the fleet's cooldowns may be
	// when its journal is a HealthStore: a Launch reads the store again
	// (one query) only when its last read is older, and a cooldown begun
	// here is written to it (one statement, off the Manager's lock).
	// Default 1s.
	Shared time.Duration
}

// Health defaults (HealthPolicy's zero fields).
const (
	defaultHealthCooldown     = 30 * time.Second
	defaultHealthUnavailable  = 5 * time.Minute
	defaultHealthMaxCooldown  = 10 * time.Minute
	defaultHealthMaxWait      = 2 * time.Minute
	defaultHealthOutageAfter  = 3
	defaultHealthProbeTimeout = 5 * time.Minute
	defaultHealthShared       = time.Second
)

// WithHealth keeps model and provider health, shared by every task of the
// Manager, by policy p (its zero fields: the defaults). Without it (or
// with p.Off) no health is kept, and every attempt runs on the model its
// place in the chain names.
func WithHealth(p HealthPolicy) Option {
	return optionFunc(func(c *config) {
		if p.Off {
			c.health = nil
			return
		}
		def := func(d *time.Duration, v time.Duration) {
			if *d <= 0 {
				*d = v
			}
		}
		def(&p.Cooldown, defaultHealthCooldown)
		def(&p.Unavailable, defaultHealthUnavailable)
		def(&p.MaxCooldown, defaultHealthMaxCooldown)
		def(&p.ProbeTimeout, defaultHealthProbeTimeout)
		def(&p.Shared, defaultHealthShared)
		switch {
		case p.MaxWait == 0:
			p.MaxWait = defaultHealthMaxWait
		case p.MaxWait < 0:
			p.MaxWait = 0
		}
		if p.OutageAfter <= 0 {
			p.OutageAfter = defaultHealthOutageAfter
		}
		c.health = &p
	})
}

// HealthState is a model's or a provider's state.
type HealthState string

const (
	// HealthHealthy: attempts run on it.
	HealthHealthy HealthState = "healthy"
	// HealthCooling: attempts skip it until the cooldown ends.
	HealthCooling HealthState = "cooling"
	// HealthProbing: its cooldown is over; one attempt (the probe) is let
	// through, or is in flight, before others.
	HealthProbing HealthState = "probing"
)

// Health is one model's or provider's health (Manager.Health).
type Health struct {
	// Model is the model; for a provider's health only its Provider is
	// set (Provider is then true). A model's variant is not told apart.
	Model    Model `json:"model"`
	Provider bool  `json:"provider,omitempty"`
	// State is healthy, cooling, or probing (its cooldown is over).
	State HealthState `json:"state"`
	// Since is when the cooldown began, Until when it ends (zero while
	// healthy). Why is the class of the failure that began it
	// (rate_limited, overloaded, model_not_found, forbidden,
	// unauthorized, server_error).
	Since time.Time `json:"since,omitzero"`
	Until time.Time `json:"until,omitzero"`
	Why   string    `json:"why,omitempty"`
	// InARow counts the failures since the last success; Failures,
	// Successes, Cooldowns and Skips count since the Manager began.
	InARow    int    `json:"inARow"`
	Failures  uint64 `json:"failures"`
	Successes uint64 `json:"successes"`
	Cooldowns uint64 `json:"cooldowns"`
	Skips     uint64 `json:"skips"`
}

// Key is what ResetHealth takes for it: "provider/id" for a model
// ("/id" for a model with no provider), "provider" for a provider.
func (h Health) Key() string {
	if h.Provider {
		return h.Model.Provider
	}
	return h.Model.Provider + "/" + h.Model.ID
}

// Skip is a model a task's chain skipped because it was cooling (Task.Skips).
type Skip struct {
	// Attempt is the number of the attempt that moved past it.
	Attempt int `json:"attempt"`
	// Model is the model skipped.
	Model Model `json:"model"`
	// Why says what cooled: the class of the failure, and "provider" when
	// the provider cools ("rate_limited", "provider forbidden", "probe in
	// flight").
	Why string `json:"why"`
	// Until is when its cooldown was to end; At when it was skipped.
	Until time.Time `json:"until,omitzero"`
	At    time.Time `json:"at,omitzero"`
}

// coolRec is a cooldown as the ledger records it (recCooldownBegan):
// with the failures in a row that made it, for the backoff after a
// restart.
type coolRec struct {
	Cooldown
	inARow int
}

// healthRecord records x's cooldown in the ledger (a journal keeps it, so
// a restart takes it back). m.mu is held.
func (m *Manager) healthRecord(x *healthOf, now time.Time) {
	if m.led.recording() {
		m.led.recordCool(record{kind: recCooldownBegan, at: now, recordExt: &recordExt{cool: &coolRec{
			Cooldown: Cooldown{Key: x.pub.Key(), Since: x.pub.Since, Until: x.pub.Until, Why: x.pub.Why}, inARow: x.pub.InARow}}})
	}
}

// healthRestore takes back the cooldowns a previous life recorded that
// are not over (after a replay); those over are forgotten. m.mu is held.
func (m *Manager) healthRestore(now time.Time) {
	h := m.calls.health
	for key, c := range m.led.cools {
		if !now.Before(c.Until) {
			delete(m.led.cools, key)
			continue
		}
		if h == nil {
			continue
		}
		x := h.healthAt(key)
		h.gen++
		x.window, x.gen, x.shared = c.Until.Sub(c.Since), h.gen, false
		x.pub.State, x.pub.Since, x.pub.Until, x.pub.Why, x.pub.InARow = HealthCooling, c.Since, c.Until, c.Why, c.inARow
		m.healthChanged(x)
	}
}

// healthClass is what a failure means for health.
type healthClass uint8

const (
	hcNone         healthClass = iota
	hcRateLimited              // the model cools
	hcOverloaded               // the model cools
	hcNotFound                 // the model cools, long
	hcForbidden                // the provider cools, long
	hcUnauthorized             // the provider cools, long
	hcServerError              // the provider cools after OutageAfter in a row
)

var healthClassNames = [...]string{"", "rate_limited", "overloaded", "model_not_found", "forbidden", "unauthorized", "server_error"}

func (c healthClass) String() string { return healthClassNames[c] }

// provider reports whether c cools the provider rather than the model.
func (c healthClass) provider() bool { return c >= hcForbidden }

// healthClassOf classifies err for health. It runs the error's methods:
// never under m.mu (classify calls it, guarded).
func healthClassOf(err error) healthClass {
	switch errclass.Classify(err) {
	case errclass.RateLimited:
		return hcRateLimited
	case errclass.Overloaded:
		return hcOverloaded
	case errclass.ModelNotFound:
		return hcNotFound
	case errclass.Forbidden:
		return hcForbidden
	case errclass.Unauthorized:
		return hcUnauthorized
	case errclass.ServerError:
		return hcServerError
	case errclass.Unknown, errclass.Validation:
		if msg := strings.ToLower(safeText(err)); strings.Contains(msg, "model") && strings.Contains(msg, "not supported") {
			return hcNotFound
		}
	}
	return hcNone
}

// healthOf is one model's or provider's health as the Manager keeps it.
type healthOf struct {
	pub     Health
	window  time.Duration // the current cooldown's length
	probe   string        // the run token of the probe in flight ("": none)
	probeAt time.Time
	servers int    // server errors in a row
	gen     uint64 // the book's count of cooldowns begun, as this one began
	shared  bool   // the cooldown is the fleet's (HealthStore), not one begun here
	// stored is, for a cooldown begun here, the number of the first read
	// of the store begun after it was written there (0: not written yet):
	// that read and later ones that miss it were told it ended elsewhere.
	stored uint64
}

// healthBook is the Manager's health: guarded by m.mu.
type healthBook struct {
	pol *HealthPolicy
	of  map[string]*healthOf // "m:provider/id" or "p:provider"
	gen uint64               // cooldowns begun
	// waiting are the attempts waiting for a cooldown (coolWait), in the
	// order they began to; roused says one may have ended early (a reset,
	// a success) or a probe ended: they look again before m.mu is
	// released (healthWake), in the same critical section.
	waiting []coolWaiter
	roused  bool

	store    HealthStore // the journal, when it shares cooldowns (nil: none)
	syncedAt time.Time   // when the store was last read
	syncing  bool        // a read of the store is in flight
	syncFrom time.Time   // when the read in flight began
	slowSaid bool        // a read that hangs was logged
	reads    uint64      // reads of the store begun
	// writes are the cooldowns to write to the store, the latest per key,
	// in the order their keys were first put; writing says the one writer
	// goroutine runs.
	writes  []Cooldown
	writing bool
}

// coolWaiter is an attempt waiting for a cooldown: its run, and the
// timer of its wait, whose goroutine stop ends.
type coolWaiter struct {
	e     *entry
	token string
	t     Timer
	stop  chan struct{}
}

func newHealthBook(p *HealthPolicy) *healthBook {
	return &healthBook{pol: p, of: make(map[string]*healthOf)}
}

func modelKey(md Model) string { return "m:" + md.Provider + "/" + md.ID }

func providerKey(p string) string { return "p:" + p }

// healthKeyOf is the book's key of a Health.Key (a Cooldown's).
func healthKeyOf(key string) string {
	if strings.Contains(key, "/") {
		return "m:" + key
	}
	return providerKey(key)
}

// healthAt is the health a Health.Key names, made healthy on first use.
// m.mu is held.
func (h *healthBook) healthAt(key string) *healthOf {
	provider, id, model := strings.Cut(key, "/")
	return h.get(healthKeyOf(key), Model{Provider: provider, ID: id}, !model)
}

// get is key's health, made healthy on first use.
func (h *healthBook) get(key string, md Model, provider bool) *healthOf {
	x := h.of[key]
	if x == nil {
		x = &healthOf{pub: Health{Model: md, Provider: provider, State: HealthHealthy}}
		if provider {
			x.pub.Model = Model{Provider: md.Provider}
		} else {
			x.pub.Model.Variant = ""
		}
		h.of[key] = x
	}
	return x
}

// block is what keeps attempts off a model or provider: why, until when,
// and whether that is a probe's verdict (which may come at any moment)
// rather than a cooldown's end.
type block struct {
	on      bool
	why     string
	until   time.Time
	probing bool
}

// blocks says whether x keeps an attempt off now, and why.
func (h *healthBook) blocks(x *healthOf, now time.Time) block {
	switch {
	case x == nil || x.pub.State == HealthHealthy:
		return block{}
	case now.Before(x.pub.Until):
		return block{on: true, why: x.pub.Why, until: x.pub.Until}
	case x.probe != "" && now.Before(x.probeAt.Add(h.pol.ProbeTimeout)):
		return block{on: true, why: x.pub.Why + ", probe in flight", until: x.probeAt.Add(h.pol.ProbeTimeout), probing: true}
	}
	return block{}
}

// admits says whether an attempt may run on md now (!b.on); if not, why
// and until when (the later of the model's and the provider's). A model
// with no id (a task with no chain) keeps no health.
func (h *healthBook) admits(md Model, now time.Time) block {
	if md.ID == "" {
		return block{}
	}
	mb := h.blocks(h.of[modelKey(md)], now)
	pb := h.blocks(h.of[providerKey(md.Provider)], now)
	if pb.on && (!mb.on || pb.until.After(mb.until)) {
		pb.why = "provider " + pb.why
		return pb
	}
	return mb
}

// changed tells Metrics of x's new state. m.mu is held.
func (m *Manager) healthChanged(x *healthOf) {
	if m.cfg.metrics != nil {
		pub := x.pub
		m.measure(func(mt Metrics) { mt.HealthChanged(pub) })
	}
}

// healthTake lets run token of e through on md as its session starts: a
// model or provider whose cooldown is over is probed by it (told to
// Metrics: probing). m.mu is held.
func (m *Manager) healthTake(e *entry, md Model, token string, now time.Time) {
	h := m.calls.health
	// The wait for a cooldown (MaxWait) ends as the session starts: not
	// when the attempt queues for a slot, as it may wait again as it
	// gets one.
	e.rt.admitted, e.rt.coolSince = h.gen, 0
	if len(h.of) == 0 {
		return
	}
	for _, x := range [2]*healthOf{h.of[modelKey(md)], h.of[providerKey(md.Provider)]} {
		if x == nil || x.pub.State == HealthHealthy {
			continue
		}
		if h.blocks(x, now).on {
			continue
		}
		// Each probe let through is told, also one after a probe that
		// ended saying nothing (cancelled, a failure of no health class):
		// attempts wait for it from now.
		x.probe, x.probeAt = token, now
		x.pub.State = HealthProbing
		m.healthChanged(x)
	}
}

// healthFailed records failure f of run a of e (started or not) in the
// health of its model or provider. m.mu is held.
func (m *Manager) healthFailed(e *entry, a Attempt, f failure, now time.Time) {
	h := m.calls.health
	if h == nil || f.health == hcNone || a.Model.ID == "" {
		return // a run with no model keeps no health
	}
	var x *healthOf
	if f.health.provider() && a.Model.Provider != "" {
		x = h.get(providerKey(a.Model.Provider), a.Model, true)
	} else { // a model with no provider cools alone
		x = h.get(modelKey(a.Model), a.Model, false)
	}
	x.pub.Failures++
	if f.health == hcServerError {
		if x.servers++; x.servers < h.pol.OutageAfter {
			if x.probe == a.Token { // a probe that did not fail as the cooldown's cause: let another go
				x.probe = ""
				h.rouse()
			}
			return
		}
	}
	if x.pub.State != HealthHealthy && e.rt.admitted < x.gen {
		// Sent before this cooldown began (also when its verdict comes
		// once the cooldown is over): it finishes as it will, begins no
		// cooldown of its own, leaves the probe alone; only a longer
		// Retry-After moves the end.
		if f.after > 0 && now.Add(min(f.after, h.pol.MaxCooldown)).After(x.pub.Until) {
			x.pub.Until = now.Add(min(f.after, h.pol.MaxCooldown))
			m.healthChanged(x)
			m.healthShare(x)
			m.healthRecord(x, now)
		}
		return
	}
	x.pub.InARow++
	base := h.pol.Cooldown
	if f.health == hcNotFound || f.health == hcForbidden || f.health == hcUnauthorized {
		base = h.pol.Unavailable
	}
	d := base
	for i := 1; i < x.pub.InARow && d < h.pol.MaxCooldown; i++ {
		d *= 2
	}
	if f.after > 0 {
		d = f.after
	}
	if x.probe == a.Token && x.probe != "" { // the probe failed: longer than the last
		d = max(d, 2*x.window)
	}
	d = min(d, h.pol.MaxCooldown)
	if x.probe != "" {
		h.rouse() // those waiting for the probe's verdict: a new cooldown
	}
	h.gen++
	x.window, x.probe, x.gen, x.shared, x.stored = d, "", h.gen, false, 0
	x.pub.State, x.pub.Since, x.pub.Until, x.pub.Why = HealthCooling, now, now.Add(d), f.health.String()
	x.pub.Cooldowns++
	m.healthChanged(x)
	m.healthShare(x)
	m.healthRecord(x, now)
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "cooldown began", slog.String("key", x.pub.Key()), slog.String("why", x.pub.Why),
			slog.String("until", x.pub.Until.Format(time.RFC3339)), slog.String("task", e.id))
	}
}

// healthEnded records that run a of e ended (status): a completion is a
// success; any end releases a probe the run held. m.mu is held.
func (m *Manager) healthEnded(e *entry, a Attempt) {
	h := m.calls.health
	for _, x := range [2]*healthOf{h.of[modelKey(a.Model)], h.of[providerKey(a.Model.Provider)]} {
		if x == nil {
			continue
		}
		probe := x.probe == a.Token
		if probe {
			x.probe = ""
			if a.Status != StatusCompleted {
				h.rouse() // it ended with no verdict: let the waiting look again
			}
		}
		if a.Status != StatusCompleted {
			continue
		}
		x.pub.Successes++
		x.servers = 0
		if x.pub.State != HealthHealthy && !probe && !h.pol.EarlySuccess && e.rt.admitted < x.gen {
			continue // a request sent before the cooldown: it says nothing of now
		}
		x.pub.InARow = 0
		if x.pub.State != HealthHealthy {
			if m.now().Before(x.pub.Until) {
				m.healthShareEnd(x) // ended early (EarlySuccess): the fleet's copy ends too
			}
			m.healthy(x)
		}
	}
}

// healthy ends x's cooldown and the failures in a row. m.mu is held.
func (m *Manager) healthy(x *healthOf) {
	x.pub.State, x.pub.Since, x.pub.Until, x.pub.Why, x.pub.InARow = HealthHealthy, time.Time{}, time.Time{}, "", 0
	x.probe, x.window, x.shared, x.stored, x.servers = "", 0, false, 0, 0
	m.healthChanged(x)
	m.calls.health.rouse()
}

// rouse has the attempts waiting for a cooldown look again before m.mu
// is released (healthWake): one ended early, or a probe ended. m.mu is
// held.
func (h *healthBook) rouse() {
	if len(h.waiting) > 0 {
		h.roused = true
	}
}

// healthWake has every attempt waiting for a cooldown look again, after
// a rouse: its wait's goroutine is ended (its timer stopped first) and
// the attempt is admitted again, here, under m.mu. It runs as m.mu is
// about to be released, not amid the change that roused it. m.mu is held.
func (m *Manager) healthWake() {
	h := m.calls.health
	for round := 0; h.roused && round < 8; round++ { // a wake rouses none in practice; bounded anyway
		h.roused = false
		ws := h.waiting
		h.waiting = nil
		for _, w := range ws {
			w.t.Stop()
			close(w.stop)
			m.cooled(w.e, w.token)
		}
	}
	h.roused = false
}

// skipsFor makes the skip records that move pending attempt a of e past
// the cooling models at its place in the chain, to the first that is
// not; none when that model does not cool, or when every model left
// cools (the attempt then waits: healthAdmit). m.mu is held.
func (m *Manager) skipsFor(e *entry, a Attempt, now time.Time) []record {
	h := m.calls.health
	if h == nil || len(h.of) == 0 {
		return nil
	}
	models := e.info.models
	pos := e.chainPos(a.Number)
	if !h.admits(models[pos], now).on {
		return nil
	}
	j := pos + 1
	for ; j < len(models); j++ {
		if !h.admits(models[j], now).on {
			break
		}
	}
	if j >= len(models) {
		return nil
	}
	recs := make([]record, 0, j-pos)
	for i := pos; i < j; i++ {
		b := h.admits(models[i], now)
		m.skipCounted(models[i], b.why)
		next := a
		next.Model = models[i+1]
		recs = append(recs, record{kind: recModelSkipped, task: e.id, at: now, attempt: next,
			recordExt: &recordExt{skip: &Skip{Attempt: a.Number, Model: models[i], Why: b.why, Until: b.until}}})
		a = next
	}
	return recs
}

// skipCounted counts a skip of md in what blocked it. m.mu is held.
func (m *Manager) skipCounted(md Model, why string) {
	h := m.calls.health
	key := modelKey(md)
	if strings.HasPrefix(why, "provider ") {
		key = providerKey(md.Provider)
	}
	if x := h.of[key]; x != nil {
		x.pub.Skips++
	}
}

// healthAdmit chooses the model pending attempt a of e runs on: past the
// cooling ones (skip records), or, when every model left cools, none yet
// (the attempt waits for the earliest cooldown to end, or ends in error
// past MaxWait). It returns the attempt to admit and whether to admit it.
// m.mu is held.
func (m *Manager) healthAdmit(e *entry, a Attempt) (Attempt, bool) {
	h, now := m.calls.health, m.now()
	if h.store != nil && !h.syncing && now.Sub(h.syncedAt) >= h.pol.Shared {
		// A retry's admit reads the fleet's cooldowns for later ones, off
		// the lock (a Launch reads them before it decides).
		m.healthReadLater(nil)
	}
	if len(h.of) == 0 {
		return a, true
	}
	if recs := m.skipsFor(e, a, now); len(recs) > 0 {
		if !m.commit(e, recs...) {
			m.finalize(e, a.ID, StatusError, "the ledger refused a model skip", "", now)
			return a, false
		}
		a = *e.cur()
	}
	if h.admits(a.Model, now).on {
		m.coolWait(e, a, now)
		return a, false
	}
	if a.Pending == PendingCooldown && !m.setPending(e, a.ID, PendingAwaitingSession, now) {
		return a, false
	}
	return *e.cur(), true
}

// coolWait has pending attempt a of e, every model left in whose chain
// cools, wait for the earliest cooldown to end (an fxCooldown), or end in
// error when that is past the policy's MaxWait. m.mu is held.
func (m *Manager) coolWait(e *entry, a Attempt, now time.Time) {
	h := m.calls.health
	if e.rt.coolSince == 0 {
		e.rt.coolSince = now.UnixNano()
	}
	limit := time.Unix(0, e.rt.coolSince).Add(h.pol.MaxWait)
	var end time.Time
	var cooling []string
	for _, md := range e.info.models[e.chainPos(a.Number):] {
		b := h.admits(md, now)
		wake := b.until
		if b.probing { // its verdict may come at any moment: wait for it, not past the limit
			if limit.Before(wake) {
				wake = limit
			}
		}
		if end.IsZero() || wake.Before(end) {
			end = wake
		}
		cooling = append(cooling, md.String()+" ("+b.why+", until "+b.until.UTC().Format(time.RFC3339)+")")
	}
	cooling = slices.Compact(cooling)
	if end.After(limit) || !now.Before(limit) {
		e.output().reason = ReasonProviderError
		text := fmt.Sprintf("every model left is cooling, past the %s a task waits: %s", h.pol.MaxWait, strings.Join(cooling, "; "))
		m.finalize(e, a.ID, StatusError, text, "", now)
		return
	}
	if a.Pending != PendingCooldown && !m.setPending(e, a.ID, PendingCooldown, now) {
		return
	}
	t, stop := m.cfg.clock.NewTimer(end.Sub(now)), make(chan struct{})
	if !m.effect(effect{kind: fxCooldown, e: e, run: runOfAttempt(a), timer: t, done: m.runDone(e), wake: stop}) {
		t.Stop()
		m.finalize(e, a.ID, StatusInterrupt, "", "", now)
		return
	}
	// Those whose wait ended otherwise (their run ended), and an earlier
	// wait of e's, leave the list.
	h.waiting = slices.DeleteFunc(h.waiting, func(w coolWaiter) bool {
		if w.e != e && coolWaits(w.e, w.token) {
			return false
		}
		w.t.Stop()
		close(w.stop)
		return true
	})
	h.waiting = append(h.waiting, coolWaiter{e: e, token: a.Token, t: t, stop: stop})
}

// waitCooldownNow waits for the cooldown run a of e waits on to end (its
// timer), then has the core look again (cooledIn); nothing if the run
// ended meanwhile, or the core ended the wait itself (healthWake: stop).
func (m *Manager) waitCooldownNow(fx *effect) {
	select {
	case <-fx.timer.C():
	case <-fx.wake:
		return // the timer was stopped by the core
	case <-fx.done:
		fx.timer.Stop()
		return
	case <-m.life.ctx.Done():
		fx.timer.Stop()
		return
	}
	m.step(&cooledIn{e: fx.e, a: fx.run.attempt(), stop: fx.wake})
}

// onCooled admits run a of e again once the timer of its wait for a
// cooldown fired, unless the core ended that wait first. m.mu is held.
func (m *Manager) onCooled(in *cooledIn) {
	h := m.calls.health
	i := slices.IndexFunc(h.waiting, func(w coolWaiter) bool { return w.stop == in.stop })
	if i < 0 {
		return // healthWake took it on
	}
	h.waiting = slices.Delete(h.waiting, i, i+1)
	m.cooled(in.e, in.a.Token)
}

// coolWaits reports whether run token of e still waits for a cooldown.
// m.mu is held.
func coolWaits(e *entry, token string) bool {
	if e.hot == nil || e.terminal() {
		return false
	}
	cur := e.cur()
	return cur.Token == token && cur.Status == StatusPending && cur.Pending == PendingCooldown
}

// cooled admits run token of e again after its wait for a cooldown, if
// it still waits. m.mu is held.
func (m *Manager) cooled(e *entry, token string) {
	if !coolWaits(e, token) {
		return
	}
	cur := *e.cur()
	if m.fenceStop(e) {
		m.finalize(e, cur.ID, e.stop, "", "", m.now())
		return
	}
	m.admit(e, cur)
}

// Health lists the health of every model and provider that failed since
// the Manager began (the others are healthy), models first, by name. It
// is nil without WithHealth.
func (m *Manager) Health() []Health {
	m.mu.Lock()
	defer m.mu.Unlock()
	h := m.calls.health
	if h == nil {
		return nil
	}
	now := m.now()
	out := make([]Health, 0, len(h.of))
	for _, x := range h.of {
		pub := x.pub
		if pub.State == HealthCooling && !now.Before(pub.Until) {
			pub.State = HealthProbing // over: the next attempt probes
		}
		out = append(out, pub)
	}
	slices.SortFunc(out, func(a, b Health) int {
		if a.Provider != b.Provider {
			if a.Provider {
				return 1
			}
			return -1
		}
		return strings.Compare(a.Model.String(), b.Model.String())
	})
	return out
}

// ErrNotCooling is ResetHealth's answer for a model or provider that is
// healthy (or was never seen to fail).
var ErrNotCooling = errors.New("not cooling")

// ResetHealth ends the cooldown of a model ("provider/id") or a provider
// ("provider") by hand: the failures in a row are forgotten and tasks
// waiting for it look again. The reset is recorded (a journal keeps it)
// before ResetHealth returns. It returns ErrNotCooling when target does
// not cool, errors.ErrUnsupported without WithHealth (or with
// HealthPolicy.Off), and ErrInvalidArgument for a
// blank target.
func (m *Manager) ResetHealth(ctx context.Context, target string) error {
	ctx = orBackground(ctx)
	if strings.TrimSpace(target) == "" {
		return fmt.Errorf("%w: ResetHealth of a blank model or provider", ErrInvalidArgument)
	}
	m.mu.Lock()
	h := m.calls.health
	if h == nil {
		m.mu.Unlock()
		return errNoHealth
	}
	x := h.of[healthKeyOf(target)]
	if x == nil || x.pub.State == HealthHealthy {
		m.mu.Unlock()
		return fmt.Errorf("%w: %s", ErrNotCooling, target)
	}
	if m.led.recording() {
		m.led.recordCool(record{kind: recHealthReset, at: m.now(), recordExt: &recordExt{note: x.pub.Key()}})
	}
	m.healthShareEnd(x)
	m.healthy(x)
	if m.cfg.logInfo {
		m.logLocked(slog.LevelInfo, "health reset", slog.String("key", target))
	}
	return m.unlockCtx(ctx)
}
