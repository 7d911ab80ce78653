#!/usr/bin/env bash
# The offline default, start to finish on CPU: SmolLM2-135M-Instruct learns easy sums with GRPO.
#
#   bash launch/demo.sh            # about 10 minutes on 2 idle cores after the one-time set-up
#   tensorboard --logdir runs/demo # while it runs, or after
#
# 1. a short SFT warm start (4 steps) teaches the <think> ... </think> <answer> ... </answer> contract
#    -> runs/demo/sft/model (skipped when it is already there);
# 2. GRPO from it on generated two-number sums (launch/configs/grpo_cpu_demo.yaml) -> runs/demo/grpo;
# 3. the reward curve as a PNG (runs/demo/grpo/reward_curve.png) and a before/after line.
# Extra key=value arguments go to the GRPO stage. Delete runs/demo to start over.
# `bash launch/demo.sh --grpo-dir [key=value ...]` only prints the GRPO stage's directory, which the
# curve step reads.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."
grpo_dir() {  # runs/demo/grpo, or where an output.dir= argument sends the GRPO stage (given twice, it refuses)
  local dir=runs/demo/grpo arg
  for arg in "$@"; do case "$arg" in output.dir=*) dir="${arg#output.dir=}" ;; esac; done
  echo "$dir"
}
if [ "${1:-}" = --grpo-dir ]; then shift; grpo_dir "$@"; exit 0; fi
source "$here/setup.sh" || exit 1
if [ ! -f runs/demo/sft/model/config.json ]; then
  echo "[demo] 1/3 SFT warm start: 4 steps on the answer contract" >&2
  bash "$here/sft.sh" "$here/configs/sft_cpu_demo.yaml" || exit $?
else
  echo "[demo] 1/3 SFT warm start: runs/demo/sft/model is already there" >&2
fi
echo "[demo] 2/3 GRPO: watch it with  tensorboard --logdir runs/demo" >&2
bash "$here/train.sh" "$here/configs/grpo_cpu_demo.yaml" "$@" || exit $?
echo "[demo] 3/3 what it learnt" >&2
python -m rlft.curves "$(grpo_dir "$@")" --title "GRPO on CPU: SmolLM2-135M-Instruct, two-number sums"
