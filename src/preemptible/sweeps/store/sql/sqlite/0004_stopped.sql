-- Sweep queue, schema version 4 (SQLite): early termination.
-- state STOPPED: a run that early termination (Hyperband) stopped; it saved a checkpoint and
-- can be resumed from it (``preemptible sweep resume SWEEP --run ID``).
-- early_exempt: 1 once the user resumed a STOPPED run: they overrode the judge's decision, so
-- it is not stopped again (it would be at once, by the same thresholds).
--
-- SQLite cannot change a CHECK constraint in place: the runs table is rebuilt (its rows copied
-- aside, the table dropped and made again with the new CHECK, the rows put back, its indexes
-- made again). Other tables refer to its ids (attempts, history); with foreign keys on, the
-- drop leaves their rows without a parent until the rows are back, so the check of foreign
-- keys is deferred to this transaction's commit, when every parent is there again.

PRAGMA defer_foreign_keys = ON;

CREATE TABLE preemptible_runs_0004 AS SELECT * FROM preemptible_runs;

DROP TABLE preemptible_runs;

CREATE TABLE preemptible_runs (
    id TEXT PRIMARY KEY,
    sweep_id TEXT NOT NULL REFERENCES preemptible_sweeps (id),
    run_index INTEGER NOT NULL,
    params TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('PENDING', 'RUNNING', 'FINISHED', 'FAILED',
                                         'PREEMPTED', 'KILLED', 'CRASHED', 'CANCELLED',
                                         'STOPPED')),
    attempt INTEGER NOT NULL DEFAULT 0,
    preemptions INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    lease_owner TEXT,
    lease_host TEXT,
    lease_expires REAL,
    claim_token TEXT,
    create_token TEXT,
    queued_at REAL NOT NULL,
    -- 1 once the run went back to the queue: it is taken before runs that never ran
    requeued INTEGER NOT NULL DEFAULT 0,
    checkpoint_dir TEXT NOT NULL,
    summary TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    lease_epoch INTEGER NOT NULL DEFAULT 0,
    lease_seconds REAL,
    lease_holder TEXT,
    early_exempt INTEGER NOT NULL DEFAULT 0,
    UNIQUE (sweep_id, run_index)
);

INSERT INTO preemptible_runs (
    id, sweep_id, run_index, params, state, attempt, preemptions, failures, lease_owner,
    lease_host, lease_expires, claim_token, create_token, queued_at, requeued, checkpoint_dir,
    summary, created_at, updated_at, lease_epoch, lease_seconds, lease_holder
)
SELECT
    id, sweep_id, run_index, params, state, attempt, preemptions, failures, lease_owner,
    lease_host, lease_expires, claim_token, create_token, queued_at, requeued, checkpoint_dir,
    summary, created_at, updated_at, lease_epoch, lease_seconds, lease_holder
FROM preemptible_runs_0004;

DROP TABLE preemptible_runs_0004;

CREATE INDEX preemptible_runs_queue
    ON preemptible_runs (sweep_id, state, requeued DESC, queued_at, run_index);
CREATE INDEX preemptible_runs_lease ON preemptible_runs (state, lease_expires);
CREATE INDEX preemptible_runs_claim ON preemptible_runs (claim_token);
CREATE INDEX preemptible_runs_create ON preemptible_runs (create_token);
