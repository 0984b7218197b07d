package bgtask

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bgtask/bgtask/internal/clock"
)

// cooldownWorld is a host whose models fail as errs says, counting runs.
type cooldownWorld struct {
	mu   sync.Mutex
	errs map[string]error
	runs map[string]int
}

func (w *cooldownWorld) host() Host {
	return NewFuncHost(func(_ context.Context, run Run) (string, error) {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.runs[run.Model.String()]++
		return "ok", w.errs[run.Model.String()]
	})
}

func (w *cooldownWorld) ran(model string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.runs[model]
}

// cooling is what a Manager's health says cools: key → why, until, in a row.
func cooling(m *Manager) map[string]string {
	out := map[string]string{}
	for _, h := range m.Health() {
		if h.State == HealthCooling {
			out[h.Key()] = fmt.Sprintf("%s until %s, %d in a row", h.Why, h.Until.UTC().Format(time.RFC3339), h.InARow)
		}
	}
	return out
}

// coolingIn is what records say cools at now: the cooldowns recorded, less
// those reset, not over.
func coolingIn(t *testing.T, recs []Record, now time.Time) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, r := range recs {
		rec, err := decodeRecord(r)
		require.NoError(t, err)
		switch rec.kind {
		case recCooldownBegan:
			c := rec.cool
			out[c.Key] = fmt.Sprintf("%s until %s, %d in a row", c.Why, c.Until.UTC().Format(time.RFC3339), c.inARow)
			if !now.Before(c.Until) {
				delete(out, c.Key)
			}
		case recHealthReset:
			delete(out, rec.note)
		}
	}
	return out
}

// healthLife is a first life with health: a 429 (Retry-After a minute)
// cools a/1, a 403 cools provider b, which is then reset by hand, and a
// 404 cools c/3. It returns the journal's records and the clock.
func healthLife(t *testing.T) ([]Record, *clock.Fake, *cooldownWorld) {
	t.Helper()
	w := &cooldownWorld{runs: map[string]int{}, errs: map[string]error{
		"a/1": throttledErr{after: time.Minute},
		"b/2": errors.New("403 Forbidden"),
		"c/3": errors.New("404 model not found"),
	}}
	clk := clock.NewFake(time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC))
	j := &memJournal{}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := Open(ctx, w.host(), WithJournal(j), WithHealth(HealthPolicy{}), WithClock(clk), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	run := func(models ...string) Task {
		t.Helper()
		task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, models...)})
		require.NoError(t, err)
		done, err := m.Wait(ctx, task.ID)
		require.NoError(t, err)
		require.Equal(t, StatusCompleted, done.Status, "%+v", done)
		return done
	}
	run("a/1", "b/2", "d/4")
	clk.Advance(time.Second)
	require.NoError(t, m.ResetHealth(ctx, "b"))
	run("c/3", "d/4")
	want := cooling(m)
	require.Len(t, want, 2, "a/1 and c/3 cool: %v", want)
	require.NoError(t, m.Shutdown(ctx))
	j.mu.Lock()
	defer j.mu.Unlock()
	require.Equal(t, want, coolingIn(t, j.recs, clk.Now()), "the journal says what cooled")
	return cloneRecords(j.recs), clk, w
}

// A restart takes back the cooldowns the journal holds, after a crash at
// every record too: what cools after it is what the records up to there
// say, and a reset stays a reset.
func TestHealthCooldownsSurviveARestartAtEveryRecord(t *testing.T) {
	recs, clk, w := healthLife(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// A run the restart takes back waits for the shutdown: a run that failed
	// again would begin a cooldown of its own, which is not the replay's.
	held := func() Host {
		return NewFuncHost(func(ctx context.Context, _ Run) (string, error) {
			<-ctx.Done()
			return "", ctx.Err()
		})
	}
	for k := 1; k <= len(recs); k++ {
		m, err := Open(ctx, held(), WithJournal(&memJournal{recs: cloneRecords(recs[:k])}), WithHealth(HealthPolicy{}),
			WithClock(clock.NewFake(clk.Now())), WithIDs(SequentialIDs()))
		require.NoError(t, err, "after record %d", k)
		assert.Equal(t, coolingIn(t, recs[:k], clk.Now()), cooling(m), "after record %d", k)
		require.NoError(t, m.Shutdown(ctx))
	}

	// The whole journal: a new task skips the model that still cools.
	m, err := Open(ctx, w.host(), WithJournal(&memJournal{recs: cloneRecords(recs)}), WithHealth(HealthPolicy{}),
		WithClock(clock.NewFake(clk.Now())), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	before := w.ran("c/3")
	task, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "c/3", "d/4")})
	require.NoError(t, err)
	done, err := m.Wait(ctx, task.ID)
	require.NoError(t, err)
	require.Len(t, done.Skips, 1)
	assert.Equal(t, "c/3", done.Skips[0].Model.String())
	assert.Equal(t, before, w.ran("c/3"), "no session on a model the last life cooled")
	require.NoError(t, m.Shutdown(ctx))

	// Past every cooldown, nothing cools; without health, nothing is kept.
	m, err = Open(ctx, w.host(), WithJournal(&memJournal{recs: cloneRecords(recs)}), WithHealth(HealthPolicy{}),
		WithClock(clock.NewFake(clk.Now().Add(time.Hour))), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	assert.Empty(t, cooling(m))
	require.NoError(t, m.Shutdown(ctx))
	m, err = Open(ctx, w.host(), WithJournal(&memJournal{recs: cloneRecords(recs)}), WithClock(clock.NewFake(clk.Now())))
	require.NoError(t, err)
	assert.Nil(t, m.Health())
	require.NoError(t, m.Shutdown(ctx))
}

// A compaction keeps the cooldowns not over, and only those (a Manager
// without health keeps them too, for a later life that has it).
func TestHealthACompactionKeepsTheCooldownsNotOver(t *testing.T) {
	recs, clk, w := healthLife(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, health := range []bool{true, false} {
		t.Run(fmt.Sprint("health ", health), func(t *testing.T) {
			now := clk.Now().Add(2 * time.Minute) // a/1's minute is over, c/3's five are not
			opts := []Option{WithJournal(&memJournal{recs: cloneRecords(recs)}), WithClock(clock.NewFake(now)), WithIDs(SequentialIDs())}
			if health {
				opts = append(opts, WithHealth(HealthPolicy{}))
			}
			m, err := Open(ctx, w.host(), opts...)
			require.NoError(t, err)
			m.mu.Lock()
			kept, err := encodeAll(m.snapshotRecords())
			m.mu.Unlock()
			require.NoError(t, err)
			require.NoError(t, m.Shutdown(ctx))
			want := coolingIn(t, recs, now)
			require.Len(t, want, 1, "c/3 still cools: %v", want)
			require.Equal(t, want, coolingIn(t, kept, time.Time{}), "the compacted journal holds c/3's cooldown alone")

			m, err = Open(ctx, w.host(), WithJournal(&memJournal{recs: kept}), WithHealth(HealthPolicy{}), WithClock(clock.NewFake(now)))
			require.NoError(t, err)
			assert.Equal(t, want, cooling(m))
			require.NoError(t, m.Shutdown(ctx))
		})
	}
}

// The notifications a life produced and did not deliver are delivered
// again after a restart before anything the new life tells the parent:
// here a task that waited for a cooldown in the first life ends as it is
// taken back (the new life's MaxWait is shorter than the cooldown), and
// its summary comes after the earlier task's, in sequence order.
func TestARestartDeliversWhatWasOwedBeforeWhatItTells(t *testing.T) {
	w := &cooldownWorld{runs: map[string]int{}, errs: map[string]error{"a/1": throttledErr{after: 5 * time.Minute}}}
	start := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	j := &memJournal{}
	stuck := NotifierFunc(func(ctx context.Context, _ Notification) error { <-ctx.Done(); return ctx.Err() })
	m, err := Open(ctx, w.host(), WithJournal(j), WithNotifier(stuck), WithHealth(HealthPolicy{MaxWait: 10 * time.Minute}),
		WithClock(clock.NewFake(start)), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	first, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "a/1")})
	require.NoError(t, err)
	_, err = m.Wait(ctx, first.ID)
	require.NoError(t, err)
	waiting, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "a/1")})
	require.NoError(t, err)
	require.Equal(t, PendingCooldown, waiting.Pending)
	j.await(t, func(recs []Record) bool {
		return hasKind(recs, waiting.ID, "attempt_pending")
	})
	j.mu.Lock()
	crashed := cloneRecords(j.recs) // the process dies here: nothing was delivered
	j.mu.Unlock()
	shut, stop := context.WithTimeout(ctx, 300*time.Millisecond)
	defer stop()
	_ = m.Shutdown(shut)

	rec := &crashRecorder{}
	m, err = Open(ctx, w.host(), WithJournal(&memJournal{recs: crashed}), WithNotifier(rec), WithHealth(HealthPolicy{MaxWait: time.Minute}),
		WithClock(clock.NewFake(start)), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	done, err := m.Wait(ctx, waiting.ID)
	require.NoError(t, err)
	require.Equal(t, StatusError, done.Status, "the new life's wait is shorter than the cooldown")
	require.NoError(t, m.Shutdown(ctx))

	var finals []string
	var last uint64
	for _, n := range rec.all() {
		assert.Greater(t, n.Seq, last, "delivered in sequence order: %s %s after %d", n.Kind, n.TaskID, last)
		last = n.Seq
		if n.Kind == NotifyFinalSummary {
			finals = append(finals, n.TaskID)
		}
	}
	assert.Equal(t, []string{first.ID, waiting.ID}, finals, "the owed summary first")
}

// A wait for a cooldown is bounded by MaxWait from when it began, also
// across a restart: the new life does not start the wait over.
func TestHealthAWaitKeepsItsStartAcrossARestart(t *testing.T) {
	w := &cooldownWorld{runs: map[string]int{}, errs: map[string]error{"a/1": throttledErr{after: 5 * time.Minute}}}
	clk := clock.NewFake(time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	j := &memJournal{}
	pol := HealthPolicy{MaxWait: 4 * time.Minute}
	m, err := Open(ctx, w.host(), WithJournal(j), WithHealth(pol), WithClock(clk), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	first, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "a/1")})
	require.NoError(t, err)
	_, err = m.Wait(ctx, first.ID)
	require.NoError(t, err)
	clk.Advance(time.Minute)
	waiting, err := m.Launch(ctx, Spec{ParentSessionID: "p", Models: mustModels(t, "a/1")})
	require.NoError(t, err)
	require.Equal(t, PendingCooldown, waiting.Pending, "4 minutes of wait cover the 4 left")
	j.await(t, func(recs []Record) bool {
		return hasKind(recs, waiting.ID, "attempt_pending")
	})
	j.mu.Lock()
	crashed := cloneRecords(j.recs) // the process dies while it waits
	j.mu.Unlock()
	require.NoError(t, m.Shutdown(ctx))

	// Three minutes later the cooldown ends in one; the new life waits
	// at most 3m30s, counted from when the wait began (3 minutes ago),
	// not from the restart: it would end 30 s before the cooldown.
	clk.Advance(3 * time.Minute)
	pol.MaxWait = 3*time.Minute + 30*time.Second
	m, err = Open(ctx, w.host(), WithJournal(&memJournal{recs: crashed}), WithHealth(pol), WithClock(clk), WithIDs(SequentialIDs()))
	require.NoError(t, err)
	done, err := m.Wait(ctx, waiting.ID)
	require.NoError(t, err)
	assert.Equal(t, StatusError, done.Status, "the wait would last past its 4 minutes")
	assert.Contains(t, done.Error, "past the 3m30s")
	require.NoError(t, m.Shutdown(ctx))
}
