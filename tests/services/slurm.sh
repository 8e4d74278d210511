#!/usr/bin/env bash
# A throwaway single-node SLURM cluster for the test suite (Debian, root, no systemd).
#
#   bash tests/services/slurm.sh up      install (apt) if needed, configure, start, wait until idle
#   bash tests/services/slurm.sh down    cancel jobs, stop the daemons by the pids they wrote
#
# State, spool, pid files and logs live under $SLURM_LOCAL_DIR; the config goes to
# /etc/slurm/slurm.conf so that sbatch/scontrol need no SLURM_CONF. Nothing is killed by name.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/preemptible-slurm}
CONF=/etc/slurm/slurm.conf
# A requeued job may start again cred_expire + 1 s later (SLURM's default is 120 s).
CRED_EXPIRE=${SLURM_LOCAL_CRED_EXPIRE:-10}

log() { echo "[slurm.sh] $*" >&2; }
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pidof_file() { [ -s "$1" ] && tr -dc '0-9' <"$1" || true; }

install_slurm() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || { log "installing SLURM needs root"; return 1; }
    command -v apt-get >/dev/null || { log "no apt-get: cannot install SLURM here"; return 1; }
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-install-recommends: 8 packages instead of 42
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)
    mem=$(( ${mem:-1024} - 256 ))   # above what slurmd detects, the node is drained
    mkdir -p "$DIR"/{state,spool,log} "$(dirname "$CONF")"
    cat >"$CONF" <<CONF
ClusterName=preemptible-test
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=${CRED_EXPIRE}
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool
SlurmctldPidFile=${DIR}/slurmctld.pid
SlurmdPidFile=${DIR}/slurmd.pid
SlurmctldLogFile=${DIR}/log/slurmctld.log
SlurmdLogFile=${DIR}/log/slurmd.log
# pgid tracking kills a job's leftover processes at its end (linuxproc lets them escape)
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
PreemptType=preempt/none
JobRequeue=1
ReturnToService=2
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
}

start_munge() {
    alive "$(pidof_file /run/munge/munged.pid)" && return 0
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 2>/dev/null
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.1; done
    log "munged did not start"; return 1
}

up() {
    install_slurm
    if ! alive "$(pidof_file "$DIR/slurmctld.pid")"; then
        write_conf
    fi
    start_munge
    if ! alive "$(pidof_file "$DIR/slurmctld.pid")"; then
        /usr/sbin/slurmctld -c -f "$CONF" </dev/null >/dev/null 2>&1
    fi
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
    if ! alive "$(pidof_file "$DIR/slurmd.pid")"; then
        /usr/sbin/slurmd -f "$CONF" </dev/null >/dev/null 2>&1
    fi
    local state=""
    for _ in $(seq 300); do
        state=$(sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
        case "$state" in idle|mixed|allocated) log "up: node $(hostname -s) is $state"; return 0 ;; esac
        sleep 0.1
    done
    log "node state '$state' after 30 s; see $DIR/log"
    return 1
}

stop_pids() {  # TERM, wait up to 15 s, then KILL
    local pid
    for pid in "$@"; do alive "$pid" && kill -TERM "$pid" 2>/dev/null || true; done
    for _ in $(seq 150); do
        local left=0
        for pid in "$@"; do alive "$pid" && left=1; done
        [ $left = 0 ] && return 0
        sleep 0.1
    done
    for pid in "$@"; do alive "$pid" && kill -KILL "$pid" 2>/dev/null || true; done
}

down() {
    if scontrol ping 2>/dev/null | grep -q 'is UP'; then
        scancel --user=root --full 2>/dev/null || true
        scancel --user=root 2>/dev/null || true
        for _ in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
    fi
    stop_pids "$(pidof_file "$DIR/slurmd.pid")" "$(pidof_file "$DIR/slurmctld.pid")"
    stop_pids "$(pidof_file /run/munge/munged.pid)"
    rm -rf "$DIR/state" "$DIR/spool" "$DIR"/*.pid
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
