#!/usr/bin/env bash
# Evaluate a model on GSM8K-style maths (sets up the environment on first use).
#   bash launch/eval.sh MODEL [options of python -m rlft.evaluate]
#   bash launch/eval.sh runs/grpo/model --data gsm8k:test --num-examples 200   # a run's final model
#   bash launch/eval.sh smollm2-135m-instruct --data gsm_symbolic --k 4 --temperature 0.7
# MODEL is an HF model directory, a .gguf file, a hub id, or smollm2-135m-instruct (offline default);
# `bash launch/eval.sh --help` lists the options.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 MODEL [options of python -m rlft.evaluate]" >&2; exit 2; }
source "$here/setup.sh" || exit 1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
case "$1" in
  -h|--help) exec python -m rlft.evaluate --help ;;
esac
model="$1"; shift
exec python -m rlft.evaluate --model "$model" "$@"
