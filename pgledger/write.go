package pgledger

// writeFunction is migration 10. It makes the outbox a part of the
// commit, and the commit one statement per kind of work.
//
// The outbox. A Manager of a node with a Notifier produces each
// notification in the commit that decides it (fleet.AtCommit), and
// bgtask_write writes it, in that commit, to bgtask_notes: append-only,
// in 16 parts by a hash of the parent session (bgtask_part), each
// row's id from one sequence. A notification is durable exactly when its
// cause is, is written once (a commit is written once), and costs no
// statement and no commit of its own. A round's all_complete is made in
// the commit that ends its last live task, after that commit's summaries,
// with the final summary of each of its tasks — that commit's, or kept in
// bgtask_finals from the commits that ended the others — so it is whole
// when written, and comes after every summary of its round in its part:
// a commit that ended another of the round's tasks committed before this
// one could end the round (both move the parent's row). A node delivers a
// part at a time (bgtask_parts: who holds it, until when): see outbox.go.
// bgtask_outbox and bgtask_claims, and the functions that wrote them,
// are gone; the notifications they still held are moved over.
//
// The commit. bgtask_write does what bgtask_append_budgets did (the
// lease, the identity checks, the parent rounds, the keys, the records,
// the budgets) with a statement per kind of work rather than per record:
// a commit of many records costs about what one costs.
//
//   - The checks. A record on a task is checked against the attempt
//     current when the record was made: the last attempt_created before it
//     in the commit, or else the task's row as the commit found it. The
//     first record (in the commit's order) that disagrees raises, with the
//     error the per-record append raised for it.
//   - The tasks. A task the commit launched is inserted as the commit
//     leaves it; each other task an attempt_created or attempt_finalized
//     moved is updated once, to the last attempt the commit created and to
//     whether the last of those records ended it.
//   - The budgets. A commit none of whose tasks spends from a budget (no
//     bgtask_spends row: the common case, and every commit of a ledger
//     that has no budget) skips them in one index probe; the others go
//     through bgtask_spend, which locks the budgets' chains in holder
//     order and moves them in a statement for the usage and one for the
//     reservations, with the outcome of moving them record by record.
//
// It returns the parts it wrote notes to, a bit each, so that the writer
// can wake their deliverers.
const writeFunction = `
-- Where a task's records lie among its member's (Journal.TaskRecords):
-- from its first record's seq to its last's as of the commit that last
-- moved it (read to the end while it is live).
ALTER TABLE bgtask_tasks ADD COLUMN first_seq bigint, ADD COLUMN last_seq bigint;
-- Who acted, when a closure's caller named them (Target.Actor): its
-- owners' stops say so.
ALTER TABLE bgtask_closures ADD COLUMN actor text NOT NULL DEFAULT '';
UPDATE bgtask_tasks t SET first_seq = r.f, last_seq = r.l
  FROM (SELECT ledger, member, task_id, min(seq) AS f, max(seq) AS l FROM bgtask_records WHERE task_id <> ''
         GROUP BY ledger, member, task_id) r
 WHERE r.ledger = t.ledger AND r.member = t.member AND r.task_id = t.task_id;
-- bgtask_part is the part of the outbox a parent's notifications go to
-- (the tests' partOf is the same in Go).
CREATE FUNCTION bgtask_part(p_parent text) RETURNS int
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
	SELECT get_byte(sha256(convert_to(p_parent, 'UTF8')), 0) & 15
$$;
CREATE SEQUENCE bgtask_notes_id;
CREATE TABLE bgtask_notes (
	ledger         text   NOT NULL,
	part           int    NOT NULL,
	id             bigint NOT NULL DEFAULT nextval('bgtask_notes_id'),
	parent_session text   NOT NULL,
	note_id        text   NOT NULL,
	kind           text   NOT NULL,
	body           text   NOT NULL, -- the Notification's JSON; an all_complete's: its round's final summaries, a JSON array
	PRIMARY KEY (ledger, part, id)
);
ALTER SEQUENCE bgtask_notes_id OWNED BY bgtask_notes.id;
CREATE TABLE bgtask_parts (
	ledger text        NOT NULL,
	part   int         NOT NULL,
	member text        NOT NULL DEFAULT '',
	until  timestamptz NOT NULL DEFAULT '-infinity',
	PRIMARY KEY (ledger, part)
);
CREATE TABLE bgtask_finals (
	ledger         text NOT NULL,
	parent_session text NOT NULL,
	task_id        text NOT NULL,
	body           text NOT NULL,
	PRIMARY KEY (ledger, parent_session, task_id)
);
-- What the outbox still held: each pending row, in its order; an
-- all_complete with its round's summaries (delivered or not, the latest
-- of each task).
INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body)
SELECT o.ledger, bgtask_part(o.parent_session), o.parent_session, o.note_id, o.kind,
       CASE WHEN o.kind = 'all_complete' THEN '[' || coalesce((
         SELECT string_agg(x.b, ',' ORDER BY x.id) FROM (
           SELECT DISTINCT ON (s.task_id) s.id, s.body::text AS b FROM bgtask_outbox s
            WHERE s.ledger = o.ledger AND s.kind = 'final_summary' AND s.task_id = ANY(o.round_tasks)
            ORDER BY s.task_id, s.id DESC) x), '') || ']'
       ELSE coalesce(o.body::text, '{}') END
  FROM bgtask_outbox o WHERE o.delivered_at IS NULL ORDER BY o.id;
-- The summaries of the tasks of rounds still open, for their all_complete.
INSERT INTO bgtask_finals (ledger, parent_session, task_id, body)
SELECT DISTINCT ON (s.ledger, s.parent_session, s.task_id) s.ledger, s.parent_session, s.task_id, s.body::text
  FROM bgtask_outbox s JOIN bgtask_parents p ON p.ledger = s.ledger AND p.parent_session = s.parent_session
 WHERE s.kind = 'final_summary' AND s.body IS NOT NULL AND s.task_id = ANY(p.round_tasks)
 ORDER BY s.ledger, s.parent_session, s.task_id, s.id DESC;
DROP FUNCTION bgtask_append_budgets(text, text, bigint, interval, bigint[], text[], text[], text[], text[], text[], text[], bytea[], boolean,
	bigint[], bigint[], bigint[], bigint[], bigint[]);
DROP FUNCTION bgtask_append(text, text, bigint, interval, bigint[], text[], text[], text[], text[], text[], text[], bytea[], boolean);
DROP TABLE bgtask_outbox;
DROP TABLE bgtask_claims;

-- bgtask_spend moves the budgets a commit's records spend from, in a few
-- statements whatever the commit's size, with the outcome of moving them
-- record by record: every usage report counts against each budget from
-- its task's holder up, and a budget becomes over at the first report, in
-- the commit's order, that takes it to a limit (tokens, then cost, then
-- requests, as each report is checked); a task's first binding turns its
-- reservation into a spawn above its own budget, once; a task that ended
-- reserved gives its reservation back.
CREATE FUNCTION bgtask_spend(
	p_ledger text, p_kind text[], p_task text[],
	p_input bigint[], p_output bigint[], p_cached bigint[], p_requests bigint[], p_cost bigint[]
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
	crossed boolean;
BEGIN
	PERFORM bgtask_budget_lock(p_ledger, ARRAY(
		SELECT sp.holder FROM bgtask_spends sp WHERE sp.ledger = p_ledger AND sp.task_id = ANY(p_task)));
	IF 'usage' = ANY(p_kind) THEN
		WITH RECURSIVE u AS (
			SELECT x.o, sp.holder, x.i, x.ou, x.c, x.r, x.co
			  FROM unnest(p_kind, p_task, p_input, p_output, p_cached, p_requests, p_cost) WITH ORDINALITY AS x(k, t, i, ou, c, r, co, o)
			  JOIN bgtask_spends sp ON sp.ledger = p_ledger AND sp.task_id = x.t
			 WHERE x.k = 'usage'),
		-- each holder's chain: the budgets from it up, while they are there
		c(start, holder, n) AS (
			SELECT DISTINCT b.holder, b.holder, 0 FROM u JOIN bgtask_budgets b ON b.ledger = p_ledger AND b.holder = u.holder
			UNION
			SELECT c.start, b.up, c.n + 1 FROM c JOIN bgtask_budgets b ON b.ledger = p_ledger AND b.holder = c.holder
			 WHERE b.up <> '' AND c.n < 1000),
		-- each budget's reports in the commit's order, with what it had spent
		-- after each
		run AS (
			SELECT b.holder, u.o, u.i, u.ou, u.c, u.r, u.co,
			       CASE WHEN b.over <> '' THEN ''
			            WHEN b.lim_tokens > 0 AND b.spent_input + b.spent_output + sum(u.i + u.ou) OVER w >= b.lim_tokens THEN 'tokens'
			            WHEN b.lim_cost > 0 AND b.spent_cost + sum(u.co) OVER w >= b.lim_cost THEN 'cost'
			            WHEN b.lim_requests > 0 AND b.spent_requests + sum(u.r) OVER w >= b.lim_requests THEN 'requests'
			            ELSE '' END AS reached
			  FROM (SELECT DISTINCT start, holder FROM c) h
			  JOIN u ON u.holder = h.start
			  JOIN bgtask_budgets b ON b.ledger = p_ledger AND b.holder = h.holder
			WINDOW w AS (PARTITION BY b.holder ORDER BY u.o)),
		d AS (
			SELECT run.holder, sum(run.i) AS i, sum(run.ou) AS ou, sum(run.c) AS c, sum(run.r) AS r, sum(run.co) AS co,
			       coalesce((array_agg(run.reached ORDER BY run.o) FILTER (WHERE run.reached <> ''))[1], '') AS reached
			  FROM run GROUP BY run.holder),
		up AS (
			UPDATE bgtask_budgets b SET spent_input = b.spent_input + d.i, spent_output = b.spent_output + d.ou,
			       spent_cached = b.spent_cached + d.c, spent_requests = b.spent_requests + d.r, spent_cost = b.spent_cost + d.co,
			       over = CASE WHEN b.over <> '' THEN b.over ELSE d.reached END
			  FROM d WHERE b.ledger = p_ledger AND b.holder = d.holder
			RETURNING b.over <> '' AND NOT b.closed AND b.closing_at IS NULL AS x)
		SELECT coalesce(bool_or(x), false) INTO crossed FROM up;
		IF crossed THEN
			PERFORM pg_notify('bgtask_budget', p_ledger);
		END IF;
	END IF;
	-- The reservations: a task bound for the first time starts (its
	-- reservation, if it has one, becomes a spawn); a task that ended
	-- reserved gives it back. Each moves every budget above its own.
	WITH RECURSIVE s AS (
		UPDATE bgtask_spends sp SET started = sp.started OR m.bound, reserved = false
		  FROM (SELECT sp.task_id, sp.holder, sp.reserved AS was, NOT sp.started AND b.t IS NOT NULL AS bound
		          FROM bgtask_spends sp
		          LEFT JOIN (SELECT DISTINCT x.t FROM unnest(p_kind, p_task) AS x(k, t) WHERE x.k = 'session_bound') b ON b.t = sp.task_id
		          LEFT JOIN bgtask_tasks t ON t.ledger = sp.ledger AND t.task_id = sp.task_id
		         WHERE sp.ledger = p_ledger AND sp.task_id = ANY(p_task)
		           AND ((NOT sp.started AND b.t IS NOT NULL) OR (sp.reserved AND t.ended))) m
		 WHERE sp.ledger = p_ledger AND sp.task_id = m.task_id
		RETURNING bgtask_budget_above(p_ledger, m.task_id, m.holder) AS above,
		          CASE WHEN m.was THEN -1 ELSE 0 END AS dr, m.bound::int AS ds),
		c(start, holder, n) AS (
			SELECT DISTINCT s.above, s.above, 0 FROM s WHERE s.above <> ''
			UNION
			SELECT c.start, b.up, c.n + 1 FROM c JOIN bgtask_budgets b ON b.ledger = p_ledger AND b.holder = c.holder
			 WHERE b.up <> '' AND c.n < 1000),
		d AS (
			SELECT h.holder, sum(s.dr) AS dr, sum(s.ds) AS ds
			  FROM (SELECT DISTINCT start, holder FROM c) h JOIN s ON s.above = h.start GROUP BY h.holder)
	UPDATE bgtask_budgets b SET reserved = greatest(b.reserved + d.dr, 0), spawned = b.spawned + d.ds
	  FROM d WHERE b.ledger = p_ledger AND b.holder = d.holder AND (d.dr <> 0 OR d.ds <> 0);
END
$$;

-- bgtask_admit_launches is bgtask_admit_all, but for a launch from a
-- session of a task that spends from a budget (bgtask_spends), unless
-- p_checked says its budget admitted it already: that one is answered -1
-- (admit it to its budget first, then here again), with no fence check
-- and nothing in flight. A launch into a spent budget's branch is so
-- refused by the budget, also while the closure that stops the branch
-- runs; and a launch from a branch with no budget — every launch of a
-- ledger with none — costs no budget statement at all.
CREATE FUNCTION bgtask_admit_launches(p_ledger text, p_task text[], p_parent text[], p_member text[], p_checked boolean[],
	p_within interval) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
	keep int[];
	sub bigint[];
	out bigint[];
	i int;
BEGIN
	SELECT array_agg(u.o::int ORDER BY u.o) INTO keep
	  FROM unnest(p_parent, p_checked) WITH ORDINALITY AS u(p, c, o)
	 WHERE u.c OR NOT EXISTS (SELECT 1 FROM bgtask_sessions s JOIN bgtask_spends sp ON sp.ledger = s.ledger AND sp.task_id = s.task_id
	                           WHERE s.ledger = p_ledger AND s.session_id = u.p);
	IF cardinality(keep) = cardinality(p_task) THEN
		RETURN bgtask_admit_all(p_ledger, p_task, p_parent, p_member, p_within);
	END IF;
	out := array_fill(-1::bigint, ARRAY[cardinality(p_task)]);
	IF keep IS NOT NULL THEN
		sub := bgtask_admit_all(p_ledger, ARRAY(SELECT p_task[k] FROM unnest(keep) k), ARRAY(SELECT p_parent[k] FROM unnest(keep) k),
			ARRAY(SELECT p_member[k] FROM unnest(keep) k), p_within);
		FOR i IN 1 .. cardinality(keep) LOOP
			out[keep[i]] := sub[i];
		END LOOP;
	END IF;
	RETURN out;
END
$$;

-- bgtask_budget_admit_all is bgtask_budget_admit of many launches, in
-- order, in one statement: every budget chain the launches reach is
-- locked first, at once, in holder order (bgtask_budget_lock: two batches
-- never wait on each other crosswise), then each launch is admitted or
-- refused as bgtask_budget_admit does it. A launch refused by the
-- database (admitted already: BT002) is answered with its error and
-- undoes nothing of the others. p_has says which launch brings a budget
-- of its own (p_own: five figures a launch, flattened).
CREATE FUNCTION bgtask_budget_admit_all(p_ledger text, p_task text[], p_parent text[], p_has boolean[], p_own bigint[])
RETURNS TABLE (r_i int, r_by text, r_limit text, r_max bigint, r_spent bigint, r_reserved bigint, r_grant bigint[], r_err text)
LANGUAGE plpgsql AS $$
DECLARE
	i int;
BEGIN
	PERFORM bgtask_budget_lock(p_ledger, ARRAY(
		SELECT sp.holder FROM unnest(p_parent) AS u(p)
		  JOIN bgtask_sessions s ON s.ledger = p_ledger AND s.session_id = u.p
		  JOIN bgtask_spends sp ON sp.ledger = s.ledger AND sp.task_id = s.task_id));
	FOR i IN 1 .. coalesce(cardinality(p_task), 0) LOOP
		BEGIN
			RETURN QUERY SELECT i, a.r_by, a.r_limit, a.r_max, a.r_spent, a.r_reserved, a.r_grant, ''::text
			  FROM bgtask_budget_admit(p_ledger, p_task[i], p_parent[i],
			       CASE WHEN p_has[i] THEN p_own[5 * i - 4 : 5 * i] END) a;
		EXCEPTION WHEN SQLSTATE 'BT002' THEN
			RETURN QUERY SELECT i, ''::text, ''::text, 0::bigint, 0::bigint, 0::bigint, NULL::bigint[], SQLERRM;
		END;
	END LOOP;
END
$$;

CREATE FUNCTION bgtask_write(
	p_ledger text, p_member text, p_fence bigint, p_lease interval,
	p_seq bigint[], p_kind text[], p_task text[], p_attempt text[], p_token text[],
	p_session text[], p_parent text[], p_data bytea[], p_rounds boolean,
	p_input bigint[], p_output bigint[], p_cached bigint[], p_requests bigint[], p_cost bigint[],
	p_note_parent text[], p_note_id text[], p_note_kind text[], p_note_task text[], p_note_body text[]
) RETURNS int LANGUAGE plpgsql AS $$
DECLARE
	bad record;
	before jsonb;
	born text[] := '{}'; -- the tasks the commit launched
	rounds jsonb;        -- the parent rounds the commit ended
	parents text[];      -- their parents
	parts int := 0;      -- the parts the commit wrote notes to, a bit each
BEGIN
	UPDATE bgtask_members SET expires_at = now() + p_lease
	 WHERE ledger = p_ledger AND member = p_member AND fence = p_fence AND expires_at > now();
	IF NOT FOUND THEN
		RAISE EXCEPTION 'bgtask: the lease of member % (fence %) was lost', p_member, p_fence
			USING ERRCODE = 'BT001';
	END IF;
	IF coalesce(cardinality(p_seq), 0) = 0 THEN
		RETURN 0;
	END IF;
	-- A commit tried again after its outcome was lost with its connection:
	-- if it landed (its first record is here: records of one member are
	-- written only under its fence, in sequence), it is not written twice.
	IF EXISTS (SELECT 1 FROM bgtask_records WHERE ledger = p_ledger AND member = p_member AND seq = p_seq[1]) THEN
		RETURN 0;
	END IF;
	-- Which of the commit's tasks were live before it: its end moves
	-- their parents' live counts.
	IF p_rounds THEN
		SELECT coalesce(jsonb_object_agg(task_id, NOT ended), '{}') INTO before
		  FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = ANY(p_task);
	END IF;
	-- The tasks the commit launched: no longer in flight, and the member's,
	-- inserted as the commit leaves them (the attempt it created last, and
	-- ended if the last of its attempt_created and attempt_finalized ended
	-- it).
	IF 'task_launched' = ANY(p_kind) THEN
		DELETE FROM bgtask_launching WHERE ledger = p_ledger
		   AND task_id = ANY(ARRAY(SELECT u.t FROM unnest(p_kind, p_task) AS u(k, t) WHERE u.k = 'task_launched'));
		WITH f AS (
			SELECT u.t, max(u.o) FILTER (WHERE u.k = 'attempt_created') AS lc,
			       max(u.o) FILTER (WHERE u.k = 'attempt_finalized') AS lf, max(u.s) AS ls
			  FROM unnest(p_kind, p_task, p_seq) WITH ORDINALITY AS u(k, t, s, o) GROUP BY u.t),
		ins AS (
			INSERT INTO bgtask_tasks (ledger, task_id, member, parent_session, attempt_id, token, ended, first_seq, last_seq)
			SELECT DISTINCT ON (u.t) p_ledger, u.t, p_member, u.p, coalesce(p_attempt[f.lc::int], ''), coalesce(p_token[f.lc::int], ''),
			       coalesce(f.lf, 0) > coalesce(f.lc, 0), u.s, f.ls
			  FROM unnest(p_kind, p_task, p_parent, p_seq) WITH ORDINALITY AS u(k, t, p, s, o) JOIN f ON f.t = u.t
			 WHERE u.k = 'task_launched' ORDER BY u.t, u.o
			ON CONFLICT (ledger, task_id) DO NOTHING
			RETURNING task_id)
		SELECT coalesce(array_agg(task_id), '{}') INTO born FROM ins;
	END IF;
	-- The first record that does not agree with the tasks: each is checked
	-- against the attempt the last attempt_created before it in the commit
	-- made current, or else against the task as the commit found it (none
	-- yet, for a task it launched).
	SELECT r.o, r.k, r.t, r.a, r.r, x.member INTO bad
	  FROM (SELECT u.o, u.k, u.t, u.a, u.r,
	               max(u.o) FILTER (WHERE u.k = 'attempt_created')
	                 OVER (PARTITION BY u.t ORDER BY u.o ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev
	          FROM unnest(p_kind, p_task, p_attempt, p_token) WITH ORDINALITY AS u(k, t, a, r, o)
	         WHERE u.k IN ('task_launched', 'attempt_created', 'session_bound', 'attempt_finalized', 'retry_scheduled', 'start_requested')) r
	  LEFT JOIN bgtask_tasks x ON x.ledger = p_ledger AND x.task_id = r.t
	 WHERE x.member IS DISTINCT FROM p_member
	    OR (r.k NOT IN ('task_launched', 'attempt_created')
	        AND (CASE WHEN r.prev IS NOT NULL THEN p_attempt[r.prev::int] WHEN r.t = ANY(born) THEN '' ELSE x.attempt_id END IS DISTINCT FROM r.a
	             OR CASE WHEN r.prev IS NOT NULL THEN p_token[r.prev::int] WHEN r.t = ANY(born) THEN '' ELSE x.token END IS DISTINCT FROM r.r))
	 ORDER BY r.o LIMIT 1;
	IF FOUND THEN
		IF bad.k = 'task_launched' THEN
			RAISE EXCEPTION 'bgtask: task id % is taken by member %', bad.t, bad.member
				USING ERRCODE = 'BT002';
		ELSIF bad.k = 'attempt_created' THEN
			RAISE EXCEPTION 'bgtask: attempt % of task %: no such task of member %', bad.a, bad.t, p_member
				USING ERRCODE = 'BT003';
		END IF;
		RAISE EXCEPTION 'bgtask: % for attempt % (run %) of task %, which is not its current attempt',
			bad.k, bad.a, bad.r, bad.t
			USING ERRCODE = 'BT003';
	END IF;
	-- Each task launched before that the commit moved, likewise.
	UPDATE bgtask_tasks t
	   SET attempt_id = CASE WHEN f.lc IS NULL THEN t.attempt_id ELSE p_attempt[f.lc::int] END,
	       token = CASE WHEN f.lc IS NULL THEN t.token ELSE p_token[f.lc::int] END,
	       ended = coalesce(f.lf, 0) > coalesce(f.lc, 0),
	       last_seq = f.ls
	  FROM (SELECT u.t, max(u.o) FILTER (WHERE u.k = 'attempt_created') AS lc,
	               max(u.o) FILTER (WHERE u.k = 'attempt_finalized') AS lf, max(u.s) AS ls
	          FROM unnest(p_kind, p_task, p_seq) WITH ORDINALITY AS u(k, t, s, o)
	         WHERE u.t <> ALL(born) GROUP BY u.t
	        HAVING count(*) FILTER (WHERE u.k IN ('attempt_created', 'attempt_finalized')) > 0) f
	 WHERE t.ledger = p_ledger AND t.task_id = f.t;
	-- The sessions the commit bound (the last binding of each, should one
	-- be bound twice); one another member holds raises.
	IF 'session_bound' = ANY(p_kind) THEN
		INSERT INTO bgtask_sessions AS s (ledger, session_id, member, task_id, attempt_id)
		SELECT DISTINCT ON (u.s) p_ledger, u.s, p_member, u.t, u.a
		  FROM unnest(p_kind, p_session, p_task, p_attempt) WITH ORDINALITY AS u(k, s, t, a, o)
		 WHERE u.k = 'session_bound' ORDER BY u.s, u.o DESC
		ON CONFLICT (ledger, session_id) DO UPDATE
		   SET task_id = EXCLUDED.task_id, attempt_id = EXCLUDED.attempt_id
		 WHERE s.member = EXCLUDED.member;
		SELECT u.s, x.member INTO bad
		  FROM unnest(p_kind, p_session) WITH ORDINALITY AS u(k, s, o)
		  JOIN bgtask_sessions x ON x.ledger = p_ledger AND x.session_id = u.s
		 WHERE u.k = 'session_bound' AND x.member <> p_member
		 ORDER BY u.o LIMIT 1;
		IF FOUND THEN
			RAISE EXCEPTION 'bgtask: session % is bound by member %', bad.s, bad.member
				USING ERRCODE = 'BT004';
		END IF;
	END IF;
	-- The notifications the commit produced, in its order: each in its
	-- parent's part of the outbox (bgtask_part), before any all_complete
	-- the commit makes below, which comes after its round's summaries.
	IF coalesce(cardinality(p_note_id), 0) > 0 THEN
		WITH ins AS (
			INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body)
			SELECT p_ledger, bgtask_part(u.p), u.p, u.i, u.k, u.b
			  FROM unnest(p_note_parent, p_note_id, p_note_kind, p_note_body) WITH ORDINALITY AS u(p, i, k, b, o)
			 ORDER BY u.o
			RETURNING part)
		SELECT coalesce(bit_or(1 << part), 0) INTO parts FROM ins;
	END IF;
	-- Each parent whose live count the commit moved, in a fixed order (two
	-- commits never wait on each other's rows crosswise); a round whose
	-- last task ended makes its all_complete, with the final summary of
	-- each of its tasks: kept in bgtask_finals from the commits that ended
	-- them, or this commit's.
	IF p_rounds THEN
		WITH m AS (
			SELECT t.parent_session AS parent,
			       sum((NOT t.ended)::int - coalesce((before ->> t.task_id)::boolean, false)::int) AS delta,
			       -- born into the round: new in this commit (whatever it came to),
			       -- or live again after it had ended
			       array_agg(t.task_id) FILTER (WHERE NOT (before ? t.task_id)
			           OR (NOT t.ended AND NOT (before ->> t.task_id)::boolean)) AS born
			  FROM bgtask_tasks t
			 WHERE t.ledger = p_ledger AND t.task_id = ANY(p_task) AND t.parent_session <> ''
			 GROUP BY t.parent_session),
		up AS (
			INSERT INTO bgtask_parents AS x (ledger, parent_session, live, round_tasks)
			SELECT p_ledger, m.parent, m.delta, coalesce(m.born, '{}') FROM m
			 WHERE m.delta <> 0 OR m.born IS NOT NULL ORDER BY m.parent
			ON CONFLICT (ledger, parent_session) DO UPDATE
			   SET live = x.live + EXCLUDED.live, round_tasks = x.round_tasks || EXCLUDED.round_tasks
			RETURNING x.parent_session, x.live, x.round, x.round_tasks)
		SELECT jsonb_agg(jsonb_build_object('p', up.parent_session, 'r', up.round, 't', up.round_tasks) ORDER BY up.parent_session),
		       array_agg(up.parent_session)
		  INTO rounds, parents FROM up WHERE up.live <= 0 AND cardinality(up.round_tasks) > 0;
		-- A summary of a round that goes on waits for the round's end.
		IF 'final_summary' = ANY(p_note_kind) THEN
			INSERT INTO bgtask_finals AS f (ledger, parent_session, task_id, body)
			SELECT DISTINCT ON (u.p, u.t) p_ledger, u.p, u.t, u.b
			  FROM unnest(p_note_parent, p_note_kind, p_note_task, p_note_body) WITH ORDINALITY AS u(p, k, t, b, o)
			  JOIN bgtask_parents x ON x.ledger = p_ledger AND x.parent_session = u.p AND u.t = ANY(x.round_tasks)
			 WHERE u.k = 'final_summary' AND u.p <> ALL(coalesce(parents, '{}'))
			 ORDER BY u.p, u.t, u.o DESC
			ON CONFLICT (ledger, parent_session, task_id) DO UPDATE SET body = EXCLUDED.body;
		END IF;
		IF rounds IS NOT NULL THEN
			WITH ins AS (
				INSERT INTO bgtask_notes (ledger, part, parent_session, note_id, kind, body)
				SELECT p_ledger, bgtask_part(e.p), e.p, 'all_complete:' || e.p || ':' || e.r, 'all_complete',
				       '[' || coalesce((
				         SELECT string_agg(c.b, ',' ORDER BY array_position(e.t, c.t)) FROM (
				           SELECT DISTINCT ON (a.t) a.t, a.b FROM (
				             SELECT u.t, u.b, 0 AS pri, u.o
				               FROM unnest(p_note_parent, p_note_kind, p_note_task, p_note_body) WITH ORDINALITY AS u(p, k, t, b, o)
				              WHERE u.p = e.p AND u.k = 'final_summary' AND u.t = ANY(e.t)
				             UNION ALL
				             SELECT f.task_id, f.body, 1, 0 FROM bgtask_finals f
				              WHERE f.ledger = p_ledger AND f.parent_session = e.p AND f.task_id = ANY(e.t)) a
				            ORDER BY a.t, a.pri, a.o DESC) c), '') || ']'
				  FROM jsonb_to_recordset(rounds) AS e(p text, r bigint, t text[]) ORDER BY e.p
				RETURNING part)
			SELECT parts | coalesce(bit_or(1 << part), 0) INTO parts FROM ins;
			DELETE FROM bgtask_finals WHERE ledger = p_ledger AND parent_session = ANY(parents);
			-- (rows this transaction moved and holds: their round is the one
			-- that ended)
			UPDATE bgtask_parents SET live = 0, round = round + 1, round_tasks = '{}'
			 WHERE ledger = p_ledger AND parent_session = ANY(parents);
		END IF;
	END IF;
	-- A task that ended in this commit gives its key up (a retry in the
	-- same commit keeps it: it is live again).
	IF 'attempt_finalized' = ANY(p_kind) THEN
		DELETE FROM bgtask_keys k USING bgtask_tasks t
		 WHERE k.ledger = p_ledger AND t.ledger = p_ledger AND t.task_id = k.task_id
		   AND t.ended AND k.task_id = ANY(p_task);
	END IF;
	INSERT INTO bgtask_records (ledger, member, seq, kind, task_id, attempt_id, token, data)
	SELECT p_ledger, p_member, r.seq, r.kind, r.task, r.attempt, r.token, r.data
	  FROM unnest(p_seq, p_kind, p_task, p_attempt, p_token, p_data) AS r(seq, kind, task, attempt, token, data);
	IF EXISTS (SELECT 1 FROM bgtask_spends WHERE ledger = p_ledger AND task_id = ANY(p_task)) THEN
		PERFORM bgtask_spend(p_ledger, p_kind, p_task, p_input, p_output, p_cached, p_requests, p_cost);
	END IF;
	RETURN parts;
END
$$;
`

// appendSQL is how a journal writes a commit (bgtask_write).
const appendSQL = `SELECT bgtask_write($1, $2, $3, $4::interval, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
 $19, $20, $21, $22, $23)`
