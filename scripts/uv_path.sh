# Sourced (`. scripts/uv_path.sh`): puts the uv that scripts/install.sh installs, where uv was not on PATH, on PATH.
# One place for that directory: install.sh, quickstart.sh, gpu-check.sh and .ci/run all source this.
UV_HOME="${XDG_DATA_HOME:-$HOME/.local/share}/rl/uv"
case ":$PATH:" in
  *":$UV_HOME/bin:"*) ;;
  *) export PATH="$PATH:$UV_HOME/bin" ;;  # after the user's own: a uv already on PATH wins
esac
