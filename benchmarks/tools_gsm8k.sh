#!/usr/bin/env bash
# The calculator environment against the single-turn instruct recipe on GSM8K, one GPU, the same minutes
# of training each: both arms run side by side on the GPU (each its own launch, engine and policy), from
# the same model with the same seed; held-out accuracy on every test question (greedy) at step 0 and after
# the last step, each arm with its own episodes (tools on for the calculator arm).
#
#   MODEL=path/to/model.gguf GSM8K=path/to/gsm8k MINUTES=10 bash benchmarks/tools_gsm8k.sh OUT
#
# OUT/single and OUT/tools are the two runs (steps.jsonl, eval/step_*/); OUT/results.tar.gz packs what the
# comparison reads: python benchmarks/compare_runs.py single=OUT/single tools=OUT/tools.
# Environment: MODEL, GSM8K (train.jsonl and test.jsonl), MINUTES (10), STAGGER (45 s between the two
# starts, so that the engines start one after the other), KV_BYTES (each engine's KV cache, 8 GiB: a fixed
# size needs no start-up memory profile, which another process on the GPU would disturb), PYTHON (python3),
# ARGS (more key=value overrides for both arms).
set -uo pipefail
out="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
PYTHON="${PYTHON:-python3}"; MINUTES="${MINUTES:-10}"; STAGGER="${STAGGER:-45}"; KV_BYTES="${KV_BYTES:-8589934592}"
: "${MODEL:?set MODEL to the instruct model (HF directory, .gguf or hub id)}"
: "${GSM8K:?set GSM8K to a directory with train.jsonl and test.jsonl}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RLFT_PROGRESS=0
mkdir -p "$out"
# The model is converted (a .gguf) or fetched once, before the two launches that read it.
MODEL="$("$PYTHON" -c 'import sys; from rlft.models.loading import resolve_model_path; print(resolve_model_path(sys.argv[1]))' "$MODEL" | tail -1)"
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
arm() {  # NAME CONFIG
  "$PYTHON" -m deepspeed.launcher.runner --master_port "$(free_port)" --num_gpus 1 --module rlft.train_grpo \
    --config "$2" model.path="$MODEL" data.source="$GSM8K" sampling.backend=vllm seed=0 \
    schedule.steps=1000 schedule.time_limit_minutes="$MINUTES" schedule.evaluate_at_start=true \
    schedule.evaluate_freq=0 schedule.save_every=0 \
    sampling.vllm.kv_cache_memory_bytes="$KV_BYTES" sampling.vllm.gpu_memory_utilization=0.2 \
    output.dir="$out/$1" ${ARGS:-} > "$out/$1.log" 2>&1
  echo "[tools_gsm8k $(date +%H:%M:%S)] $1 exited $?" | tee -a "$out/phases.log"
}
echo "[tools_gsm8k $(date +%H:%M:%S)] start: $MINUTES minutes of training per arm" | tee -a "$out/phases.log"
arm single launch/configs/grpo_instruct_1gpu.yaml &
sleep "$STAGGER"
arm tools launch/configs/grpo_tools_1gpu.yaml &
wait
tar -czf "$out/results.tar.gz" -C "$out" --exclude='*.safetensors' --exclude='checkpoints' --exclude='tb' \
  phases.log single.log tools.log single tools 2>/dev/null
echo "[tools_gsm8k $(date +%H:%M:%S)] done" | tee -a "$out/phases.log"
