package pgledger

import (
	"context"
	"fmt"

	"github.com/bgtask/bgtask"
)

// The Journal is a bgtask.HealthStore: with bgtask.WithHealth, a cooldown
// a Manager begins (a 429, an overload, a provider refused) is written to
// the ledger's bgtask_health table, and every Manager of the ledger reads
// it before a launch (at most once per HealthPolicy.Shared), so a model
// one process saw throttled is skipped by the fleet. A failure that begins
// a cooldown costs one statement, a success none.
var _ bgtask.HealthStore = (*Journal)(nil)

// The statements say "reset" (the root's reset reason) as the literal 'reset' (the
// EXPLAIN test reads them from the source as literals); a test holds the
// two equal.
const coolDownSQL = `
INSERT INTO bgtask_health (ledger, key, since, until, why) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (ledger, key) DO UPDATE SET since = excluded.since, until = excluded.until, why = excluded.why
WHERE excluded.why = 'reset' OR bgtask_health.why = 'reset' OR excluded.until > bgtask_health.until`

// CoolDown sets the cooldown of c.Key in the ledger to c, in one statement
// (bgtask.HealthStore): when c ends later than the row kept, ends it
// early ("reset"), or follows a reset; a shorter cooldown
// never cuts a longer one short.
func (j *Journal) CoolDown(ctx context.Context, c bgtask.Cooldown) error {
	if _, err := j.pool.Exec(ctx, coolDownSQL, j.ledger, c.Key, c.Since, c.Until, c.Why); err != nil {
		return fmt.Errorf("pgledger: a cooldown of %s: %w", c.Key, err)
	}
	return nil
}

// Cooldowns returns the ledger's cooldowns not yet over by the database's
// clock, less those ended early, in one query (bgtask.HealthStore).
func (j *Journal) Cooldowns(ctx context.Context) ([]bgtask.Cooldown, error) {
	rows, err := j.pool.Query(ctx, cooldownsSQL, j.ledger)
	if err != nil {
		return nil, fmt.Errorf("pgledger: the cooldowns: %w", err)
	}
	defer rows.Close()
	var out []bgtask.Cooldown
	for rows.Next() {
		var c bgtask.Cooldown
		if err := rows.Scan(&c.Key, &c.Since, &c.Until, &c.Why); err != nil {
			return nil, fmt.Errorf("pgledger: the cooldowns: %w", err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("pgledger: the cooldowns: %w", err)
	}
	return out, nil
}

const cooldownsSQL = `SELECT key, since, until, why FROM bgtask_health WHERE ledger = $1 AND until > now() AND why <> 'reset'`
