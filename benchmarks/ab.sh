#!/usr/bin/env bash
# Side by side with another version: run a benchmark N times with OLD's source, then this
# tree's, alternated (old, new, old, new...), with this checkout's .venv.
#   git worktree add /tmp/old 2fd3275
#   bash benchmarks/ab.sh /tmp/old/src 3 benchmarks/bench_step_overhead.py --repeats 7
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: ab.sh OLD_SRC N SCRIPT [ARGS...]" >&2
  exit 2
fi
old=$1 n=$2
shift 2
here="$(cd "$(dirname "$0")/.." && pwd)"
for i in $(seq "$n"); do
  echo "== before, round $i ($old)"
  PYTHONPATH="$old" "$here/.venv/bin/python" "$@"
  echo "== this tree, round $i"
  PYTHONPATH="$here/src" "$here/.venv/bin/python" "$@"
done
