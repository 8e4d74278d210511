# Sourced by the emulator scripts (azurite.sh, gcs.sh): what they share around their own
# `install` (exit 3 when the emulator cannot be had here) and `start DIR` (launch it on the port
# in DIR/port, its pid in DIR/pid, and return once it answers), which each script defines.
#
#   SCRIPT up DIR     install if missing, start; prints the endpoint
#   SCRIPT stop DIR   stop it: an outage, until `start` (same port, data)
#   SCRIPT start DIR  start it again
#   SCRIPT down DIR   stop it and remove DIR
#
# Only the pid in DIR/pid is ever killed.

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# running: not gone and not a zombie (a dead server waits for PID 1 to reap it, which in a
# container can take seconds: it holds no port then, so it is stopped)
alive() {
    kill -0 "$1" 2>/dev/null || return 1
    [ -r "/proc/$1/stat" ] || return 0
    [ "$(sed 's/.*) //' "/proc/$1/stat" | cut -c1)" != Z ]
}

stop() {
    local dir=$1 pid
    [ -f "$dir/pid" ] || return 0
    pid=$(cat "$dir/pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do  # 10 s, then SIGKILL
        alive "$pid" || { rm -f "$dir/pid"; return 0; }
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/pid"
}

up() {
    local dir=$1
    install
    mkdir -p "$dir/data"
    free_port >"$dir/port"
    start "$dir"
    echo "http://127.0.0.1:$(cat "$dir/port")" | tee "$dir/endpoint"
}

down() {  # nothing in DIR is kept: no graceful close (it would wait out keep-alive connections)
    local dir=$1 pid
    if [ -f "$dir/pid" ]; then
        pid=$(cat "$dir/pid")
        kill -9 "$pid" 2>/dev/null || true
        for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
    fi
    rm -rf "$dir"
}

emulator_main() {
    case "${1:-}" in
        up | stop | start | down)
            [ -n "${2:-}" ] || { echo "usage: $0 up|stop|start|down DIR" >&2; exit 2; }
            local dir
            dir=$(mkdir -p "$2" && cd "$2" && pwd)
            "$1" "$dir"
            ;;
        *) echo "usage: $0 up|stop|start|down DIR" >&2; exit 2 ;;
    esac
}
