package sim

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bgtask/bgtask"
)

// host is the scripted Host. Its decisions are a hash of the seed and the
// call's identity (attempt or session ids, which are deterministic), never a
// shared random stream, so calls that run concurrently decide the same way
// in every run of a seed.
type host struct {
	seed int64
	m    atomic.Pointer[bgtask.Manager] // the live harness process's Manager

	mu         sync.Mutex // guards everything below
	blocked    map[string]chan struct{}
	changed    chan struct{} // closed when blocked changes; nil while nobody waits
	aborts     map[string]int
	created    map[string]bool      // sessions StartSession returned
	confirmed  map[string]bool      // sessions whose abort returned nil
	abortsFail bool                 // mode: every abort fails
	reliable   bool                 // mode: nothing fails or hangs (the final drain)
	throttle   map[string]time.Time // provider → the end of its window of 429s (health)
	now        func() time.Time
}

func newHost(seed int64) *host {
	return &host{seed: seed, blocked: map[string]chan struct{}{}, aborts: map[string]int{}, created: map[string]bool{}, confirmed: map[string]bool{}, throttle: map[string]time.Time{}}
}

func (h *host) decide(parts ...string) int {
	f := fnv.New64a()
	fmt.Fprint(f, h.seed)
	for _, p := range parts {
		f.Write([]byte{0})
		f.Write([]byte(p))
	}
	return int(f.Sum64() % 100)
}

// block parks the calling host call until the driver releases it (or ctx
// ends).
func (h *host) block(ctx context.Context, key string) error {
	ch := make(chan struct{})
	h.mu.Lock()
	h.blocked[key] = ch
	h.bump()
	h.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		h.mu.Lock()
		if h.blocked[key] == ch {
			delete(h.blocked, key)
			h.bump()
		}
		h.mu.Unlock()
		return ctx.Err()
	}
}

func (h *host) bump() {
	if h.changed != nil {
		close(h.changed)
		h.changed = nil
	}
}

// state returns how many calls are blocked and a channel closed at the next
// change.
func (h *host) state() (int, <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.changed == nil {
		h.changed = make(chan struct{})
	}
	return len(h.blocked), h.changed
}

// release lets the i-th blocked call (in key order) go on.
func (h *host) release(i int) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.blocked) == 0 {
		return ""
	}
	keys := make([]string, 0, len(h.blocked))
	for k := range h.blocked {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	k := keys[i%len(keys)]
	close(h.blocked[k])
	delete(h.blocked, k)
	h.bump()
	return k
}

func (h *host) releaseAll() int {
	n := 0
	for h.release(0) != "" {
		n++
	}
	return n
}

var errForbidden = errors.New("Forbidden: Selected provider is forbidden") //lint:ignore ST1005 a provider's own text

func (h *host) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	sid := "s-" + req.AttemptID
	d := h.decide("start", req.AttemptID)
	h.mu.Lock()
	reliable := h.reliable
	throttled := h.throttled(req.Model.Provider)
	h.mu.Unlock()
	if throttled != nil && !reliable {
		return "", throttled
	}
	if !reliable {
		if d%7 == 0 { // the child talks before the start returns
			_ = h.m.Load().Observe(bgtask.Event{AttemptID: req.AttemptID, Kind: bgtask.SessionBusy})
		}
		switch {
		case d < 8:
			return "", errors.New("503 Service Unavailable")
		case d < 10:
			return "", errForbidden
		case d < 12:
			h.mu.Lock()
			h.created[sid] = true
			h.mu.Unlock()
			return sid, errors.New("500 after the session was created")
		case d < 22:
			if err := h.block(ctx, "start "+req.AttemptID); err != nil {
				return "", err
			}
		}
	}
	h.mu.Lock()
	h.created[sid] = true
	h.mu.Unlock()
	return sid, nil
}

func (h *host) AbortSession(ctx context.Context, sid string) error {
	h.mu.Lock()
	h.aborts[sid]++
	n := h.aborts[sid]
	failMode, reliable := h.abortsFail, h.reliable
	h.mu.Unlock()
	d := h.decide("abort", sid, strconv.Itoa(n))
	if !reliable {
		switch {
		case failMode || d < 8:
			return errors.New("abort refused: session busy")
		case d < 18:
			if err := h.block(ctx, "abort "+sid+" #"+strconv.Itoa(n)); err != nil {
				return err
			}
		}
	}
	h.mu.Lock()
	h.confirmed[sid] = true
	h.mu.Unlock()
	return nil
}

// PromptSession accepts a supplemental prompt, refuses it, or hangs until
// the driver releases it, as the seed decides for that invocation.
func (h *host) PromptSession(ctx context.Context, req bgtask.PromptRequest) error {
	d := h.decide("prompt", req.AttemptID, strconv.Itoa(req.Invocation))
	h.mu.Lock()
	reliable := h.reliable
	h.mu.Unlock()
	switch {
	case reliable:
	case d < 15:
		return errors.New("prompt refused: session busy")
	case d < 35:
		return h.block(ctx, "prompt "+req.AttemptID+" #"+strconv.Itoa(req.Invocation))
	}
	return nil
}

// gate is one harness process's connection to the world: the host and the
// parents. Once its process has died (a restart), nothing it does reaches
// either; the sessions it started live on in the host.
type gate struct {
	h    *host
	n    *notes
	dead atomic.Bool
}

var errDead = errors.New("sim: this harness process is dead")

func (g *gate) StartSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	if g.dead.Load() {
		return "", errDead
	}
	return g.h.StartSession(ctx, req)
}

func (g *gate) AbortSession(ctx context.Context, sid string) error {
	if g.dead.Load() {
		return errDead
	}
	return g.h.AbortSession(ctx, sid)
}

func (g *gate) PromptSession(ctx context.Context, req bgtask.PromptRequest) error {
	if g.dead.Load() {
		return errDead
	}
	return g.h.PromptSession(ctx, req)
}

// SessionStatus: a session the host made and did not stop is alive; any
// other is gone (the sim's children end only through events the driver
// sends, which a dead process never hears).
func (g *gate) SessionStatus(ctx context.Context, sid string) (bgtask.SessionReport, error) {
	if g.dead.Load() {
		return bgtask.SessionReport{}, errDead
	}
	g.h.mu.Lock()
	defer g.h.mu.Unlock()
	if g.h.created[sid] && !g.h.confirmed[sid] {
		return bgtask.SessionReport{State: bgtask.SessionStateAlive}, nil
	}
	return bgtask.SessionReport{State: bgtask.SessionStateGone}, nil
}

func (g *gate) FindSession(ctx context.Context, req bgtask.SessionRequest) (string, error) {
	if g.dead.Load() {
		return "", errDead
	}
	sid := "s-" + req.AttemptID
	g.h.mu.Lock()
	defer g.h.mu.Unlock()
	if g.h.created[sid] && !g.h.confirmed[sid] {
		return sid, nil
	}
	return "", nil
}

func (g *gate) Notify(ctx context.Context, x bgtask.Notification) error {
	if g.dead.Load() {
		return errDead
	}
	return g.n.Notify(ctx, x)
}

// memJournal is what outlives the harness's process lives: a journal in
// memory, or the caller's (Options.Journal), behind a switch that a crash
// throws — what the dead process appends from then on is lost. What was
// appended before a crash is what the next life replays.
type memJournal struct {
	open    func() (bgtask.Journal, error) // the caller's journal; nil: in memory
	mu      sync.Mutex
	inner   bgtask.Journal // the caller's journal of this life
	recs    []bgtask.Record
	crashed bool
}

type doneCommit struct{}

func (doneCommit) Wait() error { return nil }

// reopen starts a process life: the caller's journal of the last one is
// closed and the next one opened.
func (j *memJournal) reopen() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.crashed = false
	if j.open == nil {
		return nil
	}
	if j.inner != nil {
		if err := j.inner.Close(); err != nil {
			return err
		}
		j.inner = nil
	}
	inner, err := j.open()
	j.inner = inner
	return err
}

func (j *memJournal) Append(batch []bgtask.Record) bgtask.Commit {
	j.mu.Lock()
	defer j.mu.Unlock()
	switch {
	case j.crashed:
	case j.inner != nil:
		return j.inner.Append(batch)
	default:
		j.recs = append(j.recs, batch...)
	}
	return doneCommit{}
}

func (j *memJournal) Replay(fn func(bgtask.Record) error) error {
	j.mu.Lock()
	if j.inner != nil {
		inner := j.inner
		j.mu.Unlock()
		return inner.Replay(fn)
	}
	recs := append([]bgtask.Record(nil), j.recs...)
	j.mu.Unlock()
	for _, r := range recs {
		if err := fn(r); err != nil {
			return err
		}
	}
	return nil
}

func (j *memJournal) Compact(keep []bgtask.Record) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	switch {
	case j.crashed:
	case j.inner != nil:
		return j.inner.Compact(keep)
	default:
		j.recs = append([]bgtask.Record(nil), keep...)
	}
	return nil
}

// Close ends a process life: the next one reopens it.
func (j *memJournal) Close() error { return nil }

// close releases the caller's journal at the end of the run.
func (j *memJournal) close() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.inner == nil {
		return nil
	}
	err := j.inner.Close()
	j.inner = nil
	return err
}
