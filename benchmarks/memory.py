"""Peak memory and speed of the trainer's output layer (logprob + entropy, forward and backward) at Qwen3's vocabulary,
chunked (trainer/output_head.py) against the naive `log_softmax` over [tokens, vocab], side by side in one run.

Peak memory is read from the torch profiler's memory timeline (profile_memory=True, every tensor's allocation and
free in time order, on the CPU): the most memory the pass held beyond what existed before it (inputs and weights
excluded). Summing operators' own memory usage instead misses tensors created inside an autograd.Function (the
chunks' logits) and under-counts the chunked side about tenfold. On CPU in fp32; the ratio carries to a GPU, where
the naive [16k, 151,936] fp32 logits alone are ~10 GB.

    uv run python benchmarks/memory.py [--tokens 4096] [--hidden 256] [--vocab 151936] [--chunk 1024] [--repeats 2]

The last line reads `peak memory <R>x naive, tokens/s <S>x naive`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rl.trainer.output_head import chunked_logprobs


def naive(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, -1)  # [N, V]
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def chunked(chunk):
    return lambda hidden, weight, targets, temperature: chunked_logprobs(hidden, weight, targets, temperature, chunk)


def one_pass(fn, hidden, weight, targets) -> None:
    logprobs, entropy = fn(hidden, weight, targets, 0.7)
    (logprobs.sum() + entropy.detach().sum()).backward()
    hidden.grad = weight.grad = None


def peak_bytes(fn, hidden, weight, targets) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        one_pass(fn, hidden, weight, targets)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for CUDA snapshots; the CPU has no other
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _times, sizes = json.loads(path.read_text())  # sizes: [time][category] bytes held
    held = [sum(categories) for categories in sizes]
    return max(held) - held[0]


def seconds(fn, hidden, weight, targets, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass(fn, hidden, weight, targets)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(args.tokens, args.hidden, generator=g) * 0.1).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    sides = {"naive": naive, f"chunked ({args.chunk})": chunked(args.chunk)}
    results = {}
    for name, fn in sides.items():
        one_pass(fn, hidden, weight, targets)  # warm-up
        results[name] = (peak_bytes(fn, hidden, weight, targets), seconds(fn, hidden, weight, targets, args.repeats))
        peak, secs = results[name]
        print(f"{name:>16}: peak {peak / 2**30:.2f} GiB beyond the inputs, "
              f"{args.tokens / secs:,.0f} tokens/s ({secs:.2f} s)")
    (naive_peak, naive_s), (chunk_peak, chunk_s) = results.values()
    print(f"peak memory {chunk_peak / naive_peak:.3f}x naive, tokens/s {naive_s / chunk_s:.2f}x naive")


if __name__ == "__main__":
    main()
