#!/usr/bin/env bash
# Supervised fine-tuning on GSM8K solutions through the deepspeed launcher; its OUT/model/ is where
# the GRPO configs start (output.init_checkpoint: runs/sft/model).
#   bash launch/sft.sh launch/configs/sft_1gpu.yaml [key=value ...]
# The number of ranks comes from the config's topology. Without a GPU the same topology runs on
# CPU (gloo), one process per rank.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 CONFIG.yaml [key=value ...]" >&2; exit 2; }
config="$1"; shift
source "$here/setup.sh" || exit 1
# SFT's own settings (sft.batch_size vs replicas x micro-batches) are refused before launching, with the
# rest of the checks (the sft trainer's record, rlft/config/trainers.py).
exec bash "$here/_launch.sh" sft "$config" "$@"
