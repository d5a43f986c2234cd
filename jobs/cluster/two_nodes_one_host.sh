#!/usr/bin/env bash
# Two Ray nodes on one multi-GPU host, its GPUs and CPUs split between them: a two-machine cluster measured on one.
# NCCL's peer-to-peer (NVLink) and shared-memory transports are off on both, so DDP between the two nodes goes
# through the network stack as it would between machines; the benchmark labels its figures with them.
#
#   bash jobs/cluster/two_nodes_one_host.sh            # prints the address
#   RAY_AUTH_MODE=token python jobs/benchmark.py cluster --address "$(cat /tmp/gx-two-nodes/address)"
#   ray stop                                           # both nodes
set -euo pipefail
root=${GX_TWO_NODES_DIR:-/tmp/gx-two-nodes}
gpus=$(nvidia-smi -L | wc -l)
cpus=$(nproc)
if [ "$gpus" -lt 2 ]; then
  echo "two nodes need at least two GPUs; this host has $gpus" >&2
  exit 2
fi
half=$((gpus / 2))
ip=$(python -c "import ray._private.services as s; print(s.get_node_ip_address())")
port=${GX_RAY_PORT:-6379}
export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
# Ray's token authentication on, as for a cluster of one's own (ray.init's default): every node and driver of this
# user reads the token from ~/.ray/auth_token, made here when missing
export RAY_AUTH_MODE=token
ray get-auth-token --generate >/dev/null
mkdir -p "$root/head" "$root/worker"
# each node its own temp dir (its sockets and logs) and working directory
(cd "$root/head" && CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((half - 1))) ray start --head --port="$port" \
  --num-gpus="$half" --num-cpus=$((cpus / 2)) --temp-dir="$root/head/tmp" --include-dashboard=false \
  --disable-usage-stats >"$root/head/ray.log" 2>&1)
(cd "$root/worker" && CUDA_VISIBLE_DEVICES=$(seq -s, "$half" $((gpus - 1))) ray start --address="$ip:$port" \
  --num-gpus=$((gpus - half)) --num-cpus=$((cpus - cpus / 2)) --temp-dir="$root/worker/tmp" \
  --disable-usage-stats >"$root/worker/ray.log" 2>&1)
echo "$ip:$port" >"$root/address"
echo "$ip:$port"
