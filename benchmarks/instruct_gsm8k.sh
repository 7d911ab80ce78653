#!/usr/bin/env bash
# GRPO from an instruct model on GSM8K (launch/configs/grpo_instruct_1gpu.yaml): held-out accuracy on all
# 1319 test questions before and after, greedy, with the model's chat template and \boxed{} answers.
#
#   MODEL=path/to/model.gguf GSM8K=path/to/gsm8k bash benchmarks/instruct_gsm8k.sh OUT PHASE [PHASE ...]
#
# Phases (each resumable: run a phase again to continue it):
#   eval     python -m rlft.evaluate of MODEL with the config's prompt and format  -> OUT/before
#            (not while a training on the same GPU starts or sleeps: vLLM's start-up profile fails then)
#   grpo     GRPO from MODEL (STEPS steps or MINUTES of training per launch, whichever ends first;
#            held-out accuracy at step 0, every EVAL_EVERY steps and after the last) -> OUT/grpo_instruct
#   summary  learning.json (gsm8k_instruct: before/after, McNemar) and the curves   -> OUT/
# Environment: MODEL, GSM8K (a directory with train.jsonl and test.jsonl), CONFIG, STEPS (100), MINUTES (6),
# EVAL_EVERY (25), PYTHON (python3), GRPO_ARGS (more key=value overrides).
set -euo pipefail
out="$1"; shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
PYTHON="${PYTHON:-python3}"
CONFIG="${CONFIG:-launch/configs/grpo_instruct_1gpu.yaml}"
STEPS="${STEPS:-100}"; MINUTES="${MINUTES:-6}"; EVAL_EVERY="${EVAL_EVERY:-25}"
: "${MODEL:?set MODEL to the instruct model (HF directory, .gguf or hub id)}"
: "${GSM8K:?set GSM8K to a directory with train.jsonl and test.jsonl}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$out"
say() { echo "[instruct $(date +%H:%M:%S)] $*" | tee -a "$out/phases.log"; }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
for phase in "$@"; do
  t0=$(date +%s)
  case "$phase" in
    eval)
      "$PYTHON" -m rlft.evaluate --model "$MODEL" --data "$GSM8K:test" --num-examples 0 --config "$CONFIG" \
        --max-tokens 512 --backend vllm --gpu-memory-utilization "${EVAL_GPU_SHARE:-0.5}" --no-progress --out "$out/before" ;;
    grpo)
      "$PYTHON" -m deepspeed.launcher.runner --master_port "$(free_port)" --num_gpus 1 --module rlft.train_grpo \
        --config "$CONFIG" model.path="$MODEL" data.source="$GSM8K" sampling.backend=vllm \
        schedule.steps="$STEPS" schedule.time_limit_minutes="$MINUTES" schedule.evaluate_freq="$EVAL_EVERY" \
        output.dir="$out/grpo_instruct" ${GRPO_ARGS:-} ;;
    summary)
      "$PYTHON" benchmarks/learning_summary.py "$out" ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
  say "$phase took $(( $(date +%s) - t0 )) s"
done
