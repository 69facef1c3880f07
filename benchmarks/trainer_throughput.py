"""Trainer tokens/s against a plain single-process PyTorch loop on the same model, packed batches and loss.

    uv run python benchmarks/trainer_throughput.py --model models/tiny --steps 6

The plain loop is the floor the trainer's machinery (FSDP, micro-batch planning, all-reduces) must stay
close to: it runs the same packed micro-batches through an unsharded model with the same loss and AdamW.
The trainer runs under torchrun at world size 1 and 2 on fake batches written through rl.protocol; its
tokens/s (metrics.jsonl, forward/backward/optimizer time only) is averaged over steps after the first.
The three run in turn for several rounds, and each step counts with its best time over the rounds: on a
shared machine the same step varies by 15% or more from one run to the next.
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

from rl.protocol import RunPaths, read_metrics, write_batch
from rl.samples import Sample
from rl.trainer.loss_config import LossConfig
from rl.trainer.data import build_micro_batches, trained_tokens
from rl.trainer.linear_attention import separate_samples
from rl.trainer.loss import policy_loss
from rl.trainer.model import forward_logprobs
from rl.trainer.output_head import DEFAULT_CHUNK_TOKENS, install_logprob_head

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


def step_tokens(steps: int, samples_per_step: int, seq_len: int) -> list[int]:
    return [sum(len(s.input_ids) for s in fake_samples(step, samples_per_step, seq_len)) for step in range(steps)]


def plain_loop(model_dir: str, steps: int, samples_per_step: int, seq_len: int) -> list[float]:
    """Seconds per step of an unsharded model on the same packed micro-batches."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    install_logprob_head(model, DEFAULT_CHUNK_TOKENS)  # the same output-layer maths as the trainer's
    separate_samples(model)  # a hybrid's (Qwen3.5's) linear attention computes each packed sample alone, as rl's does
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    seconds = []
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
        seconds.append(time.perf_counter() - start)
    return seconds


def trainer_command(model_dir: str, out: Path, steps: int, seq_len: int, ranks: int) -> list[str]:
    """The trainer on `ranks` ranks, on the batches written under `out`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
            str(port), "-m", "rl.trainer.main", "--model.name", model_dir, "--output-dir", str(out),
            "--max-steps", str(steps), "--seq-len", str(seq_len), "--optim.lr", "1e-5"]


def trainer_run(model_dir: str, steps: int, samples_per_step: int, seq_len: int, ranks: int) -> list[float]:
    """Seconds per step of the trainer (its train_s: forward/backward/optimizer, no waiting or publishing)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for step in range(steps):
            samples = fake_samples(step, samples_per_step, seq_len)
            write_batch(RunPaths(out), step, [samples[r::ranks] for r in range(ranks)])
        command = trainer_command(model_dir, out, steps, seq_len, ranks)
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)  # inherits OMP_NUM_THREADS=1
        rows = sorted((m for m in read_metrics(RunPaths(out)) if m["process"] == "trainer"), key=lambda m: m["step"])
        return [m["train_s"] for m in rows]


def tokens_per_s(rounds: list[list[float]], tokens: list[int]) -> float:
    """Each step's best time over the rounds (steps after the first, which warms up)."""
    best = [min(times) for times in zip(*rounds)]
    return sum(tokens[1:]) / sum(best[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=32, help="samples per step (all ranks)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of plain loop, 1 rank, 2 ranks in turn")
    args = parser.parse_args()
    shape = (args.model, args.steps, args.samples, args.seq_len)
    tokens = step_tokens(args.steps, args.samples, args.seq_len)
    plain, one, two = [], [], []
    for r in range(args.rounds):  # in turn, so that a busy moment of the machine can hit every contender
        plain.append(plain_loop(*shape))
        one.append(trainer_run(*shape, 1))
        two.append(trainer_run(*shape, 2))
        print(f"round {r}: " + "  ".join(
            f"{name} {tokens_per_s([times[-1]], tokens):6.0f}" for name, times in (("plain", plain), ("1 rank", one),
                                                                                 ("2 ranks", two))
        ) + " tokens/s", flush=True)
    plain_tps, one_tps, two_tps = (tokens_per_s(times, tokens) for times in (plain, one, two))
    print(f"best of {args.rounds} rounds per step:")
    print(f"plain loop        {plain_tps:10.0f} tokens/s")
    print(f"trainer, 1 rank   {one_tps:10.0f} tokens/s   ratio to plain {one_tps / plain_tps:.2f} (target >= 0.9)")
    print(f"trainer, 2 ranks  {two_tps:10.0f} tokens/s   ratio to 1 rank {two_tps / one_tps:.2f}")


if __name__ == "__main__":
    main()
