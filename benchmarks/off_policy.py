"""Off-policy training with and without the geometric sequence mask, against on-policy: the quickstart's reward gain.

The tiny model after the quickstart's SFT (`--model`), served in bfloat16 while the trainer computes in float32 (a
real train-inference mismatch beside the staleness), trains the quickstart's task for `--steps` steps on three sides,
their order rotated over `--rounds`:

- k=0: on-policy (async level 0, step by step), the geometric mask on;
- k=8 mask: continuous dispatch at async level 8, max_off_policy_steps 8,
  `trainer.loss.mismatch = [{ type = "geo_mask", against = "rescored" }]`: each sample's ratio is to inference's
  logprobs under the trained policy (the orchestrator re-scores stale samples), so the mask sees the bf16-against-fp32
  mismatch alone, not the policy's steps since sampling (on-policy the two are the same);
- k=8 none: the same, no correction (`mismatch = { type = "none" }`).

Per run, from the orchestrator's step records: the reward gain and its noise as the run's summary computes them
(rl/launcher/report.py: the last fifth of the steps against the first, 3 standard errors), the mean and largest
staleness of each batch's oldest token, the run's seconds; from the trainer's: the share of trained sequences masked.
The last line reads (medians over rounds):

off-policy: reward gain at k=8 <a> vs k=0 <b> (mask on), <c> vs <b> (mask off)

    uv run --no-sync tiny-model --out /tmp/tiny && (the quickstart's SFT, scripts/quickstart.sh, to /tmp/tiny-sft)
    uv run --no-sync python benchmarks/off_policy.py --model /tmp/tiny-sft [--rounds 2] [--steps 60] [--lr 3e-4]
        [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from router_replay import ROOT, quickstart_command

from rl.launcher.report import reward_change

GEO_MASK = '[{"type": "geo_mask", "against": "rescored"}]'
K8 = ["--async-level", "8", "--orchestrator.max-off-policy-steps", "8", "--orchestrator.dispatch", "continuous",
      "--trainer.keep-weights", "10"]  # the weights a server may still serve or roll back to, 8 steps behind
SIDES = {
    "k0": ["--async-level", "0", "--trainer.loss.mismatch", GEO_MASK],  # step by step: on-policy
    "k8-mask": [*K8, "--trainer.loss.mismatch", GEO_MASK],
    "k8-none": [*K8, "--trainer.loss.mismatch", '{"type": "none"}'],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the tiny model after the quickstart's SFT")
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, their order rotated")
    parser.add_argument("--lr", type=float, help="the trainer's learning rate on every side (default: the "
                                                 "quickstart's, 1e-3, at which on-policy gains little)")
    parser.add_argument("--out", type=Path, help="runs' directory (default: a new temporary one)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="print each side's command line and run nothing")
    return parser.parse_args()


def rl_command(args, out: Path, side: str) -> list[str]:
    lr = [] if args.lr is None else ["--trainer.optim.lr", str(args.lr)]
    return quickstart_command(args.model, out, args.steps, "--inference.dtype", "bfloat16", *lr, *SIDES[side])


def run(args, out: Path, side: str) -> list[dict]:
    """The run's records (every process)."""
    print("+", out.name, *SIDES[side], flush=True)
    with out.with_suffix(".log").open("w") as log:
        done = subprocess.run(rl_command(args, out, side), stdout=log, stderr=subprocess.STDOUT,
                              timeout=args.timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{out.name} exited {done.returncode}; see {out.with_suffix('.log')}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def measure(records: list[dict]) -> dict:
    """The reward gain and noise over the orchestrator's steps, the staleness, the sequences masked."""
    def by_step(process: str) -> list[dict]:
        return sorted((r for r in records if r.get("process") == process), key=lambda r: r["step"])

    orchestrator, trainer = by_step("orchestrator"), by_step("trainer")
    change = reward_change([r["reward"] for r in orchestrator])
    return {"gain": change["reward_gain"], "noise": change["noise_3se"],
            "staleness_mean": statistics.fmean(r.get("staleness", 0) for r in orchestrator),
            "staleness_max": max(r.get("staleness", 0) for r in orchestrator),
            "masked_seq": statistics.fmean(r.get("masked_seq_frac", 0) for r in trainer)}


def main() -> None:
    args = parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-off-policy-"))
    if args.dry_run:
        for side in SIDES:
            print(f"{side}: {shlex.join(rl_command(args, root / f'{side}-0', side))}")
        return
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    names = list(SIDES)
    for round_ in range(args.rounds):
        turn = round_ % len(names)
        for side in names[turn:] + names[:turn]:
            start = time.monotonic()
            result = measure(run(args, root / f"{side}-{round_}", side)) | {"seconds": time.monotonic() - start}
            results[side].append(result)
            print(f"round {round_ + 1} {side}: reward gain {result['gain']:+.3f} (noise {result['noise']:.3f}), "
                  f"staleness mean {result['staleness_mean']:.2f} max {result['staleness_max']}, "
                  f"{result['masked_seq']:.1%} of sequences masked, {result['seconds']:.0f} s", flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    gain = {side: statistics.median(r["gain"] for r in runs) for side, runs in results.items()}
    print(f"off-policy: reward gain at k=8 {gain['k8-mask']:+.3f} vs k=0 {gain['k0']:+.3f} (mask on), "
          f"{gain['k8-none']:+.3f} vs {gain['k0']:+.3f} (mask off)")


if __name__ == "__main__":
    main()
