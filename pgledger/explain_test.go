package pgledger

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

var explainLong = flag.Bool("pg.explain", false,
	"run TestQueriesStayIndexed on a ledger of 1,000,000 tasks (a few minutes) rather than 50,000")

// TestQueriesStayIndexed fills a ledger of its own schema with many tasks
// (50,000; 1,000,000 with -pg.explain) and what goes with them — sessions,
// records, keys, changes, closures and their stops, the outbox, parents, and
// members, most of them dead — then ANALYZEs it and EXPLAINs every statement
// of the package's code (each SQL literal of its .go files, and the
// statements of its PL/pgSQL functions) with realistic arguments, as a
// custom plan and as a generic one (a cached prepared statement's after a
// few runs, pgx's and PL/pgSQL's alike). No plan may read a table of
// bigTable rows or more with a Seq Scan: the planner must choose an index on
// its own. A statement that reads the whole ledger by design (Snapshot, its
// Closures) is checked on a small ledger in the same tables instead, and
// only timed on the big one.
//
// A SQL literal of the code with no case here fails the test: add its
// case to explainCases (or, if it touches no table, to explainExempt).
//
// Every case is then timed: the median of 7 runs of EXPLAIN ANALYZE
// (planning and execution, in a transaction rolled back), logged as a
// table (go test -v), with the EXPLAIN ANALYZE of any slower than
// slowCase.
func TestQueriesStayIndexed(t *testing.T) {
	n := 50_000
	if *explainLong {
		n = 1_000_000
	}
	cases := explainCases(n)
	checkCoverage(t, cases)

	pool := explainSchema(t)
	start := time.Now()
	fillLedger(t, pool, n)
	t.Logf("filled and analyzed a ledger of %d tasks in %s", n, time.Since(start).Round(time.Millisecond))

	c, err := pool.Acquire(ctx(t))
	require.NoError(t, err)
	defer c.Release()
	conn := c.Conn()
	big := bigTables(t, conn)
	type row struct {
		name, custom, generic string  // generic: the plan cached after seven runs
		ms, exec              float64 // planning and execution; execution
		jit                   int     // of the 7 runs, those JIT-compiled
	}
	var report []row
	for i, k := range cases {
		name := fmt.Sprintf("q%d", i)
		exec := func(sql string) {
			t.Helper()
			_, err := conn.Exec(context.Background(), sql, pgx.QueryExecModeSimpleProtocol)
			require.NoError(t, err, "%s: %s", k.name, sql)
		}
		exec("PREPARE " + name + " AS " + k.sql)
		call := "EXECUTE " + name + "(" + strings.Join(k.args, ", ") + ")"
		if len(k.args) == 0 {
			call = "EXECUTE " + name
		}
		// The custom plan (a statement's first runs), then — after seven
		// runs, timed — the plan the cache keeps using: generic, if the
		// planner finds it no dearer than the custom ones (pgx's cached
		// statements and PL/pgSQL's alike).
		var plans [2][]scan
		check := func(i int, which string) {
			t.Helper()
			plans[i] = scans(explainJSON(t, conn, "EXPLAIN (FORMAT JSON) "+call).Plan)
			if k.whole {
				return
			}
			for _, s := range plans[i] {
				if s.node == "Seq Scan" && big[s.rel] {
					var text []string
					rows, err := conn.Query(context.Background(), "EXPLAIN "+call, pgx.QueryExecModeSimpleProtocol)
					if err == nil {
						text, _ = pgx.CollectRows(rows, pgx.RowTo[string])
					}
					t.Errorf("%s (%s plan): a Seq Scan on %s (%d rows)\n%s\n%s", k.name, which, s.rel, bigRows[s.rel], squash(k.sql),
						strings.Join(text, "\n"))
				}
			}
		}
		exec("SET plan_cache_mode = force_custom_plan")
		check(0, "custom")
		exec("SET plan_cache_mode = auto")
		var times, execs []float64
		var last plan
		jit := 0
		for range 7 {
			exec("BEGIN")
			p := explainJSON(t, conn, "EXPLAIN (ANALYZE, FORMAT JSON) "+call)
			exec("ROLLBACK")
			last = p
			times, execs = append(times, p.Planning+p.Execution), append(execs, p.Execution)
			if p.JIT != nil {
				jit++
			}
		}
		slices.Sort(times)
		slices.Sort(execs)
		if times[len(times)/2] > slowCase && !k.whole {
			// Where a slow one spends its time.
			exec("BEGIN")
			rows, err := conn.Query(context.Background(), "EXPLAIN (ANALYZE) "+call, pgx.QueryExecModeSimpleProtocol)
			require.NoError(t, err)
			text, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			exec("ROLLBACK")
			t.Logf("%s takes %.3f ms:\n%s", k.name, times[len(times)/2], strings.Join(text, "\n"))
		}
		check(1, "cached")
		// What the plan the cache keeps reads of the big tables: a
		// statement on a few rows must not find them among many (a
		// member's whole history, say).
		if n, where := rowsRead(last.Plan, big); !k.whole && n > max(k.reads, readLimit) {
			t.Errorf("%s (cached plan): reads %d rows of big tables (%s), more than %d\n%s", k.name, n, where, max(k.reads, readLimit), squash(k.sql))
		}
		exec("DEALLOCATE " + name)
		report = append(report, row{k.name, summary(plans[0]), summary(plans[1]), times[len(times)/2], execs[len(execs)/2], jit})
	}
	var b strings.Builder
	fmt.Fprintf(&b, "EXPLAIN at %d tasks: median ms of 7 runs, planning + execution (execution); the plan (and the cached plan, if it differs)\n", n)
	for _, r := range report {
		fmt.Fprintf(&b, "%8.3f (%7.3f)  %-44s %s", r.ms, r.exec, r.name, r.custom)
		if r.jit > 0 {
			fmt.Fprintf(&b, " [JIT-compiled in %d of 7 runs]", r.jit)
		}
		if r.generic != r.custom {
			fmt.Fprintf(&b, " | cached: %s", r.generic)
		}
		b.WriteString("\n")
	}
	t.Log(b.String())
}

// slowCase is how many milliseconds make a case slow: its EXPLAIN
// ANALYZE is logged.
const slowCase = 5.0

// explainCase is one statement EXPLAINed: its SQL (a literal of the code,
// exactly, or a PL/pgSQL statement with its variables as parameters, cast
// to their types), and its arguments as SQL (EXECUTE's).
type explainCase struct {
	name string
	sql  string
	// prefix, instead of sql: the literal of the code that begins so (a
	// statement of a file still changing, outbox.go).
	prefix string
	args   []string
	from   string // a PL/pgSQL statement's text in schema.go ("": a literal of the code)
	whole  bool   // it reads the whole (retained) ledger by design: timed, its plan not checked
	reads  int64  // rows of big tables it may read by design, if more than readLimit (a page, say)
}

// explainExempt are the literals of the code that touch no table of the
// ledger's, with why.
var explainExempt = map[string]string{
	`SELECT pg_notify($1, $2)`:                                           "no table",
	`SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`:              "no table",
	`SELECT now() - $1::interval`:                                        "no table",
	`SELECT pg_advisory_xact_lock($1)`:                                   "Migrate: no table",
	`SELECT coalesce(max(version), 0) FROM bgtask_schema`:                "Migrate: a few rows",
	`INSERT INTO bgtask_schema (version) VALUES ($1)`:                    "Migrate: a few rows",
	`SELECT pg_try_advisory_lock(hashtextextended('bgtask analyze', 0))`: "no table",
	`SELECT pg_advisory_unlock(hashtextextended('bgtask analyze', 0))`:   "no table",
}

// The arguments of the cases name rows fillLedger makes: task t-<i>
// (live when i is a multiple of 100, of member m-<i/100 mod 10>; else,
// when i is even, of m-<i/2 mod 8>), its
// session s-<i>, attempt a-<i> and run r-<i>, launched from session
// s-<i/10>; members m-0…m-7 hold live leases, m-8 and m-9 are dead with
// live tasks, the rest dead and idle.
func explainCases(n int) []explainCase {
	s := func(v ...string) []string { return v }
	return []explainCase{
		// The node's loop: the inbox, the takeover poll, releasing members.
		{name: "drain: the inbox", sql: `SELECT id, event FROM bgtask_inbox WHERE ledger = $1 AND member = $2
 ORDER BY id LIMIT 100`, args: s("'big'", "'m-1'")},
		{name: "drain: applied events go", sql: `DELETE FROM bgtask_inbox WHERE id = ANY($1)`, args: s("ARRAY[1, 3, 5]::bigint[]")},
		{name: "takeover poll", sql: `
SELECT m.member FROM bgtask_members m
 WHERE m.ledger = $1 AND m.expires_at <= now() AND NOT m.idle AND m.member <> ALL($2)
   AND (EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = m.ledger AND t.member = m.member AND NOT t.ended)
        OR EXISTS (SELECT 1 FROM bgtask_inbox i WHERE i.ledger = m.ledger AND i.member = m.member))
 ORDER BY m.expires_at`, args: s("'big'", "ARRAY['m-0']")},
		{name: "releaseIdle: nothing live", sql: `SELECT NOT EXISTS (SELECT 1 FROM bgtask_tasks WHERE ledger = $1 AND member = $2 AND NOT ended)
   AND NOT EXISTS (SELECT 1 FROM bgtask_inbox WHERE ledger = $1 AND member = $2)`, args: s("'big'", "'m-3'")},
		// Actions asked of another process (ask.go), and the processes.
		{name: "ask: the owner and its lease", sql: `SELECT t.member, t.ended, coalesce(m.expires_at > now(), false), coalesce(m.expires_at, now())
  FROM bgtask_tasks t LEFT JOIN bgtask_members m ON m.ledger = t.ledger AND m.member = t.member
 WHERE t.ledger = $1 AND t.task_id = $2`, args: s("'big'", "'t-500'")},
		{name: "ask: until the run ended", sql: `SELECT coalesce((SELECT body->>'status' FROM bgtask_changes WHERE ledger = $1 AND task_id = $2 ORDER BY id DESC LIMIT 1), '')`,
			args: s("'big'", "'t-500'")},
		{name: "Published: one task as the ledger last published it", sql: `SELECT body FROM bgtask_changes
 WHERE ledger = $1 AND task_id = $2 AND (ended_at IS NULL OR $3::interval IS NULL OR ended_at >= now() - $3::interval) ORDER BY id DESC LIMIT 1`,
			args: s("'big'", "'t-500'", "'1 hour'")},
		{name: "drain: an ask taken", sql: `DELETE FROM bgtask_inbox WHERE id = $1`, args: s("7")},
		{name: "answer: into a live member's inbox", sql: `INSERT INTO bgtask_inbox (ledger, member, event) SELECT $1, $2, $3
 WHERE EXISTS (SELECT 1 FROM bgtask_members WHERE ledger = $1 AND member = $2 AND expires_at > now())`, args: s("'big'", "'m-1'", `'{"answer":{"id":"x"}}'`)},
		// It counts every live task, by member: by design, a page of a
		// fleet's processes reads them all (by the index of live tasks).
		{name: "Processes", prefix: `SELECT m.member, m.holder, m.expires_at, m.expires_at > now(), m.idle,`, args: s("'big'"), whole: true},
		// Observe, routing, keys.
		{name: "Observe: owner by attempt", sql: `
SELECT t.member, t.attempt_id = $2 AND ($3 = '' OR t.token = $3) AND NOT t.ended
  FROM bgtask_tasks t
 WHERE t.ledger = $1 AND (t.attempt_id = $2
       OR t.task_id = (SELECT s.task_id FROM bgtask_sessions s WHERE s.ledger = $1 AND s.attempt_id = $2 LIMIT 1))
 LIMIT 1`, args: s("'big'", "'a-500'", "'r-500'")},
		{name: "Observe: owner by session", sql: `
SELECT s.member, s.attempt_id = t.attempt_id AND ($3 = '' OR t.token = $3) AND NOT t.ended
  FROM bgtask_sessions s JOIN bgtask_tasks t ON t.ledger = s.ledger AND t.task_id = s.task_id
 WHERE s.ledger = $1 AND s.session_id = $2`, args: s("'big'", "'s-500'", "''")},
		{name: "Observe: a start in flight", sql: startingSQL, args: s("'big'"),
			reads: int64(n/50 + 500)}, // every live task (a hundredth of all) and its probe of the sessions, when each is bound
		{name: "route: into the inbox", sql: `INSERT INTO bgtask_inbox (ledger, member, event) VALUES ($1, $2, $3)`, args: s("'big'", "'m-5'", "'{}'")},
		{name: "claimKey", sql: claimKeySQL, args: s("'big'", "'k-500'", "'m-0'", "'t-new'", "'1 minute'")},
		{name: "claimKey: its holder", sql: `SELECT task_id FROM bgtask_keys WHERE ledger = $1 AND key = $2`, args: s("'big'", "'k-500'")},
		{name: "releaseKey", sql: `DELETE FROM bgtask_keys WHERE ledger = $1 AND key = $2 AND task_id = $3`, args: s("'big'", "'k-500'", "'t-new'")},
		{name: "health: a cooldown begun", sql: coolDownSQL, args: s("'big'", "'p/one'", "now()", "now() + interval '30 seconds'", "'rate_limited'")},
		{name: "health: the fleet's cooldowns", sql: cooldownsSQL, args: s("'big'")},

		// Closures: the fence, the scope, the stops, the record.
		{name: "admit (bgtask_admit_launches)", sql: `SELECT bgtask_admit_launches($1, $2, $3, $4, $5, $6::interval)`,
			args: s("'big'", "ARRAY['t-new', 't-new2']", "ARRAY['s-43210', 's-77']", "ARRAY['m-0', 'm-1']", "ARRAY[false, false]", "'10 seconds'")},
		{name: "admit: the launches a budget admits first", from: `SELECT array_agg(u.o::int ORDER BY u.o) INTO keep FROM unnest(p_parent, p_checked) WITH ORDINALITY AS u(p, c, o)`,
			sql: `SELECT array_agg(u.o::int ORDER BY u.o) FROM unnest($2::text[], $3::boolean[]) WITH ORDINALITY AS u(p, c, o)
 WHERE u.c OR NOT EXISTS (SELECT 1 FROM bgtask_sessions s JOIN bgtask_spends sp ON sp.ledger = s.ledger AND sp.task_id = s.task_id
                           WHERE s.ledger = $1::text AND s.session_id = u.p)`,
			args: s("'big'", "ARRAY['s-500', 's-77']", "ARRAY[false, true]")},
		{name: "start gate (bgtask_start_fenced_all)", sql: `SELECT bgtask_start_fenced_all($1, $2, $3)`,
			args: s("'big'", "ARRAY['t-500', 't-77']", "ARRAY['s-50', 's-7']")},
		{name: "admitted: a launch that failed", sql: `DELETE FROM bgtask_launching WHERE ledger = $1 AND task_id = $2`, args: s("'big'", "'t-new'")},
		{name: "scope of a branch", sql: scopeQuery, args: s("'big'", "'s-4321'", "'t-4321'", "NULL")},
		{name: "scope of a branch, a node's members", sql: scopeQuery, args: s("'big'", "'s-4321'", "'t-4321'", "ARRAY['m-0', 'm-1']"),
			reads: int64(n/500 + 500)}, // the planner may read the node's live tasks (two members' of ten, a hundredth of all) to join them to the scope
		{name: "Stop of a session: a known session", sql: `SELECT
  coalesce((SELECT task_id FROM bgtask_sessions WHERE ledger = $1 AND session_id = $2), ''),
  EXISTS (SELECT 1 FROM bgtask_sessions WHERE ledger = $1 AND session_id = $2)
  OR EXISTS (SELECT 1 FROM bgtask_tasks WHERE ledger = $1 AND parent_session = $2)
  OR EXISTS (SELECT 1 FROM bgtask_launching WHERE ledger = $1 AND parent_session = $2)`, args: s("'big'", "'s-4321'")},
		{name: "Stop with Tree: its root", sql: `SELECT coalesce((SELECT s.session_id FROM bgtask_sessions s
  WHERE s.ledger = t.ledger AND s.task_id = t.task_id ORDER BY s.attempt_id = t.attempt_id DESC LIMIT 1), '')
  FROM bgtask_tasks t WHERE t.ledger = $1 AND t.task_id = $2`, args: s("'big'", "'t-4321'")},
		{name: "close: the fence up", sql: `INSERT INTO bgtask_closures (ledger, root_session, task_id, member, actor) VALUES ($1, $2, $3, $4, $5) RETURNING id`,
			args: s("'big'", "'s-4321'", "'t-4321'", "'m-0'", "'alice'")},
		{name: "stopsOf", sql: `SELECT task_id, attempt_id, session_id, token, status, member, err FROM bgtask_stops
 WHERE closure_id = $1 ORDER BY seq`, args: s("5")},
		{name: "record: the fence down", sql: `UPDATE bgtask_closures SET closed_at = now(), record = $2 WHERE id = $1 AND record IS NULL`, args: s("5", "'{}'")},
		{name: "record: the root's parent", sql: `SELECT parent_session FROM bgtask_tasks WHERE ledger = $1 AND task_id = $2`, args: s("'big'", "'t-4321'")},
		{name: "record: NotifyBranchClosed", sql: `INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body) VALUES ($1, bgtask_part($2), $2, $3, $4, $5)`,
			args: s("'big'", "'s-432'", "'branch_closed:5'", "'branch_closed'", "'{}'")},
		{name: "Snapshot's Closures (small ledger)", sql: `SELECT record FROM bgtask_closures WHERE ledger = $1 AND closed_at IS NOT NULL AND record IS NOT NULL ORDER BY id`,
			args: s("'small'")},
		{name: "Snapshot's Closures (big ledger: all of them)", sql: `SELECT record FROM bgtask_closures WHERE ledger = $1 AND closed_at IS NOT NULL AND record IS NOT NULL ORDER BY id`,
			args: s("'big'"), whole: true},
		{name: "serveAll: open closures", sql: `SELECT id, root_session, task_id, actor FROM bgtask_closures
 WHERE ledger = $1 AND closed_at IS NULL AND bgtask_closure_live(ledger, member)`, args: s("'big'")},
		{name: "serveFor: a closure", sql: `SELECT id, root_session, task_id, actor FROM bgtask_closures
 WHERE id = $1 AND closed_at IS NULL AND bgtask_closure_live(ledger, member)`, args: s("5")},
		{name: "insertStops", sql: `INSERT INTO bgtask_stops (closure_id, task_id, attempt_id, session_id, token, member, status, err)
SELECT u.* FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[])
       AS u(closure_id, task_id, attempt_id, session_id, token, member, status, err)
 WHERE EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.id = u.closure_id)
ON CONFLICT (closure_id, token) DO UPDATE SET status = EXCLUDED.status, err = EXCLUDED.err`,
			args: s("ARRAY[5]", "ARRAY['t-250']", "ARRAY['a-250']", "ARRAY['s-250']", "ARRAY['r-x']", "ARRAY['m-0']", "ARRAY['cancelled']", "ARRAY['']")},

		// Statistics (statistics.go): the server's views, a row per table.
		{name: "statistics: tables behind", sql: staleSQL, args: s("1000")},
		// The outbox.
		{name: "outbox: a round", sql: roundSQL, args: s("'big'", "'m-0'", "ARRAY[1, 2]", "ARRAY[1, 1]",
			"ARRAY[101, 102]::bigint[]", "ARRAY[2]", "'30 seconds'", "false", "14", "ARRAY['s-7']::text[]", "256"), reads: 600},
		{name: "deliverer: the outbox's parts, made", sql: `INSERT INTO bgtask_parts (ledger, part) SELECT $1, g FROM generate_series(0, $2::int - 1) g
ON CONFLICT (ledger, part) DO NOTHING`, args: s("'big'", "16")},

		// The change stream.
		{name: "Subscribe/Snapshot: the newest id", sql: `SELECT coalesce(max(id), 0) FROM bgtask_changes WHERE ledger = $1`, args: s("'big'")},
		{name: "Subscribe: the next changes", sql: `SELECT id, body FROM bgtask_changes WHERE ledger = $1 AND id > $2 ORDER BY id LIMIT 1000`,
			args: s("'big'", strconv.Itoa(n-500)), reads: 2000}, // big's ids are 1…n; a page, with the small ledger's rows after them
		{name: "Snapshot (small ledger)", sql: snapshotSQL, args: s("'small'", "'24 hours'")},
		{name: "Snapshot (big ledger: all it retains)", sql: snapshotSQL, args: s("'big'", "'24 hours'"), whole: true},
		{name: "publish (bgtask_publish)", sql: `SELECT bgtask_publish($1, $2, $3, $4, $5::jsonb[])`,
			args: s("'big'", "'m-0'", "1", "ARRAY['t-1000']", `ARRAY['{"id":"t-1000","status":"running"}']::jsonb[]`)},

		// The journal.
		{name: "Open: the lease", sql: acquireLease, args: s("'big'", "'m-9'", "'h'", "'15 seconds'")},
		{name: "Open: who holds it", sql: `SELECT holder, expires_at, greatest(expires_at - now(), '0') FROM bgtask_members WHERE ledger = $1 AND member = $2`,
			args: s("'big'", "'m-0'")},
		{name: "heartbeat", sql: renewLease, args: s("'big'", "'m-0'", "1", "'15 seconds'")},
		{name: "append: a launch (bgtask_write)", sql: appendSQL,
			args: s("'big'", "'m-0'", "1", "'15 seconds'", "ARRAY[9000001, 9000002]::bigint[]", "ARRAY['task_launched', 'attempt_created']",
				"ARRAY['t-new', 't-new']", "ARRAY['', 'a-new']", "ARRAY['', 'r-new']", "ARRAY['', '']", "ARRAY['s-500', 's-500']",
				`ARRAY['\x01', '\x01']::bytea[]`, "true", "ARRAY[0, 0]::bigint[]", "ARRAY[0, 0]::bigint[]", "ARRAY[0, 0]::bigint[]",
				"ARRAY[0, 0]::bigint[]", "ARRAY[0, 0]::bigint[]", "ARRAY[]::text[]", "ARRAY[]::text[]", "ARRAY[]::text[]", "ARRAY[]::text[]", "ARRAY[]::text[]")},
		{name: "append: an end (bgtask_write)", sql: appendSQL,
			args: s("'big'", "'m-5'", "1", "'15 seconds'", "ARRAY[9000003]::bigint[]", "ARRAY['attempt_finalized']",
				"ARRAY['t-500']", "ARRAY['a-500']", "ARRAY['r-500']", "ARRAY['']", "ARRAY['s-50']", `ARRAY['\x01']::bytea[]`, "true",
				"ARRAY[0]::bigint[]", "ARRAY[0]::bigint[]", "ARRAY[0]::bigint[]", "ARRAY[0]::bigint[]", "ARRAY[0]::bigint[]",
				"ARRAY['s-50']", "ARRAY['final:t-500']", "ARRAY['final_summary']", "ARRAY['t-500']", "ARRAY['{}']")},
		{name: "append: a usage (bgtask_write)", sql: appendSQL,
			args: s("'big'", "'m-5'", "1", "'15 seconds'", "ARRAY[9000004]::bigint[]", "ARRAY['usage']",
				"ARRAY['t-500']", "ARRAY['a-500']", "ARRAY['']", "ARRAY['']", "ARRAY['']", `ARRAY['\x01']::bytea[]`, "true",
				"ARRAY[100]::bigint[]", "ARRAY[20]::bigint[]", "ARRAY[0]::bigint[]", "ARRAY[1]::bigint[]", "ARRAY[5]::bigint[]", "ARRAY[]::text[]", "ARRAY[]::text[]", "ARRAY[]::text[]", "ARRAY[]::text[]", "ARRAY[]::text[]")},

		// Budgets (budget.go).
		{name: "budget: admit launches", sql: budgetAdmitSQL,
			args: s("'big'", "ARRAY['t-new', 't-new2']", "ARRAY['s-500', 's-7']", "ARRAY[true, false]", "ARRAY[1000, 0, 0, 3, 0, 0, 0, 0, 0, 0]::bigint[]")},
		{name: "budget: the chains a batch locks", from: `SELECT sp.holder FROM unnest(p_parent) AS u(p) JOIN bgtask_sessions s ON s.ledger = p_ledger AND s.session_id = u.p JOIN bgtask_spends sp ON sp.ledger = s.ledger AND sp.task_id = s.task_id`,
			sql: `SELECT sp.holder FROM unnest($2::text[]) AS u(p)
  JOIN bgtask_sessions s ON s.ledger = $1::text AND s.session_id = u.p
  JOIN bgtask_spends sp ON sp.ledger = s.ledger AND sp.task_id = s.task_id`, args: s("'big'", "ARRAY['s-500', 's-7']")},
		{name: "budget: a launch taken back", sql: `SELECT bgtask_budget_undo($1, $2)`, args: s("'big'", "'t-new'")},
		{name: "budget: read one", sql: `SELECT up, lim_tokens, lim_cost, lim_requests, lim_spawns, spent_input, spent_output, spent_cached,
       spent_requests, spent_cost, spawned, reserved, over FROM bgtask_budgets WHERE ledger = $1 AND holder = $2`, args: s("'big'", "'t-5'")},
		{name: "budget: claim the spent", sql: `UPDATE bgtask_budgets SET closing_at = now()
 WHERE ledger = $1 AND over <> '' AND NOT closed AND (closing_at IS NULL OR closing_at < now() - $2::interval)
 RETURNING holder, over`, args: s("'big'", "'1 minute'")},
		{name: "budget: its branch closed", sql: `UPDATE bgtask_budgets SET closed = true WHERE ledger = $1 AND holder = $2`, args: s("'big'", "'t-5'")},
		{name: "budget: a closure's cause", sql: `SELECT coalesce((SELECT over FROM bgtask_budgets WHERE ledger = $1 AND holder = $2), '')`, args: s("'big'", "'t-5'")},
		{name: "History: an ended task's records", sql: taskRecordsSQL, args: s("'big'", "'t-505'")},
		// A live task's history runs to the end of its member's records:
		// with no index by task (it would cost every record a write), it
		// reads what its member wrote since the task's first record.
		{name: "History: a live task's records", sql: taskRecordsSQL, args: s("'big'", "'t-500'"), reads: int64(n / 50)},
		{name: "replay", sql: `SELECT seq, kind, task_id, attempt_id, token, data FROM bgtask_records
 WHERE ledger = $1 AND member = $2 ORDER BY seq`, args: s("'big'", "'m-15'")},
		{name: "compact: the records", sql: `DELETE FROM bgtask_records WHERE ledger = $1 AND member = $2`, args: s("'big'", "'m-15'")},
		{name: "compact: the sessions", sql: `DELETE FROM bgtask_sessions s WHERE s.ledger = $1 AND s.member = $2
   AND NOT EXISTS (SELECT 1 FROM unnest($3::text[]) k(id) WHERE k.id = s.task_id)`, args: s("'big'", "'m-15'", "ARRAY['t-5', 't-995']")},
		{name: "compact: the tasks", sql: `DELETE FROM bgtask_tasks t WHERE t.ledger = $1 AND t.member = $2
   AND NOT EXISTS (SELECT 1 FROM unnest($3::text[]) k(id) WHERE k.id = t.task_id)`, args: s("'big'", "'m-15'", "ARRAY['t-5', 't-995']")},
		{name: "Close: release, idle", sql: `UPDATE bgtask_members m SET expires_at = now(),
       idle = NOT EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = m.ledger AND t.member = m.member AND NOT t.ended)
          AND NOT EXISTS (SELECT 1 FROM bgtask_inbox i WHERE i.ledger = m.ledger AND i.member = m.member)
 WHERE ledger = $1 AND member = $2 AND fence = $3`, args: s("'big'", "'m-3'", "1")},

		// Retention.
		{name: "retention: claim a pass", sql: `INSERT INTO bgtask_retention AS r (ledger, pruned_at) VALUES ($1, now())
ON CONFLICT (ledger) DO UPDATE SET pruned_at = now() WHERE r.pruned_at <= now() - $2::interval`, args: s("'big'", "'1 minute'")},
		{name: "retention: close dead openers' closures", sql: closeInert, args: s("'big'", "1000")},
		{name: "retention: find dead members idle", sql: idleDead, args: s("'big'")},
		{name: "retention: launches left in flight", sql: pruneLaunching, args: s("'big'", "1000", "'1 hour'")},
		{name: "a node's launches left in flight", sql: sweepLaunchingSQL, args: s("'big'", "ARRAY['m-0', 'm-1']", "'15 seconds'", "ARRAY['t-1']::text[]")},
		{name: "retention: closures and stops", sql: pruneClosures, args: s("'big'", "100", "'24 hours'")},
		{name: "retention: idle parents", sql: pruneParents, args: s("'big'", "1000", "'24 hours'"), reads: 2000},                   // a batch, found and deleted
		{name: "retention: the MaxEnded-th ended", sql: changesEdge, args: s("'big'", "10000"), reads: 10000},                       // counts MaxEnded down the index
		{name: "retention: changes", sql: pruneChangesBefore, args: s("'big'", "1000", "now() - interval '24 hours'"), reads: 2001}, // a batch, found and deleted
		{name: "retention: dead members", sql: deadMembers, args: s("'big'", "1000", "'24 hours'", "''"), reads: 2000},              // a page of members, and those it passes
		{name: "retention: a dead member's row", sql: `SELECT fence FROM bgtask_members
 WHERE ledger = $1 AND member = $2 AND idle AND fence > pruned_fence AND expires_at < now() - $3::interval
 FOR UPDATE SKIP LOCKED`, args: s("'big'", "'m-20'", "'24 hours'")},
		{name: "retention: a dead member busy?", sql: memberBusy, args: s("'big'", "'m-20'", "200000")},
		{name: "retention: a dead member's records", sql: `DELETE FROM bgtask_records WHERE ledger = $1 AND member = $2`, args: s("'big'", "'m-20'")},
		{name: "retention: a dead member's sessions", sql: `DELETE FROM bgtask_sessions WHERE ledger = $1 AND member = $2`, args: s("'big'", "'m-20'")},
		{name: "retention: a dead member's tasks", sql: `DELETE FROM bgtask_tasks WHERE ledger = $1 AND member = $2`, args: s("'big'", "'m-20'")},
		{name: "retention: a dead member pruned", sql: `UPDATE bgtask_members SET pruned_fence = fence WHERE ledger = $1 AND member = $2`, args: s("'big'", "'m-20'")},

		// bgtask_write's statements ($1 p_ledger, …): each reads the rows
		// the commit names, whatever the commit's size.
		{name: "write: launches no longer in flight", from: `DELETE FROM bgtask_launching WHERE ledger = p_ledger AND task_id = ANY(ARRAY(SELECT u.t FROM unnest(p_kind, p_task) AS u(k, t) WHERE u.k = 'task_launched'));`,
			sql:  `DELETE FROM bgtask_launching WHERE ledger = $1::text AND task_id = ANY(ARRAY(SELECT u.t FROM unnest($2::text[], $3::text[]) AS u(k, t) WHERE u.k = 'task_launched'))`,
			args: s("'big'", "ARRAY['task_launched', 'attempt_created']", "ARRAY['t-new', 't-new']")},
		{name: "write: the tasks launched", from: `INSERT INTO bgtask_tasks (ledger, task_id, member, parent_session, attempt_id, token, ended, first_seq, last_seq) SELECT DISTINCT ON (u.t) p_ledger, u.t, p_member, u.p,`,
			sql: `WITH f AS (
	SELECT u.t, max(u.o) FILTER (WHERE u.k = 'attempt_created') AS lc, max(u.o) FILTER (WHERE u.k = 'attempt_finalized') AS lf, max(u.s) AS ls
	  FROM unnest($3::text[], $4::text[], $8::bigint[]) WITH ORDINALITY AS u(k, t, s, o) GROUP BY u.t),
ins AS (
	INSERT INTO bgtask_tasks (ledger, task_id, member, parent_session, attempt_id, token, ended, first_seq, last_seq)
	SELECT DISTINCT ON (u.t) $1::text, u.t, $2::text, u.p, coalesce(($6::text[])[f.lc::int], ''), coalesce(($7::text[])[f.lc::int], ''),
	       coalesce(f.lf, 0) > coalesce(f.lc, 0), u.s, f.ls
	  FROM unnest($3::text[], $4::text[], $5::text[], $8::bigint[]) WITH ORDINALITY AS u(k, t, p, s, o) JOIN f ON f.t = u.t
	 WHERE u.k = 'task_launched' ORDER BY u.t, u.o
	ON CONFLICT (ledger, task_id) DO NOTHING
	RETURNING task_id)
SELECT coalesce(array_agg(task_id), '{}') FROM ins`,
			args: s("'big'", "'m-0'", "ARRAY['task_launched', 'attempt_created']", "ARRAY['t-new', 't-new']", "ARRAY['s-500', '']",
				"ARRAY['', 'a-new']", "ARRAY['', 'r-new']", "ARRAY[9000001, 9000002]::bigint[]")},
		{name: "write: the first record that disagrees", from: `LEFT JOIN bgtask_tasks x ON x.ledger = p_ledger AND x.task_id = r.t WHERE x.member IS DISTINCT FROM p_member`,
			sql: `SELECT r.o, r.k, r.t, r.a, r.r, x.member, x.attempt_id, x.token, r.prev
  FROM (SELECT u.o, u.k, u.t, u.a, u.r,
               max(u.o) FILTER (WHERE u.k = 'attempt_created')
                 OVER (PARTITION BY u.t ORDER BY u.o ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev
          FROM unnest($3::text[], $4::text[], $5::text[], $6::text[]) WITH ORDINALITY AS u(k, t, a, r, o)
         WHERE u.k IN ('task_launched', 'attempt_created', 'session_bound', 'attempt_finalized', 'retry_scheduled', 'start_requested')) r
  LEFT JOIN bgtask_tasks x ON x.ledger = $1::text AND x.task_id = r.t
 WHERE x.member IS DISTINCT FROM $2::text
    OR (r.k NOT IN ('task_launched', 'attempt_created')
        AND (CASE WHEN r.prev IS NULL THEN x.attempt_id ELSE ($5::text[])[r.prev::int] END IS DISTINCT FROM r.a
             OR CASE WHEN r.prev IS NULL THEN x.token ELSE ($6::text[])[r.prev::int] END IS DISTINCT FROM r.r))
 ORDER BY r.o LIMIT 1`,
			args: s("'big'", "'m-5'", "ARRAY['session_bound', 'attempt_finalized']", "ARRAY['t-500', 't-500']", "ARRAY['a-500', 'a-500']", "ARRAY['r-500', 'r-500']")},
		{name: "write: the tasks moved", from: `UPDATE bgtask_tasks t SET attempt_id = CASE WHEN f.lc IS NULL THEN t.attempt_id ELSE p_attempt[f.lc::int] END,`,
			sql: `UPDATE bgtask_tasks t
   SET attempt_id = CASE WHEN f.lc IS NULL THEN t.attempt_id ELSE ($4::text[])[f.lc::int] END,
       token = CASE WHEN f.lc IS NULL THEN t.token ELSE ($5::text[])[f.lc::int] END,
       ended = coalesce(f.lf, 0) > coalesce(f.lc, 0),
       last_seq = f.ls
  FROM (SELECT u.t, max(u.o) FILTER (WHERE u.k = 'attempt_created') AS lc,
               max(u.o) FILTER (WHERE u.k = 'attempt_finalized') AS lf, max(u.s) AS ls
          FROM unnest($2::text[], $3::text[], $6::bigint[]) WITH ORDINALITY AS u(k, t, s, o)
         GROUP BY u.t HAVING count(*) FILTER (WHERE u.k IN ('attempt_created', 'attempt_finalized')) > 0) f
 WHERE t.ledger = $1::text AND t.task_id = f.t`,
			args: s("'big'", "ARRAY['attempt_finalized', 'attempt_created']", "ARRAY['t-500', 't-500']", "ARRAY['a-500', 'a-x']", "ARRAY['r-500', 'r-x']",
				"ARRAY[9000003, 9000004]::bigint[]")},
		{name: "write: the sessions bound", from: `INSERT INTO bgtask_sessions AS s (ledger, session_id, member, task_id, attempt_id) SELECT DISTINCT ON (u.s) p_ledger, u.s, p_member, u.t, u.a`,
			sql: `INSERT INTO bgtask_sessions AS s (ledger, session_id, member, task_id, attempt_id)
SELECT DISTINCT ON (u.s) $1::text, u.s, $2::text, u.t, u.a
  FROM unnest($3::text[], $4::text[], $5::text[], $6::text[]) WITH ORDINALITY AS u(k, s, t, a, o)
 WHERE u.k = 'session_bound' ORDER BY u.s, u.o DESC
ON CONFLICT (ledger, session_id) DO UPDATE SET task_id = EXCLUDED.task_id, attempt_id = EXCLUDED.attempt_id WHERE s.member = EXCLUDED.member`,
			args: s("'big'", "'m-0'", "ARRAY['session_bound']", "ARRAY['s-new']", "ARRAY['t-new']", "ARRAY['a-new']")},
		{name: "write: a session another member holds", from: `JOIN bgtask_sessions x ON x.ledger = p_ledger AND x.session_id = u.s WHERE u.k = 'session_bound' AND x.member <> p_member`,
			sql: `SELECT u.s, x.member FROM unnest($3::text[], $4::text[]) WITH ORDINALITY AS u(k, s, o)
  JOIN bgtask_sessions x ON x.ledger = $1::text AND x.session_id = u.s
 WHERE u.k = 'session_bound' AND x.member <> $2::text ORDER BY u.o LIMIT 1`,
			args: s("'big'", "'m-0'", "ARRAY['session_bound']", "ARRAY['s-500']")},
		{name: "write: the parents moved", from: `INSERT INTO bgtask_parents AS x (ledger, parent_session, live, round_tasks) SELECT p_ledger, m.parent, m.delta, coalesce(m.born, '{}') FROM m`,
			sql: `WITH m AS (
	SELECT t.parent_session AS parent,
	       sum((NOT t.ended)::int - coalesce(($3::jsonb ->> t.task_id)::boolean, false)::int) AS delta,
	       array_agg(t.task_id) FILTER (WHERE NOT ($3::jsonb ? t.task_id)
	           OR (NOT t.ended AND NOT ($3::jsonb ->> t.task_id)::boolean)) AS born
	  FROM bgtask_tasks t
	 WHERE t.ledger = $1::text AND t.task_id = ANY($2::text[]) AND t.parent_session <> ''
	 GROUP BY t.parent_session),
up AS (
	INSERT INTO bgtask_parents AS x (ledger, parent_session, live, round_tasks)
	SELECT $1::text, m.parent, m.delta, coalesce(m.born, '{}') FROM m
	 WHERE m.delta <> 0 OR m.born IS NOT NULL ORDER BY m.parent
	ON CONFLICT (ledger, parent_session) DO UPDATE
	   SET live = x.live + EXCLUDED.live, round_tasks = x.round_tasks || EXCLUDED.round_tasks
	RETURNING x.parent_session, x.live, x.round, x.round_tasks)
SELECT jsonb_agg(jsonb_build_object('p', up.parent_session, 'r', up.round, 't', up.round_tasks) ORDER BY up.parent_session),
       array_agg(up.parent_session)
  FROM up WHERE up.live <= 0 AND cardinality(up.round_tasks) > 0`,
			args: s("'big'", "ARRAY['t-500', 't-501']", `'{"t-500": true, "t-501": false}'`)},
		{name: "write: the notes", from: `INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body) SELECT p_ledger, bgtask_part(u.p), u.p, u.i, u.k, u.b`,
			sql: `WITH ins AS (
	INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body)
	SELECT $1::text, bgtask_part(u.p), u.p, u.i, u.k, u.b
	  FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]) WITH ORDINALITY AS u(p, i, k, b, o)
	 ORDER BY u.o
	RETURNING part)
SELECT coalesce(bit_or(1 << part), 0) FROM ins`,
			args: s("'big'", "ARRAY['s-50']", "ARRAY['final:t-new']", "ARRAY['final_summary']", "ARRAY['{}']")},
		{name: "write: a summary kept for its round", from: `INSERT INTO bgtask_finals AS f (ledger, parent_session, task_id, body) SELECT DISTINCT ON (u.p, u.t) p_ledger, u.p, u.t, u.b`,
			sql: `INSERT INTO bgtask_finals AS f (ledger, parent_session, task_id, body)
SELECT DISTINCT ON (u.p, u.t) $1::text, u.p, u.t, u.b
  FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]) WITH ORDINALITY AS u(p, k, t, b, o)
  JOIN bgtask_parents x ON x.ledger = $1::text AND x.parent_session = u.p AND u.t = ANY(x.round_tasks)
 WHERE u.k = 'final_summary' AND u.p <> ALL(coalesce($6::text[], '{}'))
 ORDER BY u.p, u.t, u.o DESC
ON CONFLICT (ledger, parent_session, task_id) DO UPDATE SET body = EXCLUDED.body`,
			args: s("'big'", "ARRAY['s-100']", "ARRAY['final_summary']", "ARRAY['t-1000']", "ARRAY['{}']", "ARRAY['s-7']")},
		{name: "write: the rounds' all_complete", from: `SELECT p_ledger, bgtask_part(e.p), e.p, 'all_complete:' || e.p || ':' || e.r, 'all_complete',`,
			sql: `WITH ins AS (
	INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body)
	SELECT $1::text, bgtask_part(e.p), e.p, 'all_complete:' || e.p || ':' || e.r, 'all_complete',
	       '[' || coalesce((
	         SELECT string_agg(c.b, ',' ORDER BY array_position(e.t, c.t)) FROM (
	           SELECT DISTINCT ON (a.t) a.t, a.b FROM (
	             SELECT u.t, u.b, 0 AS pri, u.o
	               FROM unnest($3::text[], $4::text[], $5::text[], $6::text[]) WITH ORDINALITY AS u(p, k, t, b, o)
	              WHERE u.p = e.p AND u.k = 'final_summary' AND u.t = ANY(e.t)
	             UNION ALL
	             SELECT f.task_id, f.body, 1, 0 FROM bgtask_finals f
	              WHERE f.ledger = $1::text AND f.parent_session = e.p AND f.task_id = ANY(e.t)) a
	            ORDER BY a.t, a.pri, a.o DESC) c), '') || ']'
	  FROM jsonb_to_recordset($2::jsonb) AS e(p text, r bigint, t text[]) ORDER BY e.p
	RETURNING part)
SELECT coalesce(bit_or(1 << part), 0) FROM ins`,
			args: s("'big'", `'[{"p": "s-100", "r": 7, "t": ["t-1000", "t-new"]}]'`, "ARRAY['s-100']", "ARRAY['final_summary']", "ARRAY['t-new']", "ARRAY['{}']")},
		{name: "write: the rounds' kept summaries go", from: `DELETE FROM bgtask_finals WHERE ledger = p_ledger AND parent_session = ANY(parents);`,
			sql: `DELETE FROM bgtask_finals WHERE ledger = $1::text AND parent_session = ANY($2::text[])`, args: s("'big'", "ARRAY['s-100']")},
		{name: "write: the next rounds", from: `UPDATE bgtask_parents SET live = 0, round = round + 1, round_tasks = '{}' WHERE ledger = p_ledger AND parent_session = ANY(parents);`,
			sql:  `UPDATE bgtask_parents SET live = 0, round = round + 1, round_tasks = '{}' WHERE ledger = $1::text AND parent_session = ANY($2::text[])`,
			args: s("'big'", "ARRAY['s-50']")},
		{name: "spend: the reservations a commit moves", from: `LEFT JOIN bgtask_tasks t ON t.ledger = sp.ledger AND t.task_id = sp.task_id WHERE sp.ledger = p_ledger AND sp.task_id = ANY(p_task)`,
			sql: `SELECT sp.task_id, sp.holder, sp.reserved, NOT sp.started AND b.t IS NOT NULL
  FROM bgtask_spends sp
  LEFT JOIN (SELECT DISTINCT x.t FROM unnest($2::text[], $3::text[]) AS x(k, t) WHERE x.k = 'session_bound') b ON b.t = sp.task_id
  LEFT JOIN bgtask_tasks t ON t.ledger = sp.ledger AND t.task_id = sp.task_id
 WHERE sp.ledger = $1::text AND sp.task_id = ANY($3::text[])
   AND ((NOT sp.started AND b.t IS NOT NULL) OR (sp.reserved AND t.ended))`,
			args: s("'big'", "ARRAY['session_bound', 'attempt_finalized']", "ARRAY['t-500', 't-501']")},
		{name: "write: does a task spend from a budget?", from: `IF EXISTS (SELECT 1 FROM bgtask_spends WHERE ledger = p_ledger AND task_id = ANY(p_task)) THEN`,
			sql: `SELECT EXISTS (SELECT 1 FROM bgtask_spends WHERE ledger = $1::text AND task_id = ANY($2::text[]))`, args: s("'big'", "ARRAY['t-500', 't-501']")},

		// bgtask_publish's statements.
		{name: "publish: the lease", from: `PERFORM 1 FROM bgtask_members WHERE ledger = p_ledger AND member = p_member AND fence = p_fence AND expires_at > now();`,
			sql:  `SELECT 1 FROM bgtask_members WHERE ledger = $1::text AND member = $2::text AND fence = $3::bigint AND expires_at > now()`,
			args: s("'big'", "'m-0'", "1")},
		{name: "publish: the changes, the older rows go", from: `WITH r AS ( SELECT DISTINCT ON (r.t) r.t, r.b, r.o FROM unnest(p_task, p_body) WITH ORDINALITY AS r(t, b, o) ORDER BY r.t, r.o DESC), ins AS ( INSERT INTO bgtask_changes (ledger, member, task_id, body, ended_at) SELECT p_ledger, p_member, r.t, r.b, bgtask_ended_at(r.b) FROM r ORDER BY r.o RETURNING task_id, id) DELETE FROM bgtask_changes c USING ins WHERE c.ledger = p_ledger AND c.task_id = ins.task_id AND c.id < ins.id;`,
			sql: `WITH r AS (
	SELECT DISTINCT ON (r.t) r.t, r.b, r.o FROM unnest($3::text[], $4::jsonb[]) WITH ORDINALITY AS r(t, b, o) ORDER BY r.t, r.o DESC),
ins AS (
	INSERT INTO bgtask_changes (ledger, member, task_id, body, ended_at)
	SELECT $1::text, $2::text, r.t, r.b, bgtask_ended_at(r.b) FROM r ORDER BY r.o
	RETURNING task_id, id)
DELETE FROM bgtask_changes c USING ins WHERE c.ledger = $1::text AND c.task_id = ins.task_id AND c.id < ins.id`,
			args: s("'big'", "'m-0'", "ARRAY['t-1000', 't-999']", `ARRAY['{"id":"t-1000","status":"completed"}', '{"id":"t-999","status":"running"}']::jsonb[]`)},
		{name: "fence: any open closure", from: `IF NOT EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.ledger = p_ledger AND k.closed_at IS NULL AND bgtask_closure_live(k.ledger, k.member)) THEN`,
			sql:  `SELECT EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.ledger = $1::text AND k.closed_at IS NULL AND bgtask_closure_live(k.ledger, k.member))`,
			args: s("'big'")},
		{name: "fence: a session's task", from: `SELECT task_id INTO t FROM bgtask_sessions WHERE ledger = p_ledger AND session_id = s;`,
			sql: `SELECT task_id FROM bgtask_sessions WHERE ledger = $1::text AND session_id = $2::text`, args: s("'big'", "'s-43210'")},
		{name: "fence: a closure over a session", from: `SELECT id INTO c FROM bgtask_closures k WHERE k.ledger = p_ledger AND k.closed_at IS NULL AND bgtask_closure_live(k.ledger, k.member) AND (k.root_session = s OR (t IS NOT NULL AND (k.task_id = t OR k.root_session IN (SELECT session_id FROM bgtask_sessions WHERE ledger = p_ledger AND task_id = t)))) LIMIT 1;`,
			sql: `SELECT id FROM bgtask_closures k
 WHERE k.ledger = $1::text AND k.closed_at IS NULL AND bgtask_closure_live(k.ledger, k.member)
   AND (k.root_session = $2::text OR ($3::text IS NOT NULL AND (k.task_id = $3::text OR k.root_session IN
        (SELECT session_id FROM bgtask_sessions WHERE ledger = $1::text AND task_id = $3::text))))
 LIMIT 1`, args: s("'big'", "'s-43210'", "'t-43210'")},
		{name: "fence: up to the parent", from: `SELECT parent_session INTO s FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = t;`,
			sql: `SELECT parent_session FROM bgtask_tasks WHERE ledger = $1::text AND task_id = $2::text`, args: s("'big'", "'t-43210'")},
		{name: "fence: a closure over a task", from: `SELECT k.id INTO c FROM bgtask_closures k WHERE k.ledger = p_ledger AND k.closed_at IS NULL AND bgtask_closure_live(k.ledger, k.member) AND (k.task_id = p_task OR k.root_session IN (SELECT session_id FROM bgtask_sessions WHERE ledger = p_ledger AND task_id = p_task)) LIMIT 1;`,
			sql: `SELECT k.id FROM bgtask_closures k
 WHERE k.ledger = $1::text AND k.closed_at IS NULL AND bgtask_closure_live(k.ledger, k.member)
   AND (k.task_id = $2::text OR k.root_session IN (SELECT session_id FROM bgtask_sessions WHERE ledger = $1::text AND task_id = $2::text))
 LIMIT 1`, args: s("'big'", "'t-500'")},
		{name: "admit: launches in flight, no fence up", from: `INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) SELECT p_ledger, r.t, r.p, r.m FROM unnest(p_task, p_parent, p_member) AS r(t, p, m) ON CONFLICT (ledger, task_id) DO NOTHING;`,
			sql: `INSERT INTO bgtask_launching (ledger, task_id, parent_session, member)
SELECT $1::text, r.t, r.p, r.m FROM unnest($2::text[], $3::text[], $4::text[]) AS r(t, p, m) ON CONFLICT (ledger, task_id) DO NOTHING`,
			args: s("'big'", "ARRAY['t-new', 't-new2']", "ARRAY['s-43210', 's-7']", "ARRAY['m-0', 'm-1']")},
		{name: "admit: in flight", from: `INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) VALUES (p_ledger, p_task[i], p_parent[i], p_member[i]) ON CONFLICT (ledger, task_id) DO NOTHING;`,
			sql: `INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) VALUES ($1::text, $2::text, $3::text, $4::text)
ON CONFLICT (ledger, task_id) DO NOTHING`, args: s("'big'", "'t-new'", "'s-43210'", "'m-0'")},
	}
}

// snapshotSQL is a literal of the code (changes.go's Snapshot), as
// checkCoverage finds it.
const snapshotSQL = `SELECT task_id, body FROM bgtask_changes
 WHERE ledger = $1 AND (ended_at IS NULL OR $2::interval IS NULL OR ended_at >= now() - $2::interval) ORDER BY id`

// squash is sql with its whitespace made single spaces.
func squash(sql string) string { return strings.Join(strings.Fields(sql), " ") }

var sqlStart = regexp.MustCompile(`(?is)^\s*(SELECT|INSERT|UPDATE|DELETE|WITH)\b`)

// checkCoverage fails the test for every SQL literal of the package's code
// with no case (and no exemption), for every case of the code's that is
// no literal of it, and for every PL/pgSQL case whose statement is not in
// schema.go; it gives each case by prefix its literal.
func checkCoverage(t *testing.T, cases []explainCase) {
	t.Helper()
	raw := map[string]string{} // squashed → as written
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	literals := map[string]string{} // squashed → where
	schema := ""
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		if f == "schema.go" || f == "appendfn.go" || f == "write.go" {
			schema += squash(string(src))
		}
		fs := token.NewFileSet()
		af, err := parser.ParseFile(fs, f, src, 0)
		require.NoError(t, err)
		ast.Inspect(af, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING {
				if s, err := strconv.Unquote(lit.Value); err == nil && sqlStart.MatchString(s) {
					literals[squash(s)] = fs.Position(lit.Pos()).String()
					raw[squash(s)] = s
				}
			}
			return true
		})
	}
	covered := map[string]bool{}
	for i := range cases {
		k := &cases[i]
		if k.prefix != "" {
			var found []string
			for q := range literals {
				if strings.HasPrefix(q, squash(k.prefix)) {
					found = append(found, q)
				}
			}
			if len(found) != 1 {
				t.Errorf("case %q: %d literals of the code begin with %q, not one", k.name, len(found), k.prefix)
				continue
			}
			k.sql = raw[found[0]]
		}
		if k.from != "" {
			if !strings.Contains(schema, squash(k.from)) {
				t.Errorf("case %q: its statement is not in schema.go any more: %s", k.name, squash(k.from))
			}
			continue
		}
		q := squash(k.sql)
		if _, ok := literals[q]; !ok {
			t.Errorf("case %q is no SQL literal of the code (any more): %s", k.name, q)
		}
		covered[q] = true
	}
	var missing []string
	for q, at := range literals {
		if _, exempt := explainExempt[q]; !covered[q] && !exempt {
			missing = append(missing, at+": "+q)
		}
	}
	sort.Strings(missing)
	for _, m := range missing {
		t.Errorf("no EXPLAIN case for a statement of the code (add one to explainCases in explain_test.go): %s", m)
	}
}

// explainSchema makes a schema of the test's own, migrated, and returns a
// pool whose connections work in it; it is dropped at the test's end.
func explainSchema(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool := ownSchema(t, "bgtask_explain")
	require.NoError(t, Migrate(ctx(t), pool))
	return pool
}

// ownSchema makes schema afresh, empty, and returns a pool whose
// connections work in it; it is dropped at the test's end.
func ownSchema(t *testing.T, schema string) *pgxpool.Pool {
	t.Helper()
	admin, err := pgxpool.New(ctx(t), dbURL)
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	_, err = admin.Exec(ctx(t), `DROP SCHEMA IF EXISTS `+schema+` CASCADE; CREATE SCHEMA `+schema)
	require.NoError(t, err)
	t.Cleanup(func() {
		c, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, _ = admin.Exec(c, `DROP SCHEMA IF EXISTS `+schema+` CASCADE`)
	})
	cfg := admin.Config().Copy()
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx(t), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// fillLedger fills ledger "big" with n tasks and what goes with them, and
// ledger "small" with a thousand, then VACUUMs and ANALYZEs the tables.
func fillLedger(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	// members: m-0…m-7 live, each with a sixteenth of the tasks (a
	// worker's history), m-8 and m-9 dead with live tasks, the rest dead
	// and idle
	m := n / 50
	c := n / 50 // closures that ended, over two days (and two open)
	p := n / 10 // parents' rows
	vars := strings.NewReplacer("$N", strconv.Itoa(n), "$M", strconv.Itoa(m), "$C", strconv.Itoa(c), "$P", strconv.Itoa(p))
	c1, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	for _, q := range []string{
		`INSERT INTO bgtask_members (ledger, member, fence, holder, expires_at, idle, pruned_fence)
SELECT 'big', 'm-' || k, CASE WHEN k < 10 THEN 1 ELSE 1 + k % 5 END, 'h-' || k,
       CASE WHEN k < 8 THEN now() + interval '1 day' WHEN k < 10 THEN now() - interval '1 hour' ELSE now() - k * interval '1 minute' END,
       k >= 10, CASE WHEN k >= 10 AND k % 10 <> 0 THEN 1 + k % 5 ELSE 0 END
  FROM generate_series(0, $M - 1) k`,
		`INSERT INTO bgtask_tasks (ledger, task_id, member, attempt_id, token, ended, parent_session, first_seq, last_seq)
SELECT 'big', 't-' || i, CASE WHEN i % 100 = 0 THEN 'm-' || (i / 100) % 10 WHEN i % 2 = 0 THEN 'm-' || (i / 2) % 8 ELSE 'm-' || (10 + i % ($M - 10)) END,
       'a-' || i, 'r-' || i, i % 100 <> 0, CASE WHEN i <= 10 THEN 'chat-' || i ELSE 's-' || (i / 10) END, i, i
  FROM generate_series(1, $N) i`,
		`INSERT INTO bgtask_sessions (ledger, session_id, member, task_id, attempt_id)
SELECT ledger, 's-' || substr(task_id, 3), member, task_id, attempt_id FROM bgtask_tasks WHERE ledger = 'big'`,
		`INSERT INTO bgtask_records (ledger, member, seq, kind, task_id, attempt_id, token, data)
SELECT ledger, member, substr(task_id, 3)::bigint, 'attempt_finalized', task_id, attempt_id, token, '\x01'
  FROM bgtask_tasks WHERE ledger = 'big' AND substr(task_id, 3)::bigint % 5 = 0`,
		`INSERT INTO bgtask_keys (ledger, key, member, task_id)
SELECT ledger, 'k-' || substr(task_id, 3), member, task_id FROM bgtask_tasks WHERE ledger = 'big' AND NOT ended`,
		`INSERT INTO bgtask_inbox (ledger, member, event) SELECT 'big', CASE WHEN j % 2 = 0 THEN 'm-8' ELSE 'm-1' END, '{}' FROM generate_series(1, 200) j`,
		`INSERT INTO bgtask_closures (ledger, root_session, task_id, member, opened_at, closed_at, record)
SELECT 'big', 's-' || (j * 50), 't-' || (j * 50), 'm-' || (j % 8), now() - j * (interval '2 days' / $C) - interval '1 minute',
       now() - j * (interval '2 days' / $C), '{}'
  FROM generate_series(1, $C) j`,
		`INSERT INTO bgtask_closures (ledger, root_session, task_id, member) VALUES ('big', 's-77', 't-77', 'm-0'), ('big', 's-88', 't-88', 'm-9')`,
		`INSERT INTO bgtask_stops (closure_id, task_id, attempt_id, session_id, token, member, status, err)
SELECT k.id, k.task_id, 'a', 's', 'r-' || k.id || '-' || x, k.member, 'cancelled', '' FROM bgtask_closures k, generate_series(1, 2) x WHERE k.ledger = 'big'`,
		`INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) SELECT 'big', 'l-' || j, 's-' || j, 'm-' || (j % 10) FROM generate_series(1, 20) j`,
		`INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body)
SELECT ledger, bgtask_part(parent_session), parent_session, 'n-' || task_id, 'progress', '{}'
  FROM bgtask_tasks WHERE ledger = 'big' AND substr(task_id, 3)::bigint % 200 = 5`,
		`INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body)
SELECT 'big', bgtask_part('s-' || (j * 7)), 's-' || (j * 7), 'all_complete:s-' || (j * 7) || ':1', 'all_complete', '[]' FROM generate_series(1, 100) j`,
		`INSERT INTO bgtask_finals (ledger, parent_session, task_id, body)
SELECT 'big', 's-' || (j * 100), 't-' || (j * 1000), '{}' FROM generate_series(1, $P / 100) j`,
		`ALTER TABLE bgtask_parents DISABLE TRIGGER bgtask_parents_row`,
		`INSERT INTO bgtask_parents (ledger, parent_session, live, round, round_tasks, touched)
SELECT 'big', 's-' || j, CASE WHEN j % 100 = 0 THEN 1 ELSE 0 END, 2, CASE WHEN j % 100 = 0 THEN ARRAY['t-' || (j * 10)] ELSE '{}' END,
       now() - j * (interval '2 days' / $P)
  FROM generate_series(1, $P) j`,
		`ALTER TABLE bgtask_parents ENABLE TRIGGER bgtask_parents_row`,
		`INSERT INTO bgtask_parts (ledger, part, member, until)
SELECT 'big', j, 'm-' || (j % 8), now() + (j - 8) * interval '1 minute' FROM generate_series(0, 15) j`,
		`INSERT INTO bgtask_changes (ledger, member, task_id, body, ended_at)
SELECT ledger, member, task_id, jsonb_build_object('id', task_id, 'status', CASE WHEN ended THEN 'completed' ELSE 'running' END),
       CASE WHEN ended THEN now() - ($N - substr(task_id, 3)::bigint) * (interval '2 days' / $N) END
  FROM bgtask_tasks WHERE ledger = 'big' ORDER BY substr(task_id, 3)::bigint`,
		`INSERT INTO bgtask_retention (ledger) VALUES ('big'), ('small')`,
		// The small ledger: a thousand tasks, five members.
		`INSERT INTO bgtask_members (ledger, member, fence, holder, expires_at) SELECT 'small', 'm-' || k, 1, 'h', now() + interval '1 day' FROM generate_series(0, 4) k`,
		`INSERT INTO bgtask_tasks (ledger, task_id, member, attempt_id, token, ended, parent_session)
SELECT 'small', 't-' || i, 'm-' || i % 5, 'a-' || i, 'r-' || i, i % 10 <> 0, 'chat' FROM generate_series(1, 1000) i`,
		`INSERT INTO bgtask_sessions (ledger, session_id, member, task_id, attempt_id)
SELECT ledger, 's-' || substr(task_id, 3), member, task_id, attempt_id FROM bgtask_tasks WHERE ledger = 'small'`,
		`INSERT INTO bgtask_changes (ledger, member, task_id, body, ended_at)
SELECT ledger, member, task_id, jsonb_build_object('id', task_id, 'status', 'completed'), now() FROM bgtask_tasks WHERE ledger = 'small'`,
		`INSERT INTO bgtask_closures (ledger, root_session, task_id, member, closed_at, record)
SELECT 'small', 's-' || j, 't-' || j, 'm-0', now(), '{}' FROM generate_series(1, 10) j`,
	} {
		_, err := pool.Exec(c1, vars.Replace(q))
		require.NoError(t, err, "%s", q)
	}
	for _, table := range []string{"bgtask_members", "bgtask_records", "bgtask_tasks", "bgtask_sessions", "bgtask_keys", "bgtask_inbox",
		"bgtask_closures", "bgtask_launching", "bgtask_stops", "bgtask_notes", "bgtask_parents", "bgtask_parts", "bgtask_finals", "bgtask_changes",
		"bgtask_retention"} {
		_, err := pool.Exec(c1, "VACUUM ANALYZE "+table)
		require.NoError(t, err)
	}
}

// bigRows holds the row counts bigTables read, for the messages.
var bigRows = map[string]int64{}

// bigTable is how many rows make a table big: the planner may read a
// smaller one whole (a few dozen pages), and rightly. At 50,000 tasks
// the tasks, sessions, changes and records are big; at 1,000,000 every
// table but the inbox, launches, claims and retention rows.
const bigTable = 10_000

// bigTables names the tables of the schema with bigTable rows or more.
func bigTables(t *testing.T, conn *pgx.Conn) map[string]bool {
	t.Helper()
	rows, err := conn.Query(ctx(t), `SELECT c.relname, c.reltuples::bigint FROM pg_class c
 WHERE c.relnamespace = current_schema()::regnamespace AND c.relkind = 'r'`)
	require.NoError(t, err)
	out := map[string]bool{}
	var name string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&name, &n}, func() error {
		bigRows[name] = n
		out[name] = n >= bigTable
		return nil
	})
	require.NoError(t, err)
	return out
}

// plan is what EXPLAIN (FORMAT JSON) says.
type plan struct {
	Plan      map[string]any `json:"Plan"`
	Planning  float64        `json:"Planning Time"`
	Execution float64        `json:"Execution Time"`
	JIT       map[string]any `json:"JIT"` // set when the run was compiled (its cost was above jit_above_cost)
	raw       string
}

func explainJSON(t *testing.T, conn *pgx.Conn, sql string) plan {
	t.Helper()
	var raw string
	require.NoError(t, conn.QueryRow(context.Background(), sql, pgx.QueryExecModeSimpleProtocol).Scan(&raw), "%s", sql)
	var out []plan
	require.NoError(t, json.Unmarshal([]byte(raw), &out))
	require.Len(t, out, 1)
	out[0].raw = raw
	return out[0]
}

// readLimit is how many rows of big tables a statement may read (index
// entries and rows a filter dropped included): its own few, and not a
// member's history or a table's.
const readLimit = 1000

// rowsRead sums the rows the scans of plan (EXPLAIN ANALYZE's) read of
// the big tables — returned, and those a filter or a recheck dropped —
// and says where.
func rowsRead(plan map[string]any, big map[string]bool) (int64, string) {
	var n int64
	var where []string
	var walk func(map[string]any)
	walk = func(p map[string]any) {
		if rel, ok := p["Relation Name"].(string); ok && big[rel] && p["Node Type"] != "ModifyTable" {
			num := func(k string) float64 { f, _ := p[k].(float64); return f }
			r := int64((num("Actual Rows") + num("Rows Removed by Filter") + num("Rows Removed by Index Recheck")) * max(num("Actual Loops"), 1))
			if r > 0 {
				idx, _ := p["Index Name"].(string)
				where = append(where, fmt.Sprintf("%s %s %s: %d", p["Node Type"], rel, idx, r))
			}
			n += r
		}
		if subs, ok := p["Plans"].([]any); ok {
			for _, s := range subs {
				if m, ok := s.(map[string]any); ok {
					walk(m)
				}
			}
		}
	}
	walk(plan)
	return n, strings.Join(where, ", ")
}

// scan is one node of a plan that reads a relation.
type scan struct{ node, rel, index string }

// scans lists the nodes of plan that read a relation, depth first.
func scans(plan map[string]any) []scan {
	var out []scan
	var walk func(map[string]any)
	walk = func(p map[string]any) {
		if rel, ok := p["Relation Name"].(string); ok && p["Node Type"] != "ModifyTable" {
			idx, _ := p["Index Name"].(string)
			out = append(out, scan{node: p["Node Type"].(string), rel: rel, index: idx})
		} else if idx, ok := p["Index Name"].(string); ok { // a Bitmap Index Scan
			out = append(out, scan{node: p["Node Type"].(string), index: idx})
		}
		if subs, ok := p["Plans"].([]any); ok {
			for _, s := range subs {
				if m, ok := s.(map[string]any); ok {
					walk(m)
				}
			}
		}
	}
	walk(plan)
	return out
}

// summary says how a plan reads its relations: "Index Scan bgtask_tasks_pkey,
// Seq Scan bgtask_inbox", or "-" for none.
func summary(ss []scan) string {
	var parts []string
	for _, s := range ss {
		switch {
		case s.index != "":
			parts = append(parts, strings.TrimSuffix(s.node, " Scan")+" "+s.index)
		default:
			parts = append(parts, s.node+" "+s.rel)
		}
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, ", ")
}
