-- Sweep queue, schema version 4 (PostgreSQL): early termination.
-- state STOPPED: a run that early termination (Hyperband) stopped; it saved a checkpoint and
-- can be resumed from it (``preemptible sweep resume SWEEP --run ID``).
-- early_exempt: 1 once the user resumed a STOPPED run: they overrode the judge's decision, so
-- it is not stopped again (it would be at once, by the same thresholds).

ALTER TABLE preemptible_runs DROP CONSTRAINT preemptible_runs_state_check;
ALTER TABLE preemptible_runs ADD CONSTRAINT preemptible_runs_state_check
    CHECK (state IN ('PENDING', 'RUNNING', 'FINISHED', 'FAILED', 'PREEMPTED', 'KILLED',
                     'CRASHED', 'CANCELLED', 'STOPPED'));
ALTER TABLE preemptible_runs ADD COLUMN early_exempt integer NOT NULL DEFAULT 0;
