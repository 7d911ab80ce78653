#!/usr/bin/env bash
# Shared by train.sh and sft.sh: MODULE CONFIG [key=value ...] -> the deepspeed launcher.
set -uo pipefail
module="$1"; config="$2"; shift 2
if [ "${RLFT_FLAVOR:-cpu}" = gpu ]; then
  gpus=$(nvidia-smi -L | wc -l)
else
  gpus=-1
  export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
fi
plan=$(python -m rlft.launch_plan --config "$config" --gpus-available "$gpus" "$@") || exit $?
read -r world nodes per_node port hostfile <<< "$plan"
args=(--master_port "$port")
if [ "$nodes" -gt 1 ]; then
  args+=(--hostfile "$hostfile")
else
  args+=(--num_gpus "$per_node")
fi
if [ "$gpus" -lt 0 ]; then
  # CPU: share the cores between the ranks instead of oversubscribing them.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / per_node > 0 ? $(nproc) / per_node : 1 ))}"
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
echo "[rlft] $module: $world rank(s) on $nodes node(s), config $config $*" >&2
exec deepspeed "${args[@]}" --module "$module" --config "$config" "$@"
