#!/usr/bin/env bash
# Two Ray nodes on one multi-GPU host, its GPUs and CPUs split between them, and a command run against them: a
# two-machine cluster measured on one. The nodes stop when the command ends.
#
#   bash jobs/cluster/two_nodes_one_host.sh python jobs/benchmark.py cluster --address 127.0.0.1:6379
#
# The nodes, the command and whatever it starts (the sweeps' MLflow) share a network namespace of their own whose one
# interface is loopback: the nodes are 127.0.0.1, nothing outside reaches them, and the command reaches nothing
# outside this host either (no model hub, no team MLflow). On the host's own network Ray 2.60 cannot be kept to
# loopback: it puts a node given --node-ip-address 127.0.0.1 on the host's network address, and its GCS and raylets
# listen on every interface. The namespace needs root, or else unprivileged user namespaces (the command then runs as
# root of a user namespace of its own, which is you outside it).
#
# NCCL's peer-to-peer (NVLink) and shared-memory transports are off on both nodes, so DDP between them goes through
# NCCL's socket transport over that loopback: TCP through the kernel between processes, as between machines, without
# a NIC or a wire (no bandwidth or latency of a real network). The benchmark labels its figures with these settings.
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: bash $0 COMMAND [ARGUMENT...]: runs COMMAND against two Ray nodes at 127.0.0.1:${GX_RAY_PORT:-6379}" >&2
  exit 2
fi
if [ -z "${GX_TWO_NODES_NAMESPACE:-}" ]; then  # once more, inside new network and hostname namespaces
  as_user=()
  [ "$(id -u)" -eq 0 ] || as_user=(--user --map-root-user)
  exec unshare "${as_user[@]}" --net --uts env GX_TWO_NODES_NAMESPACE=1 bash "$0" "$@"
fi
root=${GX_TWO_NODES_DIR:-/tmp/gx-two-nodes}
gpus=$(nvidia-smi -L | wc -l)
cpus=$(nproc)
if [ "$gpus" -lt 2 ]; then
  echo "two nodes need at least two GPUs; this host has $gpus" >&2
  exit 2
fi
half=$((gpus / 2))
port=${GX_RAY_PORT:-6379}
# Ray finds no route out here, and falls back to this host's name for its address: a name that is loopback
hostname localhost
python - <<'EOF'
import fcntl, socket, struct  # `ip link set lo up`, without iproute2: SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack("16sh14x", fcntl.ioctl(s, 0x8913, struct.pack("16sh14x", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sh14x", b"lo", flags | 1))
EOF
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo
# Ray's token authentication on, as for a cluster of one's own (ray.init's default): every node and driver of this
# user reads the token from ~/.ray/auth_token, made here when missing
export RAY_AUTH_MODE=token
ray get-auth-token --generate >/dev/null
mkdir -p "$root/head" "$root/worker"
rm -f "$root/head/tmp/ray_current_cluster"  # a last run's
nodes=()
stop() {
  # each node's `ray start --block` stops its processes on SIGTERM; what is left of its process group is killed.
  # Never `ray stop`: it ends every Ray process on this machine, other users' clusters included
  for pid in "${nodes[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${nodes[@]}"; do
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
}
trap stop EXIT
# each node its own temp dir (its sockets and logs), working directory and process group
(cd "$root/head" && CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((half - 1))) exec setsid ray start --block --head \
  --node-ip-address=127.0.0.1 --port="$port" --num-gpus="$half" --num-cpus=$((cpus / 2)) \
  --temp-dir="$root/head/tmp" --include-dashboard=false --disable-usage-stats >"$root/head/ray.log" 2>&1) &
nodes+=("$!")
for _ in $(seq 120); do  # its address, written once it is up
  [ -s "$root/head/tmp/ray_current_cluster" ] || ! kill -0 "${nodes[0]}" 2>/dev/null && break
  sleep 1
done
(cd "$root/worker" && CUDA_VISIBLE_DEVICES=$(seq -s, "$half" $((gpus - 1))) exec setsid ray start --block \
  --address="127.0.0.1:$port" --node-ip-address=127.0.0.1 --num-gpus=$((gpus - half)) \
  --num-cpus=$((cpus - cpus / 2)) --temp-dir="$root/worker/tmp" --disable-usage-stats >"$root/worker/ray.log" 2>&1) &
nodes+=("$!")
export RAY_ADDRESS="127.0.0.1:$port"
# the command starts once the worker has joined the head
python - <<'EOF' || { tail -n 20 "$root"/*/ray.log >&2; exit 1; }
import time
import ray
deadline = time.monotonic() + 120
ray.init(logging_level="ERROR", log_to_driver=False)
while sum(n["Alive"] for n in ray.nodes()) < 2 and time.monotonic() < deadline:
    time.sleep(1)
if sum(n["Alive"] for n in ray.nodes()) < 2:
    raise SystemExit("the worker node did not join the head within 2 minutes")
EOF
echo "two Ray nodes at $RAY_ADDRESS (logs in $root/head and $root/worker)" >&2
"$@"
