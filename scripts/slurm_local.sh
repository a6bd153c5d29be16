#!/usr/bin/env bash
# A throwaway two-node SLURM cluster on this one machine, to try zerotune's SLURM path without one:
#
#   scripts/slurm_local.sh up        # writes the config, starts slurmctld and two slurmd, waits for the nodes
#   export SLURM_CONF=/tmp/zerotune-slurm/slurm.conf    # (printed by `up`) for sinfo, sbatch, zerotune
#   scripts/slurm_local.sh status    # the daemons and sinfo
#   scripts/slurm_local.sh down      # stops the daemons by their pids
#
# Debian's slurm-wlm daemons, run as root without systemd or munge: authentication and credentials are off
# (auth/none, cred/none), so this is for a laptop or a test machine, never a shared host. Both nodes are this
# host under two names (added to /etc/hosts), each its own slurmd on its own port, so a job gets a genuine
# two-node allocation (SLURM_NODEID 0 and 1).
# Settings: ZEROTUNE_SLURM_DIR (state, logs, pids; default /tmp/zerotune-slurm), ZEROTUNE_SLURM_PORT (slurmctld's
# port; the nodes take the next two), ZEROTUNE_SLURM_CPUS (CPUs each node offers; default: this host's).
set -euo pipefail

DIR=${ZEROTUNE_SLURM_DIR:-/tmp/zerotune-slurm}
PORT=${ZEROTUNE_SLURM_PORT:-16817}
CPUS=${ZEROTUNE_SLURM_CPUS:-$(nproc)}
NODES=(zt-node1 zt-node2)
CONF=$DIR/slurm.conf

die() { echo "slurm_local: $*" >&2; exit 1; }

need_binaries() {
    for bin in slurmctld slurmd sinfo scontrol; do
        command -v "$bin" >/dev/null || die "$bin not found: apt-get install slurmctld slurmd slurm-client (make setup does)"
    done
    [ "$(id -u)" = 0 ] || die "the daemons run as root here (SlurmUser=root); run as root or with sudo"
}

write_conf() {
    mkdir -p "$DIR/ctld"
    local mem_mib
    mem_mib=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)   # half the host's memory per node
    cat > "$CONF" <<CONF
# Written by scripts/slurm_local.sh: two nodes on this host.
ClusterName=zerotune-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
# Both nodes claim the host's CPUs and half its memory, whatever slurmd counts.
SlurmdParameters=config_overrides
StateSaveLocation=$DIR/ctld
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdSpoolDir=$DIR/%n/spool
SlurmdPidFile=$DIR/%n/slurmd.pid
SlurmdLogFile=$DIR/%n/slurmd.log
KillWait=10
MinJobAge=300
NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$CPUS RealMemory=$mem_mib State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$CPUS RealMemory=$mem_mib State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
CONF
    for node in "${NODES[@]}"; do
        mkdir -p "$DIR/$node/spool"
        grep -qE "^[0-9.]+[[:space:]].*\b$node\b" /etc/hosts || echo "127.0.0.1 $node" >> /etc/hosts
    done
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
    need_binaries
    if alive "$DIR/slurmctld.pid"; then echo "slurm_local: already up ($CONF)"; return; fi
    write_conf
    export SLURM_CONF=$CONF
    slurmctld -i -c -f "$CONF"          # forks; its pid lands in SlurmctldPidFile
    for node in "${NODES[@]}"; do slurmd -N "$node" -f "$CONF"; done
    for _ in $(seq 60); do
        idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle"' | wc -l)
        [ "$idle" = "${#NODES[@]}" ] && { echo "slurm_local: up, nodes ${NODES[*]} idle"; echo "export SLURM_CONF=$CONF"; return; }
        sleep 1
    done
    status || true
    die "the nodes did not become idle in 60 s; see $DIR/slurmctld.log and $DIR/<node>/slurmd.log"
}

stop_pid() {
    local file=$1
    alive "$file" || return 0
    local pid; pid=$(cat "$file")
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
}

down() {
    for node in "${NODES[@]}"; do stop_pid "$DIR/$node/slurmd.pid"; done
    stop_pid "$DIR/slurmctld.pid"
    echo "slurm_local: down"
}

status() {
    for file in "$DIR/slurmctld.pid" "${NODES[@]/#/$DIR/}"; do
        [ -d "$file" ] && file=$file/slurmd.pid
        if alive "$file"; then echo "running  $(basename "$(dirname "$file")")/$(basename "$file") pid $(cat "$file")"
        else echo "stopped  $file"; fi
    done
    SLURM_CONF=$CONF sinfo -N 2>/dev/null || echo "sinfo: no answer from slurmctld"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
