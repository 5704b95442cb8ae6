#!/usr/bin/env bash
# netns.sh -- the two-node testbed of benchmarks/two_nodes: two network namespaces joined by one veth pair (the
# inter-node link, rate-capped with tc tbf on both ends; no added delay: this kernel has no netem), each with
# its own loopback for intra-node traffic. COMMAND runs once per namespace with NODE_RANK, MASTER_ADDR,
# MASTER_PORT, NODE_IFACE and GLOO_SOCKET_IFNAME (gloo must bind the link, not the loopback the hostname
# resolves to). Everything created is removed on any exit; traffic never leaves the two namespaces.
#
#   sudo benchmarks/two_nodes/netns.sh [--rate 200mbit|1gbit|none] [--timeout S] [--logs DIR] -- 'COMMAND'
#
# Exit status: COMMAND's (node 0 first), 124 on the deadline, 77 = SKIP (not root, no `ip`/`tc`, or namespaces
# unavailable: containers without CAP_SYS_ADMIN), with a line saying why. Prints "LINK_TX node<i> <bytes>".
set -uo pipefail
RATE=none TIMEOUT=900 LOGS="" CMD=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --logs) LOGS=$2; shift 2 ;;
    --) shift; CMD="$*"; break ;;
    *) echo "netns.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
skip() { echo "two_nodes: SKIP: $*" >&2; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (ip netns, tc): run it with sudo, or on a machine where you are root"
for t in ip tc timeout; do command -v $t >/dev/null || skip "$t not found (install iproute2 / coreutils)"; done
[ -n "$CMD" ] || { echo "netns.sh: give -- 'COMMAND'" >&2; exit 2; }

ID=${TWO_NODES_ID:-$$}
NS=("fpb${ID}a" "fpb${ID}b") IF=("fpb${ID}x" "fpb${ID}y")
NET=${TWO_NODES_NET:-10.232.0}
ADDR=("$NET.1" "$NET.2")
PORT=${MASTER_PORT:-29611}
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
MADE=() PIDS=()
cleanup() {
  local rc=$? p ns
  trap - EXIT INT TERM
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  [ ${#PIDS[@]} -gt 0 ] && sleep 1
  for ns in "${MADE[@]}"; do for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done; done
  for ns in "${MADE[@]}"; do ip netns del "$ns" 2>/dev/null; done
  ip link del "${IF[0]}" 2>/dev/null
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for i in 0 1; do
  ip netns add "${NS[$i]}" 2>/dev/null || skip "ip netns add failed (no namespace support or no CAP_SYS_ADMIN here)"
  MADE+=("${NS[$i]}")
done
ip link add "${IF[0]}" type veth peer name "${IF[1]}" || skip "veth pairs unavailable"
for i in 0 1; do
  ip link set "${IF[$i]}" netns "${NS[$i]}"
  ip -n "${NS[$i]}" link set lo up
  ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${IF[$i]}"
  ip -n "${NS[$i]}" link set "${IF[$i]}" up
  if [ "$RATE" != none ]; then
    # bucket: 2 ms of line rate, at least 128 KB (veth hands tbf GSO packets of up to 64 KB)
    bits=$(python3 -c "import re,sys;m=re.fullmatch(r'(\d+)([kmg])bit','${RATE,,}');print(int(m[1])*{'k':1e3,'m':1e6,'g':1e9}[m[2]] if m else 0)" | cut -d. -f1)
    [ "${bits:-0}" -gt 0 ] || { echo "netns.sh: --rate like 200mbit or 1gbit" >&2; exit 2; }
    burst=$(( bits / 8 / 500 )); [ $burst -lt 131072 ] && burst=131072
    ip netns exec "${NS[$i]}" tc qdisc add dev "${IF[$i]}" root tbf rate "$RATE" burst $burst latency 20ms \
      || skip "tc tbf unavailable in this kernel"
  fi
done
txb() { ip netns exec "${NS[$1]}" cat "/sys/class/net/${IF[$1]}/statistics/tx_bytes"; }
T0=("$(txb 0)" "$(txb 1)")
for i in 0 1; do
  ip netns exec "${NS[$i]}" env NODE_RANK=$i NNODES=2 MASTER_ADDR="${ADDR[0]}" MASTER_PORT="$PORT" \
    NODE_IFACE="${IF[$i]}" GLOO_SOCKET_IFNAME="${IF[$i]}" LINK_RATE="$RATE" \
    timeout -k 10 "$TIMEOUT" bash -c "$CMD" > "$LOGS/node$i.log" 2>&1 &
  PIDS+=($!)
done
wait "${PIDS[0]}"; rc0=$?
wait "${PIDS[1]}"; rc1=$?
PIDS=()
for i in 0 1; do echo "LINK_TX node$i $(( $(txb $i) - ${T0[$i]} ))"; done
for i in 0 1; do [ "$([ $i = 0 ] && echo $rc0 || echo $rc1)" = 0 ] || { echo "---- node $i log tail"; tail -n 30 "$LOGS/node$i.log"; }; done
[ $rc0 -ne 0 ] && exit $rc0
exit $rc1
