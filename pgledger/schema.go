package pgledger

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// migrations are the schema's versions, in order: migration i takes the
// schema from version i to i+1. A released migration never changes; a
// change to the schema is a new one at the end.
var migrations = []string{
	// 1: members (leases), records, the identity tables (each task's
	// current attempt, parent session and whether it ended, each
	// session's binding, each key's claim), the inbox of events routed to
	// a member's owner, and closures (their fence, the launches in flight
	// it must see, and what each owner's stops came to).
	`
CREATE TABLE bgtask_members (
	ledger     text        NOT NULL,
	member     text        NOT NULL,
	fence      bigint      NOT NULL,
	holder     text        NOT NULL,
	expires_at timestamptz NOT NULL,
	PRIMARY KEY (ledger, member)
);
CREATE TABLE bgtask_records (
	ledger     text   NOT NULL,
	member     text   NOT NULL,
	seq        bigint NOT NULL,
	kind       text   NOT NULL,
	task_id    text   NOT NULL,
	attempt_id text   NOT NULL,
	token      text   NOT NULL,
	data       bytea  NOT NULL,
	PRIMARY KEY (ledger, member, seq)
);
CREATE TABLE bgtask_tasks (
	ledger     text NOT NULL,
	task_id    text NOT NULL,
	member     text NOT NULL,
	attempt_id text NOT NULL DEFAULT '',
	token      text NOT NULL DEFAULT '',
	ended      boolean NOT NULL DEFAULT false,
	parent_session text NOT NULL DEFAULT '',
	PRIMARY KEY (ledger, task_id)
);
CREATE INDEX bgtask_tasks_attempt ON bgtask_tasks (ledger, attempt_id);
CREATE INDEX bgtask_tasks_parent ON bgtask_tasks (ledger, parent_session);
CREATE TABLE bgtask_sessions (
	ledger     text NOT NULL,
	session_id text NOT NULL,
	member     text NOT NULL,
	task_id    text NOT NULL,
	attempt_id text NOT NULL,
	PRIMARY KEY (ledger, session_id)
);
CREATE INDEX bgtask_sessions_member ON bgtask_sessions (ledger, member, task_id);
CREATE INDEX bgtask_sessions_task ON bgtask_sessions (ledger, task_id);
CREATE INDEX bgtask_sessions_attempt ON bgtask_sessions (ledger, attempt_id);

CREATE TABLE bgtask_keys (
	ledger     text        NOT NULL,
	key        text        NOT NULL,
	member     text        NOT NULL,
	task_id    text        NOT NULL,
	claimed_at timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (ledger, key)
);
CREATE TABLE bgtask_inbox (
	id     bigserial PRIMARY KEY,
	ledger text  NOT NULL,
	member text  NOT NULL,
	event  jsonb NOT NULL
);
CREATE INDEX bgtask_inbox_member ON bgtask_inbox (ledger, member, id);

-- A closure is one row: its root, who opened it, and once it ended the
-- whole ClosureReport by value. While closed_at is null its fence holds.
CREATE TABLE bgtask_closures (
	id           bigserial   PRIMARY KEY,
	ledger       text        NOT NULL,
	root_session text        NOT NULL,
	task_id      text        NOT NULL DEFAULT '',
	member       text        NOT NULL,
	opened_at    timestamptz NOT NULL DEFAULT now(),
	closed_at    timestamptz,
	record       jsonb
);
CREATE INDEX bgtask_closures_open ON bgtask_closures (ledger) WHERE closed_at IS NULL;
-- A launch past the fence check whose task_launched is not durable yet:
-- a closure opened meanwhile waits for it (the check and a closure's
-- opening take one advisory lock, shared and exclusive).
CREATE TABLE bgtask_launching (
	ledger         text        NOT NULL,
	task_id        text        NOT NULL,
	parent_session text        NOT NULL,
	member         text        NOT NULL,
	at             timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (ledger, task_id)
);
CREATE INDEX bgtask_launching_parent ON bgtask_launching (ledger, parent_session);
-- What an owner's stop of a run in a closure came to: the attempt's
-- status, or the abort's error.
CREATE TABLE bgtask_stops (
	seq        bigserial,
	closure_id bigint NOT NULL,
	task_id    text   NOT NULL,
	attempt_id text   NOT NULL,
	session_id text   NOT NULL,
	token      text   NOT NULL,
	member     text   NOT NULL,
	status     text   NOT NULL,
	err        text   NOT NULL,
	PRIMARY KEY (closure_id, token)
);

-- The outbox: every notification a member's Manager produced, delivered
-- per parent session in id order by one process at a time (its claim),
-- and the all_complete of each parent round, which bgtask_append makes
-- (exactly once: the parent's row in bgtask_parents serializes the
-- commits that end its last tasks, whichever members they are).
CREATE TABLE bgtask_outbox (
	id             bigserial   PRIMARY KEY,
	ledger         text        NOT NULL,
	member         text        NOT NULL,
	note_id        text        NOT NULL,
	parent_session text        NOT NULL,
	kind           text        NOT NULL,
	task_id        text        NOT NULL DEFAULT '',
	body           jsonb,
	round_tasks    text[],
	made           timestamptz NOT NULL DEFAULT now(),
	delivered_at   timestamptz,
	UNIQUE (ledger, member, note_id)
);
CREATE INDEX bgtask_outbox_pending ON bgtask_outbox (ledger, parent_session, id) WHERE delivered_at IS NULL;
CREATE INDEX bgtask_outbox_task ON bgtask_outbox (ledger, task_id) WHERE kind = 'final_summary';
CREATE TABLE bgtask_parents (
	ledger         text   NOT NULL,
	parent_session text   NOT NULL,
	live           int    NOT NULL DEFAULT 0,
	round          bigint NOT NULL DEFAULT 1,
	round_tasks    text[] NOT NULL DEFAULT '{}',
	PRIMARY KEY (ledger, parent_session)
);
CREATE TABLE bgtask_claims (
	ledger         text        NOT NULL,
	parent_session text        NOT NULL,
	member         text        NOT NULL,
	until          timestamptz NOT NULL,
	PRIMARY KEY (ledger, parent_session)
);

-- The change stream of the whole ledger: each task's latest change, as
-- its owner published it, numbered in the order the rows became visible
-- (the writers take one advisory lock per ledger, so an id is never seen
-- before a smaller one).
CREATE TABLE bgtask_changes (
	id      bigserial PRIMARY KEY,
	ledger  text  NOT NULL,
	member  text  NOT NULL,
	task_id text  NOT NULL,
	body    jsonb NOT NULL
);
CREATE INDEX bgtask_changes_ledger ON bgtask_changes (ledger, id);
CREATE INDEX bgtask_changes_task ON bgtask_changes (ledger, task_id, id);

-- bgtask_publish writes member's changes of tasks (their latest states,
-- in order) under the ledger's change lock, if the caller holds the
-- member's lease (its fence), keeps only the newest row of
-- each task, and tells the subscribers: one statement.
CREATE FUNCTION bgtask_publish(p_ledger text, p_member text, p_fence bigint, p_task text[], p_body jsonb[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_advisory_xact_lock(hashtextextended('bgtask changes ' || p_ledger, 0));
	-- Only the member's owner publishes its tasks: a process that lost the
	-- lease must not overwrite the new owner's changes with older ones.
	PERFORM 1 FROM bgtask_members WHERE ledger = p_ledger AND member = p_member AND fence = p_fence AND expires_at > now();
	IF NOT FOUND THEN
		RAISE EXCEPTION 'bgtask: the lease of member % (fence %) was lost', p_member, p_fence
			USING ERRCODE = 'BT001';
	END IF;
	INSERT INTO bgtask_changes (ledger, member, task_id, body)
	SELECT p_ledger, p_member, r.t, r.b FROM unnest(p_task, p_body) WITH ORDINALITY AS r(t, b, o) ORDER BY r.o;
	DELETE FROM bgtask_changes c USING (
		SELECT task_id, max(id) AS top FROM bgtask_changes WHERE ledger = p_ledger AND task_id = ANY(p_task) GROUP BY task_id) k
	 WHERE c.ledger = p_ledger AND c.task_id = k.task_id AND c.id < k.top;
	PERFORM pg_notify('bgtask_change', p_ledger);
END
$$;

-- bgtask_closure_live: a closure's fence holds while the member that
-- opened it holds its lease (a closure whose process died is inert, and
-- is closed when the member is opened again).
CREATE FUNCTION bgtask_closure_live(p_ledger text, p_member text) RETURNS boolean
LANGUAGE sql STABLE AS $$
	SELECT EXISTS (SELECT 1 FROM bgtask_members m WHERE m.ledger = p_ledger AND m.member = p_member AND m.expires_at > now())
$$;

-- bgtask_fenced returns the open closure whose branch holds session
-- p_session (walking up from it through the tasks that launched it), or
-- null.
CREATE FUNCTION bgtask_fenced(p_ledger text, p_session text) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
	s text := p_session;
	t text;
	c bigint;
	depth int := 0;
BEGIN
	IF NOT EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.ledger = p_ledger AND k.closed_at IS NULL
	               AND bgtask_closure_live(k.ledger, k.member)) THEN
		RETURN NULL;
	END IF;
	LOOP
		t := NULL;
		SELECT task_id INTO t FROM bgtask_sessions WHERE ledger = p_ledger AND session_id = s;
		SELECT id INTO c FROM bgtask_closures k
		 WHERE k.ledger = p_ledger AND k.closed_at IS NULL AND bgtask_closure_live(k.ledger, k.member)
		   AND (k.root_session = s OR (t IS NOT NULL AND (k.task_id = t OR k.root_session IN
		        (SELECT session_id FROM bgtask_sessions WHERE ledger = p_ledger AND task_id = t))))
		 LIMIT 1;
		IF c IS NOT NULL OR t IS NULL THEN
			RETURN c;
		END IF;
		SELECT parent_session INTO s FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = t;
		depth := depth + 1;
		IF s IS NULL OR s = '' OR depth > 10000 THEN
			RETURN NULL;
		END IF;
	END LOOP;
END
$$;

-- bgtask_start_fenced returns the open closure whose branch holds task
-- p_task (launched from p_parent) — the task as a unit, or its parent's
-- branch — or null: a start it names is refused.
CREATE FUNCTION bgtask_start_fenced(p_ledger text, p_task text, p_parent text) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
	c bigint;
BEGIN
	IF NOT EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.ledger = p_ledger AND k.closed_at IS NULL
	               AND bgtask_closure_live(k.ledger, k.member)) THEN
		RETURN NULL;
	END IF;
	SELECT k.id INTO c FROM bgtask_closures k
	 WHERE k.ledger = p_ledger AND k.closed_at IS NULL AND bgtask_closure_live(k.ledger, k.member)
	   AND (k.task_id = p_task OR k.root_session IN
	        (SELECT session_id FROM bgtask_sessions WHERE ledger = p_ledger AND task_id = p_task))
	 LIMIT 1;
	RETURN coalesce(c, bgtask_fenced(p_ledger, p_parent));
END
$$;

-- bgtask_admit admits a launch of task p_task from session p_parent: it
-- returns the open closure whose fence holds p_parent, or records the
-- launch as in flight and returns null. The fence lock (shared here,
-- exclusive where a closure opens) makes the two exact.
CREATE FUNCTION bgtask_admit(p_ledger text, p_task text, p_parent text, p_member text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
	c bigint;
BEGIN
	PERFORM pg_advisory_xact_lock_shared(hashtextextended('bgtask fence ' || p_ledger, 0));
	c := bgtask_fenced(p_ledger, p_parent);
	IF c IS NULL THEN
		INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) VALUES (p_ledger, p_task, p_parent, p_member)
		ON CONFLICT (ledger, task_id) DO NOTHING;
	END IF;
	RETURN c;
END
$$;

-- bgtask_append writes one group commit of member's records, as one
-- statement: the lease must be the caller's (its fence) and unexpired,
-- and every record must agree with the identity tables. Any disagreement
-- raises, so that nothing of the commit lands.
CREATE FUNCTION bgtask_append(
	p_ledger text, p_member text, p_fence bigint, p_lease interval,
	p_seq bigint[], p_kind text[], p_task text[], p_attempt text[], p_token text[],
	p_session text[], p_parent text[], p_data bytea[], p_rounds boolean
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
	i int;
	n int;
	other text;
	before jsonb;
	p record;
	live int;
	rnd bigint;
	tasks text[];
BEGIN
	UPDATE bgtask_members SET expires_at = now() + p_lease
	 WHERE ledger = p_ledger AND member = p_member AND fence = p_fence AND expires_at > now();
	IF NOT FOUND THEN
		RAISE EXCEPTION 'bgtask: the lease of member % (fence %) was lost', p_member, p_fence
			USING ERRCODE = 'BT001';
	END IF;
	-- Which of the commit's tasks were live before it: its end moves
	-- their parents' live counts.
	IF p_rounds THEN
		SELECT coalesce(jsonb_object_agg(task_id, NOT ended), '{}') INTO before
		  FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = ANY(p_task);
	END IF;
	FOR i IN 1 .. coalesce(array_length(p_seq, 1), 0) LOOP
		CASE p_kind[i]
		WHEN 'task_launched' THEN
			DELETE FROM bgtask_launching WHERE ledger = p_ledger AND task_id = p_task[i];
			INSERT INTO bgtask_tasks (ledger, task_id, member, parent_session)
			VALUES (p_ledger, p_task[i], p_member, p_parent[i])
			ON CONFLICT (ledger, task_id) DO NOTHING;
			IF NOT FOUND THEN
				SELECT member INTO other FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = p_task[i];
				IF other IS DISTINCT FROM p_member THEN
					RAISE EXCEPTION 'bgtask: task id % is taken by member %', p_task[i], other
						USING ERRCODE = 'BT002';
				END IF;
			END IF;
		WHEN 'attempt_created' THEN
			UPDATE bgtask_tasks SET attempt_id = p_attempt[i], token = p_token[i], ended = false
			 WHERE ledger = p_ledger AND task_id = p_task[i] AND member = p_member;
			IF NOT FOUND THEN
				RAISE EXCEPTION 'bgtask: attempt % of task %: no such task of member %', p_attempt[i], p_task[i], p_member
					USING ERRCODE = 'BT003';
			END IF;
		WHEN 'session_bound', 'attempt_finalized', 'retry_scheduled', 'start_requested' THEN
			PERFORM 1 FROM bgtask_tasks
			 WHERE ledger = p_ledger AND task_id = p_task[i] AND member = p_member
			   AND attempt_id = p_attempt[i] AND token = p_token[i];
			IF NOT FOUND THEN
				RAISE EXCEPTION 'bgtask: % for attempt % (run %) of task %, which is not its current attempt',
					p_kind[i], p_attempt[i], p_token[i], p_task[i]
					USING ERRCODE = 'BT003';
			END IF;
			IF p_kind[i] = 'attempt_finalized' THEN
				-- Until a retry's attempt_created, which follows in the same
				-- commit, makes the task live again.
				UPDATE bgtask_tasks SET ended = true WHERE ledger = p_ledger AND task_id = p_task[i];
			ELSIF p_kind[i] = 'session_bound' THEN
				INSERT INTO bgtask_sessions (ledger, session_id, member, task_id, attempt_id)
				VALUES (p_ledger, p_session[i], p_member, p_task[i], p_attempt[i])
				ON CONFLICT (ledger, session_id) DO UPDATE
				   SET task_id = EXCLUDED.task_id, attempt_id = EXCLUDED.attempt_id
				 WHERE bgtask_sessions.member = EXCLUDED.member;
				GET DIAGNOSTICS n = ROW_COUNT;
				IF n = 0 THEN
					SELECT member INTO other FROM bgtask_sessions WHERE ledger = p_ledger AND session_id = p_session[i];
					RAISE EXCEPTION 'bgtask: session % is bound by member %', p_session[i], other
						USING ERRCODE = 'BT004';
				END IF;
			END IF;
		ELSE
		END CASE;
	END LOOP;
	-- Each parent whose live count the commit moved, in a fixed order (two
	-- commits never wait on each other's rows crosswise): a round whose
	-- last task ended makes its all_complete.
	FOR p IN
		SELECT t.parent_session AS parent,
		       sum((NOT t.ended)::int - coalesce((before ->> t.task_id)::boolean, false)::int) AS delta,
		       -- born into the round: new in this commit (whatever it came to),
		       -- or live again after it had ended
		       array_agg(t.task_id) FILTER (WHERE NOT (before ? t.task_id)
		           OR (NOT t.ended AND NOT (before ->> t.task_id)::boolean)) AS born
		  FROM bgtask_tasks t
		 WHERE p_rounds AND t.ledger = p_ledger AND t.task_id = ANY(p_task) AND t.parent_session <> ''
		 GROUP BY t.parent_session ORDER BY t.parent_session
	LOOP
		CONTINUE WHEN p.delta = 0 AND p.born IS NULL;
		INSERT INTO bgtask_parents AS x (ledger, parent_session, live, round_tasks)
		VALUES (p_ledger, p.parent, p.delta, coalesce(p.born, '{}'))
		ON CONFLICT (ledger, parent_session) DO UPDATE
		   SET live = x.live + EXCLUDED.live, round_tasks = x.round_tasks || EXCLUDED.round_tasks
		RETURNING x.live, x.round, x.round_tasks INTO live, rnd, tasks;
		IF live <= 0 AND cardinality(tasks) > 0 THEN
			INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, round_tasks)
			VALUES (p_ledger, '', 'all_complete:' || p.parent || ':' || rnd, p.parent, 'all_complete', tasks);
			UPDATE bgtask_parents SET live = 0, round = rnd + 1, round_tasks = '{}'
			 WHERE ledger = p_ledger AND parent_session = p.parent;
			PERFORM pg_notify('bgtask_outbox', p_ledger);
		END IF;
	END LOOP;
	-- A task that ended in this commit gives its key up (a retry in the
	-- same commit keeps it: ended is false again by the end of the loop).
	DELETE FROM bgtask_keys k USING bgtask_tasks t
	 WHERE k.ledger = p_ledger AND t.ledger = p_ledger AND t.task_id = k.task_id
	   AND t.ended AND k.task_id = ANY(p_task);
	INSERT INTO bgtask_records (ledger, member, seq, kind, task_id, attempt_id, token, data)
	SELECT p_ledger, p_member, r.seq, r.kind, r.task, r.attempt, r.token, r.data
	  FROM unnest(p_seq, p_kind, p_task, p_attempt, p_token, p_data) AS r(seq, kind, task, attempt, token, data);
END
$$;
`,
	// 2: riding out the database. bgtask_append is idempotent (a commit
	// tried again after its connection dropped is not written twice);
	// indexes for the takeover poll (a member's live tasks), compaction
	// (a member's tasks) and key release (a task's key); a member released
	// by a clean close with nothing live is idle, and the takeover poll
	// skips it.
	`
CREATE INDEX bgtask_tasks_live ON bgtask_tasks (ledger, member) WHERE NOT ended;
CREATE INDEX bgtask_tasks_member ON bgtask_tasks (ledger, member);
CREATE INDEX bgtask_keys_task ON bgtask_keys (ledger, task_id);
ALTER TABLE bgtask_members ADD COLUMN idle boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION bgtask_append(
	p_ledger text, p_member text, p_fence bigint, p_lease interval,
	p_seq bigint[], p_kind text[], p_task text[], p_attempt text[], p_token text[],
	p_session text[], p_parent text[], p_data bytea[], p_rounds boolean
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
	i int;
	n int;
	other text;
	before jsonb;
	p record;
	live int;
	rnd bigint;
	tasks text[];
BEGIN
	UPDATE bgtask_members SET expires_at = now() + p_lease
	 WHERE ledger = p_ledger AND member = p_member AND fence = p_fence AND expires_at > now();
	IF NOT FOUND THEN
		RAISE EXCEPTION 'bgtask: the lease of member % (fence %) was lost', p_member, p_fence
			USING ERRCODE = 'BT001';
	END IF;
	-- A commit tried again after its outcome was lost with its connection:
	-- if it landed (its first record is here: records of one member are
	-- written only under its fence, in sequence), it is not written twice.
	IF coalesce(array_length(p_seq, 1), 0) > 0 AND EXISTS (
		SELECT 1 FROM bgtask_records WHERE ledger = p_ledger AND member = p_member AND seq = p_seq[1]) THEN
		RETURN;
	END IF;
	-- Which of the commit's tasks were live before it: its end moves
	-- their parents' live counts.
	IF p_rounds THEN
		SELECT coalesce(jsonb_object_agg(task_id, NOT ended), '{}') INTO before
		  FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = ANY(p_task);
	END IF;
	FOR i IN 1 .. coalesce(array_length(p_seq, 1), 0) LOOP
		CASE p_kind[i]
		WHEN 'task_launched' THEN
			DELETE FROM bgtask_launching WHERE ledger = p_ledger AND task_id = p_task[i];
			INSERT INTO bgtask_tasks (ledger, task_id, member, parent_session)
			VALUES (p_ledger, p_task[i], p_member, p_parent[i])
			ON CONFLICT (ledger, task_id) DO NOTHING;
			IF NOT FOUND THEN
				SELECT member INTO other FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = p_task[i];
				IF other IS DISTINCT FROM p_member THEN
					RAISE EXCEPTION 'bgtask: task id % is taken by member %', p_task[i], other
						USING ERRCODE = 'BT002';
				END IF;
			END IF;
		WHEN 'attempt_created' THEN
			UPDATE bgtask_tasks SET attempt_id = p_attempt[i], token = p_token[i], ended = false
			 WHERE ledger = p_ledger AND task_id = p_task[i] AND member = p_member;
			IF NOT FOUND THEN
				RAISE EXCEPTION 'bgtask: attempt % of task %: no such task of member %', p_attempt[i], p_task[i], p_member
					USING ERRCODE = 'BT003';
			END IF;
		WHEN 'session_bound', 'attempt_finalized', 'retry_scheduled', 'start_requested' THEN
			PERFORM 1 FROM bgtask_tasks
			 WHERE ledger = p_ledger AND task_id = p_task[i] AND member = p_member
			   AND attempt_id = p_attempt[i] AND token = p_token[i];
			IF NOT FOUND THEN
				RAISE EXCEPTION 'bgtask: % for attempt % (run %) of task %, which is not its current attempt',
					p_kind[i], p_attempt[i], p_token[i], p_task[i]
					USING ERRCODE = 'BT003';
			END IF;
			IF p_kind[i] = 'attempt_finalized' THEN
				-- Until a retry's attempt_created, which follows in the same
				-- commit, makes the task live again.
				UPDATE bgtask_tasks SET ended = true WHERE ledger = p_ledger AND task_id = p_task[i];
			ELSIF p_kind[i] = 'session_bound' THEN
				INSERT INTO bgtask_sessions (ledger, session_id, member, task_id, attempt_id)
				VALUES (p_ledger, p_session[i], p_member, p_task[i], p_attempt[i])
				ON CONFLICT (ledger, session_id) DO UPDATE
				   SET task_id = EXCLUDED.task_id, attempt_id = EXCLUDED.attempt_id
				 WHERE bgtask_sessions.member = EXCLUDED.member;
				GET DIAGNOSTICS n = ROW_COUNT;
				IF n = 0 THEN
					SELECT member INTO other FROM bgtask_sessions WHERE ledger = p_ledger AND session_id = p_session[i];
					RAISE EXCEPTION 'bgtask: session % is bound by member %', p_session[i], other
						USING ERRCODE = 'BT004';
				END IF;
			END IF;
		ELSE
		END CASE;
	END LOOP;
	-- Each parent whose live count the commit moved, in a fixed order (two
	-- commits never wait on each other's rows crosswise): a round whose
	-- last task ended makes its all_complete.
	FOR p IN
		SELECT t.parent_session AS parent,
		       sum((NOT t.ended)::int - coalesce((before ->> t.task_id)::boolean, false)::int) AS delta,
		       -- born into the round: new in this commit (whatever it came to),
		       -- or live again after it had ended
		       array_agg(t.task_id) FILTER (WHERE NOT (before ? t.task_id)
		           OR (NOT t.ended AND NOT (before ->> t.task_id)::boolean)) AS born
		  FROM bgtask_tasks t
		 WHERE p_rounds AND t.ledger = p_ledger AND t.task_id = ANY(p_task) AND t.parent_session <> ''
		 GROUP BY t.parent_session ORDER BY t.parent_session
	LOOP
		CONTINUE WHEN p.delta = 0 AND p.born IS NULL;
		INSERT INTO bgtask_parents AS x (ledger, parent_session, live, round_tasks)
		VALUES (p_ledger, p.parent, p.delta, coalesce(p.born, '{}'))
		ON CONFLICT (ledger, parent_session) DO UPDATE
		   SET live = x.live + EXCLUDED.live, round_tasks = x.round_tasks || EXCLUDED.round_tasks
		RETURNING x.live, x.round, x.round_tasks INTO live, rnd, tasks;
		IF live <= 0 AND cardinality(tasks) > 0 THEN
			INSERT INTO bgtask_outbox (ledger, member, note_id, parent_session, kind, round_tasks)
			VALUES (p_ledger, '', 'all_complete:' || p.parent || ':' || rnd, p.parent, 'all_complete', tasks);
			UPDATE bgtask_parents SET live = 0, round = rnd + 1, round_tasks = '{}'
			 WHERE ledger = p_ledger AND parent_session = p.parent;
			PERFORM pg_notify('bgtask_outbox', p_ledger);
		END IF;
	END LOOP;
	-- A task that ended in this commit gives its key up (a retry in the
	-- same commit keeps it: ended is false again by the end of the loop).
	DELETE FROM bgtask_keys k USING bgtask_tasks t
	 WHERE k.ledger = p_ledger AND t.ledger = p_ledger AND t.task_id = k.task_id
	   AND t.ended AND k.task_id = ANY(p_task);
	INSERT INTO bgtask_records (ledger, member, seq, kind, task_id, attempt_id, token, data)
	SELECT p_ledger, p_member, r.seq, r.kind, r.task, r.attempt, r.token, r.data
	  FROM unnest(p_seq, p_kind, p_task, p_attempt, p_token, p_data) AS r(seq, kind, task, attempt, token, data);
END
$$;
`,
	// 3: tables that stay small (retention.go) and queries that stay
	// indexed (explain_test.go). The takeover poll reads the members that
	// are not idle; retention finds what it prunes by age: a change whose
	// task ended (ended_at, which bgtask_publish sets), a closure that
	// ended, a parent with nothing live and no round open (touched: when
	// its row last changed), a member closed with nothing live whose data
	// it has not pruned yet (pruned_fence). bgtask_retention is one row per
	// ledger: when it was last pruned, and the round floor — above every
	// round a pruned parent reached — at which a parent's row made again
	// starts counting, so that an all_complete id never repeats.
	`
CREATE INDEX bgtask_members_busy ON bgtask_members (ledger, member) WHERE NOT idle;
ALTER TABLE bgtask_members ADD COLUMN pruned_fence bigint NOT NULL DEFAULT 0;
CREATE INDEX bgtask_members_prunable ON bgtask_members (ledger, member) WHERE idle AND fence > pruned_fence;
CREATE INDEX bgtask_closures_closed ON bgtask_closures (ledger, closed_at) WHERE closed_at IS NOT NULL;
ALTER TABLE bgtask_changes ADD COLUMN ended_at timestamptz;
CREATE INDEX bgtask_changes_ended ON bgtask_changes (ledger, ended_at) WHERE ended_at IS NOT NULL;
ALTER TABLE bgtask_parents ADD COLUMN touched timestamptz NOT NULL DEFAULT now();
CREATE INDEX bgtask_parents_idle ON bgtask_parents (ledger, touched) WHERE live <= 0 AND cardinality(round_tasks) = 0;
CREATE TABLE bgtask_retention (
	ledger      text        PRIMARY KEY,
	pruned_at   timestamptz NOT NULL DEFAULT '-infinity',
	round_floor bigint      NOT NULL DEFAULT 0
);

-- bgtask_parent_row keeps a parent's row: touched at every change (unless
-- the change sets touched itself), and a row made (again) starts its
-- rounds where they cannot repeat an id. A row this statement's snapshot
-- still has, which retention is deleting meanwhile (the insert waits for
-- that, and then inserts), goes on from its round; a row it does not have
-- starts above the ledger's round floor, which retention raises in the
-- transaction that deletes a parent's row.
CREATE FUNCTION bgtask_parent_row() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
	IF TG_OP = 'UPDATE' THEN
		IF NEW.touched IS NOT DISTINCT FROM OLD.touched THEN
			NEW.touched := now();
		END IF;
	ELSE
		NEW.touched := now();
		NEW.round := greatest(NEW.round, coalesce(
			(SELECT p.round FROM bgtask_parents p WHERE p.ledger = NEW.ledger AND p.parent_session = NEW.parent_session),
			(SELECT f.round_floor + 1 FROM bgtask_retention f WHERE f.ledger = NEW.ledger),
			1));
	END IF;
	RETURN NEW;
END
$$;
CREATE TRIGGER bgtask_parents_row BEFORE INSERT OR UPDATE ON bgtask_parents
	FOR EACH ROW EXECUTE FUNCTION bgtask_parent_row();

-- bgtask_ended_at is when the task of a change (its body) ended, or null
-- while it is live: its completedAt as bgtask wrote it, or now.
CREATE FUNCTION bgtask_ended_at(p_body jsonb) RETURNS timestamptz
LANGUAGE sql STABLE AS $$
	SELECT CASE WHEN p_body ->> 'status' IN ('completed', 'error', 'cancelled', 'interrupt') THEN
	       CASE WHEN p_body ->> 'completedAt' ~ '^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$'
	            THEN (p_body ->> 'completedAt')::timestamptz ELSE now() END END
$$;
UPDATE bgtask_changes SET ended_at = bgtask_ended_at(body) WHERE body ->> 'status' IN ('completed', 'error', 'cancelled', 'interrupt');

CREATE OR REPLACE FUNCTION bgtask_publish(p_ledger text, p_member text, p_fence bigint, p_task text[], p_body jsonb[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_advisory_xact_lock(hashtextextended('bgtask changes ' || p_ledger, 0));
	-- Only the member's owner publishes its tasks: a process that lost the
	-- lease must not overwrite the new owner's changes with older ones.
	PERFORM 1 FROM bgtask_members WHERE ledger = p_ledger AND member = p_member AND fence = p_fence AND expires_at > now();
	IF NOT FOUND THEN
		RAISE EXCEPTION 'bgtask: the lease of member % (fence %) was lost', p_member, p_fence
			USING ERRCODE = 'BT001';
	END IF;
	INSERT INTO bgtask_changes (ledger, member, task_id, body, ended_at)
	SELECT p_ledger, p_member, r.t, r.b, bgtask_ended_at(r.b) FROM unnest(p_task, p_body) WITH ORDINALITY AS r(t, b, o) ORDER BY r.o;
	DELETE FROM bgtask_changes c USING (
		SELECT task_id, max(id) AS top FROM bgtask_changes WHERE ledger = p_ledger AND task_id = ANY(p_task) GROUP BY task_id) k
	 WHERE c.ledger = p_ledger AND c.task_id = k.task_id AND c.id < k.top;
	PERFORM pg_notify('bgtask_change', p_ledger);
END
$$;
`,
	// 4: delivery at database speed (outbox.go): a deliverer looks at the
	// pending rows oldest first, and stops once it found what it claims.
	`
CREATE INDEX bgtask_outbox_pending_id ON bgtask_outbox (ledger, id) WHERE delivered_at IS NULL;
`,
	// 5: bgtask_append finds each task by its key alone (appendFunction);
	// a node checks the launches and the starts that come together against
	// the fence in one statement each (batch.go); bgtask_publish finds the
	// rows a change replaces by key.
	appendFunction + `
-- bgtask_admit_all is bgtask_admit of many launches, in order: a
-- closure's id for each launch a fence holds, null for each admitted. A
-- check that took longer than p_within (it waited for a lock, say) is
-- rolled back (BT006): its callers have left, and a launch left in flight
-- by them would hold a closure up.
CREATE FUNCTION bgtask_admit_all(p_ledger text, p_task text[], p_parent text[], p_member text[], p_within interval) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
	out bigint[] := '{}';
	c bigint;
	i int;
BEGIN
	PERFORM pg_advisory_xact_lock_shared(hashtextextended('bgtask fence ' || p_ledger, 0));
	IF NOT EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.ledger = p_ledger AND k.closed_at IS NULL
	               AND bgtask_closure_live(k.ledger, k.member)) THEN
		INSERT INTO bgtask_launching (ledger, task_id, parent_session, member)
		SELECT p_ledger, r.t, r.p, r.m FROM unnest(p_task, p_parent, p_member) AS r(t, p, m)
		ON CONFLICT (ledger, task_id) DO NOTHING;
		out := array_fill(NULL::bigint, ARRAY[cardinality(p_task)]);
	ELSE
		FOR i IN 1 .. cardinality(p_task) LOOP
			c := bgtask_fenced(p_ledger, p_parent[i]);
			IF c IS NULL THEN
				INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) VALUES (p_ledger, p_task[i], p_parent[i], p_member[i])
				ON CONFLICT (ledger, task_id) DO NOTHING;
			END IF;
			out := array_append(out, c);
		END LOOP;
	END IF;
	IF clock_timestamp() > statement_timestamp() + p_within THEN
		RAISE EXCEPTION 'bgtask: a fence check took longer than its callers wait (%)', p_within
			USING ERRCODE = 'BT006';
	END IF;
	RETURN out;
END
$$;

-- bgtask_start_fenced_all is bgtask_start_fenced of many starts, in order.
CREATE FUNCTION bgtask_start_fenced_all(p_ledger text, p_task text[], p_parent text[]) RETURNS bigint[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
	IF NOT EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.ledger = p_ledger AND k.closed_at IS NULL
	               AND bgtask_closure_live(k.ledger, k.member)) THEN
		RETURN array_fill(NULL::bigint, ARRAY[cardinality(p_task)]);
	END IF;
	RETURN ARRAY(SELECT bgtask_start_fenced(p_ledger, r.t, r.p) FROM unnest(p_task, p_parent) WITH ORDINALITY AS r(t, p, o) ORDER BY r.o);
END
$$;

-- bgtask_publish as before (migration 3), but the rows a change replaces
-- are found from the rows it inserts, by key (a task's rows older than its
-- new one), not by an aggregate over the tasks' rows: one statement.
CREATE OR REPLACE FUNCTION bgtask_publish(p_ledger text, p_member text, p_fence bigint, p_task text[], p_body jsonb[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
	PERFORM pg_advisory_xact_lock(hashtextextended('bgtask changes ' || p_ledger, 0));
	-- Only the member's owner publishes its tasks: a process that lost the
	-- lease must not overwrite the new owner's changes with older ones.
	PERFORM 1 FROM bgtask_members WHERE ledger = p_ledger AND member = p_member AND fence = p_fence AND expires_at > now();
	IF NOT FOUND THEN
		RAISE EXCEPTION 'bgtask: the lease of member % (fence %) was lost', p_member, p_fence
			USING ERRCODE = 'BT001';
	END IF;
	-- A task twice in one call keeps its last change only.
	WITH r AS (
		SELECT DISTINCT ON (r.t) r.t, r.b, r.o FROM unnest(p_task, p_body) WITH ORDINALITY AS r(t, b, o) ORDER BY r.t, r.o DESC),
	ins AS (
		INSERT INTO bgtask_changes (ledger, member, task_id, body, ended_at)
		SELECT p_ledger, p_member, r.t, r.b, bgtask_ended_at(r.b) FROM r ORDER BY r.o
		RETURNING task_id, id)
	DELETE FROM bgtask_changes c USING ins WHERE c.ledger = p_ledger AND c.task_id = ins.task_id AND c.id < ins.id;
	PERFORM pg_notify('bgtask_change', p_ledger);
END
$$;
`,
	// 6: an all_complete is ready once its round's final summaries are all
	// written (writeNotesSQL marks it), so that a deliverer looking for
	// what it can tell need not count each waiting round's summaries.
	`
ALTER TABLE bgtask_outbox ADD COLUMN ready boolean NOT NULL DEFAULT false;
`,
	// 7: the fleet's model and provider health (bgtask.HealthStore): each
	// key's latest cooldown, written by the Manager that began it, read by
	// every Manager of the ledger.
	`
CREATE TABLE bgtask_health (
	ledger   text        NOT NULL,
	key      text        NOT NULL,
	since    timestamptz NOT NULL,
	until    timestamptz NOT NULL,
	why      text        NOT NULL,
	PRIMARY KEY (ledger, key)
);
`,
	// 8: budgets shared by a fleet (budget.go): each budget's limits and
	// what its tree spent, each task's place under them, and the append
	// that moves them with the records.
	budgetSchema,
	// 9: a fence check that runs after its launch landed (queued in a
	// server that was stopped, and run once it went on) leaves no launch
	// in flight behind: bgtask_admit_all records none for a task that is
	// in bgtask_tasks already. (scopeQuery passes by such a row, and
	// retention deletes it, should one come in between: the check's
	// snapshot may miss a task that lands while it runs.)
	`
CREATE OR REPLACE FUNCTION bgtask_admit_all(p_ledger text, p_task text[], p_parent text[], p_member text[], p_within interval) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
	out bigint[] := '{}';
	c bigint;
	i int;
BEGIN
	PERFORM pg_advisory_xact_lock_shared(hashtextextended('bgtask fence ' || p_ledger, 0));
	IF NOT EXISTS (SELECT 1 FROM bgtask_closures k WHERE k.ledger = p_ledger AND k.closed_at IS NULL
	               AND bgtask_closure_live(k.ledger, k.member)) THEN
		INSERT INTO bgtask_launching (ledger, task_id, parent_session, member)
		SELECT p_ledger, r.t, r.p, r.m FROM unnest(p_task, p_parent, p_member) AS r(t, p, m)
		 WHERE NOT EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = p_ledger AND t.task_id = r.t)
		ON CONFLICT (ledger, task_id) DO NOTHING;
		out := array_fill(NULL::bigint, ARRAY[cardinality(p_task)]);
	ELSE
		FOR i IN 1 .. cardinality(p_task) LOOP
			c := bgtask_fenced(p_ledger, p_parent[i]);
			IF c IS NULL AND NOT EXISTS (SELECT 1 FROM bgtask_tasks t WHERE t.ledger = p_ledger AND t.task_id = p_task[i]) THEN
				INSERT INTO bgtask_launching (ledger, task_id, parent_session, member) VALUES (p_ledger, p_task[i], p_parent[i], p_member[i])
				ON CONFLICT (ledger, task_id) DO NOTHING;
			END IF;
			out := array_append(out, c);
		END LOOP;
	END IF;
	IF clock_timestamp() > statement_timestamp() + p_within THEN
		RAISE EXCEPTION 'bgtask: a fence check took longer than its callers wait (%)', p_within
			USING ERRCODE = 'BT006';
	END IF;
	RETURN out;
END
$$;
`,
	// 10: bgtask_write (write.go), the append with a statement per kind of
	// work rather than per record, and no budget work for a commit whose
	// tasks spend from no budget.
	writeFunction,
}

// schemaLock is the advisory lock key migrations run under, so that two
// processes migrating at once take turns.
const schemaLock = 0x6267_7461_736b // "bgtask"

// Migrate brings the database's bgtask schema to the version this package
// knows, in one transaction: creating it in an empty database, applying
// only the missing migrations otherwise (idempotent), and refusing a
// database whose schema is newer than this package.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if pool == nil {
		return errors.New("pgledger: Migrate with a nil pool")
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(schemaLock)); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS bgtask_schema (
			version    int         PRIMARY KEY,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return err
		}
		var have int
		if err := tx.QueryRow(ctx, `SELECT coalesce(max(version), 0) FROM bgtask_schema`).Scan(&have); err != nil {
			return err
		}
		if have > len(migrations) {
			return fmt.Errorf("pgledger: the database's schema is version %d, newer than this package's %d: upgrade the package", have, len(migrations))
		}
		for v := have; v < len(migrations); v++ {
			if _, err := tx.Exec(ctx, migrations[v]); err != nil {
				return fmt.Errorf("pgledger: migration %d: %w", v+1, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO bgtask_schema (version) VALUES ($1)`, v+1); err != nil {
				return err
			}
		}
		return nil
	})
}

// SchemaVersion is the version Migrate brings a database to.
func SchemaVersion() int { return len(migrations) }
