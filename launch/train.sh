#!/usr/bin/env bash
# GRPO training through the deepspeed launcher.
#   bash launch/train.sh launch/configs/grpo_8gpu.yaml [key=value ...]
# The number of ranks comes from the config's topology. Without a GPU the same topology runs on
# CPU (gloo), one process per rank.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 CONFIG.yaml [key=value ...]" >&2; exit 2; }
config="$1"; shift
source "$here/setup.sh" || exit 1
exec bash "$here/_launch.sh" grpo "$config" "$@"
