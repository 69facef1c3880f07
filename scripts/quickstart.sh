#!/usr/bin/env bash
# Fresh machine to a finished RL run on the tiny model: install, build the model, run `rl`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
out="${1:-outputs/quickstart-$(date +%Y%m%d-%H%M%S)}"
[ -d models/tiny ] || uv run tiny-model --out models/tiny
uv run rl \
  --trainer @ configs/reverse_text/train.toml \
  --orchestrator @ configs/reverse_text/orch.toml \
  --inference @ configs/reverse_text/infer.toml \
  --model.name models/tiny --max-steps 20 --seq-len 128 --async-level 1 \
  --output-dir "$out"
