#!/usr/bin/env bash
# The integration tier in two lanes: two pytest processes at once, each one test at a time.
#
#   bash tests/services/lanes.sh PYTHON PYTEST_ARGS...
#
# Lane "waits" runs the tests marked `waits` (they wait on SLURM's time limit or a lease;
# tests/conftest.py also marks every test that submits SLURM jobs, so that jobs never queue
# behind each other on the one node); the other lane runs everything else, whose tests time
# real processes against deadlines and so must not share the CPU with each other. A waiting
# test costs the other lane little CPU. (pytest-xdist's loadgroup would do this in one
# process, but xdist 3.8 sets a node id that pytest 9 no longer reads, so its groups are
# ignored and every test runs beside another.) The waits lane's output is printed after the
# other's; the exit status is 0 only when both lanes pass.
set -uo pipefail
py=$1
shift
base=$(mktemp -d "${TMPDIR:-/tmp}/preemptible-lanes.XXXXXX")
trap 'rm -rf "$base"' EXIT
# each lane its own --basetemp: pytest prunes old numbered ones, which a lane would do under
# the other one's feet
"$py" -m pytest -p no:cacheprovider -m waits --basetemp "$base/waits" "$@" >"$base/waits.log" 2>&1 &
waits=$!
"$py" -m pytest -m "not waits" --basetemp "$base/rest" "$@"
rest=$?
wait "$waits"
w=$?
echo "---- lane 'waits' (pytest -m waits), run beside the above ----"
cat "$base/waits.log"
echo "lanes: the rest exited $rest, 'waits' exited $w"
[ "$rest" = 0 ] && [ "$w" = 0 ]
