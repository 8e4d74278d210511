#!/usr/bin/env bash
# A throwaway S3-protocol server on 127.0.0.1 for the test suite: moto's standalone server
# (moto[server], in the dev extra), in memory, on a free port.
#
#   bash tests/services/s3.sh up DIR     start it; prints its endpoint (http://127.0.0.1:PORT)
#   bash tests/services/s3.sh down DIR   stop it (the pid in DIR/pid) and remove DIR
#
# DIR holds the pid, the log and `endpoint`. Nothing is killed by name.
# Exit code 3: moto_server is not installed here (the tests that need it skip).
set -euo pipefail

log() { echo "[s3.sh] $*" >&2; }

server_bin() {
    local here py
    here=$(cd "$(dirname "$0")/../.." && pwd)
    for py in "${PREEMPTIBLE_TEST_PYTHON:-}" "$here/.venv/bin/python" python3; do
        [ -n "$py" ] || continue
        if "$py" -c 'import moto.server, flask' >/dev/null 2>&1; then echo "$py"; return 0; fi
    done
    log "moto's server is not installed (pip install 'moto[server]')"
    return 1
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

up() {
    local dir=$1 py port i
    py=$(server_bin) || exit 3
    mkdir -p "$dir"
    port=$(free_port)
    # setsid: the server leaves the caller's process group (a test's Ctrl+C is not for it)
    setsid "$py" -m moto.server -H 127.0.0.1 -p "$port" >"$dir/server.log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    for i in $(seq 200); do
        if python3 - "$port" <<'PY' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/moto-api/", timeout=1)
PY
            echo "http://127.0.0.1:$port" | tee "$dir/endpoint"
            return 0
        fi
        kill -0 "$(cat "$dir/pid")" 2>/dev/null || { log "moto_server exited: $(tail -1 "$dir/server.log")"; return 1; }
        sleep 0.1
    done
    log "moto_server did not answer within 20 s: $(tail -1 "$dir/server.log")"
    down "$dir"
    return 1
}

down() {
    local dir=$1 pid
    if [ -f "$dir/pid" ]; then
        pid=$(cat "$dir/pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -rf "$dir"
}

case "${1:-}" in
    up | down)
        [ -n "${2:-}" ] || { echo "usage: $0 up|down DIR" >&2; exit 2; }
        "$1" "$2"
        ;;
    *) echo "usage: $0 up|down DIR" >&2; exit 2 ;;
esac
