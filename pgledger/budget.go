package pgledger

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/bgtask/bgtask"
	"github.com/jackc/pgx/v5"
)

// Budgets across a fleet. A tree's budget (bgtask.Budget) is kept in the
// database, so that every process of the fleet spends from the one
// account, whichever member holds each task of the tree:
//
//   - bgtask_budgets is one row per budget: the task that holds it, the
//     budget above it, its limits, and what its tree spent, spawned and
//     holds reserved; over names the hard limit it reached.
//   - bgtask_spends is one row per task in a budget: the innermost budget
//     it spends from, whether its spawn is still reserved, whether a
//     session of it ran.
//   - Node.Launch admits each launch (bgtask_budget_admit), in one
//     transaction that locks the rows of the budgets above it: refused
//     when one is spent or has no spawn left (*bgtask.BudgetError),
//     otherwise a spawn reserved in each and the launch's own budget
//     granted, clamped by what they have left.
//   - Every commit of a member goes through bgtask_write (write.go), which
//     writes it and, in the same transaction, adds each
//     usage record to every budget above its task, spends a spawn at a
//     task's first session, gives one back when a task ends without one,
//     and marks a budget over when a figure reaches its limit
//     (NOTIFY bgtask_budget).
//   - A node that hears of a budget over (or finds one at its Poll)
//     claims it and closes its holder's branch across the fleet, as
//     Node.Stop with Target.Tree does, with the budget as the stop cause.
//
// So no launch is admitted past a spent budget from the commit that spent
// it, and the overrun is what the tree's live runs report until their
// stop is recorded: the notification's latency (Poll at most) plus the
// closure's.

// budgetChannel is what bgtask_write (bgtask_spend) notifies when a budget
// became over.
const budgetChannel = "bgtask_budget"

// budgetSchema is migration 8.
const budgetSchema = `
CREATE TABLE bgtask_budgets (
	ledger         text        NOT NULL,
	holder         text        NOT NULL,
	up             text        NOT NULL DEFAULT '',
	lim_tokens     bigint      NOT NULL DEFAULT 0,
	lim_cost       bigint      NOT NULL DEFAULT 0,
	lim_requests   bigint      NOT NULL DEFAULT 0,
	lim_spawns     bigint      NOT NULL DEFAULT 0,
	spent_input    bigint      NOT NULL DEFAULT 0,
	spent_output   bigint      NOT NULL DEFAULT 0,
	spent_cached   bigint      NOT NULL DEFAULT 0,
	spent_requests bigint      NOT NULL DEFAULT 0,
	spent_cost     bigint      NOT NULL DEFAULT 0,
	spawned        bigint      NOT NULL DEFAULT 0,
	reserved       bigint      NOT NULL DEFAULT 0,
	over           text        NOT NULL DEFAULT '',
	closing_at     timestamptz,
	closed         boolean     NOT NULL DEFAULT false,
	PRIMARY KEY (ledger, holder)
);
CREATE INDEX bgtask_budgets_open ON bgtask_budgets (ledger) WHERE over <> '' AND NOT closed;
CREATE TABLE bgtask_spends (
	ledger   text    NOT NULL,
	task_id  text    NOT NULL,
	holder   text    NOT NULL,
	reserved boolean NOT NULL,
	started  boolean NOT NULL DEFAULT false,
	PRIMARY KEY (ledger, task_id)
);

-- bgtask_budget_move moves the reservations (by d_reserved) and spawns
-- (by d_spawned) of every budget from p_holder up.
CREATE FUNCTION bgtask_budget_move(p_ledger text, p_holder text, d_reserved bigint, d_spawned bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
	h text := p_holder;
	n int := 0;
BEGIN
	WHILE h <> '' AND n < 1000 LOOP
		UPDATE bgtask_budgets SET reserved = greatest(reserved + d_reserved, 0), spawned = spawned + d_spawned
		 WHERE ledger = p_ledger AND holder = h RETURNING up INTO h;
		EXIT WHEN NOT FOUND;
		n := n + 1;
	END LOOP;
END
$$;

-- bgtask_budget_lock locks the budgets of the chains from p_holders up,
-- in holder order: every transaction that moves budgets takes their
-- locks in the one order, so two never wait on each other crosswise.
CREATE FUNCTION bgtask_budget_lock(p_ledger text, p_holders text[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
	PERFORM 1 FROM bgtask_budgets b
	 WHERE b.ledger = p_ledger AND b.holder IN (
		WITH RECURSIVE c(holder, n) AS (
			SELECT h, 0 FROM unnest(p_holders) AS h WHERE h <> ''
			UNION
			SELECT x.up, c.n + 1 FROM bgtask_budgets x JOIN c ON x.ledger = p_ledger AND x.holder = c.holder
			 WHERE x.up <> '' AND c.n < 1000)
		SELECT holder FROM c)
	 ORDER BY b.holder FOR UPDATE;
END
$$;

-- bgtask_budget_above is the budget a task spends from above its own.
CREATE FUNCTION bgtask_budget_above(p_ledger text, p_task text, p_holder text) RETURNS text
LANGUAGE sql STABLE AS $$
	SELECT CASE WHEN p_holder = p_task
	       THEN coalesce((SELECT up FROM bgtask_budgets WHERE ledger = p_ledger AND holder = p_task), '')
	       ELSE p_holder END
$$;

-- bgtask_budget_admit admits the launch of task p_task under session
-- p_parent, bringing budget p_own (tokens, cost, requests, spawns, soft
-- percent; null: none): refused_by names the budget that refuses it, and
-- lim, max, spent and reserved the figures; otherwise grant is its own
-- budget as granted (null: none), and a spawn is reserved above it.
CREATE FUNCTION bgtask_budget_admit(p_ledger text, p_task text, p_parent text, p_own bigint[])
RETURNS TABLE (r_by text, r_limit text, r_max bigint, r_spent bigint, r_reserved bigint, r_grant bigint[])
LANGUAGE plpgsql AS $$
DECLARE
	up text;
	h text;
	b bgtask_budgets;
	chain text[] := '{}';
	lt bigint := -1;
	lc bigint := -1;
	lr bigint := -1;
	ls bigint := -1;
	g bigint[];
BEGIN
	SELECT sp.holder INTO up FROM bgtask_sessions s JOIN bgtask_spends sp ON sp.ledger = s.ledger AND sp.task_id = s.task_id
	 WHERE s.ledger = p_ledger AND s.session_id = p_parent;
	up := coalesce(up, '');
	PERFORM bgtask_budget_lock(p_ledger, ARRAY[up]);
	h := up;
	WHILE h <> '' AND cardinality(chain) < 1000 LOOP
		SELECT * INTO b FROM bgtask_budgets WHERE ledger = p_ledger AND holder = h FOR UPDATE;
		EXIT WHEN NOT FOUND;
		IF b.over <> '' THEN
			RETURN QUERY SELECT b.holder, b.over,
				CASE b.over WHEN 'tokens' THEN b.lim_tokens WHEN 'cost' THEN b.lim_cost ELSE b.lim_requests END,
				CASE b.over WHEN 'tokens' THEN b.spent_input + b.spent_output WHEN 'cost' THEN b.spent_cost ELSE b.spent_requests END,
				0::bigint, NULL::bigint[];
			RETURN;
		END IF;
		IF b.lim_spawns > 0 AND b.spawned + b.reserved >= b.lim_spawns THEN
			RETURN QUERY SELECT b.holder, 'spawns'::text, b.lim_spawns, b.spawned, b.reserved, NULL::bigint[];
			RETURN;
		END IF;
		IF b.lim_tokens > 0 THEN lt := CASE WHEN lt < 0 THEN greatest(b.lim_tokens - b.spent_input - b.spent_output, 0)
			ELSE least(lt, greatest(b.lim_tokens - b.spent_input - b.spent_output, 0)) END; END IF;
		IF b.lim_cost > 0 THEN lc := CASE WHEN lc < 0 THEN greatest(b.lim_cost - b.spent_cost, 0)
			ELSE least(lc, greatest(b.lim_cost - b.spent_cost, 0)) END; END IF;
		IF b.lim_requests > 0 THEN lr := CASE WHEN lr < 0 THEN greatest(b.lim_requests - b.spent_requests, 0)
			ELSE least(lr, greatest(b.lim_requests - b.spent_requests, 0)) END; END IF;
		IF b.lim_spawns > 0 THEN ls := CASE WHEN ls < 0 THEN greatest(b.lim_spawns - b.spawned - b.reserved, 0)
			ELSE least(ls, greatest(b.lim_spawns - b.spawned - b.reserved, 0)) END; END IF;
		chain := chain || h;
		h := b.up;
	END LOOP;
	IF cardinality(chain) = 0 AND p_own IS NULL THEN
		RETURN QUERY SELECT ''::text, ''::text, 0::bigint, 0::bigint, 0::bigint, NULL::bigint[];
		RETURN;
	END IF;
	IF EXISTS (SELECT 1 FROM bgtask_spends WHERE ledger = p_ledger AND task_id = p_task) THEN
		RAISE EXCEPTION 'bgtask: task % was admitted to a budget already', p_task USING ERRCODE = 'BT002';
	END IF;
	UPDATE bgtask_budgets SET reserved = reserved + 1 WHERE ledger = p_ledger AND holder = ANY(chain);
	IF p_own IS NOT NULL THEN
		g := p_own;
		IF lt >= 0 AND (g[1] = 0 OR g[1] > lt) THEN g[1] := lt; END IF;
		IF lc >= 0 AND (g[2] = 0 OR g[2] > lc) THEN g[2] := lc; END IF;
		IF lr >= 0 AND (g[3] = 0 OR g[3] > lr) THEN g[3] := lr; END IF;
		IF ls >= 0 AND (g[4] = 0 OR g[4] > ls - 1) THEN g[4] := ls - 1; END IF;
		INSERT INTO bgtask_budgets (ledger, holder, up, lim_tokens, lim_cost, lim_requests, lim_spawns)
		VALUES (p_ledger, p_task, up, g[1], g[2], g[3], g[4]);
	END IF;
	INSERT INTO bgtask_spends (ledger, task_id, holder, reserved)
	VALUES (p_ledger, p_task, CASE WHEN p_own IS NULL THEN up ELSE p_task END, cardinality(chain) > 0);
	RETURN QUERY SELECT ''::text, ''::text, 0::bigint, 0::bigint, 0::bigint, g;
END
$$;

-- bgtask_budget_undo takes back the admission of a launch that did not
-- happen (its task is no member's).
CREATE FUNCTION bgtask_budget_undo(p_ledger text, p_task text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
	s bgtask_spends;
BEGIN
	IF EXISTS (SELECT 1 FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = p_task) THEN
		RETURN;
	END IF;
	SELECT * INTO s FROM bgtask_spends WHERE ledger = p_ledger AND task_id = p_task FOR UPDATE;
	IF NOT FOUND THEN
		RETURN;
	END IF;
	IF s.reserved THEN
		PERFORM bgtask_budget_move(p_ledger, bgtask_budget_above(p_ledger, p_task, s.holder), -1, 0);
	END IF;
	DELETE FROM bgtask_spends WHERE ledger = p_ledger AND task_id = p_task;
	DELETE FROM bgtask_budgets WHERE ledger = p_ledger AND holder = p_task;
END
$$;

-- bgtask_append_budgets is bgtask_append, and the budgets its records
-- move, in one transaction: each usage record (p_input … p_cost, by
-- record) is added to every budget its task spends from, a task's first
-- session spends its spawn, a task the commit ended with its spawn still
-- reserved gives it back, and a budget whose figure reached its limit is
-- over (NOTIFY bgtask_budget). A commit that landed already moves
-- nothing again.
CREATE FUNCTION bgtask_append_budgets(
	p_ledger text, p_member text, p_fence bigint, p_lease interval,
	p_seq bigint[], p_kind text[], p_task text[], p_attempt text[], p_token text[],
	p_session text[], p_parent text[], p_data bytea[], p_rounds boolean,
	p_input bigint[], p_output bigint[], p_cached bigint[], p_requests bigint[], p_cost bigint[]
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
	i int;
	s bgtask_spends;
	h text;
	n int;
	crossed boolean := false;
	x boolean;
	landed boolean;
BEGIN
	landed := coalesce(array_length(p_seq, 1), 0) > 0 AND EXISTS (
		SELECT 1 FROM bgtask_records WHERE ledger = p_ledger AND member = p_member AND seq = p_seq[1]);
	PERFORM bgtask_append(p_ledger, p_member, p_fence, p_lease, p_seq, p_kind, p_task, p_attempt, p_token,
		p_session, p_parent, p_data, p_rounds);
	IF landed THEN
		RETURN;
	END IF;
	PERFORM bgtask_budget_lock(p_ledger, ARRAY(
		SELECT sp.holder FROM bgtask_spends sp WHERE sp.ledger = p_ledger AND sp.task_id = ANY(p_task)));
	FOR i IN 1 .. coalesce(array_length(p_seq, 1), 0) LOOP
		CONTINUE WHEN p_kind[i] <> 'usage' AND p_kind[i] <> 'session_bound';
		SELECT * INTO s FROM bgtask_spends WHERE ledger = p_ledger AND task_id = p_task[i] FOR UPDATE;
		CONTINUE WHEN NOT FOUND;
		IF p_kind[i] = 'usage' THEN
			h := s.holder;
			n := 0;
			WHILE h <> '' AND n < 1000 LOOP
				UPDATE bgtask_budgets SET spent_input = spent_input + p_input[i], spent_output = spent_output + p_output[i],
				       spent_cached = spent_cached + p_cached[i], spent_requests = spent_requests + p_requests[i],
				       spent_cost = spent_cost + p_cost[i],
				       over = CASE WHEN over <> '' THEN over
				                   WHEN lim_tokens > 0 AND spent_input + spent_output + p_input[i] + p_output[i] >= lim_tokens THEN 'tokens'
				                   WHEN lim_cost > 0 AND spent_cost + p_cost[i] >= lim_cost THEN 'cost'
				                   WHEN lim_requests > 0 AND spent_requests + p_requests[i] >= lim_requests THEN 'requests'
				                   ELSE '' END
				 WHERE ledger = p_ledger AND holder = h RETURNING up, over <> '' AND NOT closed AND closing_at IS NULL INTO h, x;
				EXIT WHEN NOT FOUND;
				crossed := crossed OR coalesce(x, false); -- over and nobody closing it yet: tell the nodes
				n := n + 1;
			END LOOP;
		ELSIF NOT s.started THEN
			UPDATE bgtask_spends SET started = true, reserved = false WHERE ledger = p_ledger AND task_id = p_task[i];
			PERFORM bgtask_budget_move(p_ledger, bgtask_budget_above(p_ledger, p_task[i], s.holder),
				CASE WHEN s.reserved THEN -1 ELSE 0 END, 1);
		END IF;
	END LOOP;
	FOR s IN SELECT sp.* FROM bgtask_spends sp JOIN bgtask_tasks t ON t.ledger = sp.ledger AND t.task_id = sp.task_id
	          WHERE sp.ledger = p_ledger AND sp.task_id = ANY(p_task) AND sp.reserved AND t.ended FOR UPDATE OF sp LOOP
		UPDATE bgtask_spends SET reserved = false WHERE ledger = p_ledger AND task_id = s.task_id;
		PERFORM bgtask_budget_move(p_ledger, bgtask_budget_above(p_ledger, s.task_id, s.holder), -1, 0);
	END LOOP;
	IF crossed THEN
		PERFORM pg_notify('bgtask_budget', p_ledger);
	END IF;
END
$$;
`

// admitBudget admits the launch of task under parent, bringing own, into
// the budgets of its tree: it returns the budget to launch it with (own
// as granted, or nil), or the *bgtask.BudgetError that refuses it. The
// admissions that come together go in one statement (budgetAll).
func (n *Node) admitBudget(ctx context.Context, task, parent string, own *bgtask.Budget) (*bgtask.Budget, error) {
	a, err := n.budgets.do(ctx, budgetAsk{task: task, parent: parent, own: own})
	switch {
	case err != nil:
		return nil, dbErr("admitting a launch to its budget", err)
	case a.err != "":
		return nil, dbErr("admitting a launch to its budget", errors.New(a.err))
	case a.refused != nil:
		return nil, a.refused
	}
	return a.grant, nil
}

// budgetAsk is a launch's budget admission: its task, the session it is
// launched from, and the budget it brings (nil: none).
type budgetAsk struct {
	task, parent string
	own          *bgtask.Budget
}

// alone reports whether q must be sent alone (as admission.alone).
func (q budgetAsk) alone() bool { return admission{task: q.task, parent: q.parent}.alone() }

// budgetAnswer is an admission's answer: refused, or granted (grant: the
// launch's own budget as granted, nil if it brings none), or err, the
// database's refusal of this one launch.
type budgetAnswer struct {
	refused *bgtask.BudgetError
	grant   *bgtask.Budget
	err     string
}

// budgetAdmitSQL is budgetAll's statement.
const budgetAdmitSQL = `SELECT r_i, r_by, r_limit, r_max, r_spent, r_reserved, r_grant, r_err
  FROM bgtask_budget_admit_all($1, $2, $3, $4, $5)`

// budgetAll is the budget admissions' statement (bgtask_budget_admit_all).
func (n *Node) budgetAll(ctx context.Context, qs []budgetAsk) ([]budgetAnswer, error) {
	task, parent, has, own := make([]string, len(qs)), make([]string, len(qs)), make([]bool, len(qs)), make([]int64, 0, 5*len(qs))
	for i, q := range qs {
		task[i], parent[i] = q.task, q.parent
		if q.own != nil {
			has[i] = true
			own = append(own, q.own.Tokens, int64(q.own.Cost), q.own.Requests, q.own.Spawns, int64(q.own.SoftPercent))
		} else {
			own = append(own, 0, 0, 0, 0, 0)
		}
	}
	rows, err := n.pool.Query(ctx, budgetAdmitSQL, n.o.Ledger, task, parent, has, own)
	if err != nil {
		return nil, err
	}
	out := make([]budgetAnswer, len(qs))
	var i int
	var by, limit, msg string
	var maxv, spent, reserved int64
	var grant []int64
	_, err = pgx.ForEachRow(rows, []any{&i, &by, &limit, &maxv, &spent, &reserved, &grant, &msg}, func() error {
		if i < 1 || i > len(out) {
			return fmt.Errorf("pgledger: an answer for launch %d of %d", i, len(out))
		}
		a := &out[i-1]
		switch {
		case msg != "":
			a.err = msg
		case by != "":
			a.refused = &bgtask.BudgetError{TaskID: by, Limit: limit, Max: maxv, Spent: spent, Reserved: reserved}
		case len(grant) == 5:
			a.grant = &bgtask.Budget{Tokens: grant[0], Cost: bgtask.Cost(grant[1]), Requests: grant[2], Spawns: grant[3], SoftPercent: int(grant[4])}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// budgetDropped takes back the admission of a launch whose caller left
// before its answer came.
func (n *Node) budgetDropped(ctx context.Context, q budgetAsk, a budgetAnswer) {
	if a.refused == nil && a.err == "" {
		n.cleanUp(ctx, "launch's budget admission", func(c context.Context) error { return n.undoBudget(c, q.task) })
	}
}

// undoBudget takes back the admission of a launch that did not happen.
func (n *Node) undoBudget(ctx context.Context, task string) error {
	if _, err := n.pool.Exec(ctx, `SELECT bgtask_budget_undo($1, $2)`, n.o.Ledger, task); err != nil {
		return fmt.Errorf("taking back the budget admission of task %s: %w", task, err)
	}
	return nil
}

// Budget is the budget task id holds, as the fleet spent it (the whole
// tree's figures, whichever members ran it); false if it holds none.
// Left counts the budgets above it, as bgtask.BudgetState does.
func (n *Node) Budget(ctx context.Context, id string) (bgtask.BudgetState, bool, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	s := bgtask.BudgetState{TaskID: id, Left: bgtask.Budget{Tokens: -1, Cost: -1, Requests: -1, Spawns: -1}}
	for h, first := id, true; h != ""; first = false {
		var b bgtask.Budget
		var u bgtask.Usage
		var spawned, reserved int64
		var over, up string
		err := n.pool.QueryRow(ctx, `SELECT up, lim_tokens, lim_cost, lim_requests, lim_spawns, spent_input, spent_output, spent_cached,
       spent_requests, spent_cost, spawned, reserved, over FROM bgtask_budgets WHERE ledger = $1 AND holder = $2`, n.o.Ledger, h).Scan(
			&up, &b.Tokens, &b.Cost, &b.Requests, &b.Spawns, &u.InputTokens, &u.OutputTokens, &u.CachedTokens, &u.Requests, &u.Cost,
			&spawned, &reserved, &over)
		if errors.Is(err, pgx.ErrNoRows) {
			if first {
				return bgtask.BudgetState{}, false, nil
			}
			break
		}
		if err != nil {
			return bgtask.BudgetState{}, false, dbErr("reading a budget", err)
		}
		if first {
			s.Limit, s.Spent, s.Spawned, s.Reserved, s.Exceeded = b, u, spawned, reserved, over
		}
		left := func(cur *int64, limit, used int64) {
			if limit > 0 && (*cur < 0 || max(limit-used, 0) < *cur) {
				*cur = max(limit-used, 0)
			}
		}
		left(&s.Left.Tokens, b.Tokens, u.Tokens())
		c := int64(s.Left.Cost)
		left(&c, int64(b.Cost), int64(u.Cost))
		s.Left.Cost = bgtask.Cost(c)
		left(&s.Left.Requests, b.Requests, u.Requests)
		left(&s.Left.Spawns, b.Spawns, spawned+reserved)
		h = up
	}
	return s, true, nil
}

// budgetClaim is how long a node's claim to close a spent budget's
// branch holds before another node may take it over.
const budgetClaim = time.Minute

// closeSpent closes the branch of every budget that is over and not yet
// closed, which this node claims (another claimed it less than
// budgetClaim ago: it is left to that one), each on a goroutine of the
// node's.
func (n *Node) closeSpent(ctx context.Context) {
	rows, err := n.pool.Query(ctx, `UPDATE bgtask_budgets SET closing_at = now()
 WHERE ledger = $1 AND over <> '' AND NOT closed AND (closing_at IS NULL OR closing_at < now() - $2::interval)
 RETURNING holder, over`, n.o.Ledger, budgetClaim)
	if err != nil {
		return
	}
	type spent struct{ holder, over string }
	claimed, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (spent, error) {
		var s spent
		return s, row.Scan(&s.holder, &s.over)
	})
	if err != nil {
		return
	}
	for _, s := range claimed {
		if !n.goOwned(func() {
			_, err := n.Stop(n.loopCtx, bgtask.Target{Task: s.holder, Tree: true}) // its stops name the budget (stopCauseOf)
			switch {
			case n.loopCtx.Err() != nil:
				return // the node closes: the branch is not known closed, and once the claim expires another node closes it
			case err != nil && !errors.Is(err, context.Canceled):
				n.o.Logger.Warn("pgledger: closing a spent budget's branch", "task", s.holder, "err", err)
				return
			}
			if _, err := n.pool.Exec(n.loopCtx, `UPDATE bgtask_budgets SET closed = true WHERE ledger = $1 AND holder = $2`, n.o.Ledger, s.holder); err != nil && n.loopCtx.Err() == nil {
				n.o.Logger.Warn("pgledger: recording a spent budget's branch closed", "task", s.holder, "err", err)
			} // a node that closes meanwhile leaves it unrecorded: the next claim stops the branch again (nothing left to stop) and records it
		}) {
			return
		}
	}
}

// budgetOver is the limit a spent budget held by task reached, or "":
// the stop cause of a closure of task (cached per closure).
func (n *Node) budgetOver(ctx context.Context, k openClosure) string {
	if k.task == "" {
		return ""
	}
	n.stops.mu.Lock()
	over, ok := n.stops.over[k.id]
	n.stops.mu.Unlock()
	if ok {
		return over
	}
	err := n.pool.QueryRow(ctx, `SELECT coalesce((SELECT over FROM bgtask_budgets WHERE ledger = $1 AND holder = $2), '')`, n.o.Ledger, k.task).Scan(&over)
	if err != nil {
		return ""
	}
	n.stops.mu.Lock()
	if n.stops.over == nil {
		n.stops.over = map[int64]string{}
	}
	n.stops.over[k.id] = over
	n.stops.mu.Unlock()
	return over
}

// stopCauseOf is who a closure's stops say asked: the budget, for a
// closure of a spent budget's task; the closure otherwise.
func (n *Node) stopCauseOf(ctx context.Context, k openClosure) bgtask.StopCause {
	if over := n.budgetOver(ctx, k); over != "" {
		return bgtask.StopCause{Kind: bgtask.StopBudget, TaskID: k.task, Limit: over}
	}
	by := bgtask.StopCause{Kind: bgtask.StopClosure, Root: k.root, TaskID: k.task, Actor: k.actor}
	if k.task == "" || k.root != "" {
		by.TaskID = "" // a closure of a session, or of a task by its session: the session names it
	}
	return by
}

// isBudgetChannel reports whether a notification on channel, with
// payload, tells this node's ledger of a spent budget.
func (n *Node) isBudgetChannel(channel, payload string) bool {
	return channel == budgetChannel && strings.TrimSpace(payload) == n.o.Ledger
}
