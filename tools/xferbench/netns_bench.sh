#!/usr/bin/env bash
# xferbench over UCX TCP between two network namespaces joined by a veth pair: the
# target (and ucx_perftest's server) in a fresh namespace, the initiator (and the
# perftest client) in this one. Needs root. Extra arguments go to xferbench.
#   sudo tools/xferbench/netns_bench.sh build/bin/xferbench --layers 8 --iters 3 --json
set -euo pipefail
XFERBENCH=${1:?usage: netns_bench.sh path/to/xferbench [xferbench flags...]}
shift
TAG=$$
NS=xbns$TAG
HOST_DEV=xbh$TAG
NS_DEV=xbn$TAG
SUBNET=$((TAG % 200 + 20))
HOST_IP=10.232.$SUBNET.1
NS_IP=10.232.$SUBNET.2

cleanup() {
  ip link del "$HOST_DEV" 2>/dev/null || true
  ip netns del "$NS" 2>/dev/null || true
}
trap cleanup EXIT

ip netns add "$NS"
ip link add "$HOST_DEV" type veth peer name "$NS_DEV"
ip link set "$NS_DEV" netns "$NS"
ip addr add "$HOST_IP/24" dev "$HOST_DEV"
ip -n "$NS" addr add "$NS_IP/24" dev "$NS_DEV"
ip -n "$NS" link set lo up
ip -n "$NS" link set "$NS_DEV" up
ip link set "$HOST_DEV" up

# ucx_perftest (the reference) drops a UCX_NET_DEVICES entry that has no carrier yet
# (xfer's engines wait for it themselves): wait until both ends are operationally up.
for _ in $(seq 1 500); do
  if [ "$(cat /sys/class/net/$HOST_DEV/operstate)" = up ] &&
     [ "$(ip netns exec "$NS" cat /sys/class/net/$NS_DEV/operstate)" = up ]; then
    break
  fi
  sleep 0.01
done

"$XFERBENCH" --backend ucx --ucx-tls tcp --target-netns "$NS" --target-host "$NS_IP" --initiator-host "$HOST_IP" "$@"
