#!/usr/bin/env bash
# The calculator environment against the single-turn instruct recipe on GSM8K, one GPU, the same budget each:
# first the same cold start, SFT_STEPS steps of SFT on the same training solutions (launch/configs/
# sft_tools_coldstart.yaml), with GSM8K's calculator annotations as tool calls answered by the calculator for
# the calculator arm (sft.solution_form: tool_calls) and stripped for the single-turn arm (plain_checked: the
# same rows), one after the other; then the same minutes of GRPO from each arm's own SFT model, both arms
# side by side on the GPU (each its own launch, engine and policy; one after the other on a card too small for two,
# ORDER below), from the same model with the same seed;
# held-out accuracy on every test question (greedy) at the start of GRPO and after its last step, each arm
# with its own episodes (tools on for the calculator arm).
#
#   MODEL=path/to/model.gguf GSM8K=path/to/gsm8k MINUTES=10 SFT_STEPS=100 bash benchmarks/tools_gsm8k.sh OUT
#
# OUT/sft_single and OUT/sft_tools are the cold starts, OUT/single and OUT/tools the two GRPO runs (steps.jsonl,
# eval/step_*/); OUT/compare.json and compare.txt hold python benchmarks/compare_runs.py single=OUT/single
# tools=OUT/tools (accuracy at each evaluation, McNemar between the arms, the step ratio per generated token);
# OUT/results.tar.gz packs them with what they read.
# Environment: MODEL, GSM8K (train.jsonl and test.jsonl), MINUTES (10), SFT_STEPS (100; 0: no cold start, GRPO
# from MODEL itself), SFT_EVAL (100: the test questions the SFT runs' final evaluation scores), STAGGER (45 s
# between the two starts, so that the engines start one after the other), KV_BYTES (each engine's KV cache,
# 8 GiB: a fixed size needs no start-up memory profile, which another process on the GPU would disturb),
# PYTHON (python3), ARGS (more key=value overrides for both GRPO arms), SFT_ARGS (for both SFT arms), ENGINE_ARGS
# (the sampler's overrides for all four launches; default vLLM with the KV cache above; each key once: a key
# given twice on the command line is refused), ORDER (side_by_side, one_after_other, or auto, the default: side by
# side where the GPU holds 120 GiB or more, one after the other below that: on an 80 GB H100 the second arm's
# train phase ran out of memory beside the first's, which held 53 GiB with its engine). The script exits non-zero
# when a launch failed.
set -uo pipefail
out="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
PYTHON="${PYTHON:-python3}"; MINUTES="${MINUTES:-10}"; STAGGER="${STAGGER:-45}"; KV_BYTES="${KV_BYTES:-8589934592}"
SFT_STEPS="${SFT_STEPS:-100}"; SFT_EVAL="${SFT_EVAL:-100}"
ORDER="${ORDER:-auto}"
if [ "$ORDER" = auto ]; then
  gib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)"
  if [[ "$gib" =~ ^[0-9]+$ ]] && [ "$gib" -lt $((120 * 1024)) ]; then ORDER=one_after_other; else ORDER=side_by_side; fi
fi
case "$ORDER" in side_by_side|one_after_other) ;;
  *) echo "ORDER must be side_by_side, one_after_other or auto, got '$ORDER'" >&2; exit 2 ;; esac
: "${MODEL:?set MODEL to the instruct model (HF directory, .gguf or hub id)}"
: "${GSM8K:?set GSM8K to a directory with train.jsonl and test.jsonl}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RLFT_PROGRESS=0
mkdir -p "$out"
# The model is converted (a .gguf) or fetched once, before the two launches that read it.
MODEL="$("$PYTHON" -c 'import sys; from rlft.models.loading import resolve_model_path; print(resolve_model_path(sys.argv[1]))' "$MODEL" | tail -1)"
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
read -r -a engine_args <<< "${ENGINE_ARGS:-sampling.backend=vllm sampling.vllm.kv_cache_memory_bytes=$KV_BYTES sampling.vllm.gpu_memory_utilization=0.2}"
failed=0
said() {  # NAME CODE: the launch's exit status in the phase log (a non-zero one fails the script at its end)
  [ "$2" -eq 0 ] || failed=1
  echo "[tools_gsm8k $(date +%H:%M:%S)] $1 exited $2" | tee -a "$out/phases.log"
}
sft_arm() {  # NAME [key=value ...]: the cold start, SFT_STEPS steps on the same solutions
  local name="$1"; shift
  "$PYTHON" -m deepspeed.launcher.runner --master_port "$(free_port)" --num_gpus 1 --module rlft.train_sft \
    --config launch/configs/sft_tools_coldstart.yaml model.path="$MODEL" data.source="$GSM8K" seed=0 \
    sft.max_steps="$SFT_STEPS" data.eval_size="$SFT_EVAL" schedule.evaluate_freq=0 schedule.save_every=0 \
    "${engine_args[@]}" output.dir="$out/sft_$name" "$@" ${SFT_ARGS:-} > "$out/sft_$name.log" 2>&1
  said "sft_$name" $?
}
start_of() {  # NAME: the arm's starting model for GRPO
  if [ "$SFT_STEPS" -gt 0 ]; then echo "output.init_checkpoint=$out/sft_$1/model"; else echo "output.init_checkpoint=null"; fi
}
arm() {  # NAME CONFIG
  "$PYTHON" -m deepspeed.launcher.runner --master_port "$(free_port)" --num_gpus 1 --module rlft.train_grpo \
    --config "$2" model.path="$MODEL" data.source="$GSM8K" seed=0 "$(start_of "$1")" \
    schedule.steps=1000 schedule.time_limit_minutes="$MINUTES" schedule.evaluate_at_start=true \
    schedule.evaluate_freq=0 schedule.save_every=0 \
    "${engine_args[@]}" output.dir="$out/$1" ${ARGS:-} > "$out/$1.log" 2>&1
  said "$1" $?
}
if [ "$SFT_STEPS" -gt 0 ]; then
  echo "[tools_gsm8k $(date +%H:%M:%S)] cold start: $SFT_STEPS SFT steps per arm" | tee -a "$out/phases.log"
  # One after the other: the budget is the steps, and an engine put to sleep beside another run's
  # allocations can fail to wake (README, one GPU shared by two runs).
  sft_arm single environment.name=single_turn sft.solution_form=plain_checked
  sft_arm tools
  for name in single tools; do
    [ -f "$out/sft_$name/model/config.json" ] || { echo "sft_$name wrote no model: see $out/sft_$name.log" >&2; exit 1; }
  done
fi
echo "[tools_gsm8k $(date +%H:%M:%S)] start: $MINUTES minutes of training per arm, $ORDER" | tee -a "$out/phases.log"
case "$ORDER" in
  side_by_side)
    arm single launch/configs/grpo_instruct_1gpu.yaml &
    sleep "$STAGGER"
    arm tools launch/configs/grpo_tools_1gpu.yaml &
    wait ;;
  one_after_other)
    arm single launch/configs/grpo_instruct_1gpu.yaml
    arm tools launch/configs/grpo_tools_1gpu.yaml ;;
esac
for name in single tools; do  # the arms run in the background: their status is read from what they wrote
  grep -q "\] $name exited 0$" "$out/phases.log" || failed=1
  [ -s "$out/$name/steps.jsonl" ] || { echo "$name logged no step: see $out/$name.log" >&2; failed=1; }
done
if [ -s "$out/single/steps.jsonl" ] && [ -s "$out/tools/steps.jsonl" ]; then  # accuracy, McNemar, step cost per token
  "$PYTHON" benchmarks/compare_runs.py single="$out/single" tools="$out/tools" --json "$out/compare.json" \
    > "$out/compare.txt" 2>&1 || echo "compare_runs failed: see $out/compare.txt" >&2
fi
tar -czf "$out/results.tar.gz" -C "$out" --exclude='*.safetensors' --exclude='checkpoints' --exclude='tb' \
  phases.log single.log tools.log single tools $( [ -f "$out/compare.json" ] && echo compare.json compare.txt ) $( [ "$SFT_STEPS" -gt 0 ] && echo sft_single.log sft_tools.log sft_single sft_tools ) 2>/dev/null
echo "[tools_gsm8k $(date +%H:%M:%S)] done$( [ "$failed" -eq 0 ] || echo ', with a failed launch' )" | tee -a "$out/phases.log"
exit "$failed"
