package sim

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/bgtask/bgtask"
)

// Health in the simulation (WithHealth): providers throttle — StartSession
// answers 429, with a Retry-After for what is left of the window or
// without one — and recover when the window ends; the driver sometimes
// resets a cooldown by hand. After every step two invariants hold: no
// task skipped a model that was not cooling at that moment (as the
// Manager's own HealthChanged measurements tell it), and no attempt waits
// for a cooldown (PendingCooldown) longer than the policy's MaxWait.

// throttledErr is a provider's 429, with its Retry-After (0: none given).
type throttledErr struct{ after time.Duration }

func (e throttledErr) Error() string             { return "429 Too Many Requests" }
func (e throttledErr) RetryAfter() time.Duration { return e.after }

// throttled reports whether provider throttles now, and the error it
// answers. h.mu is held.
func (h *host) throttled(provider string) error {
	until, ok := h.throttle[provider]
	if !ok || h.now == nil {
		return nil
	}
	now := h.now()
	if !now.Before(until) {
		return nil
	}
	if h.decide("retry-after", provider, until.String())%3 == 0 {
		return throttledErr{} // some providers say nothing of when
	}
	return throttledErr{after: until.Sub(now)}
}

// span is a time a model or provider kept attempts off: a cooldown, or a
// probe in flight, as the Manager reported it.
type span struct {
	since, from, to time.Time
	open            bool
}

// healthLog keeps what HealthChanged told of one process life: each
// key's spans, from which a skip is checked.
type healthLog struct {
	bgtask.NopMetrics
	now   func() time.Time
	probe time.Duration

	mu sync.Mutex
	of map[string][]span // Health.Key() → its spans, in order
}

func newHealthLog(now func() time.Time, probe time.Duration) *healthLog {
	return &healthLog{now: now, probe: probe, of: map[string][]span{}}
}

func (l *healthLog) HealthChanged(h bgtask.Health) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	k := h.Key()
	spans := l.of[k]
	var last *span
	if n := len(spans); n > 0 && spans[n-1].open {
		last = &spans[n-1]
	}
	switch h.State {
	case bgtask.HealthCooling:
		if last != nil && last.since.Equal(h.Since) {
			if h.Until.After(last.to) {
				last.to = h.Until
			}
			break
		}
		if last != nil {
			last.to, last.open = minTime(last.to, now), false
		}
		spans = append(spans, span{since: h.Since, from: h.Since, to: h.Until, open: true})
	case bgtask.HealthProbing: // a probe was let through: others wait for it, at most ProbeTimeout
		if last != nil {
			if end := now.Add(l.probe); end.After(last.to) {
				last.to = end
			}
			break
		}
		spans = append(spans, span{since: h.Since, from: now, to: now.Add(l.probe), open: true})
	case bgtask.HealthHealthy:
		if last != nil {
			last.to, last.open = minTime(last.to, now), false
		}
	}
	l.of[k] = spans
}

// covers reports whether key kept attempts off at at.
func (l *healthLog) covers(key string, at time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range l.of[key] {
		if !at.Before(s.from) && !at.After(s.to) {
			return true
		}
	}
	return false
}

// spans says when key kept attempts off, for a failure's message.
func (l *healthLog) spans(key string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for _, s := range l.of[key] {
		fmt.Fprintf(&b, "[%s, %s] ", s.from.Format(time.TimeOnly), s.to.Format(time.TimeOnly))
	}
	return b.String()
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// healthPolicy draws the run's policy from the health stream.
func (w *world) healthPolicy() bgtask.HealthPolicy {
	return bgtask.HealthPolicy{
		Cooldown:     time.Duration(10+w.hrng.IntN(30)) * time.Second,
		Unavailable:  time.Duration(60+w.hrng.IntN(120)) * time.Second,
		MaxCooldown:  5 * time.Minute,
		MaxWait:      time.Duration(30+w.hrng.IntN(90)) * time.Second,
		OutageAfter:  1 + w.hrng.IntN(3),
		ProbeTimeout: time.Duration(60+w.hrng.IntN(120)) * time.Second,
	}
}

// weather is the health stream's step: a provider starts throttling for a
// window, or a cooldown is reset by hand, or nothing.
func (w *world) weather() {
	switch op := w.hrng.IntN(10); {
	case op < 2:
		p := models[w.hrng.IntN(len(models))].Provider
		d := time.Duration(10+w.hrng.IntN(140)) * time.Second
		w.host.mu.Lock()
		w.host.throttle[p] = w.clock.Now().Add(d)
		w.host.mu.Unlock()
		w.log("provider %s throttles for %s", p, d)
	case op < 3:
		md := models[w.hrng.IntN(len(models))]
		target := md.Provider + "/" + md.ID
		if w.hrng.IntN(3) == 0 {
			target = md.Provider
		}
		err := w.m.ResetHealth(context.Background(), target)
		if err != nil && !errors.Is(err, bgtask.ErrNotCooling) && !errors.Is(err, bgtask.ErrJournal) {
			w.failf("reset health of %s: %v", target, err)
		}
		w.log("reset health of %s: %v", target, err)
	}
}

// checkHealth: the skips first seen now (checkSkips); no attempt has
// waited for a cooldown longer than MaxWait, across restarts too.
func (w *world) checkHealth(tasks []bgtask.Task) {
	w.checkSkips(tasks)
	now := w.clock.Now()
	waiting := map[string]bool{}
	for _, t := range tasks {
		cur := t.Current()
		if cur.Status != bgtask.StatusPending || cur.Pending != bgtask.PendingCooldown {
			continue
		}
		waiting[cur.Token] = true
		since, ok := w.waitSince[cur.Token]
		if !ok {
			since = now
			w.waitSince[cur.Token] = now
		}
		if d := now.Sub(since); d > w.health.MaxWait {
			w.failf("%s attempt %d has waited for a cooldown %s, past the maximum %s", t.ID, cur.Number, d, w.health.MaxWait)
		}
	}
	for tok := range w.waitSince {
		if !waiting[tok] {
			delete(w.waitSince, tok)
		}
	}
}

// checkSkips: every skip first seen now was of a model (or provider) that
// kept attempts off at that moment, as this life's log says. A restart
// checks the dying life's skips against its own log first (restart).
func (w *world) checkSkips(tasks []bgtask.Task) {
	for _, t := range tasks {
		for _, sk := range t.Skips {
			id := fmt.Sprintf("%s/%d/%s/%s", t.ID, sk.Attempt, sk.Model, sk.At.Format(time.RFC3339Nano))
			if w.skipsSeen[id] {
				continue
			}
			w.skipsSeen[id] = true
			key := sk.Model.Provider + "/" + sk.Model.ID
			if len(sk.Why) > len("provider ") && sk.Why[:len("provider ")] == "provider " {
				key = sk.Model.Provider
			}
			if !w.hlog.covers(key, sk.At) {
				w.failf("%s attempt %d skipped %s at %s (%q), but %s was not cooling then; it kept attempts off %s",
					t.ID, sk.Attempt, sk.Model, sk.At, sk.Why, key, w.hlog.spans(key))
			}
		}
	}
}
