#!/usr/bin/env bash
# The instruct recipe's parts taken out one at a time (launch/configs/grpo_instruct_1gpu.yaml): every arm
# trains the same model for the same minutes, all arms at once on one GPU, then each is evaluated on the
# whole test split (greedy) and compared with the recipe as shipped on the same questions (McNemar).
#
#   MODEL=path/to/model.gguf GSM8K=path/to/gsm8k bash benchmarks/instruct_ablation.sh OUT
#
# Arms (ARMS, default all five):
#   shipped              the config as shipped
#   no_dynamic_sampling  grpo.dynamic_sampling=false (groups of equal rewards are trained on, at zero advantage)
#   no_overlong          grpo.overlong=none (no penalty for answers that run into the last tokens)
#   no_eos_training      grpo.train_on_eos=false (the end-of-turn token gets no gradient: the original's mask)
#   difficulty           data.sampler=difficulty (prompts always or never solved rested) instead of uniform;
#                        it acts from its second pass over the prompts (after 233 steps on GSM8K's 7473 at 32 a
#                        step, 59 at the least with dynamic sampling's rounds), so in a run of minutes it is the
#                        uniform order in effect: give both arms a smaller pool to see it act, e.g.
#                        ARMS="uniform512:data.train_size=512 difficulty512:data.sampler=difficulty,data.train_size=512"
#   NAME:KEY=VALUE,...   an arm of your own, e.g. lr8e-6:optim.lr=8e-6 or short:sampling.max_tokens=384
#
# Side by side on one GPU, every arm's engine stays awake and every arm's own tensors are capped at a
# share of the GPU (ARM_FRACTION, topology.gpu_memory_fraction; default 0.9 / number of arms - 0.045,
# the 0.045 about what an awake engine of a 0.5B model holds at the recipe's step).  To fit five arms,
# MEMORY_ARGS (default model.activation_checkpointing=true optim.divergence_factor=0
# optim.train_micro_batch_size=4) recomputes the decoder layers' activations in the backward pass, drops
# the update guard's copy of the optimizer state (5.5 GiB at 0.5B; it acts only on a diverging update)
# and takes a quarter of the recipe's micro-batch: each costs train time, equally in every arm, and none
# changes a number.  Measured on an H200 (benchmarks/results/h200_2026-12-03_ablation/) with
# Qwen2.5-Coder-0.5B-Instruct: at micro-batches of 8 and 0.11 of the GPU an arm's train phase ran out at
# its cap; at 4 and 0.135 (18.9 GiB) the train phases peaked at 15.5-16.3 GiB, each process held about
# 20.4 GiB and each engine 6.9 GiB (five arms: 136.5 of 139.8 GiB, so no larger share fits), and one of
# the five arms still reached its cap at step 5 (a 1.5 GiB block its cached fragments could not give).
# An arm that fails so is run again on its own and summarised beside the others:
#   ARMS=difficulty STEPS=22 ... bash benchmarks/instruct_ablation.sh OUT2
#   python benchmarks/ablation_summary.py OUT --arms shipped ... difficulty=../OUT2/difficulty
# (STEPS set to the steps the others made: alone on the GPU it steps faster, so equal steps, not minutes).
# Earlier, with sleeping engines and no cap (benchmarks/results/h200_2026-12-03_trl_ablation/), the first
# arm's caching allocator grew to 92 GiB while its engine slept and three arms could not start.
# The first arm finishes a step before the next starts (it converts the model and fills vLLM's compile
# cache, which the others then read); the others start START_GAP (20) seconds apart, or each once the one
# before has finished a step with START_GAP=step.  Each trains for MINUTES of its own step time
# (schedule.time_limit_minutes), so arms that start later share the GPU with fewer others at their end:
# the minutes are equal, the contention nearly so.  The engines' KV caches are sized from the step (vLLM's
# kv_cache_memory_bytes), so an engine starting while another arm allocates is not mis-sized.  Each arm's
# last step is followed by its final evaluation (all of data.eval_size).
# OUT/<arm>/ is each run, OUT/<arm>.log its output, OUT/ablation.json and the printed table the summary
# (benchmarks/ablation_summary.py; BEFORE=DIR adds each arm's change from the starting model's
# evaluation in DIR, e.g. instruct_gsm8k.sh's OUT/before).
#
# Environment: MODEL, GSM8K, ARMS, MINUTES (12), STEPS (1000: the minutes end the run), CONFIG, PYTHON
# (python3), MEMORY_ARGS (above), SHARED_ARGS (more key=value overrides for every arm; an arm's own win;
# e.g. schedule.evaluate_freq=20 for held-out curves, compared at equal steps with benchmarks/compare_runs.py,
# as benchmarks/results/h200_2026-12-04_lr/ did),
# NUM_GPUS (1; 0 on a machine without one, for a smoke run), START_TIMEOUT (900 s: how long an arm may
# take to finish its first step), START_GAP (20, or step), ARM_FRACTION (above).
set -uo pipefail
out="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
PYTHON="${PYTHON:-python3}"
CONFIG="${CONFIG:-launch/configs/grpo_instruct_1gpu.yaml}"
ARMS="${ARMS:-shipped no_dynamic_sampling no_overlong no_eos_training difficulty}"
: "${MODEL:?set MODEL to the instruct model (HF directory, .gguf or hub id)}"
: "${GSM8K:?set GSM8K to a directory with train.jsonl and test.jsonl}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RLFT_PROGRESS=0
if [ "${NUM_GPUS:-1}" = 0 ]; then export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""; fi
mkdir -p "$out"
say() { echo "[ablation $(date +%H:%M:%S)] $*" | tee -a "$out/arms.log"; }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
arm_args() {
  case "$1" in
    *:*=*) echo "${1#*:}" | tr ',' ' ' ;;
    shipped) ;;
    no_dynamic_sampling) echo grpo.dynamic_sampling=false ;;
    no_overlong) echo grpo.overlong=none ;;
    no_eos_training) echo grpo.train_on_eos=false ;;
    difficulty) echo data.sampler=difficulty ;;
    *) return 1 ;;
  esac
}
START_GAP="${START_GAP:-20}"
[[ "$START_GAP" =~ ^([0-9]+|step)$ ]] || { echo "instruct_ablation.sh: START_GAP must be whole seconds or step, got '$START_GAP'" >&2; exit 2; }
n_arms=$(echo $ARMS | wc -w)
ARM_FRACTION="${ARM_FRACTION:-$("$PYTHON" -c "print(round(0.9 / $n_arms - 0.045, 3))")}"
"$PYTHON" -c "import sys; f = float(sys.argv[1]); sys.exit(0 if 0 < f <= 1 else 1)" "$ARM_FRACTION" 2>/dev/null \
  || { echo "instruct_ablation.sh: ARM_FRACTION must be in (0, 1], got '$ARM_FRACTION' ($n_arms arms: fewer arms, or set it)" >&2; exit 2; }
for spec in $ARMS; do
  arm_args "$spec" >/dev/null || { echo "instruct_ablation.sh: unknown arm $spec (shipped no_dynamic_sampling no_overlong no_eos_training difficulty, or NAME:KEY=VALUE,...)" >&2; exit 2; }
done
pids=()
names=()
for spec in $ARMS; do
  arm="${spec%%:*}"; names+=("$arm")
  say "$arm: start ($(arm_args "$spec"); tensors capped at $ARM_FRACTION of the GPU)"
  # shellcheck disable=SC2046  # the overrides are words
  "$PYTHON" -m deepspeed.launcher.runner --master_port "$(free_port)" --num_gpus "${NUM_GPUS:-1}" --module rlft.train_grpo \
    --config "$CONFIG" model.path="$MODEL" data.source="$GSM8K" schedule.steps="${STEPS:-1000}" \
    schedule.time_limit_minutes="${MINUTES:-12}" schedule.evaluate_at_start=false schedule.evaluate_freq=0 \
    schedule.save_every=0 output.resume=never sampling.vllm.sleep_mode=false topology.gpu_memory_fraction="$ARM_FRACTION" \
    output.dir="$out/$arm" ${MEMORY_ARGS-model.activation_checkpointing=true optim.divergence_factor=0 optim.train_micro_batch_size=4} \
    ${SHARED_ARGS:-} $(arm_args "$spec") > "$out/$arm.log" 2>&1 &
  pids+=($!)
  if [ "$START_GAP" != step ] && [ "${#pids[@]}" -gt 1 ]; then sleep "$START_GAP"; continue; fi
  waited=0
  until [ -s "$out/$arm/steps.jsonl" ] || ! kill -0 "${pids[-1]}" 2>/dev/null; do
    sleep 5; waited=$(( waited + 5 ))
    [ "$waited" -ge "${START_TIMEOUT:-900}" ] && { say "$arm: no step after $waited s; starting the next arm anyway"; break; }
  done
done
rc=0
for i in "${!pids[@]}"; do
  arm="${names[$i]}"
  wait "${pids[$i]}"; code=$?
  say "$arm: exit $code"
  [ "$code" = 0 ] || rc=$code
done
"$PYTHON" benchmarks/ablation_summary.py "$out" --arms "${names[@]}" ${BEFORE:+--before "$BEFORE"} --json "$out/ablation.json" \
  | tee "$out/ablation.txt" || rc=$?
exit $rc
