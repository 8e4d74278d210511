-- Sweep queue, schema version 2 (SQLite): leases with fencing.
-- lease_epoch: increased by every claim of the run; the holder's heartbeats, results and
-- hand-backs carry it and are refused once it moved on (a fencing token). Never reset.
-- lease_seconds: the lease the holder asked for (its takeover margin is a share of it).
-- lease_holder: "boot_id/pid_namespace/pid/start_ticks" of the holder's process, so that an
-- agent on the same host can tell whether the holder still lives (pids are compared only
-- within one boot and one pid namespace; the start time guards against pid reuse).

ALTER TABLE preemptible_runs ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0;
ALTER TABLE preemptible_runs ADD COLUMN lease_seconds REAL;
ALTER TABLE preemptible_runs ADD COLUMN lease_holder TEXT;
ALTER TABLE preemptible_attempts ADD COLUMN epoch INTEGER;
