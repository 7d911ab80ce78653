#!/usr/bin/env bash
# The one-GPU benchmark set behind benchmarks/results/summary.json's w_big_1gpu and sft_1p5b, most
# important first; every run's result is written as soon as it ends, so a set cut short keeps them:
#
#   bash benchmarks/bench_1gpu.sh GSM8K_DIR [OUT]
#
#   1. W-big (64 prompts x 8 x 512 tokens, random 1.5B shape): rlft with launch/configs/grpo_1gpu.yaml
#      (decoder layers compiled), then vLLM's own LLM.generate on the same work, then TRL's
#      GRPOTrainer with vLLM colocate (summary key w_big_1gpu)
#   2. the same rlft run with the engine awake between steps (sampling.vllm.sleep_mode=false: the
#      1.5B shape's engine and training fit on one 141 GB GPU together), the sync without waking
#      the engine (summary key w_big_1gpu_awake)
#   3. the W-big rlft run with the decoder layers eager (model.compile_layers=false; summary key
#      w_big_1gpu_eager)
#   4. SFT of the 1.5B shape, 256 GSM8K pairs a step in micro-batches of up to 16,384 tokens, the
#      decoder layers eager (summary key sft_1p5b)
#   5. the same SFT with the decoder layers compiled, as sft_1gpu.yaml ships (summary key
#      sft_1p5b_compiled), and one step more under torch's profiler (left out of the medians):
#      OUT/sft_compiled/sft/profile/ shows which operators and kernels took the step's time
#   6. the weight sync alone (benchmarks/bench_sync.py): the 1.5B shape's load into the engine for
#      several bucket sizes, one RPC's round trip, the checksums against their float64-cast baseline,
#      the engine's wake (OUT/sync/bench_sync.json)
#
# Environment: PYTHON (default python3), STEPS (default 5: medians over steps 2..5), MODEL and WORKLOAD
# (default random-1.5b and w-big; tiny and tiny for a CPU smoke run, with SFT_BATCH=16), SETS (default
# "wbig awake eager sft sft_compiled sync": which of the six to run).  OUT/summary.json is the summary after the set.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
data="$1"
out="${2:-benchmarks/runs/1gpu-$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-python3}"
export PYTHON
mkdir -p "$out"
rc=0
for set in ${SETS:-wbig awake eager sft sft_compiled sync}; do
  t0=$(date +%s)
  case "$set" in
    wbig) STEPS="${STEPS:-5}" WORKLOADS="${WORKLOAD:-w-big}" bash benchmarks/bench_grpo.sh "$out/grpo" || rc=$? ;;
    awake) STEPS="${STEPS:-5}" WORKLOADS="${WORKLOAD:-w-big}" BASELINE=none RAW_ENGINE=0 \
             EXTRA_ARGS="--summary-key w_big_1gpu_awake sampling.vllm.sleep_mode=false" \
             bash benchmarks/bench_grpo.sh "$out/grpo_awake" || rc=$? ;;
    eager) STEPS="${STEPS:-5}" WORKLOADS="${WORKLOAD:-w-big}" BASELINE=none RAW_ENGINE=0 \
             EXTRA_ARGS="--summary-key w_big_1gpu_eager model.compile_layers=false" \
             bash benchmarks/bench_grpo.sh "$out/grpo_eager" || rc=$? ;;
    sft) STEPS="${STEPS:-5}" BATCH="${SFT_BATCH:-256}" MICRO_TOKENS=16384 EXTRA_ARGS="model.compile_layers=false" \
         bash benchmarks/bench_sft.sh "$data" "$out/sft" || rc=$? ;;
    sft_compiled) steps="${STEPS:-5}"
                  STEPS=$(( steps + 1 )) BATCH="${SFT_BATCH:-256}" MICRO_TOKENS=16384 SUMMARY_KEY=sft_1p5b_compiled \
                  EXTRA_ARGS="model.compile_layers=true schedule.profile_steps=[$(( steps + 1 ))]" bash benchmarks/bench_sft.sh "$data" "$out/sft_compiled" || rc=$? ;;
    sync) "$PYTHON" benchmarks/bench_sync.py --model "${MODEL:-random-1.5b}" --buckets-mib 64,256,1024,4096 \
            --out "$out/sync" 2>&1 | tee "$out/sync.log" | grep -v " INFO \| WARNING " || rc=$? ;;
    *) echo "bench_1gpu.sh: unknown set $set (wbig, awake, eager, sft, sft_compiled, sync)" >&2; exit 2 ;;
  esac
  echo "[bench_1gpu] $set took $(( $(date +%s) - t0 )) s (exit status so far $rc)" | tee -a "$out/sets.log"
  cp benchmarks/results/summary.json "$out/summary.json" 2>/dev/null || true
done
exit $rc
