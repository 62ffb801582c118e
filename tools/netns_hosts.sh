#!/usr/bin/env bash
# Hosts for psflow's multi-host tests: N network namespaces PREFIX-h1..PREFIX-hN, each with its own
# address NET.i/24 on eth0, joined by a bridge that lives in a namespace of its own (PREFIX-sw), and,
# with `sshd`, an OpenSSH server in each that lets in one throw-away key. Nothing is added to the
# root namespace: NET.x exists only inside PREFIX-h*. Tests run the launcher inside PREFIX-h1.
#
#   tools/netns_hosts.sh up PREFIX N [NET]     (NET default 10.79.0)
#   tools/netns_hosts.sh sshd PREFIX N DIR     sshd in each host; DIR gets id_ed25519, ssh_config, sshd-*.pid
#   tools/netns_hosts.sh limit PREFIX I RATE   tc tbf on host I's link, e.g. 100mbit (a straggler's link)
#   tools/netns_hosts.sh down PREFIX [DIR]     stops DIR's sshd (by pid file), deletes the namespaces
#
# Exit codes: 0 done; 2 not possible here (not root, no `ip netns`, no sshd and apt cannot install
# openssh-server: the reason on stderr); 1 something failed on the way.
# Reference: shared/engines/netns_up.sh / netns_down.sh, which ran on this machine kind.
set -euo pipefail

usage() { echo "usage: $0 up PREFIX N [NET] | sshd PREFIX N DIR | limit PREFIX I RATE | down PREFIX [DIR]" >&2; exit 64; }
[ $# -ge 2 ] || usage
CMD=$1 P=$2
log() { echo "netns_hosts: $*" >&2; }
cannot() { log "$*"; exit 2; }

down() {
  local dir=${1:-}
  if [ -n "$dir" ]; then
    for f in "$dir"/sshd-*.pid; do
      [ -f "$f" ] || continue
      pid=$(cat "$f" 2>/dev/null || true)
      [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
    done
  fi
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$P-(sw|h[0-9]+)\$" || true); do
    ip netns del "$ns" 2>/dev/null || true
  done
}

case $CMD in
up)
  [ $# -ge 3 ] || usage
  N=$3 NET=${4:-10.79.0}
  [ "$(id -u)" = 0 ] || cannot "network namespaces need root"
  command -v ip >/dev/null || cannot "no iproute2 (ip) here"
  down
  ip netns add "$P-sw" 2>/dev/null || cannot "ip netns add failed: network namespaces are not available here"
  ip -n "$P-sw" link set lo up
  ip -n "$P-sw" link add br0 type bridge
  ip -n "$P-sw" link set br0 up
  for i in $(seq 1 "$N"); do
    h=$P-h$i
    ip netns add "$h"
    ip -n "$P-sw" link add "sw$i" type veth peer name eth0 netns "$h"
    ip -n "$P-sw" link set "sw$i" master br0 up
    ip -n "$h" link set lo up
    ip -n "$h" addr add "$NET.$i/24" dev eth0
    ip -n "$h" link set eth0 up
  done
  log "$N hosts $P-h1..$P-h$N = $NET.1..$NET.$N"
  ;;
sshd)
  [ $# -ge 4 ] || usage
  N=$3 DIR=$4
  if ! [ -x /usr/sbin/sshd ]; then
    [ "$(id -u)" = 0 ] || cannot "no sshd, and installing openssh-server needs root"
    log "installing openssh-server with apt"
    (apt-get install -y -q openssh-server >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
      apt-get install -y -q openssh-server >/dev/null 2>&1; }) || cannot "apt could not install openssh-server"
  fi
  command -v ssh >/dev/null || cannot "no ssh client"
  mkdir -p /run/sshd && chmod 755 /run/sshd  # sshd's privilege-separation directory
  umask 077
  mkdir -p "$DIR"
  rm -f "$DIR/id_ed25519" "$DIR/id_ed25519.pub" "$DIR/host_ed25519" "$DIR/host_ed25519.pub"
  ssh-keygen -q -t ed25519 -N '' -f "$DIR/id_ed25519" -C psflow-test
  ssh-keygen -q -t ed25519 -N '' -f "$DIR/host_ed25519"
  cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"
  : > "$DIR/known_hosts"
  {
    echo "Host *"
    echo "  IdentityFile $DIR/id_ed25519"
    echo "  IdentitiesOnly yes"
    echo "  UserKnownHostsFile $DIR/known_hosts"
    echo "  StrictHostKeyChecking accept-new"
    echo "  BatchMode yes"
    echo "  ConnectTimeout 10"
    echo "  LogLevel ERROR"
  } > "$DIR/ssh_config"
  for i in $(seq 1 "$N"); do
    addr=$(ip -n "$P-h$i" -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)
    [ -n "$addr" ] || { log "host $P-h$i has no address (run up first)"; exit 1; }
    cat > "$DIR/sshd-$i.conf" <<CONF
ListenAddress $addr
Port 22
HostKey $DIR/host_ed25519
AuthorizedKeysFile $DIR/authorized_keys
PidFile $DIR/sshd-$i.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AcceptEnv none
CONF
    ip netns exec "$P-h$i" /usr/sbin/sshd -f "$DIR/sshd-$i.conf" -E "$DIR/sshd-$i.log" || { log "sshd in $P-h$i did not start: $(tail -3 "$DIR/sshd-$i.log")"; exit 1; }
  done
  # each sshd answers before the tests start (a deadline, no blind sleep)
  for i in $(seq 1 "$N"); do
    addr=$(ip -n "$P-h$i" -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)
    ok=
    for _ in $(seq 1 50); do
      if ip netns exec "$P-h1" ssh -F "$DIR/ssh_config" "$addr" true 2>/dev/null; then ok=1; break; fi
      sleep 0.1
    done
    [ -n "$ok" ] || { log "ssh to $addr (in $P-h$i) failed: $(tail -3 "$DIR/sshd-$i.log")"; exit 1; }
  done
  log "sshd up in $P-h1..$P-h$N; ssh -F $DIR/ssh_config ADDRESS"
  ;;
limit)
  [ $# -ge 4 ] || usage
  I=$3 RATE=$4
  ip netns exec "$P-h$I" tc qdisc replace dev eth0 root tbf rate "$RATE" burst 32kbit latency 400ms
  ;;
down)
  down "${3:-}"
  ;;
*) usage ;;
esac
