-- Sweep queue, schema version 5 (PostgreSQL): late results, and the renewal counter.
-- lease_beats: increased by every renewal of the run's lease. PostgreSQL judges expiry by its
-- own clock (preemptible_now() is the server's); the counter is kept for the same queries as
-- SQLite's, where it is how agents judge a lease (sweeps/_watch.py).
-- late: 1 when the attempt's own result came after another agent had taken the run over: its
-- ending and exit code are what the attempt really did; the run's state is not its to decide.

ALTER TABLE preemptible_runs ADD COLUMN lease_beats bigint NOT NULL DEFAULT 0;
ALTER TABLE preemptible_attempts ADD COLUMN late integer NOT NULL DEFAULT 0;
