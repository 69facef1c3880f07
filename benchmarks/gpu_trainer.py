"""The trainer on one GPU at a real model's shape: tokens/s, MFU and peak memory of `rl.trainer.main` (torchrun, one
rank, the device's defaults: bf16, activation checkpointing, chunked output layer) on a randomly initialised model of
Qwen3-0.6B's shape (its config's sizes, vocabulary 151,936, tied head), built here: no hub needed. Batches are the
throughput benchmark's fake packed samples.

    python benchmarks/gpu_trainer.py [--steps 6] [--samples 32] [--seq-len 4096] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.trainer_throughput import fake_samples  # noqa: E402
from rl.protocol import RunPaths, read_metrics, write_batch  # noqa: E402
from rl.tiny_model import build_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def build_model(out: Path) -> Path:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = Qwen3Config(**QWEN3_0_6B, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def trainer_command(model: Path, out: Path, args: argparse.Namespace) -> list[str]:
    """The trainer on one rank, on the batches written under `out`."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", "29533",
            "-m", "rl.trainer.main", "--model.name", str(model), "--output-dir", str(out),
            "--max-steps", str(args.steps), "--seq-len", str(args.seq_len), "--optim.lr", "1e-6",
            "--micro-batch-tokens", str(2 * args.seq_len), *(["--compile"] if args.compile else [])]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--compile", action="store_true", help="trainer.compile (per-block torch.compile)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "qwen3-0.6b-shape")
        out = Path(tmp) / "run"
        for step in range(args.steps):
            write_batch(RunPaths(out), step, [fake_samples(step, args.samples, args.seq_len)])
        done = subprocess.run(trainer_command(model, out, args), cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the trainer failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        rows = sorted((m for m in read_metrics(RunPaths(out)) if m["process"] == "trainer"), key=lambda m: m["step"])
    warm = rows[1:]  # the first step warms up (allocator, kernels, compile)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    for m in rows:
        print(f"step {m['step']}: {m['tokens']} tokens, {m['tokens_per_s']:.0f} tokens/s, MFU {m.get('mfu', 0):.3f}, "
              f"peak {m['peak_mem_gib']:.1f} GiB allocated / {m.get('peak_reserved_gib', 0):.1f} GiB reserved")
    print(f"gpu trainer, Qwen3-0.6B shape, {device}: median of steps 1..: "
          f"{statistics.median(m['tokens_per_s'] for m in warm):.0f} tokens/s, "
          f"MFU {statistics.median(m.get('mfu', 0) for m in warm):.3f}, "
          f"peak {max(m['peak_mem_gib'] for m in warm):.1f} GiB")


if __name__ == "__main__":
    main()
