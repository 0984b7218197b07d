package pgledger

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// healthStatements counts the fleet health's statements.
type healthStatements struct{ writes, reads *atomic.Int64 }

func (s healthStatements) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch d.SQL {
	case coolDownSQL:
		s.writes.Add(1)
	case cooldownsSQL:
		s.reads.Add(1)
	}
	return ctx
}

func (healthStatements) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A 429 one process of a fleet sees cools the model for every process on
// the ledger: another's next launch skips it. A success costs no
// statement, a cooldown one, and a process reads the cooldowns at most
// once per HealthPolicy.Shared.
func TestA429CoolsTheModelForTheFleet(t *testing.T) {
	f := newFixture(t)
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	var writes, reads atomic.Int64
	cfg.ConnConfig.Tracer = healthStatements{writes: &writes, reads: &reads}
	pool, err := pgxpool.NewWithConfig(ctx(t), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	f.pool = pool

	var mu sync.Mutex
	ran := map[string]int{} // "member model": runs
	host := func(member string, throttled bool) bgtask.Host {
		return bgtask.NewFuncHost(func(_ context.Context, run bgtask.Run) (string, error) {
			mu.Lock()
			ran[member+" "+run.Model.String()]++
			mu.Unlock()
			if throttled && run.Model.ID == "one" {
				return "", errors.New("429 Too Many Requests")
			}
			return "ok", nil
		})
	}
	policy := bgtask.WithHealth(bgtask.HealthPolicy{Shared: 300 * time.Millisecond})
	a := f.manager(host("w0", true), f.open("w0", Options{}), policy)
	b := f.manager(host("w1", false), f.open("w1", Options{}), policy)
	chain := bgtask.Spec{ParentSessionID: "ses", Prompt: "go", Models: []bgtask.Model{{Provider: "p", ID: "one"}, {Provider: "p", ID: "two"}}}
	run := func(m *bgtask.Manager) bgtask.Task {
		task, err := m.Launch(ctx(t), chain)
		require.NoError(t, err)
		done, err := m.Wait(ctx(t), task.ID)
		require.NoError(t, err)
		require.Equal(t, bgtask.StatusCompleted, done.Status, done.Error)
		return done
	}

	ok := run(b) // b reads the fleet's cooldowns (none)
	assert.Empty(t, ok.Skips)
	mu.Lock()
	assert.Equal(t, 1, ran["w1 p/one"])
	mu.Unlock()
	assert.Equal(t, int64(1), reads.Load())
	assert.Zero(t, writes.Load(), "a success writes nothing")

	failed := run(a) // a's 429 on p/one, then p/two
	require.Len(t, failed.Attempts, 2)
	require.Eventually(t, func() bool { return f.count("bgtask_health", "key = 'p/one'") == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Equal(t, int64(1), writes.Load(), "one statement for the failure that began the cooldown")

	// b's next launch, once its view is older than Shared, reads the
	// fleet's cooldowns and skips p/one.
	time.Sleep(350 * time.Millisecond)
	skipped := run(b)
	require.Len(t, skipped.Skips, 1, "the fleet's 429 is skipped")
	assert.Equal(t, "p/one", skipped.Skips[0].Model.String())
	assert.Equal(t, "rate_limited", skipped.Skips[0].Why)
	mu.Lock()
	assert.Equal(t, 1, ran["w1 p/one"], "b never ran p/one again")
	mu.Unlock()
	h := b.Health()
	require.Len(t, h, 1)
	assert.Equal(t, bgtask.HealthCooling, h[0].State)
	assert.Equal(t, "p/one", h[0].Key())

	// Successes write nothing, and read at most once per Shared.
	w, r := writes.Load(), reads.Load()
	for range 3 {
		run(b)
	}
	assert.Equal(t, w, writes.Load())
	assert.LessOrEqual(t, reads.Load()-r, int64(1))
}
