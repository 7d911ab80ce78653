#!/usr/bin/env bash
# Does rlft learn? SFT -> GRPO on GSM8K and on an easier generated task, held-out accuracy before/after.
#
#   bash benchmarks/learning.sh OUT PHASE [PHASE ...]
#
# Environment:
#   MODEL     the starting model: an HF directory, a .gguf file or an HF id (default smollm2-135m-instruct)
#   GSM8K     a local GSM8K copy (a directory with train.jsonl and test.jsonl)
#   GPUS      GPUs on this machine (default 1); every run uses launch/configs/grpo_1gpu.yaml's layout
#   BACKEND   the rollout/evaluation engine (default vllm)
#   EXTRA_ARGS  overrides added to every SFT/GRPO launch (e.g. device=cpu for a dry run)
#   PYTHON    the interpreter (default python3); the deepspeed launcher runs as `$PYTHON -m deepspeed.launcher.runner`
#   *_STEPS, *_ARGS   see the phases
#
# Phases (each skips what OUT already holds, so a phase cut short by a time limit is resumed by
# running it again: checkpoints are written every SAVE_EVERY steps and resume=auto picks them up):
#   sft         SFT on GSM8K train (SFT_STEPS steps)                     -> OUT/sft/model
#   gsm8k       GRPO from OUT/sft/model on GSM8K (GSM8K_STEPS steps or GSM8K_MINUTES of training, whichever
#               ends first); greedy accuracy on all 1319 test
#               questions at step 0 (= the SFT model) and after the last step -> OUT/grpo_gsm8k
#   easy_pick   greedy accuracy of OUT/sft/model on the candidate easy tasks (one engine start); the
#               first whose accuracy lies in [0.10, 0.50] becomes the easy task -> OUT/easy_task.txt
#   easy        GRPO from OUT/sft/model on the easy task (EASY_STEPS steps or EASY_MINUTES), held-out accuracy before/after
#               on EASY_EVAL_N generated problems                        -> OUT/grpo_easy
#   summary     learning.json + reward-curve PNGs                         -> OUT/
set -euo pipefail
out="$1"; shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
PYTHON="${PYTHON:-python3}"
MODEL="${MODEL:-smollm2-135m-instruct}"
GSM8K="${GSM8K:-}"
SFT_STEPS="${SFT_STEPS:-200}"
GSM8K_STEPS="${GSM8K_STEPS:-200}"
GSM8K_MINUTES="${GSM8K_MINUTES:-6}"
EASY_STEPS="${EASY_STEPS:-100}"
EASY_MINUTES="${EASY_MINUTES:-3}"
EASY_EVAL_N="${EASY_EVAL_N:-500}"
SAVE_EVERY="${SAVE_EVERY:-10}"
SFT_CONFIG="${SFT_CONFIG:-launch/configs/sft_1gpu.yaml}"
GRPO_CONFIG="${GRPO_CONFIG:-launch/configs/grpo_1gpu.yaml}"
GPUS="${GPUS:-1}"
BACKEND="${BACKEND:-vllm}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
# Candidate easy tasks, easiest first: reasoning_gym sources (see rlft/data/generated.py).
EASY_TASKS="${EASY_TASKS:-reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=2 reasoning_gym:chain_sum?min_terms=2&max_terms=3&min_digits=2&max_digits=2 reasoning_gym:basic_arithmetic?min_terms=2&max_terms=3&min_digits=1&max_digits=2}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$out"
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
ds() { "$PYTHON" -m deepspeed.launcher.runner --master_port "$(free_port)" --num_gpus "$GPUS" "$@"; }
say() { echo "[learning $(date +%H:%M:%S)] $*" | tee -a "$out/phases.log"; }
[ -n "$GSM8K" ] || { echo "set GSM8K to a directory with train.jsonl and test.jsonl" >&2; exit 2; }

model_dir() {  # the HF directory of MODEL (a .gguf is converted once and cached)
  "$PYTHON" -c 'import sys; from rlft.models.loading import resolve_model_path; print(resolve_model_path(sys.argv[1]))' "$MODEL" | tail -n 1
}

for phase in "$@"; do
  t0=$(date +%s)
  case "$phase" in
    sft)
      if [ -f "$out/sft/model/config.json" ]; then say "sft: $out/sft/model exists"; continue; fi
      ds --module rlft.train_sft --config "$SFT_CONFIG" model.path="$(model_dir)" data.source="$GSM8K" \
        sft.max_steps="$SFT_STEPS" sft.max_seq_len=512 optim.train_micro_batch_size=16 \
        schedule.evaluate_freq=0 schedule.save_every=50 data.eval_size=100 sampling.backend=$BACKEND \
        sampling.max_tokens=512 output.dir="$out/sft" $EXTRA_ARGS ${SFT_ARGS:-} ;;
    gsm8k)
      if [ -f "$out/grpo_gsm8k/model/config.json" ]; then say "gsm8k: finished"; continue; fi
      # eval_size null = all 1319 test questions; evaluate_at_start scores the SFT model first.
      ds --module rlft.train_grpo --config "$GRPO_CONFIG" output.init_checkpoint="$out/sft/model" \
        data.source="$GSM8K" data.train_size=null data.eval_size=null sampling.backend=$BACKEND \
        sampling.max_tokens=320 sampling.eval_max_tokens=512 optim.rollout_batch_size=256 \
        optim.train_micro_batch_size=32 grpo.group_size=16 grpo.dynamic_sampling=true \
        grpo.max_sampling_rounds=3 sampling.temperature=0.8 optim.lr=2e-5 schedule.steps="$GSM8K_STEPS" schedule.time_limit_minutes="$GSM8K_MINUTES" schedule.evaluate_at_start=true \
        schedule.evaluate_freq=20 schedule.save_every="$SAVE_EVERY" schedule.log_samples_every=10 \
        output.dir="$out/grpo_gsm8k" $EXTRA_ARGS ${GSM8K_ARGS:-} ;;
    easy_pick)
      if [ -s "$out/easy_task.txt" ]; then say "easy_pick: $(cat "$out/easy_task.txt")"; continue; fi
      data_args=(); for task in $EASY_TASKS; do data_args+=(--data "$task:test"); done
      "$PYTHON" -m rlft.evaluate --model "$out/sft/model" "${data_args[@]}" --num-examples 300 \
        --backend "$BACKEND" --max-tokens 256 --batch-size 300 --no-progress --out "$out/easy_pick"
      "$PYTHON" - "$out" $EASY_TASKS <<'PY' | tee -a "$out/phases.log"
import json, pathlib, sys
out, tasks = pathlib.Path(sys.argv[1]), sys.argv[2:]
summaries = {json.loads(p.read_text())["data"].rsplit(":", 1)[0]: json.loads(p.read_text())
             for p in sorted(out.glob("easy_pick/**/summary.json"))}
accs = {t: summaries[t]["accuracy"] for t in tasks if t in summaries}
for t, a in accs.items():
    print(f"easy_pick: {t} accuracy {a:.3f}")
pick = next((t for t in tasks if 0.10 <= accs.get(t, -1) <= 0.50), tasks[0])
(out / "easy_task.txt").write_text(pick + "\n")
print(f"easy_pick: chose {pick}")
PY
      ;;
    easy)
      if [ -f "$out/grpo_easy/model/config.json" ]; then say "easy: finished"; continue; fi
      task=$(cat "$out/easy_task.txt")
      ds --module rlft.train_grpo --config "$GRPO_CONFIG" output.init_checkpoint="$out/sft/model" \
        data.source="$task" data.train_size=5000 data.eval_size="$EASY_EVAL_N" sampling.backend=$BACKEND \
        sampling.max_tokens=256 optim.rollout_batch_size=256 optim.train_micro_batch_size=32 \
        grpo.group_size=8 grpo.dynamic_sampling=true grpo.max_sampling_rounds=3 optim.lr=2e-5 \
        schedule.steps="$EASY_STEPS" schedule.time_limit_minutes="$EASY_MINUTES" schedule.evaluate_at_start=true schedule.evaluate_freq=10 \
        schedule.save_every="$SAVE_EVERY" schedule.log_samples_every=10 output.dir="$out/grpo_easy" $EXTRA_ARGS ${EASY_ARGS:-} ;;
    summary)
      "$PYTHON" benchmarks/learning_summary.py "$out" ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
  say "$phase took $(( $(date +%s) - t0 )) s"
done
