package pgledger

// appendFunction is bgtask_append (migration 5): it writes one group
// commit of a member's records, as one statement. The lease must be the
// caller's (its fence) and unexpired, and every record must agree with
// the identity tables; any disagreement raises, so that nothing of the
// commit lands. A commit tried again after its outcome was lost with its
// connection is not written twice.
//
// Every statement on a task finds its row by the primary key alone and
// checks the row's member, attempt and run in PL/pgSQL. A statement that
// also named the member in its WHERE let the planner's generic plan — the
// one PL/pgSQL caches after a few calls — read the task through
// (ledger, member) instead, every task the member ever had, so that each
// record cost a scan of the member's history (TestQueriesStayIndexed's
// member-heavy ledger checks for that).
const appendFunction = `
CREATE OR REPLACE FUNCTION bgtask_append(
	p_ledger text, p_member text, p_fence bigint, p_lease interval,
	p_seq bigint[], p_kind text[], p_task text[], p_attempt text[], p_token text[],
	p_session text[], p_parent text[], p_data bytea[], p_rounds boolean
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
	i int;
	n int;
	other text;
	c_attempt text;
	c_token text;
	fin text[] := '{}';
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
			-- Another member's task is updated only in a transaction the
			-- raise below rolls back.
			UPDATE bgtask_tasks SET attempt_id = p_attempt[i], token = p_token[i], ended = false
			 WHERE ledger = p_ledger AND task_id = p_task[i]
			RETURNING member INTO other;
			fin := array_remove(fin, p_task[i]); -- live again: a retry keeps its key
			IF other IS DISTINCT FROM p_member THEN
				RAISE EXCEPTION 'bgtask: attempt % of task %: no such task of member %', p_attempt[i], p_task[i], p_member
					USING ERRCODE = 'BT003';
			END IF;
		WHEN 'session_bound', 'attempt_finalized', 'retry_scheduled', 'start_requested' THEN
			IF p_kind[i] = 'attempt_finalized' THEN
				-- Until a retry's attempt_created, which follows in the same
				-- commit, makes the task live again.
				UPDATE bgtask_tasks SET ended = true WHERE ledger = p_ledger AND task_id = p_task[i]
				RETURNING member, attempt_id, token INTO other, c_attempt, c_token;
				fin := fin || p_task[i];
			ELSE
				SELECT member, attempt_id, token INTO other, c_attempt, c_token
				  FROM bgtask_tasks WHERE ledger = p_ledger AND task_id = p_task[i];
			END IF;
			IF other IS DISTINCT FROM p_member OR c_attempt IS DISTINCT FROM p_attempt[i] OR c_token IS DISTINCT FROM p_token[i] THEN
				RAISE EXCEPTION 'bgtask: % for attempt % (run %) of task %, which is not its current attempt',
					p_kind[i], p_attempt[i], p_token[i], p_task[i]
					USING ERRCODE = 'BT003';
			END IF;
			IF p_kind[i] = 'session_bound' THEN
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
	-- same commit keeps it: its attempt_created took it out of fin).
	IF cardinality(fin) > 0 THEN
		DELETE FROM bgtask_keys WHERE ledger = p_ledger AND task_id = ANY(fin);
	END IF;
	INSERT INTO bgtask_records (ledger, member, seq, kind, task_id, attempt_id, token, data)
	SELECT p_ledger, p_member, r.seq, r.kind, r.task, r.attempt, r.token, r.data
	  FROM unnest(p_seq, p_kind, p_task, p_attempt, p_token, p_data) AS r(seq, kind, task, attempt, token, data);
END
$$;
`
