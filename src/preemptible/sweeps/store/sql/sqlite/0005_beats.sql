-- Sweep queue, schema version 5 (SQLite): expiry without a shared wall clock, late results.
-- lease_beats: increased by every renewal of the run's lease. SQLite has no clock of its own
-- (preemptible_now() is each process's wall clock), so an agent judges a lease on another
-- host by this counter as it sees it over its own monotonic time: a run is taken over only
-- after its counter stayed the same for the lease and its margin (sweeps/_watch.py).
-- late: 1 when the attempt's own result came after another agent had taken the run over: its
-- ending and exit code are what the attempt really did; the run's state is not its to decide.

ALTER TABLE preemptible_runs ADD COLUMN lease_beats INTEGER NOT NULL DEFAULT 0;
ALTER TABLE preemptible_attempts ADD COLUMN late INTEGER NOT NULL DEFAULT 0;
