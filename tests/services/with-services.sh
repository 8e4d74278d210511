#!/usr/bin/env bash
# Runs a command (the test suite) with the services its tests need, and stops them after.
# A service that cannot be started here is reported in one line; its tests then skip and
# say why, and everything else still runs.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
logs=${TMPDIR:-/tmp}/preemptible-services
mkdir -p "$logs"

if bash "$here/slurm.sh" up >"$logs/slurm-up.log" 2>&1; then
    export PREEMPTIBLE_TEST_SLURM=1
    trap 'bash "$here/slurm.sh" down >"$logs/slurm-down.log" 2>&1' EXIT
else
    export PREEMPTIBLE_TEST_SLURM="could not start SLURM: $(tail -1 "$logs/slurm-up.log")"
    echo "with-services: $PREEMPTIBLE_TEST_SLURM (SLURM tests will skip)" >&2
fi

"$@"
