"""Full batches (DAPO's dynamic sampling) where most groups carry no signal: samples per step and reward per step.

From an SFT model of the quickstart (`--model`, e.g. benchmarks/distill.py's `model-sft`), reverse-text on short
strings of a small alphabet (`--env-args`), which the SFT model mostly reverses exactly: most groups then score all
alike and `drop_zero_variance` drops them. Two sides, their order alternated over `--rounds`: dropping alone (the
step trains on what is left) and dropping with `fill_batch` (more groups until the batch is full, at most
`max_extra_groups`). Per side: trained samples per step, extra groups drawn per step, reward over the run's first and
last 5 steps (medians over rounds). The last line reads
`fill_batch: <S> samples per step against <D> dropping alone (batch <B>); reward +<F> against +<G>`.

    uv run python benchmarks/fill_batch.py --model /tmp/distill/model-sft
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "reverse_text"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="an SFT model of the quickstart")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--env-args", default='{"min_len": 1, "max_len": 3, "alphabet": "abc"}')
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=float, default=3600)
    return parser.parse_args()


def rl_command(model: Path, out: Path, args, *extra: str) -> list[str]:
    """One side's run: the quickstart's, on the short strings, dropping groups that score all alike."""
    return [sys.executable, "-m", "rl.launcher.main",
            "--trainer", "@", str(CONFIGS / "train.toml"), "--orchestrator", "@", str(CONFIGS / "orch.toml"),
            "--inference", "@", str(CONFIGS / "infer.toml"), "--model.name", str(model),
            "--max-steps", str(args.steps), "--seq-len", "128", "--async-level", "1", "--output-dir", str(out),
            "--orchestrator.batch-size", str(args.batch_size),
            "--orchestrator.env", json.dumps([{"id": "reverse-text", "args": json.loads(args.env_args)}]),
            "--orchestrator.advantage.drop-zero-variance", "true", *extra]


def run(model: Path, out: Path, args, *extra: str) -> list[dict]:
    command = rl_command(model, out, args, *extra)
    print("+", out.name, *extra, flush=True)
    with out.with_suffix(".log").open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{out.name} exited {done.returncode}; see {out.with_suffix('.log')}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in records if r["process"] == "orchestrator"), key=lambda r: r["step"])


SIDES = {"drop": [], "fill": ["--orchestrator.advantage.fill-batch", "true"]}  # each side's flags beside the run's


def main() -> None:
    args = parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-fill-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side in list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]:
            steps = run(args.model, root / f"{side}-{round_}", args, *SIDES[side])
            rewards = [r["reward"] for r in steps]
            result = {"samples": statistics.fmean(r["samples"] for r in steps),
                      "extra": statistics.fmean(r.get("fill/extra_groups", 0) for r in steps),
                      "dropped_groups": statistics.fmean(r.get("dropped_groups/reverse-text", 0) for r in steps),
                      "first": statistics.fmean(rewards[:5]), "last": statistics.fmean(rewards[-5:])}
            results[side].append(result)
            print(f"round {round_ + 1} {side}: {result['samples']:.1f} samples per step, {result['extra']:.1f} extra "
                  f"groups, {result['dropped_groups']:.1f} groups dropped; reward {result['first']:.3f} -> "
                  f"{result['last']:.3f}", flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    median = {side: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for side, runs in results.items()}
    gain = {side: m["last"] - m["first"] for side, m in median.items()}
    print(f"fill_batch: {median['fill']['samples']:.0f} samples per step against {median['drop']['samples']:.0f} "
          f"dropping alone (batch {args.batch_size}); reward {gain['fill']:+.3f} against {gain['drop']:+.3f}")


if __name__ == "__main__":
    main()
