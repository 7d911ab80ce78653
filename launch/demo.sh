#!/usr/bin/env bash
# The offline default: a short GRPO run of SmolLM2-135M-Instruct on gsm_symbolic problems.
# First use sets up the environment and converts the model (a few minutes); then watch it with
#   tensorboard --logdir runs/demo/tensorboard
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/train.sh" "$here/configs/grpo_cpu_demo.yaml" "$@"
