package pgledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The package's queue tables (the outbox, its parts, launches, the inbox)
// are empty most of the time and fill in bursts. PostgreSQL's autovacuum
// analyzes a table once a tenth of it changed, looking at most once a
// minute (autovacuum_naptime), so the statistics it last took are those
// of an empty table when a burst comes, and the planner then picks plans
// fit for a table of a few rows: the outbox's delivery round read every
// pending row of the ledger once per parent it looked at (a round took
// 120 ms at 16,000 pending rows instead of 2, and delivery fell twenty
// seconds behind the work). So a node keeps the statistics of the
// package's tables current itself: every analyzeEvery it asks the server
// which of them changed by more rows than they held when last analyzed
// (and by at least analyzeFloor), and analyzes those. A fresh ANALYZE
// invalidates the plans cached for them, prepared statements' and
// PL/pgSQL functions' alike.

// analyzeEvery is how often a node looks for tables whose statistics fell
// behind: one cheap catalog query.
const analyzeEvery = time.Second

// analyzeFloor is how many rows a table must have changed by, at least,
// since its last ANALYZE before a node analyzes it again.
const analyzeFloor = 1000

// staleSQL names the package's tables in the current schema that this
// role may analyze (it owns them, or is a superuser) and that changed by
// more rows than $1 plus what they held at their last ANALYZE or VACUUM
// (reltuples is -1 for a table never looked at).
const staleSQL = `SELECT quote_ident(s.relname) FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
 WHERE s.schemaname = current_schema() AND s.relname LIKE 'bgtask\_%'
   AND pg_has_role(c.relowner, 'USAGE')
   AND s.n_mod_since_analyze > $1 + greatest(c.reltuples, 0)
 ORDER BY s.relname`

// keepStatistics analyzes the package's tables whose statistics fell
// behind (staleSQL), every analyzeEvery until ctx ends.
func (n *Node) keepStatistics(ctx context.Context) {
	periodically(ctx, func() time.Duration { return analyzeEvery }, func(time.Duration) {
		if tables, err := analyzeStale(ctx, n.pool, analyzeFloor); err != nil && ctx.Err() == nil {
			n.o.Logger.Debug("pgledger: analyzing tables whose statistics fell behind", "err", err, "tables", tables)
		}
	})
}

// periodically calls f until ctx ends, each call interval() after the
// previous one ended (the first, interval() after it starts); f is given
// the interval it waited for next, asked again at each call.
func periodically(ctx context.Context, interval func() time.Duration, f func(next time.Duration)) {
	t := time.NewTimer(interval())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d := interval()
		f(d)
		t.Reset(d)
	}
}

// analyzeStale analyzes the tables staleSQL names with floor as $1, each
// on its own, and returns them. One node of a database does it at a time
// (the others skip it), and it gives up on a table someone else is
// analyzing or vacuuming (lock_timeout) rather than queue behind it; an
// analysis that fails is tried again on the next look.
func analyzeStale(ctx context.Context, pool *pgxpool.Pool, floor int) ([]string, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	var mine bool
	if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(hashtextextended('bgtask analyze', 0))`).Scan(&mine); err != nil || !mine {
		return nil, err
	}
	defer func() {
		// With a context of its own: ctx may have ended. A connection
		// that cannot unlock is closed, and the lock goes with it.
		c, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if _, err := conn.Exec(c, `SELECT pg_advisory_unlock(hashtextextended('bgtask analyze', 0))`); err != nil {
			_ = conn.Conn().Close(c)
		}
	}()
	rows, err := conn.Query(ctx, staleSQL, floor)
	if err != nil {
		return nil, err
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	for _, t := range tables {
		// One simple-protocol message: an implicit transaction, which
		// SET LOCAL ends with. t was quoted by the server (quote_ident).
		if _, err := conn.Exec(ctx, "SET LOCAL lock_timeout = '1s'; ANALYZE "+t, pgx.QueryExecModeSimpleProtocol); err != nil {
			return tables, err
		}
	}
	return tables, nil
}
