-- Sweep queue, schema version 1 (SQLite). Times are seconds since the epoch from the database
-- side (preemptible_now(), registered on each connection: SQLite lives on one host, so its
-- clock is the one every agent sees). JSON is stored as text. Booleans are 0/1.

CREATE TABLE preemptible_sweeps (
    id TEXT PRIMARY KEY,
    name TEXT,
    spec TEXT NOT NULL,
    control TEXT NOT NULL DEFAULT 'running'
        CHECK (control IN ('running', 'stopped', 'paused', 'cancelled')),
    cancel_now INTEGER NOT NULL DEFAULT 0,
    run_cap INTEGER,
    max_failures INTEGER NOT NULL,
    max_preemptions INTEGER NOT NULL,
    seed INTEGER NOT NULL,
    runs_created INTEGER NOT NULL DEFAULT 0,
    create_token TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);

CREATE TABLE preemptible_runs (
    id TEXT PRIMARY KEY,
    sweep_id TEXT NOT NULL REFERENCES preemptible_sweeps (id),
    run_index INTEGER NOT NULL,
    params TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('PENDING', 'RUNNING', 'FINISHED', 'FAILED',
                                         'PREEMPTED', 'KILLED', 'CRASHED', 'CANCELLED')),
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
    UNIQUE (sweep_id, run_index)
);

-- the claim order, so that a claim reads one index entry, not every pending run
CREATE INDEX preemptible_runs_queue
    ON preemptible_runs (sweep_id, state, requeued DESC, queued_at, run_index);
CREATE INDEX preemptible_runs_lease ON preemptible_runs (state, lease_expires);
CREATE INDEX preemptible_runs_claim ON preemptible_runs (claim_token);
CREATE INDEX preemptible_runs_create ON preemptible_runs (create_token);

CREATE TABLE preemptible_attempts (
    run_id TEXT NOT NULL REFERENCES preemptible_runs (id),
    number INTEGER NOT NULL,
    agent TEXT NOT NULL,
    host TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    ending TEXT,
    exit_code INTEGER,
    duration REAL,
    checkpoint_step INTEGER,
    marked_preempting INTEGER NOT NULL DEFAULT 0,
    outcome TEXT,
    closed_by TEXT,
    PRIMARY KEY (run_id, number)
);
