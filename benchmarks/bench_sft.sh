#!/usr/bin/env bash
# SFT throughput of the Qwen2.5-1.5B shape (random bf16 weights) on one GPU: the train phase's MFU.
#
#   bash benchmarks/bench_sft.sh DATA_DIR [OUT]
#
# DATA_DIR  a local GSM8K copy (train.jsonl, test.jsonl): the (question, worked answer) pairs SFT learns.
# Runs STEPS SFT steps of BATCH sequences (micro-batches of MICRO) with launch/configs/sft_1gpu.yaml,
# summarises them with `python -m rlft.bench --from-run` (medians over the steps after the first; MFU
# = 6 * N * tokens / (time/train * peak), the formula in rlft/bench/metrics.py) into OUT/bench.json,
# and merges {"mfu", "train_tokens_per_s", "s_per_step"} into benchmarks/results/summary.json as sft_1p5b
# (SUMMARY_KEY).
#
# Environment: PYTHON (default python3), STEPS (default 8), BATCH (default 64), MICRO (default 16),
#   MICRO_TOKENS (a token budget per micro-batch, optim.micro_batch_tokens, instead of MICRO rows;
#   default 0 = MICRO rows), MODEL (default random-1.5b; tiny for a CPU smoke run), TOKENIZER (a
#   tokenizer directory for the random model; default Qwen2.5's), EXTRA_ARGS (more key=value overrides),
#   SUMMARY_KEY (default sft_1p5b).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
data="$1"
out="${2:-benchmarks/runs/sft-$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
model=$("$PYTHON" -c "import sys; from rlft.bench.presets import resolve_bench_model; \
print(resolve_bench_model(sys.argv[1], tokenizer_dir=sys.argv[2] or None))" "${MODEL:-random-1.5b}" "${TOKENIZER:-}" | tail -1)
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
"$PYTHON" -m deepspeed.launcher.runner --master_port "$port" --num_gpus 1 --module rlft.train_sft \
  --config launch/configs/sft_1gpu.yaml model.path="$model" data.source="$data" \
  sft.max_steps="${STEPS:-8}" sft.batch_size="${BATCH:-64}" optim.train_micro_batch_size="${MICRO:-16}" \
  optim.micro_batch_tokens="${MICRO_TOKENS:-0}" \
  schedule.evaluate_freq=0 schedule.save_every=0 data.eval_size=8 sampling.backend=hf sampling.max_tokens=32 \
  output.save_at_end=false output.dir="$out/sft" ${EXTRA_ARGS:-}
"$PYTHON" -m rlft.bench --from-run "$out/sft" --json "$out/bench.json"
"$PYTHON" - "$out/bench.json" "${SUMMARY_KEY:-sft_1p5b}" <<'PY'
import json, sys
from rlft.bench.cli import DEFAULT_SUMMARY
from rlft.bench.metrics import merge_summary
result = json.load(open(sys.argv[1]))
s = result["rlft"]["summary"]
entry = {"mfu": s.get("train_mfu"), "train_tokens_per_s": s.get("train_tokens_per_s"), "s_per_step": s.get("step_s"),
         "gpu": result["machine"].get("gpu"), "commit": (result.get("commit") or {}).get("sha"),
         "batch": result["config"]["sft"]["batch_size"], "micro_batch": result["config"]["optim"]["train_micro_batch_size"],
         "micro_batch_tokens": result["config"]["optim"]["micro_batch_tokens"],
         "compile_layers": result["config"]["model"].get("compile_layers", False)}
merge_summary(DEFAULT_SUMMARY, sys.argv[2], entry)
print(f"{sys.argv[2]}:", entry)
PY
