#!/usr/bin/env bash
# The integration tier in three lanes: three pytest processes at once, each one test at a time.
#
#   bash tests/services/lanes.sh PYTHON PYTEST_ARGS...
#
# Lane "waits" runs the tests marked `waits` (they wait on SLURM's time limit or a lease;
# tests/conftest.py also marks every test that submits SLURM jobs, so that jobs never queue
# behind each other on the one node). Lane "frameworks" runs the Lightning, Hugging Face, Keras
# and torch.distributed files (marked `frameworks` in tests/conftest.py) and the code blocks of
# the README and the docs that run those frameworks (marked in test_readme.py); lane "rest" runs
# the others. One test at a time per lane: measured alone, a lane keeps about one core busy (most
# of a test is one process importing a framework and training, or waiting on it), so two
# computing lanes fill the two cores of these machines and the waiting one costs them little.
# (pytest-xdist's loadgroup would do this in one process, but xdist 3.8 sets a node id that
# pytest 9 no longer reads, so its groups are ignored and every test runs beside another.)
# The other lanes' output is printed after the rest's; the exit status is 0 only when every
# lane passes.
set -uo pipefail
py=$1
shift
base=$(mktemp -d "${TMPDIR:-/tmp}/preemptible-lanes.XXXXXX")
trap 'rm -rf "$base"' EXIT
# each lane its own --basetemp: pytest prunes old numbered ones, which a lane would do under
# another one's feet
"$py" -m pytest -p no:cacheprovider -m waits --basetemp "$base/waits" "$@" >"$base/waits.log" 2>&1 &
waits=$!
"$py" -m pytest -p no:cacheprovider -m "frameworks and not waits" --basetemp "$base/frameworks" \
    "$@" >"$base/frameworks.log" 2>&1 &
frameworks=$!
"$py" -m pytest -m "not waits and not frameworks" --basetemp "$base/rest" "$@"
rest=$?
wait "$frameworks"
f=$?
wait "$waits"
w=$?
echo "---- lane 'frameworks' (pytest -m 'frameworks and not waits'), run beside the above ----"
cat "$base/frameworks.log"
echo "---- lane 'waits' (pytest -m waits), run beside the above ----"
cat "$base/waits.log"
echo "lanes: the rest exited $rest, 'frameworks' exited $f, 'waits' exited $w"
[ "$rest" = 0 ] && [ "$f" = 0 ] && [ "$w" = 0 ]
