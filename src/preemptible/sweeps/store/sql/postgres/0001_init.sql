-- Sweep queue, schema version 1 (PostgreSQL). Times are seconds since the epoch from the
-- server's clock (preemptible_now(): the transaction's start), so agents on machines with
-- skewed clocks agree on leases. JSON is stored as text (the same queries as SQLite).
-- Booleans are 0/1.

CREATE OR REPLACE FUNCTION preemptible_now() RETURNS double precision
    LANGUAGE sql STABLE AS 'SELECT extract(epoch FROM now())::double precision';

CREATE TABLE preemptible_sweeps (
    id text PRIMARY KEY,
    name text,
    spec text NOT NULL,
    control text NOT NULL DEFAULT 'running'
        CHECK (control IN ('running', 'stopped', 'paused', 'cancelled')),
    cancel_now integer NOT NULL DEFAULT 0,
    run_cap integer,
    max_failures integer NOT NULL,
    max_preemptions integer NOT NULL,
    seed bigint NOT NULL,
    runs_created integer NOT NULL DEFAULT 0,
    create_token text NOT NULL,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL
);

CREATE TABLE preemptible_runs (
    id text PRIMARY KEY,
    sweep_id text NOT NULL REFERENCES preemptible_sweeps (id),
    run_index integer NOT NULL,
    params text NOT NULL,
    state text NOT NULL CHECK (state IN ('PENDING', 'RUNNING', 'FINISHED', 'FAILED',
                                         'PREEMPTED', 'KILLED', 'CRASHED', 'CANCELLED')),
    attempt integer NOT NULL DEFAULT 0,
    preemptions integer NOT NULL DEFAULT 0,
    failures integer NOT NULL DEFAULT 0,
    lease_owner text,
    lease_host text,
    lease_expires double precision,
    claim_token text,
    create_token text,
    queued_at double precision NOT NULL,
    -- 1 once the run went back to the queue: it is taken before runs that never ran
    requeued integer NOT NULL DEFAULT 0,
    checkpoint_dir text NOT NULL,
    summary text,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    UNIQUE (sweep_id, run_index)
);

-- the claim order, so that a claim reads one index entry, not every pending run
CREATE INDEX preemptible_runs_queue
    ON preemptible_runs (sweep_id, state, requeued DESC, queued_at, run_index);
CREATE INDEX preemptible_runs_lease ON preemptible_runs (state, lease_expires);
CREATE INDEX preemptible_runs_claim ON preemptible_runs (claim_token);
CREATE INDEX preemptible_runs_create ON preemptible_runs (create_token);

CREATE TABLE preemptible_attempts (
    run_id text NOT NULL REFERENCES preemptible_runs (id),
    number integer NOT NULL,
    agent text NOT NULL,
    host text NOT NULL,
    started_at double precision NOT NULL,
    ended_at double precision,
    ending text,
    exit_code integer,
    duration double precision,
    checkpoint_step bigint,
    marked_preempting integer NOT NULL DEFAULT 0,
    outcome text,
    closed_by text,
    PRIMARY KEY (run_id, number)
);
