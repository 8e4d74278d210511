"""What tests share: fixtures (registered once, through ``pytest_plugins`` in tests/conftest.py),
fakes of what preemptible talks to, and the README block harness.

metadata  GCE, EC2 and Azure metadata services on 127.0.0.1; fixture ``metadata_server``
env       the variables that tell preemptible where it runs; ``CLEAN`` for child processes,
          fixture ``clean_platform_env`` for the test process itself
signals   fixture ``signal_handlers``: install handlers for one test, put the old ones back
slurm     a fake ``scontrol``; fixtures ``slurm`` and ``sbatch`` for the real cluster
postgres  fixtures ``pg_server`` (one per session), ``own_pg_server`` (one test's, to stop) and
          ``store_url`` (an empty sweep database)
reference fixture ``reference_runs``: one uninterrupted run per command for the session
buckets   object storage: fixtures ``s3_server`` (moto's S3 server, one per session),
          ``own_s3_server`` (one test's, to kill) and ``s3_bucket`` (a fresh bucket + AWS_* env)
readme    the harness that runs or checks every code block of README.md and docs/**/*.md
files     a directory whose entries cannot be removed; a file touched anew
sweeps    ``preemptible sweep create`` and friends as real processes
sweep_queue  fixtures ``sweep_clock`` and ``sweep_store``: a real SQLite queue on a set clock
checkpoints  what a stop test reads back: committed checkpoints, temporaries, same weights
browser   fixture ``browser`` (headless chromium, one per session) and ``Tab``, a page of it
cpu       with PREEMPTIBLE_TEST_CPU_LOG=FILE, each test's wall and CPU seconds (lane balancing)
azure_blob  Azure Blob on Azurite: fixtures ``azurite`` (one per session), ``own_azurite`` (one
          test's, to stop) and ``az_container`` (a fresh container + AZURE_STORAGE_* env); and
          ``bucket``: ``s3_bucket``, ``az_container``, ``gs_bucket``, for what must hold on
          every cloud; ``own_bucket``: one on an Azurite or fake-gcs-server of the test's own,
          to stop and start
gcs       Google Cloud Storage on fake-gcs-server: fixtures ``gcs`` (one per session),
          ``own_gcs`` (one test's, to stop) and ``gs_bucket`` (a fresh bucket +
          GOOGLE_SERVICE_ACCOUNT env), through a bridge for the XML PUT it does not take
machines  ``Machine``: a working directory, HOME and TMPDIR of their own, deleted by ``gone()``

Test modules import from here (or from tests/conftest.py), never from another test module.
"""
