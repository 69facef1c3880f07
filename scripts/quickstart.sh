#!/usr/bin/env bash
# Fresh machine to a finished RL run on the tiny model: install, build the model, SFT warm-up, then RL
# with `rl`. Prints the start and final reward; writes <out>/reward.png.
#
#   bash scripts/quickstart.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
out="${1:-outputs/quickstart-$(date +%Y%m%d-%H%M%S)}"
[ -d models/tiny ] || uv run tiny-model --out models/tiny
if [ ! -f models/tiny-sft/model.safetensors ]; then
  uv run torchrun --standalone --nproc-per-node 2 -m rl.trainer.sft @ configs/reverse_text/sft.toml
fi
uv run rl \
  --trainer @ configs/reverse_text/train.toml \
  --orchestrator @ configs/reverse_text/orch.toml \
  --inference @ configs/reverse_text/infer.toml \
  --model.name models/tiny-sft --max-steps 20 --seq-len 128 --async-level 1 \
  --output-dir "$out"
