#!/usr/bin/env bash
# Run the test suite on CPU (sets up the environment on first use).
#   bash launch/test.sh              # everything (unit, multi-process DeepSpeed on gloo, vLLM on CPU)
#   bash launch/test.sh -k grader    # any pytest arguments
# Test files run three at a time on a machine with two cores or more (pytest-xdist; a file's tests stay
# on one worker, so its fixtures are built once): the launches' ranks spend part of their time waiting
# (on each other, on timeouts a test sets, on their start), which a third worker fills; on 2 cores four
# clean-clone runs took 14 min 47 s to 15 min 41 s, against 15 min 33 s to 16 min 37 s with two workers,
# and a fourth worker was slower again (18 min 9 s against 17 min 55 s on a slower day): the suite is
# CPU-bound, each rank spending seconds importing transformers' modelling code.
# RLFT_TEST_WORKERS=N sets how many (0 or 1: one after the other, as pdb and -s need).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh" || exit 1
cd "$here/.."
export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 \
  TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
workers="${RLFT_TEST_WORKERS:-$(python -c 'import os; n = len(os.sched_getaffinity(0)); print(3 if n >= 2 else 1)')}"
[[ "$workers" =~ ^[0-9]+$ ]] || { echo "rlft: RLFT_TEST_WORKERS must be a whole number of workers, got '$workers'" >&2; exit 2; }
parallel=()
# Whole files to a worker, the longest first (tests/file_costs.py; xdist would hand out the files with the
# most tests first, leaving the few long launches for the end).
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
python -m pytest -q --timeout=900 "${parallel[@]}" "$@"
rc=$?
# pytest's "no tests collected" is a failure of the suite, not a success.
[ $rc -eq 5 ] && { echo "rlft: no tests were collected" >&2; exit 1; }
exit $rc
