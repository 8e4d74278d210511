-- Named queries of the sweep queue, the same text for SQLite and PostgreSQL. Parameters are
-- written :name (turned into %(name)s for psycopg). A query that differs between the two is
-- in sqlite/queries.sql and postgres/queries.sql instead; those files may not repeat a name.
-- Times come from preemptible_now() (the database clock, see 0001_init.sql).

-- name: insert_sweep
INSERT INTO preemptible_sweeps (id, name, spec, control, cancel_now, run_cap, max_failures,
                                max_preemptions, seed, runs_created, create_token, created_at,
                                updated_at)
VALUES (:id, :name, :spec, 'running', 0, :run_cap, :max_failures, :max_preemptions, :seed, 0,
        :token, preemptible_now(), preemptible_now())
ON CONFLICT (id) DO NOTHING

-- name: sweep_token
SELECT create_token FROM preemptible_sweeps WHERE id = :id

-- name: get_sweep
SELECT id, name, spec, control, cancel_now, run_cap, max_failures, max_preemptions, seed,
       runs_created, created_at
FROM preemptible_sweeps WHERE id = :id

-- name: list_sweeps
SELECT id, name, spec, control, cancel_now, run_cap, max_failures, max_preemptions, seed,
       runs_created, created_at
FROM preemptible_sweeps ORDER BY created_at, id

-- name: set_control
UPDATE preemptible_sweeps
SET control = :control, cancel_now = :cancel_now, updated_at = preemptible_now()
WHERE id = :id

-- name: cancel_pending
UPDATE preemptible_runs SET state = 'CANCELLED', updated_at = preemptible_now()
WHERE sweep_id = :sweep_id AND state = 'PENDING'

-- name: count_created
UPDATE preemptible_sweeps SET runs_created = runs_created + :n WHERE id = :id

-- name: insert_run
INSERT INTO preemptible_runs (id, sweep_id, run_index, params, state, attempt, preemptions,
                              failures, create_token, queued_at, checkpoint_dir, created_at,
                              updated_at)
VALUES (:id, :sweep_id, :run_index, :params, 'PENDING', 0, 0, 0, :token, preemptible_now(),
        :id, preemptible_now(), preemptible_now())

-- name: runs_by_create_token
SELECT id FROM preemptible_runs WHERE create_token = :token ORDER BY run_index

-- name: claimed_by_token
SELECT id FROM preemptible_runs
WHERE claim_token = :token AND lease_owner = :agent AND state = 'RUNNING'

-- name: take_run
UPDATE preemptible_runs
SET state = 'RUNNING', attempt = attempt + 1, lease_owner = :agent, lease_host = :host,
    lease_expires = preemptible_now() + :lease, lease_seconds = :lease,
    lease_holder = :holder, lease_epoch = lease_epoch + 1, claim_token = :token,
    updated_at = preemptible_now()
WHERE id = :id AND state = 'PENDING'

-- name: insert_attempt
INSERT INTO preemptible_attempts (run_id, number, agent, host, started_at, epoch)
SELECT id, attempt, lease_owner, lease_host, preemptible_now(), lease_epoch
FROM preemptible_runs WHERE id = :id

-- name: claim_row
SELECT id, sweep_id, run_index, params, attempt, checkpoint_dir, preemptions, failures,
       lease_epoch
FROM preemptible_runs WHERE id = :id

-- name: heartbeat
-- :epoch < 0: a caller that does not track epochs (the attempt number and owner still fence)
UPDATE preemptible_runs
SET lease_expires = preemptible_now() + :lease, lease_seconds = :lease,
    lease_beats = lease_beats + 1, updated_at = preemptible_now()
WHERE id = :id AND state = 'RUNNING' AND lease_owner = :agent AND attempt = :attempt
  AND (lease_epoch = :epoch OR :epoch < 0)

-- name: control_of_run
SELECT s.control, s.cancel_now
FROM preemptible_runs r JOIN preemptible_sweeps s ON s.id = r.sweep_id
WHERE r.id = :id

-- name: close_attempt
UPDATE preemptible_attempts
SET ended_at = preemptible_now(), ending = :ending, exit_code = :exit_code,
    duration = :duration, checkpoint_step = COALESCE(:checkpoint_step, checkpoint_step),
    marked_preempting = CASE WHEN :marked = 1 THEN 1 ELSE marked_preempting END,
    outcome = :outcome, closed_by = :closed_by
WHERE run_id = :run_id AND number = :number AND ended_at IS NULL

-- name: settle_run
UPDATE preemptible_runs
SET state = :state, preemptions = :preemptions, failures = :failures,
    summary = COALESCE(:summary, summary), lease_owner = NULL, lease_host = NULL,
    lease_expires = NULL, lease_seconds = NULL, lease_holder = NULL, claim_token = NULL,
    queued_at = CASE WHEN :state = 'PENDING' THEN preemptible_now() ELSE queued_at END,
    requeued = CASE WHEN :state = 'PENDING' THEN 1 ELSE requeued END,
    updated_at = preemptible_now()
WHERE id = :id AND state = 'RUNNING' AND attempt = :attempt

-- name: resettle_run
-- a result that came after another agent ended the attempt for its expired lease, while no
-- other attempt started: the run's state from that result instead (lease_epoch stays)
UPDATE preemptible_runs
SET state = :state, preemptions = :preemptions, failures = :failures,
    summary = COALESCE(:summary, summary),
    queued_at = CASE WHEN :state = 'PENDING' THEN preemptible_now() ELSE queued_at END,
    requeued = CASE WHEN :state = 'PENDING' THEN 1 ELSE requeued END,
    updated_at = preemptible_now()
WHERE id = :id AND attempt = :attempt AND state = :was AND lease_owner IS NULL

-- name: reclose_attempt
UPDATE preemptible_attempts
SET ended_at = preemptible_now(), ending = :ending, exit_code = :exit_code,
    duration = :duration, checkpoint_step = COALESCE(:checkpoint_step, checkpoint_step),
    marked_preempting = CASE WHEN :marked = 1 THEN 1 ELSE marked_preempting END,
    outcome = :outcome, closed_by = :closed_by, late = 1
WHERE run_id = :run_id AND number = :number AND closed_by = :expired

-- name: late_attempt
-- the holder's own result for an attempt another agent ended for its expired lease, when
-- another attempt has started since: the attempt's real ending, marked late; the run, its
-- state and its holder are the new attempt's and stay as they are (its outcome too)
UPDATE preemptible_attempts
SET ending = :ending, exit_code = :exit_code, duration = :duration,
    checkpoint_step = COALESCE(:checkpoint_step, checkpoint_step),
    marked_preempting = CASE WHEN :marked = 1 THEN 1 ELSE marked_preempting END,
    closed_by = :closed_by, late = 1
WHERE run_id = :run_id AND number = :number AND closed_by = :expired

-- name: abandon_run
-- a claim whose attempt never started (the run could not start here): the run is PENDING
-- again as if never claimed, in its old place in the queue; the epoch is not given back
UPDATE preemptible_runs
SET state = 'PENDING', attempt = attempt - 1, lease_owner = NULL, lease_host = NULL,
    lease_expires = NULL, lease_seconds = NULL, lease_holder = NULL, claim_token = NULL,
    updated_at = preemptible_now()
WHERE id = :id AND state = 'RUNNING' AND attempt = :attempt AND lease_owner = :agent
  AND lease_epoch = :epoch

-- name: delete_attempt
DELETE FROM preemptible_attempts WHERE run_id = :run_id AND number = :number AND ended_at IS NULL

-- name: mark_preempting
UPDATE preemptible_attempts SET marked_preempting = 1
WHERE run_id = :run_id AND number = :number

-- name: report
UPDATE preemptible_runs SET summary = :summary, updated_at = preemptible_now() WHERE id = :id

-- name: report_fenced
UPDATE preemptible_runs SET summary = :summary, updated_at = preemptible_now()
WHERE id = :id AND state = 'RUNNING' AND lease_epoch = :epoch

-- name: list_runs
SELECT id, sweep_id, run_index, params, state, attempt, preemptions, failures, lease_owner,
       lease_host, lease_expires, checkpoint_dir, summary, created_at, updated_at, lease_epoch,
       early_exempt
FROM preemptible_runs WHERE sweep_id = :sweep_id ORDER BY run_index

-- name: get_run
SELECT id, sweep_id, run_index, params, state, attempt, preemptions, failures, lease_owner,
       lease_host, lease_expires, checkpoint_dir, summary, created_at, updated_at, lease_epoch,
       early_exempt
FROM preemptible_runs WHERE id = :id

-- name: list_attempts
SELECT run_id, number, agent, host, started_at, ended_at, ending, exit_code, duration,
       checkpoint_step, marked_preempting, outcome, closed_by, epoch, late
FROM preemptible_attempts WHERE run_id = :run_id ORDER BY number

-- name: history
SELECT params, state, summary FROM preemptible_runs
WHERE sweep_id = :sweep_id ORDER BY run_index

-- name: status_scan
-- what `status` reads of every run of a sweep to count states, find the best finished run and
-- pick the rows worth showing; the summary only where it can be the best
SELECT id, run_index, state, attempt, updated_at,
       CASE WHEN state = 'FINISHED' THEN summary END AS summary
FROM preemptible_runs WHERE sweep_id = :sweep_id ORDER BY run_index

-- name: status_runs
-- every run of a sweep with its attempts: a row per attempt (a run without one: one row)
SELECT r.id, r.run_index, r.params, r.state, r.attempt, r.preemptions, r.failures,
       r.lease_owner, r.lease_host, r.summary, r.updated_at, a.number, a.agent, a.host,
       a.started_at, a.ended_at, a.ending, a.exit_code, a.duration, a.checkpoint_step,
       a.closed_by, a.late
FROM preemptible_runs r LEFT JOIN preemptible_attempts a ON a.run_id = r.id
WHERE r.sweep_id = :sweep_id
ORDER BY r.run_index, a.number

-- name: status_run
SELECT r.id, r.run_index, r.params, r.state, r.attempt, r.preemptions, r.failures,
       r.lease_owner, r.lease_host, r.summary, r.updated_at, a.number, a.agent, a.host,
       a.started_at, a.ended_at, a.ending, a.exit_code, a.duration, a.checkpoint_step,
       a.closed_by, a.late
FROM preemptible_runs r LEFT JOIN preemptible_attempts a ON a.run_id = r.id
WHERE r.id = :id
ORDER BY a.number

-- name: web_changed
-- the runs of a sweep written since :since (the web page keeps a row per run and reads again
-- only these, sweeps/_web_model.py); the summary only where it can be the best
SELECT id, run_index, state, attempt, updated_at,
       CASE WHEN state = 'FINISHED' THEN summary END AS summary
FROM preemptible_runs WHERE sweep_id = :sweep_id AND updated_at >= :since

-- name: fail_unreadable_run
-- a pending run whose params cannot be read back (sweeps/_fields.py) can never run
UPDATE preemptible_runs SET state = 'FAILED', failures = failures + 1, updated_at = preemptible_now()
WHERE id = :id AND state = 'PENDING'

-- name: schema_versions
SELECT version FROM preemptible_schema ORDER BY version

-- name: record_version
INSERT INTO preemptible_schema (version, applied_at) VALUES (:version, preemptible_now())

-- name: hold_fenced
-- the fence of a write for the run's holder: 1 while claim :epoch holds the run (and, in
-- PostgreSQL, the row stays locked until the write commits)
UPDATE preemptible_runs SET updated_at = preemptible_now()
WHERE id = :id AND state = 'RUNNING' AND lease_epoch = :epoch

-- name: add_point
-- one point (SQLite runs it for each point of a slice, in one transaction; PostgreSQL has
-- add_points, the whole slice in one statement)
INSERT INTO preemptible_history (run_id, name, step, value, attempt)
VALUES (:run_id, :name, :step, :value, :attempt)
ON CONFLICT (run_id, name, step) DO UPDATE SET value = excluded.value, attempt = excluded.attempt

-- name: trim_history
DELETE FROM preemptible_history WHERE run_id = :run_id AND step > :after

-- name: sweep_history
SELECT h.run_id, h.step, h.value FROM preemptible_history h
JOIN preemptible_runs r ON r.id = h.run_id
WHERE r.sweep_id = :sweep_id AND h.name = :name
ORDER BY h.run_id, h.step

-- name: sweep_nth_values
-- each run's point number :offset + 1 of the metric (ascending by step), for the runs that
-- have that many: one index walk per run, up to the point, and nothing else read
SELECT value FROM (
    SELECT (
        SELECT h.value FROM preemptible_history h
        WHERE h.run_id = r.id AND h.name = :name
        ORDER BY h.step LIMIT 1 OFFSET :offset
    ) AS value
    FROM preemptible_runs r WHERE r.sweep_id = :sweep_id
) nth
WHERE value IS NOT NULL

-- name: run_metric_points
SELECT step, value FROM preemptible_history WHERE run_id = :run_id AND name = :name ORDER BY step

-- name: run_history
SELECT name, step, value, attempt FROM preemptible_history WHERE run_id = :run_id
ORDER BY name, step

-- name: resume_stopped
-- a run early termination stopped, put back by the user: first in line, its id and checkpoint
-- directory kept; exempt from early termination from now on (they overrode the decision)
UPDATE preemptible_runs
SET state = 'PENDING', early_exempt = 1, queued_at = preemptible_now(), requeued = 1,
    updated_at = preemptible_now()
WHERE id = :id AND sweep_id = :sweep_id AND state = 'STOPPED'

-- name: run_summaries
SELECT id, summary FROM preemptible_runs
WHERE sweep_id = :sweep_id AND summary IS NOT NULL ORDER BY run_index
