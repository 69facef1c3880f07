"""Train-inference mismatch of the hybrid family against Qwen3's: the tiny Qwen3.5 (Gated DeltaNet in three layers of
four) and the tiny Qwen3, each served in float32 and in bfloat16 while the trainer computes in float32.

Each model is copied with its weights rounded to bfloat16 (kept in float32), so that both dtypes serve the same
weights and the mismatch is the computation's. Every (model, served dtype) pair runs the quickstart's task
on-policy (async level 0) with the same seed and `--steps`; per run, from the trainer's records, the means over the
steps of `mismatch_kl` (the KL between the sampled and the trained distribution over the trained tokens) and
`mismatch_corr` (the correlation of the two sides' logprobs). The last line reads:

mismatch: qwen3_5 <a> vs qwen3 <b> (bf16 served), fp32 <c>

a and b the mismatch_kl served in bf16, c qwen3_5's served in float32 (the goal: c <= 1e-6).

vLLM's CPU kernels for Gated DeltaNet in bf16 refuse the default tiny model's linear head dim of 32 ("Unexpected head
dim size, 32" at the first request): build both models with head_dim 128, as the real Qwen3.5 has.

    uv run --no-sync tiny-model --arch qwen3 --hidden-size 512 --heads 4 --out /tmp/w-qwen3
    uv run --no-sync tiny-model --arch qwen3_5 --hidden-size 512 --heads 4 --out /tmp/w-qwen3_5
    uv run --no-sync python benchmarks/mismatch.py --qwen3 /tmp/w-qwen3 --qwen3-5 /tmp/w-qwen3_5 [--steps 6] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
from pathlib import Path

from router_replay import rounded_copy, run

DTYPES = ("float32", "bfloat16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen3", type=Path, required=True, help="the tiny Qwen3 (`tiny-model`)")
    parser.add_argument("--qwen3-5", type=Path, required=True, help="the tiny Qwen3.5 (`tiny-model --arch qwen3_5`)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run")
    parser.add_argument("--out", type=Path, help="runs' directory (default: a new temporary one)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="print each run's command line and run nothing")
    return parser.parse_args()


def measure(steps: list[dict]) -> dict:
    """Means over the run's steps of the mismatch KL and the logprob correlation."""
    return {key: statistics.fmean(r[key] for r in steps if key in r) for key in ("mismatch_kl", "mismatch_corr")}


def main() -> None:
    args = parse_args()
    models = {"qwen3": args.qwen3, "qwen3_5": args.qwen3_5}
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-mismatch-"))
    if args.dry_run:
        from router_replay import rl_command

        for name, model in models.items():
            for dtype in DTYPES:
                args.dtype = dtype
                print(f"{name} {dtype}: {shlex.join(rl_command(model, root / f'{name}-{dtype}', args))}")
        return
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, model in models.items():
        rounded = rounded_copy(model, root / f"model-{name}", "bfloat16")
        for dtype in DTYPES:
            args.dtype = dtype  # what `run` serves
            results[f"{name} {dtype}"] = result = measure(run(rounded, root / f"{name}-{dtype}", args))
            print(f"{name} served in {dtype}: mismatch_kl {result['mismatch_kl']:.3g}, logprob correlation "
                  f"{result['mismatch_corr']:.6f}", flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(f"mismatch: qwen3_5 {results['qwen3_5 bfloat16']['mismatch_kl']:.3g} vs qwen3 "
          f"{results['qwen3 bfloat16']['mismatch_kl']:.3g} (bf16 served), fp32 "
          f"{results['qwen3_5 float32']['mismatch_kl']:.3g}")


if __name__ == "__main__":
    main()
