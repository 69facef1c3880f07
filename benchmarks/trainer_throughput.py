"""Trainer tokens/s against a plain single-process PyTorch loop on the same model, packed batches and loss.

    uv run python benchmarks/trainer_throughput.py --model models/tiny --steps 6

The plain loop is the floor the trainer's machinery (FSDP, micro-batch planning, all-reduces) must stay
close to: it runs the same packed micro-batches through an unsharded model with the same loss and AdamW.
The trainer runs under torchrun at world size 1 and 2 on fake batches written through rl.protocol; its
tokens/s (metrics.jsonl, forward/backward/optimizer time only) is averaged over steps after the first.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: one thread, as each trainer rank gets

import argparse
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rl.protocol import RunPaths, Sample, read_metrics, write_batch
from rl.trainer.config import LossConfig
from rl.trainer.data import build_micro_batches, trained_tokens
from rl.trainer.loss import policy_loss
from rl.trainer.model import forward_logprobs

ROOT = Path(__file__).resolve().parents[1]


def fake_samples(step: int, n: int, seq_len: int) -> list[Sample]:
    rng = random.Random(step)
    samples = []
    for _ in range(n):
        prompt, completion = rng.randint(8, seq_len // 4), rng.randint(8, seq_len // 2)
        mask = [0] * prompt + [1] * completion
        logprobs = [0.0] * prompt + [-rng.uniform(2.0, 6.0) for _ in range(completion)]
        samples.append(Sample([rng.randint(4, 90) for _ in mask], mask, logprobs, rng.uniform(-1, 1), 0.0, step))
    return samples


def plain_loop(model_dir: str, steps: int, samples_per_step: int, seq_len: int) -> float:
    """Tokens/s of an unsharded model on the same packed micro-batches (steps after the first)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens, seconds = 0, 0.0
    for step in range(steps):
        samples = fake_samples(step, samples_per_step, seq_len)
        n_tokens = sum(trained_tokens(s) for s in samples)
        weights = [1.0 / n_tokens if trained_tokens(s) else 0.0 for s in samples]
        start = time.perf_counter()
        for mb in build_micro_batches(samples, weights, seq_len, 1, packing=True, pad_id=0):
            logprobs, _ = forward_logprobs(model, mb)
            loss, _ = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, mb.weights, LossConfig())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > 0:
            seconds += time.perf_counter() - start
            tokens += sum(len(s.input_ids) for s in samples)
    return tokens / seconds


def trainer_run(model_dir: str, steps: int, samples_per_step: int, seq_len: int, ranks: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for step in range(steps):
            samples = fake_samples(step, samples_per_step, seq_len)
            write_batch(RunPaths(out), step, [samples[r::ranks] for r in range(ranks)])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
               str(port), "-m", "rl.trainer.main", "--model.name", model_dir, "--output-dir", str(out),
               "--max-steps", str(steps), "--seq-len", str(seq_len), "--optim.lr", "1e-5"]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)  # inherits OMP_NUM_THREADS=1
        rows = [m for m in read_metrics(RunPaths(out)) if m["process"] == "trainer" and m["step"] > 0]
        return sum(m["tokens"] for m in rows) / sum(m["train_s"] for m in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=32, help="samples per step (all ranks)")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    plain = plain_loop(args.model, args.steps, args.samples, args.seq_len)
    one = trainer_run(args.model, args.steps, args.samples, args.seq_len, 1)
    two = trainer_run(args.model, args.steps, args.samples, args.seq_len, 2)
    print(f"plain loop        {plain:10.0f} tokens/s")
    print(f"trainer, 1 rank   {one:10.0f} tokens/s   ratio to plain {one / plain:.2f} (target >= 0.9)")
    print(f"trainer, 2 ranks  {two:10.0f} tokens/s   ratio to 1 rank {two / one:.2f}")


if __name__ == "__main__":
    main()
