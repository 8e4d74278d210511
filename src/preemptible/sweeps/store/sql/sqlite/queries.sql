-- The SQLite side of the queries that differ. Every write runs inside BEGIN IMMEDIATE, so one
-- writer at a time holds the whole database: no row locks are needed.

-- name: create_schema_table
CREATE TABLE IF NOT EXISTS preemptible_schema (
    version INTEGER PRIMARY KEY,
    applied_at REAL NOT NULL
)

-- name: migration_lock
SELECT 1

-- name: lock_sweep
SELECT control, cancel_now, run_cap, runs_created FROM preemptible_sweeps WHERE id = :id

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

-- name: pick_pending
-- the first :n in line: a run that cannot start on this agent yet (its previous attempt's
-- processes still hold its locks here) is passed over for the next
SELECT id, sweep_id, run_index, params, attempt, checkpoint_dir, preemptions, failures,
       lease_epoch
FROM preemptible_runs
WHERE sweep_id = :sweep_id AND state = 'PENDING'
ORDER BY requeued DESC, queued_at, run_index
LIMIT :n

-- name: expired_runs
-- every running run: SQLite has no clock all agents share (preemptible_now() is this
-- process's wall clock), so which leases ran out is judged by their renewal counters as this
-- agent sees them (sweeps/_watch.py); overdue by the wall clock only hints, on the holder's
-- own host, where the holder's liveness decides
SELECT r.id, r.attempt, r.preemptions, r.failures, a.marked_preempting,
       s.control, s.max_failures, s.max_preemptions, r.lease_epoch, r.lease_seconds,
       r.lease_holder, r.lease_host, r.lease_beats,
       preemptible_now() - r.lease_expires AS wall_overdue
FROM preemptible_runs r
JOIN preemptible_attempts a ON a.run_id = r.id AND a.number = r.attempt
JOIN preemptible_sweeps s ON s.id = r.sweep_id
WHERE r.state = 'RUNNING'
