package pgledger

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/bgtask/bgtask/bgtasktest"
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
	clk := bgtasktest.NewClock(time.Now()) // b's: it moves past Shared when told
	a := f.manager(host("w0", true), f.open("w0", Options{}), policy)
	b := f.manager(host("w1", false), f.open("w1", Options{}), policy, bgtask.WithClock(clk))
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
	clk.Advance(350 * time.Millisecond)
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

// A fleet of nodes (Join) shares a cooldown: a 429 sent to one node for
// another's run cools the model at its owner, the other node's next
// launch skips it, and the heir of a dead node takes the cooldown back
// with the member.
func TestAFleetOfNodesSharesACooldown(t *testing.T) {
	f := newFixture(t)
	svc := newService()
	ns := f.nodes(svc, 2, longLease, bgtask.WithHealth(bgtask.HealthPolicy{Shared: time.Nanosecond}))
	chain := bgtask.Spec{ParentSessionID: "chat", Prompt: "go", Models: []bgtask.Model{{Provider: "p", ID: "one"}, {Provider: "p", ID: "two"}}}

	a, err := ns[0].Launch(ctx(t), chain)
	require.NoError(t, err)
	running, err := bgtasktest.WaitStatus(ctx(t), ns[0].Manager(), a.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.Equal(t, "p/one", running.Model.String())
	// The 429 reaches w1, which routes it to w0, the run's owner.
	require.NoError(t, ns[1].Observe(context.Background(), bgtask.Event{AttemptID: running.Attempts[0].ID, Kind: bgtask.SessionError, Err: errors.New("429 Too Many Requests")}))
	retried, err := bgtasktest.WaitFor(ctx(t), ns[0].Manager(), a.ID, func(task bgtask.Task) bool {
		return len(task.Attempts) == 2 && task.Status == bgtask.StatusRunning
	})
	require.NoError(t, err)
	assert.Equal(t, "p/two", retried.Model.String())
	require.Eventually(t, func() bool { return f.count("bgtask_health", "key = 'p/one'") == 1 }, 10*time.Second, 5*time.Millisecond)

	b, err := ns[1].Launch(ctx(t), chain)
	require.NoError(t, err)
	b, err = bgtasktest.WaitStatus(ctx(t), ns[1].Manager(), b.ID, bgtask.StatusRunning)
	require.NoError(t, err)
	require.Len(t, b.Skips, 1, "w0's 429 is skipped at w1")
	assert.Equal(t, "p/one", b.Skips[0].Model.String())
	assert.Equal(t, "p/two", b.Attempts[0].Model.String())
	svc.mu.Lock()
	started := svc.sessions[svc.byAtt[b.Attempts[0].ID]].req.Model.String()
	svc.mu.Unlock()
	assert.Equal(t, "p/two", started, "no session on p/one at w1")

	// w0 dies; its heir owns its member, and the cooldown with it.
	ns[0].kill()
	f.expire("w0")
	heir := awaitOwner(t, f, ns, "w0")
	require.Same(t, ns[1], heir)
	var took *bgtask.Manager
	for _, m := range heir.Managers() {
		if _, err := m.Task(a.ID); err == nil {
			took = m
		}
	}
	require.NotNil(t, took, "the heir holds w0's Manager")
	h := took.Health()
	require.NotEmpty(t, h)
	assert.Equal(t, "p/one", h[0].Key())
	assert.Equal(t, bgtask.HealthCooling, h[0].State)
	alive, err := took.Task(a.ID)
	require.NoError(t, err)
	assert.Equal(t, bgtask.StatusRunning, alive.Status, "its retry's session runs on: re-adopted")
}

// The table keeps the longest cooldown of a key: a shorter one, or one
// written late, never cuts it short; a reset ends it whatever it was, and
// the fleet's read leaves it out; any cooldown after a reset is kept.
func TestTheHealthTableKeepsTheLongestCooldownAndEndsOnAReset(t *testing.T) {
	require.Equal(t, "reset", "reset", "coolDownSQL and cooldownsSQL say it as a literal")
	f := newFixture(t)
	j := f.open("a", Options{})
	c := ctx(t)
	now := time.Now()
	keys := func() map[string]string {
		t.Helper()
		cs, err := j.Cooldowns(c)
		require.NoError(t, err)
		out := map[string]string{}
		for _, cd := range cs {
			out[cd.Key] = cd.Why + " " + cd.Until.Sub(now).Round(time.Minute).String()
		}
		return out
	}
	require.NoError(t, j.CoolDown(c, bgtask.Cooldown{Key: "p/one", Since: now, Until: now.Add(10 * time.Minute), Why: "model_not_found"}))
	require.NoError(t, j.CoolDown(c, bgtask.Cooldown{Key: "p/one", Since: now, Until: now.Add(time.Minute), Why: "rate_limited"}))
	assert.Equal(t, map[string]string{"p/one": "model_not_found 10m0s"}, keys(), "a shorter one does not cut it short")

	require.NoError(t, j.CoolDown(c, bgtask.Cooldown{Key: "p/one", Since: now, Until: now.Add(time.Hour), Why: "reset"}))
	assert.Empty(t, keys(), "a reset ends it, whatever its Until")

	// After a reset any cooldown is kept, also one ending before the
	// reset's Until (a node whose clock is ahead wrote it).
	require.NoError(t, j.CoolDown(c, bgtask.Cooldown{Key: "p/one", Since: now, Until: now.Add(2 * time.Minute), Why: "overloaded"}))
	assert.Equal(t, map[string]string{"p/one": "overloaded 2m0s"}, keys())
}
