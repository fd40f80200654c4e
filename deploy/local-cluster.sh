#!/usr/bin/env bash
# A multi-node Ray cluster on this one machine: a head and N worker nodes, each a separate
# `ray start` (its own raylet, object store and resources), for trying `--ray-address` and the
# multi-node tests without a second machine.
#
#   deploy/local-cluster.sh start N     head (hosts no actors) + N workers, 1 CPU each
#   deploy/local-cluster.sh stop        stops exactly this cluster (not other Ray instances)
#   deploy/local-cluster.sh status
#   deploy/local-cluster.sh add-worker  one more worker node
#   deploy/local-cluster.sh kill-worker I   hard-kills worker I (a node failure)
#
# Environment: MOMLP_CLUSTER_PORT (6390), MOMLP_CLUSTER_IP (127.0.0.2), MOMLP_CLUSTER_DIR (/tmp/momlp-cluster),
# MOMLP_CLUSTER_CPUS (CPUs per worker, 1), RAY (the ray executable; default: the one beside
# this script's .venv, else on PATH).
#
# Each node is started in its own process session, and its session id is kept in
# $MOMLP_CLUSTER_DIR/nodes, so `stop` kills those processes only: `ray stop` would kill every
# Ray process on the machine, other users' included.
#
# The nodes talk over 127.0.0.2, but Ray's servers listen on every interface for any node
# address but 127.0.0.1 (which `ray start` would replace by the machine's outward one), so the
# cluster keeps Ray's token authentication on: `start` writes a token readable by this user
# only to $MOMLP_CLUSTER_DIR/auth_token, and a client joins with
#   RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$MOMLP_CLUSTER_DIR/auth_token
# (what `start` prints). Without the token nobody can join the cluster or run code on it.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
port="${MOMLP_CLUSTER_PORT:-6390}"
dir="${MOMLP_CLUSTER_DIR:-/tmp/momlp-cluster}"
cpus="${MOMLP_CLUSTER_CPUS:-1}"
if [[ -n "${RAY:-}" ]]; then
  ray_bin="$RAY"
elif [[ -x "$here/../.venv/bin/ray" ]]; then
  ray_bin="$here/../.venv/bin/ray"
else
  ray_bin="$(command -v ray)"
fi
node_ip="${MOMLP_CLUSTER_IP:-127.0.0.2}"
address="${node_ip}:${port}"
nodes="$dir/nodes"
token="$dir/auth_token"
# The ports Ray's worker processes bind (Ray's defaults, given to every node explicitly so that
# the check in `start` and Ray agree): the head's two ports must lie outside them.
min_worker_port=10002
max_worker_port=19999

export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$token" RAY_USAGE_STATS_ENABLED=0
# Several nodes on one machine count as a multi-node cluster. Nodes bind 127.0.0.2: Ray rewrites
# 127.0.0.1 to the machine's outward address but keeps other loopback addresses, so all of the
# cluster's traffic stays on loopback.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1

start_node() {  # name, ray-start arguments...
  local name="$1"
  shift
  local log="$dir/$name.log"
  # setsid: the node's daemons share a new session whose id we record for `stop`.
  setsid "$ray_bin" start "$@" --min-worker-port="$min_worker_port" \
    --max-worker-port="$max_worker_port" --disable-usage-stats >"$log" 2>&1 &
  local pid=$!
  wait "$pid" || { echo "ray start failed for $name; see $log" >&2; tail -20 "$log" >&2; return 1; }
  echo "$name $pid" >>"$nodes"
}

require_cluster() {  # the commands that act on a running cluster
  if [[ ! -s "$nodes" ]]; then
    echo "no cluster is recorded in $dir; run '$0 start N' first" >&2
    exit 1
  fi
}

port_taken() {  # host port: true when something accepts connections there
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

worker_count() {
  grep -c '^worker-' "$nodes" 2>/dev/null || true
}

add_worker() {
  local i
  i=$(( $(worker_count) + 1 ))
  start_node "worker-$i" --address="$address" --node-ip-address="$node_ip" \
    --num-cpus="$cpus" --resources="{\"momlp_worker\": 1, \"momlp_node_$i\": 1}"
  echo "worker-$i joined $address"
}

kill_session() {  # session id
  local sid="$1" pids
  pids=$(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
  [[ -z "$pids" ]] && return 0
  kill -TERM $pids 2>/dev/null || true
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    pids=$(ps -eo pid=,sid=,stat= | awk -v s="$sid" '$2 == s && $3 !~ /^Z/ {print $1}')
    [[ -z "$pids" ]] && return 0
    sleep 0.5
  done
  kill -KILL $pids 2>/dev/null || true
}

case "${1:-}" in
  start)
    n="${2:?usage: $0 start N}"
    if [[ -s "$nodes" ]]; then
      echo "a cluster is already recorded in $nodes; run '$0 stop' first" >&2
      exit 1
    fi
    [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 ]] || { echo "usage: $0 start N (N worker nodes, a whole number >= 1)" >&2; exit 2; }
    # No leading zero: bash arithmetic would read 08 as a bad octal number.
    [[ "$port" =~ ^[1-9][0-9]{0,4}$ ]] && (( port < 65535 )) || {
      echo "MOMLP_CLUSTER_PORT must be a port number from 1 to 65534 (the head takes it and" \
        "the next one), got '$port'" >&2
      exit 2
    }
    # Ray hands the ports of this range to worker processes, which may hold the head's port
    # when it starts, or fail to start when handed one the head holds.
    if (( port + 1 >= min_worker_port && port <= max_worker_port )); then
      echo "MOMLP_CLUSTER_PORT $port: the head takes it and $((port + 1)), which must lie" \
        "outside Ray's worker port range $min_worker_port-$max_worker_port; pick another" \
        "(default 6390)" >&2
      exit 2
    fi
    for p in "$port" $((port + 1)); do
      if port_taken "$node_ip" "$p"; then
        echo "port $p on $node_ip is in use (another Ray cluster?): pick another with" \
          "MOMLP_CLUSTER_PORT (the head takes it and the next one)" >&2
        exit 1
      fi
    done
    mkdir -p "$dir"
    (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$token")
    : >"$nodes"
    start_node head --head --node-ip-address="$node_ip" --port="$port" \
      --ray-client-server-port=$((port + 1)) --temp-dir="$dir/ray" \
      --num-cpus=0 --include-dashboard=false
    for _ in $(seq 1 "$n"); do add_worker; done
    echo "cluster up: head $address with $n worker node(s)"
    echo "use: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$token MOMLP_ACTOR_RESOURCE=momlp_worker" \
      "momlp serve --ray-address $address --actors $n --store DIR"
    ;;
  add-worker)
    require_cluster
    add_worker
    ;;
  kill-worker)
    i="${2:?usage: $0 kill-worker I}"
    require_cluster
    sid=$(awk -v n="worker-$i" '$1 == n {print $2}' "$nodes")
    [[ -n "$sid" ]] || { echo "no worker-$i in $nodes" >&2; exit 1; }
    pids=$(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s {print $1}')
    [[ -n "$pids" ]] && kill -KILL $pids 2>/dev/null || true
    echo "worker-$i killed"
    ;;
  stop)
    if [[ ! -f "$nodes" ]]; then
      echo "no cluster is recorded in $dir: nothing to stop"
      exit 0
    fi
    # Workers first, the head last, so nodes do not wait on a vanished GCS.
    tac "$nodes" | while read -r _ sid; do kill_session "$sid"; done
    rm -f "$nodes" "$token"
    echo "cluster stopped"
    ;;
  status)
    require_cluster
    RAY_ADDRESS="$address" "$ray_bin" status
    ;;
  *)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
