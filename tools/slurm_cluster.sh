#!/usr/bin/env bash
# A throw-away Slurm cluster on this host, for psflow's tests and for trying `--backend slurm`:
# munged, one slurmctld and N slurmd "nodes" in one directory. Node i is named by its own loopback
# address, 127.0.0.i (Slurm's list: 127.0.0.[1-N]), so that, as on a real cluster, a node's name
# resolves to an address of its own: a task on node 2 that binds its node's name listens on 127.0.0.2.
#
#   tools/slurm_cluster.sh up DIR [NODES] [--netns]   prints `export SLURM_CONF=DIR/slurm.conf` (eval it)
#   tools/slurm_cluster.sh down DIR          cancels its jobs, stops its daemons (by their pid files)
#
# --netns: hosts of their own, as on a real cluster. slurmctld, each slurmd and a "login node" each live
# in a network namespace with its own address on a bridge (itself in a namespace): nodes NET.1..N (named
# by those addresses), slurmctld NET.250, the login node NET.200, NET=10.78.0 (PSFLOW_SLURM_NET). Nothing
# is added to the root namespace, so Slurm's commands and the launcher run inside the login node's:
# `nsenter --net=/run/netns/$(cat DIR/login.netns) psflow run --backend slurm ...`. Loopback is each host's own.
# A node set down (scontrol update nodename=N state=down) stays down until state=resume (ReturnToService=1).
# Needs root and iproute2 (exit 2 otherwise). munged is shared (its socket is a file). Namespaces are
# named psf<N>-* (N from DIR) and deleted by `down`. Reference: shared/engines/netns_up.sh.
#
# Exit codes of `up`: 0 up; 2 Slurm or munge is missing and cannot be installed here (not root, or
# apt failed; the reason is on stderr); 1 the daemons did not come up (their log tails on stderr).
# As root, missing binaries are installed with apt (Debian's slurmctld slurmd slurm-client munge),
# unless PSFLOW_SLURM_INSTALL=0. Every daemon runs as root without systemd or cgroups
# (proctrack/linuxproc, task/none); each node declares CPUS (default 8) whatever the host has,
# because a job that cannot fit stays queued for ever. Ports: PORT_BASE for slurmctld (default:
# 10000-29999, derived from DIR so that clusters in different directories do not collide, and below
# the ephemeral ports that tasks bind), BASE+1.. for nodes.
# Reference: shared/engines/slurm_up.sh, which ran on this machine kind.
set -euo pipefail

usage() { echo "usage: $0 up DIR [NODES] [--netns] | down DIR" >&2; exit 64; }
[ $# -ge 2 ] || usage
CMD=$1 DIR=$2 NODES=3 NETNS=0
for a in "${@:3}"; do
  case $a in --netns) NETNS=1 ;; [0-9]*) NODES=$a ;; *) usage ;; esac
done
NET=${PSFLOW_SLURM_NET:-10.78.0}
PFX=psf$(( $(echo "$DIR" | cksum | cut -d' ' -f1) % 100000 ))
CPUS=${PSFLOW_SLURM_CPUS:-8}
CONF=$DIR/slurm.conf
log() { echo "slurm_cluster: $*" >&2; }

alive() {  # $1 pid file, $2 the binary it must be running
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

in_login() {  # a Slurm command where slurmctld is reachable: the login node's namespace, if any
  local ns
  ns=$(cat "$DIR/login.netns" 2>/dev/null || true)
  if [ -n "$ns" ]; then SLURM_CONF=$CONF nsenter --net="/run/netns/$ns" "$@"; else SLURM_CONF=$CONF "$@"; fi
}

down() {
  if [ -f "$CONF" ] && alive "$DIR/slurmctld.pid" slurmctld; then
    local jobs
    jobs=$(in_login timeout 5 squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
      # shellcheck disable=SC2086
      in_login timeout 5 scancel $jobs 2>/dev/null || true
      for _ in $(seq 1 40); do  # <= 10 s for their steps to end
        [ -z "$(in_login timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.25
      done
    fi
  fi
  local pids=() f
  for f in "$DIR"/slurmd.*.pid; do alive "$f" slurmd && pids+=("$(cat "$f")"); done
  alive "$DIR/slurmctld.pid" slurmctld && pids+=("$(cat "$DIR/slurmctld.pid")")
  alive "$DIR/munge/munged.pid" munged && pids+=("$(cat "$DIR/munge/munged.pid")")
  if [ ${#pids[@]} -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 1 50); do  # each daemon takes 1-2 s to exit
      local left=0 p
      for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && left=1; done
      [ $left = 0 ] && break
      sleep 0.1
    done
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  fi
  rm -f "$DIR"/slurmd.*.pid "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/munge/munge.socket"*
  local ns
  for ns in $(cat "$DIR/netns.list" 2>/dev/null || true); do  # only the namespaces this cluster made
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true  # a task a lost node left behind
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -f "$DIR/netns.list" "$DIR/login.netns"
}

netns_up() {  # the bridge and one namespace per host (shared/engines/netns_up.sh's layout)
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v nsenter >/dev/null; then
    log "--netns needs root, iproute2 (ip netns) and nsenter"; exit 2
  fi
  ip netns add "$PFX-sw" 2>/dev/null || { log "cannot make network namespaces here (ip netns add failed)"; exit 2; }
  echo "$PFX-sw" >> "$DIR/netns.list"
  ip -n "$PFX-sw" link set lo up
  ip -n "$PFX-sw" link add br0 type bridge
  ip -n "$PFX-sw" link set br0 up
  local name i=0 hosts="ctl:250 login:200"
  for i in $(seq 1 "$NODES"); do hosts="$hosts h$i:$i"; done
  i=0
  for name in $hosts; do
    local ns=$PFX-${name%%:*} addr=$NET.${name##*:}
    i=$((i + 1))
    ip netns add "$ns"
    echo "$ns" >> "$DIR/netns.list"
    ip -n "$PFX-sw" link add "p$i" type veth peer name eth0 netns "$ns"
    ip -n "$PFX-sw" link set "p$i" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
  echo "$PFX-login" > "$DIR/login.netns"
}

install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
    && command -v munged >/dev/null && command -v mungekey >/dev/null && return 0
  local pkgs="slurmctld slurmd slurm-client munge"
  if [ "${PSFLOW_SLURM_INSTALL:-1}" != 1 ]; then log "missing: $pkgs (PSFLOW_SLURM_INSTALL=0: not installing)"; exit 2; fi
  if [ "$(id -u)" != 0 ]; then log "missing: $pkgs, and not root to apt-get install them"; exit 2; fi
  if ! command -v apt-get >/dev/null; then log "missing: $pkgs, and no apt-get to install them"; exit 2; fi
  log "installing $pkgs (apt)"
  export DEBIAN_FRONTEND=noninteractive
  { timeout 600 apt-get install -y -q --no-install-recommends $pkgs \
    || { timeout 300 apt-get update -qq && timeout 600 apt-get install -y -q --no-install-recommends $pkgs; }; } >&2 \
    || { log "apt-get install $pkgs failed"; exit 2; }
}

up() {
  install
  down
  mkdir -p "$DIR/munge" "$DIR/state" "$DIR/spool" "$DIR/log"
  chmod 755 "$DIR" "$DIR/munge"  # munged refuses a socket directory others can write to
  local base=${PSFLOW_SLURM_PORT_BASE:-$((10000 + $(echo "$DIR" | cksum | cut -d' ' -f1) % 20000))}
  mungekey -c -k "$DIR/munge/munge.key" -b 1024 2>/dev/null || mungekey -c -f -k "$DIR/munge/munge.key" -b 1024
  chmod 600 "$DIR/munge/munge.key"
  munged --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" --pid-file="$DIR/munge/munged.pid" \
         --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
  local net=127.0.0 ctl=localhost
  if [ "$NETNS" = 1 ]; then netns_up; net=$NET ctl="localhost($NET.250)"; fi
  local nodelist=$net.1 ports=$((base + 1))
  [ "$NODES" = 1 ] || { nodelist="$net.[1-$NODES]"; ports="$((base + 1))-$((base + NODES))"; }
  cat > "$CONF" <<CONF
ClusterName=psflow
SlurmctldHost=$ctl
SlurmctldPort=$base
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=1
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=60
KillWait=5
Waittime=0
NodeName=$nodelist NodeHostname=localhost NodeAddr=$nodelist Port=$ports CPUs=$CPUS RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF=$CONF
  if [ "$NETNS" = 1 ]; then
    # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup mounts slurmd insists on
    nsenter --net="/run/netns/$PFX-ctl" slurmctld -f "$CONF"
    for i in $(seq 1 "$NODES"); do nsenter --net="/run/netns/$PFX-h$i" slurmd -f "$CONF" -N "$net.$i"; done
  else
    slurmctld -f "$CONF"
    for i in $(seq 1 "$NODES"); do slurmd -f "$CONF" -N "$net.$i"; done
  fi
  local states=""
  for _ in $(seq 1 120); do  # <= 30 s for every node to be idle
    states=$(in_login timeout 5 sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')
    [ "$states" = "idle " ] && [ "$(in_login timeout 5 sinfo -h -N -o '%N' | wc -l)" = "$NODES" ] && break
    sleep 0.25
  done
  if [ "$states" != "idle " ]; then
    log "nodes not idle within 30 s (states: '$states'); log tails:"
    tail -n 20 "$DIR"/log/*.log >&2 || true
    exit 1
  fi
  log "up: $NODES node(s) in $DIR"
  echo "export SLURM_CONF=$CONF"
}

case $CMD in
  up) up ;;
  down) down; log "down ($DIR; logs kept in $DIR/log)" ;;
  *) usage ;;
esac
