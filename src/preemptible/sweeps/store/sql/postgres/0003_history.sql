-- Sweep queue, schema version 3 (PostgreSQL): each run's metric history.
-- One row per (run, metric, step): the value the run reported there (a later report at the
-- same step replaces it) and the attempt that reported it. A resumed attempt first removes
-- the points after the step it resumes from, so a stopped and resumed run's history is the
-- one an uninterrupted run would have. Hyperband reads it; the web page draws it.

CREATE TABLE preemptible_history (
    run_id text NOT NULL REFERENCES preemptible_runs (id),
    name text NOT NULL,
    step bigint NOT NULL,
    value double precision NOT NULL,
    attempt integer NOT NULL,
    PRIMARY KEY (run_id, name, step)
);
