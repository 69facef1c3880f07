"""LoRA against full fine-tuning in the real trainer: step time, peak memory and bytes published per step.

    uv run python benchmarks/lora.py [--rounds 2] [--steps 4]

Builds a ~100M-parameter model the tiny model's way (hidden 768, 14 layers), then runs the trainer under torchrun
(world size 1, float32 on CPU) on the same fake batches with full fine-tuning and with LoRA (rank 16, every
attention and MLP projection), in turn for several rounds. Each step counts with its best time over the rounds
(steps after the first, which warms up); peak memory is the trainer's own `peak_mem_gib` (the process's RSS
high-water mark on CPU, torch's peak allocated on GPUs), its largest over the rounds. Published bytes are the
files of weights/step_1. The last line gives the ratios, LoRA over full.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from rl.protocol import RunPaths, read_metrics, write_batch  # noqa: E402
from rl.tiny_model import build_tiny_model  # noqa: E402
from trainer_throughput import fake_samples  # noqa: E402

MODEL_100M = dict(hidden_size=768, layers=14, heads=12, kv_heads=4)
LORA = ("--lora.rank", "16", "--lora.alpha", "32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_command(model_dir: Path, out: Path, steps: int, seq_len: int, lora: bool) -> list[str]:
    """The trainer on one rank, on the batches written under `out`, every step's weights kept."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
            str(free_port()), "-m", "rl.trainer.main", "--model.name", str(model_dir), "--output-dir", str(out),
            "--max-steps", str(steps), "--seq-len", str(seq_len), "--keep-weights", str(steps + 2),
            *(LORA if lora else ())]


def trainer_run(model_dir: Path, steps: int, samples: int, seq_len: int, lora: bool) -> tuple[list[float], float, int]:
    """(train_s per step, peak memory GiB, bytes of weights/step_1) of one trainer run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for step in range(steps):
            write_batch(RunPaths(out), step, [fake_samples(step, samples, seq_len)])
        done = subprocess.run(trainer_command(model_dir, out, steps, seq_len, lora), cwd=ROOT, capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"trainer failed:\n{done.stderr[-3000:]}")
        rows = sorted((m for m in read_metrics(RunPaths(out)) if m["process"] == "trainer"), key=lambda m: m["step"])
        published = sum(p.stat().st_size for p in RunPaths(out).weights(1).iterdir() if p.is_file())
        return [m["train_s"] for m in rows], max(m["peak_mem_gib"] for m in rows), published


def best_mean(rounds: list[list[float]]) -> float:
    best = [min(times) for times in zip(*rounds)]
    return sum(best[1:]) / len(best[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model-100M", **MODEL_100M)
        runs = {"full": ([], 0.0, 0), "lora": ([], 0.0, 0)}
        for r in range(args.rounds):  # in turn, so that a busy moment of the machine can hit both
            for name in runs:
                times, peak, published = trainer_run(model, args.steps, args.samples, args.seq_len, name == "lora")
                runs[name] = (runs[name][0] + [times], max(runs[name][1], peak), published)
                print(f"round {r} {name}: step {best_mean([times]):.2f} s, peak {peak:.2f} GiB, "
                      f"published {published / 2**20:.1f} MiB", flush=True)
    step = {name: best_mean(times) for name, (times, _, _) in runs.items()}
    peak = {name: p for name, (_, p, _) in runs.items()}
    published = {name: b for name, (_, _, b) in runs.items()}
    for name in runs:
        print(f"{name:5s} step {step[name]:.2f} s  peak memory {peak[name]:.2f} GiB  "
              f"published {published[name] / 2**20:.1f} MiB")
    print(f"LoRA vs full at ~100M: step time {step['lora'] / step['full']:.2f}x, peak memory "
          f"{peak['lora'] / peak['full']:.2f}x, bytes published {published['lora'] / published['full']:.4f}x")


if __name__ == "__main__":
    main()
