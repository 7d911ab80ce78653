#!/usr/bin/env bash
# Shared by train.sh and sft.sh: TRAINER CONFIG [key=value ...] -> the deepspeed launcher.  TRAINER is a
# trainer's record name (rlft/config/trainers.py: grpo, sft, or one a plugin registers); the plan names its module.
# One node: DeepSpeed's per-node launcher (`python -m deepspeed.launcher.launch`, what the `deepspeed`
# runner would start).  Several nodes (topology.nodes > 1): the runner and DeepSpeed's own
# launchers with output.hostfile (pdsh over ssh, slurm, the MPI launchers, or no_ssh: this node only,
# as topology.node_rank); rlft.config.launch_plan works out the options and checks the hostfile.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
trainer="$1"; config="$2"; shift 2
if [ "${RLFT_FLAVOR:-cpu}" = gpu ]; then
  gpus=$(nvidia-smi -L | wc -l)
else
  gpus=-1
  export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
fi
plan=$(python -m rlft.config.launch_plan --trainer "$trainer" --config "$config" --gpus-available "$gpus" "$@") || exit $?
eval "$plan"  # world nodes per_node entry launcher ds_args rank_args placement module (shell-quoted by launch_plan)
if [ "$launcher" = node ]; then
  ds=(python -u -m deepspeed.launcher.launch)
else
  ds=(deepspeed)
fi
if [ "$entry" = script ]; then
  entry_args=("$here/rank.py" "$module")
else
  entry_args=(--module "$module")
fi
if [ "$gpus" -lt 0 ]; then
  # CPU: share the cores between the ranks instead of oversubscribing them.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / per_node > 0 ? $(nproc) / per_node : 1 ))}"
fi
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# c10d logs each failed call to a store whose host is gone as a warning with ~20 lines of C++ frames;
# the ranks say themselves which rank went and why (rlft/runtime/watchdog.py). Errors still show.
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
# The ranks on this host watch this script: killed by any signal, SIGKILL included (which no trap
# sees), it takes the launch with it (rlft/runtime/watchdog.py).
export RLFT_LAUNCH_SCRIPT="$(hostname):$$"
echo "[rlft] $module: $world rank(s) on $nodes node(s), config $config $*" >&2
[ "$nodes" -gt 1 ] && sed 's/^/[rlft] /' <<< "$placement" >&2

# The launcher and everything it starts on this node (DeepSpeed's per-node launcher, the ranks) run
# in a process group of their own.  A stop signal to this script reaches the whole group, so
# stopping one node's launcher stops that node's ranks, and the other nodes' ranks then lose contact
# and stop too.  Without this, a signal to the launcher alone would leave its ranks running.
set -m
"${ds[@]}" "${ds_args[@]}" "${entry_args[@]}" --config "$config" "$@" "${rank_args[@]}" </dev/null &
pid=$!
set +m
for sig in TERM INT HUP; do
  trap "kill -$sig -- -$pid 2>/dev/null" "$sig"
done
rc=0
wait "$pid" || rc=$?
while kill -0 "$pid" 2>/dev/null; do  # `wait` returns early when a trapped signal arrives
  wait "$pid"; rc=$?
done
# The runner is gone: give the rest of its group (ranks finishing their exit) a bounded while.
for _ in $(seq 60); do
  kill -0 -- -"$pid" 2>/dev/null || exit "$rc"
  sleep 1
done
kill -KILL -- -"$pid" 2>/dev/null
exit "$rc"
