#!/usr/bin/env bash
# Run the test suite on CPU (sets up the environment on first use).
#   bash launch/test.sh              # everything (unit, multi-process DeepSpeed on gloo, vLLM on CPU)
#   bash launch/test.sh -k grader    # any pytest arguments
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh" || exit 1
cd "$here/.."
export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \
  TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
python -m pytest -q --timeout=900 "$@"
rc=$?
# pytest's "no tests collected" is a failure of the suite, not a success.
[ $rc -eq 5 ] && { echo "rlft: no tests were collected" >&2; exit 1; }
exit $rc
