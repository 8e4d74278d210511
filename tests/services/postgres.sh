#!/usr/bin/env bash
# A throwaway PostgreSQL server on 127.0.0.1 for the test suite (trust auth, no fsync).
#
#   bash tests/services/postgres.sh up DIR       initdb + start; prints the server's URL
#   bash tests/services/postgres.sh restart DIR  pg_ctl restart -m fast (drops every connection)
#   bash tests/services/postgres.sh stop DIR     pg_ctl stop -m fast: an outage, until `start`
#   bash tests/services/postgres.sh start DIR    start it again (same port, socket and data)
#   bash tests/services/postgres.sh down DIR     stop it and remove DIR
#
# DIR holds the data directory, the Unix socket, the log and `url`. As root the server runs as
# the `postgres` user (initdb refuses root); otherwise as the caller. Nothing is killed by name.
# Exit code 3: no PostgreSQL server binaries here (the tests that need them skip).
set -euo pipefail

log() { echo "[postgres.sh] $*" >&2; }

bin_dir() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
    if [ -n "$d" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return 0; fi
    d=$(dirname "$(command -v pg_ctl 2>/dev/null || echo /nonexistent/pg_ctl)")
    if [ -x "$d/pg_ctl" ] && [ -x "$d/initdb" ]; then echo "$d"; return 0; fi
    log "no PostgreSQL server binaries (initdb, pg_ctl); install postgresql"
    return 1
}

as_owner() {  # run a server binary as the user that owns the cluster
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

up() {
    local dir=$1 bin port
    bin=$(bin_dir) || exit 3
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then
        id postgres >/dev/null 2>&1 \
            || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
        chown postgres:postgres "$dir"
        runuser -u postgres -- test -w "$dir" \
            || { log "the postgres user cannot reach $dir; use a directory right under /tmp or /dev/shm"; return 1; }
    fi
    port=$(free_port)
    as_owner "$bin/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 \
        --no-sync >"$dir/initdb.log" 2>&1 || { log "initdb failed: $(tail -1 "$dir/initdb.log")"; return 1; }
    # one role must give its password (the redaction tests try a wrong one); the rest is trusted
    { echo "host all preemptible_pw 127.0.0.1/32 scram-sha-256"; cat "$dir/data/pg_hba.conf"; } \
        >"$dir/pg_hba.new"
    cat "$dir/pg_hba.new" >"$dir/data/pg_hba.conf" && rm "$dir/pg_hba.new"  # keeps owner, mode
    # the options live in the data directory, so that `restart` keeps port and socket
    cat >>"$dir/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
CONF
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 start >/dev/null \
        || { log "pg_ctl start failed: $(tail -1 "$dir/server.log")"; return 1; }
    echo "postgresql://postgres@127.0.0.1:$port/postgres" | tee "$dir/url"
}

restart() {
    local dir=$1 bin
    bin=$(bin_dir) || exit 3
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -m fast -w -t 30 restart >/dev/null
}

stop() {
    local dir=$1 bin
    bin=$(bin_dir) || exit 3
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 30 stop >/dev/null
}

start() {
    local dir=$1 bin
    bin=$(bin_dir) || exit 3
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 start >/dev/null
}

down() {
    local dir=$1 bin
    bin=$(bin_dir) || exit 3
    if [ -f "$dir/data/postmaster.pid" ]; then
        as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 30 stop >/dev/null || true
    fi
    rm -rf "$dir"
}

case "${1:-}" in
    up | restart | stop | start | down)
        [ -n "${2:-}" ] || { echo "usage: $0 up|restart|stop|start|down DIR" >&2; exit 2; }
        "$1" "$2"
        ;;
    *) echo "usage: $0 up|restart|stop|start|down DIR" >&2; exit 2 ;;
esac
