#!/usr/bin/env bash
# The same seeded GRPO launch from several source trees, one after the other on the same machine: each tree's
# own copy of CONFIG, STEPS steps, no evaluation and no checkpoint, so that the step records differ only by
# the code. Then benchmarks/step_phases.py prints each phase's median over the steps after the first, and
# every tree's ratio to the first tree's.
#
#   TREES="before=path/to/old/tree after=." MODEL=path/to/model.gguf GSM8K=path/to/gsm8k STEPS=8 \
#       bash benchmarks/same_machine_steps.sh OUT
#
# A tree is a directory holding rlft/ and launch/ (e.g. `git archive COMMIT rlft launch | tar -x -C DIR`).
# Environment: TREES, MODEL, GSM8K (train.jsonl and test.jsonl), CONFIG (launch/configs/
# grpo_instruct_1gpu.yaml, read from each tree), STEPS (8), BACKEND (vllm), PYTHON (python3), ARGS (more key=value overrides).
set -uo pipefail
out="$(mkdir -p "$1" && cd "$1" && pwd)"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"; STEPS="${STEPS:-8}"; BACKEND="${BACKEND:-vllm}"; CONFIG="${CONFIG:-launch/configs/grpo_instruct_1gpu.yaml}"
: "${TREES:?set TREES to name=directory pairs}"
: "${MODEL:?set MODEL to the model (HF directory, .gguf or hub id)}"
: "${GSM8K:?set GSM8K to a directory with train.jsonl and test.jsonl}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RLFT_PROGRESS=0
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
runs=()
for pair in $TREES; do
  name="${pair%%=*}"; tree="$(cd "${pair#*=}" && pwd)"
  echo "[same_machine $(date +%H:%M:%S)] $name: $tree ($(cd "$tree" && git rev-parse --short HEAD 2>/dev/null || echo 'no git'))" \
    | tee -a "$out/phases.log"
  (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m deepspeed.launcher.runner --master_port "$(free_port)" --num_gpus 1 \
    --module rlft.train_grpo --config "$CONFIG" model.path="$MODEL" data.source="$GSM8K" seed=0 \
    sampling.backend="$BACKEND" schedule.steps="$STEPS" schedule.evaluate_at_start=false schedule.evaluate_freq=0 \
    schedule.save_every=0 output.dir="$out/$name" ${ARGS:-}) > "$out/$name.log" 2>&1
  code=$?
  # The launcher can exit 0 when its rank failed: a run counts only where it wrote its step records.
  if [ "$code" -ne 0 ] || [ ! -s "$out/$name/steps.jsonl" ]; then
    echo "[same_machine $(date +%H:%M:%S)] $name failed (exit $code, no step records): see $out/$name.log" \
      | tee -a "$out/phases.log" >&2
    exit 1
  fi
  echo "[same_machine $(date +%H:%M:%S)] $name done" | tee -a "$out/phases.log"
  runs+=("$name=$out/$name/steps.jsonl")
done
"$PYTHON" "$here/benchmarks/step_phases.py" "${runs[@]}" --json "$out/step_phases.json"
