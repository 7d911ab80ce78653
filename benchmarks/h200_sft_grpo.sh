#!/usr/bin/env bash
# GPU measurement of the SFT -> evaluation -> GRPO chain with the offline default model.
#
#   bash benchmarks/h200_sft_grpo.sh MODEL_DIR GSM8K_DIR OUT_DIR [phase ...]
#
# MODEL_DIR  an HF directory of SmolLM2-135M-Instruct (rlft.models.loading.resolve_model_path("smollm2-135m-instruct"))
# GSM8K_DIR  a local GSM8K copy (train.jsonl, test.jsonl)
# phases     any of: eval_before sft eval_after grpo (default: all, in that order)
#
# Writes OUT_DIR/{eval_before,sft,eval_after,grpo}/ and OUT_DIR/results.json (a summary of the numbers).
# Uses python3 and `python3 -m deepspeed.launcher.runner` from the current environment.
set -euo pipefail
model="$1"; data="$2"; out="$3"; shift 3
phases=("$@"); [ ${#phases[@]} -gt 0 ] || phases=(eval_before sft eval_after grpo)
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
ds() { python3 -m deepspeed.launcher.runner --master_port "$(free_port)" "$@"; }
SFT_STEPS="${SFT_STEPS:-200}"
GRPO_STEPS="${GRPO_STEPS:-4}"
EVAL_N="${EVAL_N:-200}"
for phase in "${phases[@]}"; do
  t0=$(date +%s)
  case "$phase" in
    eval_before)
      python3 -m rlft.evaluate --model "$model" --data "$data/test.jsonl" --num-examples "$EVAL_N" \
        --backend hf --max-tokens 512 --batch-size 200 --out "$out/eval_before" ;;
    sft)
      ds --num_gpus 1 --module rlft.train_sft --config launch/configs/sft_1gpu.yaml model.path="$model" \
        data.source="$data" sft.max_steps="$SFT_STEPS" schedule.evaluate_freq=0 schedule.save_every=0 \
        data.eval_size=64 sampling.backend=hf sampling.max_tokens=512 output.dir="$out/sft" ;;
    eval_after)
      python3 -m rlft.evaluate --model "$out/sft/model" --data "$data/test.jsonl" --num-examples "$EVAL_N" \
        --backend hf --max-tokens 512 --batch-size 200 --out "$out/eval_after" ;;
    grpo)
      ds --num_gpus 2 --module rlft.train_grpo --config launch/configs/grpo_2gpu.yaml \
        output.init_checkpoint="$out/sft/model" data.source="$data" sampling.backend=hf \
        sampling.max_tokens=256 optim.rollout_batch_size=64 optim.train_micro_batch_size=8 \
        schedule.steps="$GRPO_STEPS" schedule.evaluate_freq=0 schedule.save_every=0 data.eval_size=64 \
        sampling.eval_max_tokens=512 output.dir="$out/grpo" ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
  echo "[bench] $phase took $(( $(date +%s) - t0 )) s" | tee -a "$out/phases.log"
done
