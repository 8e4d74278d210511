#!/usr/bin/env bash
# Azurite, Azure's own Blob Storage emulator, on 127.0.0.1 for the test suite.
#
#   bash tests/services/azurite.sh up DIR     install if missing, start; prints the blob endpoint
#   bash tests/services/azurite.sh stop DIR   stop it: an outage, until `start` (same port, data)
#   bash tests/services/azurite.sh start DIR  start it again
#   bash tests/services/azurite.sh down DIR   stop it and remove DIR
#
# The endpoint printed (http://127.0.0.1:PORT) is the service's root; clients add the emulator
# account, devstoreaccount1, as the first path segment (obstore: AZURITE_BLOB_STORAGE_URL with
# AZURE_STORAGE_USE_EMULATOR=true; see tests/support/azure_blob.py).
#
# Azurite is an npm package: it is installed once, pinned, into a cache directory
# ($PREEMPTIBLE_AZURITE_CACHE, default ~/.cache/preemptible/azurite; about 15 s), so that a fresh
# machine gets it inside `make test`. DIR holds the data, the log, the port and the pid; only
# that pid is ever killed. Without node/npm, as root with apt, it installs nodejs and npm first.
# Exit code 3: still no node/npm, or npm could not install Azurite (the tests that need it skip,
# saying why).
set -euo pipefail

VERSION=3.35.0
cache=${PREEMPTIBLE_AZURITE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/preemptible/azurite}
bin=$cache/node_modules/.bin/azurite-blob

log() { echo "[azurite.sh] $*" >&2; }

install() {
    [ -x "$bin" ] && grep -q "\"version\": \"$VERSION\"" "$cache/node_modules/azurite/package.json" \
        2>/dev/null && return 0
    if ! { command -v node >/dev/null && command -v npm >/dev/null; } \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "no node/npm here: installing nodejs and npm with apt"
        timeout 300 apt-get install -y -qq nodejs npm >/dev/null 2>&1 \
            || { apt-get update -qq >/dev/null 2>&1 \
                && timeout 300 apt-get install -y -qq nodejs npm >/dev/null 2>&1; } || true
    fi
    command -v node >/dev/null && command -v npm >/dev/null \
        || { log "no node/npm here: install nodejs and npm to run the Azure tests"; exit 3; }
    mkdir -p "$cache"
    log "installing azurite@$VERSION into $cache"
    if ! timeout 300 npm install --prefix "$cache" --no-audit --no-fund --no-save --loglevel=error \
        "azurite@$VERSION" >"$cache/npm-install.log" 2>&1; then
        log "npm could not install azurite@$VERSION: $(tail -1 "$cache/npm-install.log")"
        exit 3
    fi
    [ -x "$bin" ] || { log "npm installed azurite but $bin is missing"; exit 3; }
}

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
    local dir=$1 port pid
    port=$(cat "$dir/port")
    # own session, stdin/stdout/stderr away from the caller: `$(azurite.sh up)` must not wait
    # on it, and a Ctrl-C in the caller's terminal is not its business
    (cd "$dir" && exec setsid "$bin" --blobHost 127.0.0.1 --blobPort "$port" \
        --location "$dir/data" --disableTelemetry --skipApiVersionCheck --silent \
        </dev/null >>"$dir/azurite.log" 2>&1) &
    pid=$!
    echo "$pid" >"$dir/pid"
    for _ in $(seq 300); do  # 30 s
        listening "$port" && return 0
        kill -0 "$pid" 2>/dev/null || { log "azurite exited: $(tail -1 "$dir/azurite.log")"; return 1; }
        sleep 0.1
    done
    log "azurite did not listen on 127.0.0.1:$port within 30 s: $(tail -1 "$dir/azurite.log")"
    return 1
}

# shellcheck source=tests/services/_emulator.sh
. "$(dirname "$0")/_emulator.sh"
emulator_main "$@"
