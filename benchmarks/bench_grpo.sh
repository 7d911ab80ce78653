#!/usr/bin/env bash
# rlft against TRL (GRPOTrainer + vLLM colocate) on the fixed-length workloads, one GPU:
#
#   bash benchmarks/bench_grpo.sh [OUT]
#
# Runs W-small (8 prompts x 8 x 256 tokens) and W-big (64 x 8 x 512) with the random
# Qwen2.5-1.5B-shaped model, STEPS steps each (medians over steps 2..STEPS), writes
# OUT/<workload>/bench.json and merges the headline figures into benchmarks/results/summary.json
# (keys w_small_1gpu, w_big_1gpu), with the raw vLLM engine's tokens/s on the same work
# (--raw-engine).  TRL is skipped with a message where it is not installed.
#
# Environment: PYTHON (default python3), STEPS (default 6), MODEL (default random-1.5b),
#   WORKLOADS (default "w-small w-big"), BASELINE (default trl; none to skip it), RAW_ENGINE
#   (default 1; 0 skips the raw engine's run), EXTRA_ARGS (more options and key=value overrides).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
out="${1:-benchmarks/runs/$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
rc=0
raw=--raw-engine
[ "${RAW_ENGINE:-1}" = 0 ] && raw=
for w in ${WORKLOADS:-w-small w-big}; do
  # shellcheck disable=SC2086
  "$PYTHON" -m rlft.bench --model "${MODEL:-random-1.5b}" --workload "$w" --steps "${STEPS:-6}" \
    --baseline "${BASELINE:-trl}" $raw --summary-json --out "$out/$w" ${EXTRA_ARGS:-} || rc=$?
done
exit $rc
