-- The PostgreSQL side of the queries that differ: row locks. A claim takes the oldest pending
-- run that no other transaction holds (FOR UPDATE SKIP LOCKED), so agents never wait on each
-- other for a run and never take the same one; only creating a new run locks the sweep row.

-- name: create_schema_table
CREATE TABLE IF NOT EXISTS preemptible_schema (
    version integer PRIMARY KEY,
    applied_at double precision NOT NULL
)

-- name: migration_lock
-- one migrator at a time per database (the key is "preemptible sweeps" as 64 bits, arbitrary)
SELECT pg_advisory_xact_lock(7093158262931977217)

-- name: lock_sweep
SELECT control, cancel_now, run_cap, runs_created FROM preemptible_sweeps WHERE id = :id FOR UPDATE

-- name: lock_run
SELECT r.id, r.sweep_id, r.state, r.attempt, r.lease_owner, r.preemptions, r.failures,
       r.lease_epoch, s.control, s.max_failures, s.max_preemptions,
       a.ended_at AS attempt_ended_at, a.outcome AS attempt_outcome,
       a.closed_by AS attempt_closed_by, a.epoch AS attempt_epoch,
       a.late AS attempt_late
FROM preemptible_runs r
JOIN preemptible_sweeps s ON s.id = r.sweep_id
LEFT JOIN preemptible_attempts a ON a.run_id = r.id AND a.number = :attempt
WHERE r.id = :id
FOR UPDATE OF r

-- name: pick_pending
-- the first :n in line: a run that cannot start on this agent yet (its previous attempt's
-- processes still hold its locks here) is passed over for the next
SELECT id, sweep_id, run_index, params, attempt, checkpoint_dir, preemptions, failures,
       lease_epoch
FROM preemptible_runs
WHERE sweep_id = :sweep_id AND state = 'PENDING'
ORDER BY requeued DESC, queued_at, run_index
LIMIT :n
FOR UPDATE SKIP LOCKED

-- name: expired_runs
SELECT r.id, r.attempt, r.preemptions, r.failures, a.marked_preempting,
       s.control, s.max_failures, s.max_preemptions, r.lease_epoch, r.lease_seconds,
       r.lease_holder, r.lease_host, preemptible_now() - r.lease_expires AS overdue
FROM preemptible_runs r
JOIN preemptible_attempts a ON a.run_id = r.id AND a.number = r.attempt
JOIN preemptible_sweeps s ON s.id = r.sweep_id
WHERE r.state = 'RUNNING' AND r.lease_expires < preemptible_now()
FOR UPDATE OF r SKIP LOCKED

-- name: add_points
-- a slice of points in one statement (arrays of names, steps and values, in step with each
-- other): half the time of one INSERT per point in a pipeline. No (name, step) twice in one
-- call: ON CONFLICT DO UPDATE cannot change one row twice in a statement.
INSERT INTO preemptible_history (run_id, name, step, value, attempt)
SELECT :run_id, p.name, p.step, p.value, :attempt
FROM unnest(CAST(:names AS text[]), CAST(:steps AS bigint[]), CAST(:vals AS double precision[]))
     AS p (name, step, value)
ON CONFLICT (run_id, name, step) DO UPDATE SET value = excluded.value, attempt = excluded.attempt
