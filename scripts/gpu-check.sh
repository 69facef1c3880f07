#!/usr/bin/env bash
# What only a GPU can show, in one command: CUDA usable (driver, CUDA, NCCL and vLLM versions), the single-GPU vLLM
# reload test, the other CUDA tests (any that skips fails here: RL_REQUIRE_GPU), the trainer alone at Qwen3-0.6B's
# shape, then a short Qwen3-0.6B run (bf16 trainer, vLLM with CUDA graphs, one trainer GPU and one inference GPU),
# shorter ones with weights over NCCL and one of the tiny MoE with router replay; on a node of 8 GPUs, the whole node (the 1.5B TP=2 layout with 4 trainer
# ranks, and a five-member NCCL group); ending with the figures that tell where the GPU path stands: trainer tokens/s
# and MFU, peak allocated and reserved memory, and the publish-to-served reload latency.
#
#   bash scripts/gpu-check.sh [OUTPUT_DIR] [MODEL]      (MODEL: default Qwen/Qwen3-0.6B; needs the hub or a local dir)
#
# Every part runs whatever failed before it (a failing CUDA test must not hide the run's figures); each part's
# status is printed at the end, and the script exits non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L; then
  echo "gpu-check: no NVIDIA GPU is visible (nvidia-smi -L failed)" >&2
  exit 2
fi
out="${1:-outputs/gpu-check-$(date +%Y%m%d-%H%M%S)}"
model="${2:-Qwen/Qwen3-0.6B}"
mkdir -p "$out"
statuses=()
failed=0

# part NAME COMMAND...: run it, its output also in $out/NAME.log, and record how it ended.
part() {
  local name="$1"
  shift
  echo "== $name"
  "$@" 2>&1 | tee "$out/$name.log"
  local code="${PIPESTATUS[0]}"
  if [ "$code" = 0 ]; then statuses+=("$name: ok"); else statuses+=("$name: FAILED (exit $code)"); failed=1; fi
}

part install env RL_STACK=gpu bash scripts/install.sh
. scripts/uv_path.sh  # where install.sh puts uv if it had none
export RL_REQUIRE_GPU=1             # a GPU test that skips here (no CUDA, too few GPUs) fails: tests/conftest.py
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# CUDA usable from the installed torch, and what this node runs: a driver too old for the CUDA 13 wheels (< 580)
# leaves torch without CUDA, and every GPU test would skip
part cuda uv run python - <<'PY'
import subprocess, sys

import torch

smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip().splitlines()
driver = smi[0].split(",")[0] if smi else "unknown"
if not torch.cuda.is_available():
    sys.exit(f"gpu-check: torch {torch.__version__} (built for CUDA {torch.version.cuda}) cannot use the GPUs with "
             f"driver {driver}: the CUDA 13 wheels need driver >= 580")
import vllm

nccl = ".".join(map(str, torch.cuda.nccl.version()))
names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
print(f"gpu-check: driver {driver}, torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {nccl}, "
      f"vLLM {vllm.__version__}; {torch.cuda.device_count()} GPUs: {', '.join(names)}")
if torch.cuda.device_count() > 1:  # PCIe GPUs without NVLink or P2P: NCCL's P2P transport hangs or fails there
    peer = torch.cuda.can_device_access_peer(0, 1)
    print(f"gpu-check: GPU 0 -> 1 peer access: {peer}"
          + ("" if peer else "; NCCL between GPUs needs NCCL_P2P_DISABLE=1 on this node (export it for rl)"))
PY
# the first thing that can fail and the cheapest to read: one bf16 step reloaded into CUDA vLLM and verified
# (-n 0: the GPU tests one at a time, not beside each other on the same GPUs as pyproject.toml's two workers)
part vllm-reload uv run pytest -n 0 -m gpu -rs -q tests/integration/test_gpu.py -k bf16_step_reloads_into_cuda_vllm
part cuda-tests uv run pytest -n 0 -m gpu -rs -q tests --deselect \
  tests/integration/test_gpu.py::test_a_bf16_step_reloads_into_cuda_vllm_and_verifies
# the trainer alone at Qwen3-0.6B's shape (random weights built locally): tokens/s, MFU, peak memory on one GPU
part trainer-figures uv run python benchmarks/gpu_trainer.py --steps 6 --samples 32 --seq-len 4096
# $model: 10 RL steps, 1 trainer GPU + 1 inference GPU, device defaults (bf16, CUDA graphs)
part rl-run uv run rl \
  --trainer @ configs/reverse_text/train.toml \
  --orchestrator @ configs/reverse_text/orch.toml \
  --inference @ configs/reverse_text/infer.toml \
  --model.name "$model" --trainer.optim.lr 1e-6 --max-steps 10 --seq-len 512 \
  --trainer-gpus 1 --inference-gpus 1 --output-dir "$out/run"
# the same run with weights over NCCL (trainer GPU -> the server's GPU), every step verified by its checksum
part rl-run-nccl uv run rl \
  --trainer @ configs/reverse_text/train.toml \
  --orchestrator @ configs/reverse_text/orch.toml \
  --inference @ configs/reverse_text/infer.toml \
  --model.name "$model" --trainer.optim.lr 1e-6 --max-steps 5 --seq-len 512 \
  --trainer-gpus 1 --inference-gpus 1 --transfer.backend nccl --output-dir "$out/run-nccl"
# and with only the changed elements sent (transfer.sparse over NCCL): which steps went as changes, and their share of the bytes
part rl-run-sparse-nccl uv run rl \
  --trainer @ configs/reverse_text/train.toml \
  --orchestrator @ configs/reverse_text/orch.toml \
  --inference @ configs/reverse_text/infer.toml \
  --model.name "$model" --trainer.optim.lr 1e-6 --max-steps 5 --seq-len 512 \
  --trainer-gpus 1 --inference-gpus 1 --transfer.backend nccl --transfer.sparse true --output-dir "$out/run-sparse-nccl"
part sparse-figures uv run python - "$out/run-sparse-nccl" <<'PY'
import json, sys
from pathlib import Path

path = Path(sys.argv[1]) / "metrics.jsonl"
if not path.is_file():
    sys.exit(f"gpu-check: no sparse figures: {path} was not written (see rl-run-sparse-nccl.log)")
trainer = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("process") == "trainer"]
whole = max(r["transfer_bytes"] for r in trainer)  # step 0 goes whole: the server served files
shares = [f"{r['transfer_bytes'] / whole:.1%}" if r["transfer_sparse"] else "whole" for r in trainer]
print(f"gpu-check: sparse NCCL bytes sent per step, of the whole step's {whole / 2**20:.0f} MiB: {', '.join(shares)}")
if not any(r["transfer_sparse"] for r in trainer):
    sys.exit("gpu-check: no step went as its changes")
PY

# a mixture of experts (the tiny Qwen3-MoE): bf16 trainer routing every token as vLLM's own recorder (its V2 runner)
# recorded it; moe-figures prints how often the trainer's router agreed, and fails where a step trained unreplayed
part tiny-moe uv run tiny-model --arch qwen3_moe --out "$out/tiny-moe"
part rl-run-moe uv run rl \
  --trainer @ configs/reverse_text/train.toml \
  --orchestrator @ configs/reverse_text/orch.toml \
  --inference @ configs/reverse_text/infer.toml \
  --model.name "$out/tiny-moe" --max-steps 5 --seq-len 512 \
  --trainer-gpus 1 --inference-gpus 1 --output-dir "$out/run-moe"
part moe-figures uv run python - "$out/run-moe" <<'PY'
import json, sys
from pathlib import Path

path = Path(sys.argv[1]) / "metrics.jsonl"
if not path.is_file():
    sys.exit(f"gpu-check: no MoE figures: {path} was not written (see rl-run-moe.log)")
trainer = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("process") == "trainer"]
for r in trainer:
    print(f"gpu-check: MoE step {r['step']}: routed as recorded {r.get('moe/routed_as_recorded', float('nan')):.4f}, "
          f"router agreement {r.get('moe/router_agreement', float('nan')):.4f}, mismatch_kl {r['mismatch_kl']:.3g}")
if not trainer or any(r.get("moe/routed_as_recorded") != 1.0 for r in trainer):
    sys.exit("gpu-check: an MoE step was not routed as inference recorded")
PY

# The whole node, where it has 8 GPUs: the 1.5B TP=2 layout over NCCL with 4 FSDP ranks (rank 0 interleaving its
# all-gathers with the broadcasts) and two TP=2 servers; then four TP=1 servers, a five-member NCCL group. 3 steps
# each, NCCL_DEBUG=WARN (above); node-figures reports each step's send and its servers' switch to it.
gpus=$(nvidia-smi -L | wc -l)
node_model="${NODE_MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"
if [ "$gpus" -ge 8 ]; then
  part node-tp2 uv run rl @ configs/layout_1.5b_tp2/rl.toml --model.name "$node_model" --max-steps 3 \
    --inference-gpus 4 --trainer-gpus 4 --transfer.backend nccl --output-dir "$out/node-tp2"
  part node-five uv run rl @ configs/layout_1.5b_tp2/rl.toml --model.name "$node_model" --max-steps 3 \
    --inference.tensor-parallel-size 1 --inference-gpus 4 --trainer-gpus 4 --transfer.backend nccl \
    --output-dir "$out/node-five"
  part node-figures uv run python - "$out/node-tp2" "$out/node-five" <<'PY'
import json, re, sys
from pathlib import Path

for run in map(Path, sys.argv[1:]):
    path = run / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"gpu-check: no figures: {path} was not written (see {run.name}.log)")
    trainer = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("process") == "trainer"]
    switches: dict[int, list[float]] = {}
    for log in sorted((run / "logs").glob("inference*.log")):
        for step, seconds in re.findall(r"update to step (\d+) from transfer:step_\d+ in ([0-9.]+) s", log.read_text()):
            switches.setdefault(int(step), []).append(float(seconds))
    for r in trainer:
        served = switches.get(r["step"], [])
        print(f"gpu-check: {run.name} step {r['step']}: sent over NCCL in {r.get('transfer_s', float('nan')):.2f} s, "
              f"served by {len(served)} servers, switch {max(served, default=float('nan')):.2f} s at most")
    if not trainer or not all(r.get("weights_sent") for r in trainer):
        sys.exit(f"gpu-check: {run.name}: a step did not go over NCCL")
PY
else
  statuses+=("node-tp2, node-five: SKIPPED (they need 8 GPUs; this node has $gpus)")
fi

part figures uv run python - "$out/run" <<'PY'
import json, re, statistics, sys
from pathlib import Path

run = Path(sys.argv[1])
if not (run / "metrics.jsonl").is_file():
    sys.exit(f"gpu-check: no figures: {run / 'metrics.jsonl'} was not written (see rl-run.log)")
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
trainer = [r for r in records if r.get("process") == "trainer"][1:]  # the first step compiles and warms up
def median(key):
    values = [r[key] for r in trainer if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")
log = "\n".join(p.read_text(errors="replace") for p in (run / "logs").rglob("inference*.log"))
reloads = [float(s) for s in re.findall(r"update to step \d+ from .* in ([0-9.]+) s", log)][1:]
print(f"gpu-check: trainer tokens/s {median('tokens_per_s'):.0f}, MFU {median('mfu'):.3f}, "
      f"peak memory {median('peak_mem_gib'):.1f} GiB allocated / {median('peak_reserved_gib'):.1f} GiB reserved, "
      f"reload {statistics.median(reloads) if reloads else float('nan'):.2f} s (median of {len(reloads)}), "
      f"reward {trainer[0]['reward'] if trainer else float('nan'):.3f} -> {trainer[-1]['reward'] if trainer else float('nan'):.3f}")
PY

echo "== gpu-check summary (logs in $out)"
printf '  %s\n' "${statuses[@]}"
exit "$failed"
