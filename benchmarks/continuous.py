"""Continuous dispatch against step-synchronous on a long-tailed environment: trained samples/s.

The environment (`tests/fixtures/environments/long_tail`, id `long-tail`) gives every `--long-every`-th task (8)
`--long-turns` (16) model turns and the rest one, so with the tiny random model (nearly every turn runs to
`--max-tokens`) a long episode samples ~16x the tokens of a short one and a step's slowest group is many times its
median one. Two sides run the real `rl` launcher, async level 1, the same `--steps` and batch (so the same number of
samples to train), their order alternated over `--rounds`:

- step: `--orchestrator.dispatch step`: each step's groups start together and its batch waits for the slowest;
- continuous: `--orchestrator.dispatch continuous --orchestrator.max-off-policy-steps K`: groups run across steps,
  a batch is made of the groups that finished, no trained token older than K steps.

Per run, from the orchestrator's records in `metrics.jsonl`: trained samples/s past the warm-up, the samples of steps
1..N-1 over the time from step 0's record to step N-1's (step 0 waits for the servers and fills the pipeline), and
the staleness of what was trained (`off_policy/max`, the oldest trained token's age in steps). A sample is a token
segment: the tiny model's long episodes split into several (its random replies do not always re-render as sampled),
so each round also prints trained rollouts/s and sampled tokens/s over the same window, the mean turns of a trained
rollout (1 + (long_turns - 1) / long_every ~ 2.9 where none is lost), the rollouts withheld as too old
(`off_policy/withheld`) and the share of sampled tokens not trained (`off_policy/discarded_tokens`): a continuous
side that loses the long episodes trains only short ones, and its samples/s is then not the same work's. The last
line reads (X the ratio of the medians over rounds, s the largest `off_policy/max` of the continuous runs):

continuous <X>x trained samples/s of step-synchronous on a long-tailed env (max_off_policy_steps <k>, staleness max <s>)

    uv run --no-sync tiny-model --out /tmp/tiny
    uv run --no-sync python benchmarks/continuous.py --model /tmp/tiny [--rounds 2] [--steps 16] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "reverse_text"
FIXTURES = ROOT / "tests" / "fixtures" / "environments"
SIDES = ("step", "continuous")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--max-off-policy-steps", type=int, default=8,
                        help="the continuous side's bound (the config's default; below the length of the long "
                             "episodes in steps, they are all dropped)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"sides to run, comma-separated ({','.join(SIDES)})")
    args = parser.parse_args()
    args.sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    unknown = set(args.sides) - set(SIDES)
    if unknown or not args.sides:
        parser.error(f"--sides: {','.join(sorted(unknown)) or 'none given'}; choose from {','.join(SIDES)}")
    return args


def add_run_arguments(parser: argparse.ArgumentParser, **defaults) -> None:
    """The options of a run on the long-tail environment (`rl_command`), with `defaults` where they differ."""
    d = {"steps": 16, "max_tokens": 8, "seq_len": 1024, "long_turns": 16} | defaults
    parser.add_argument("--model", type=Path, required=True, help="the tiny model (`tiny-model --out ...`)")
    parser.add_argument("--steps", type=int, default=d["steps"], help="steps per run (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, their order alternated")
    parser.add_argument("--batch-size", type=int, default=64, help="rollouts per step")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per task")
    parser.add_argument("--max-tokens", type=int, default=d["max_tokens"], help="tokens sampled per turn")
    parser.add_argument("--seq-len", type=int, default=d["seq_len"], help="longest sample in tokens")
    parser.add_argument("--long-every", type=int, default=8, help="task i is long when i %% long_every == 0")
    parser.add_argument("--long-turns", type=int, default=d["long_turns"],
                        help="model turns of a long task (a short one: 1)")
    parser.add_argument("--reply-ms", type=float, default=0.0,
                        help="wall time of each environment answer (a tool call's, which takes no CPU here)")
    parser.add_argument("--out", type=Path, help="runs' directory (default: a new temporary one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="print each side's command line and run nothing")


def side_flags(args) -> dict[str, list[str]]:
    """Each side's flags beside the run's."""
    return {"step": ["--orchestrator.dispatch", "step"],
            "continuous": ["--orchestrator.dispatch", "continuous",
                           "--orchestrator.max-off-policy-steps", str(args.max_off_policy_steps)]}


def rl_command(model: Path, out: Path, args, *extra: str) -> list[str]:
    """One side's run: the quickstart's configs on the long-tail environment, async level 1."""
    env = [{"id": "long-tail", "args": {"num_examples": 256, "long_every": args.long_every,
                                        "long_turns": args.long_turns, "reply_ms": args.reply_ms}}]
    return [sys.executable, "-m", "rl.launcher.main",
            "--trainer", "@", str(CONFIGS / "train.toml"), "--orchestrator", "@", str(CONFIGS / "orch.toml"),
            "--inference", "@", str(CONFIGS / "infer.toml"), "--model.name", str(model),
            "--max-steps", str(args.steps), "--seq-len", str(args.seq_len), "--async-level", "1",
            "--output-dir", str(out), "--orchestrator.batch-size", str(args.batch_size),
            "--orchestrator.rollouts-per-example", str(args.group_size),
            "--orchestrator.sampling.max-tokens", str(args.max_tokens),
            "--orchestrator.env", json.dumps(env), *extra]


def launcher_env() -> dict[str, str]:
    """This process's environment with the fixture environments importable by every process rl starts."""
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(FIXTURES), *([path] if path else [])])}


def run(model: Path, out: Path, args, *extra: str) -> list[dict]:
    """The run's orchestrator records, by step."""
    command = rl_command(model, out, args, *extra)
    print("+", out.name, *extra, flush=True)
    with out.with_suffix(".log").open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, cwd=ROOT,
                              env=launcher_env())
    if done.returncode != 0:
        raise RuntimeError(f"{out.name} exited {done.returncode}; see {out.with_suffix('.log')}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in records if r["process"] == "orchestrator"), key=lambda r: r["step"])


def discarded_share(steps: list[dict]) -> float:
    """The share of the steps' sampled tokens that no sample trained (each step's share, weighed by its tokens)."""
    tokens = sum(r["completion_tokens"] for r in steps)
    return sum(r.get("off_policy/discarded_tokens", 0) * r["completion_tokens"] for r in steps) / tokens if tokens \
        else 0.0


def past_warm_up(steps: list[dict]) -> tuple[list[dict], float]:
    """The records of steps 1..N-1 and the seconds from step 0's record to the last one's; steps 0..N-1 or an error."""
    if len(steps) < 2 or [r["step"] for r in steps] != list(range(len(steps))):
        raise RuntimeError(f"orchestrator records of steps {[r['step'] for r in steps]}: want 0..N-1, N >= 2")
    return steps[1:], steps[-1]["time"] - steps[0]["time"]


def measure(steps: list[dict]) -> dict:
    """Trained samples/s past the warm-up: the samples of steps 1..N-1 over the time from step 0's record to the
    last step's; the oldest trained token's age in steps (`off_policy/max`, 0 where not logged)."""
    window, seconds = past_warm_up(steps)
    samples = sum(r["samples"] for r in window)
    per_step = [sum(v for k, v in r.items() if k.startswith("rollouts/")) for r in window]
    rollouts = sum(per_step)
    turns = sum(r["num_turns"] * n for r, n in zip(window, per_step, strict=True))
    tokens = sum(r["completion_tokens"] for r in window)
    in_flight = [r["rollouts_in_flight"] for r in steps if "rollouts_in_flight" in r]
    return {"samples_per_s": samples / seconds, "samples": samples, "seconds": seconds,
            "rollouts_per_s": rollouts / seconds, "tokens_per_s": tokens / seconds,
            "turns": turns / max(rollouts, 1), "withheld": sum(r.get("off_policy/withheld", 0) for r in window),
            "discarded": discarded_share(window),
            "staleness": max((r.get("off_policy/max", 0) for r in steps), default=0),
            "in_flight": statistics.fmean(in_flight) if in_flight else None}


def main() -> None:
    args = parse_args()
    flags = side_flags(args)
    if args.dry_run:
        root = args.out or Path(tempfile.gettempdir()) / "rl-continuous-XXXX"
        for side in args.sides:
            print(f"{side}: PYTHONPATH={shlex.quote(str(FIXTURES))} "
                  f"{shlex.join(rl_command(args.model, root / f'{side}-0', args, *flags[side]))}")
        return
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-continuous-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {side: [] for side in args.sides}
    for round_ in range(args.rounds):
        for side in args.sides if round_ % 2 == 0 else args.sides[::-1]:
            result = measure(run(args.model, root / f"{side}-{round_}", args, *flags[side]))
            results[side].append(result)
            in_flight = f", {result['in_flight']:.1f} rollouts in flight" if result["in_flight"] is not None else ""
            print(f"round {round_ + 1} {side}: {result['samples_per_s']:.2f} trained samples/s ({result['samples']} "
                  f"samples of steps 1..{args.steps - 1} in {result['seconds']:.1f} s; {result['rollouts_per_s']:.2f} "
                  f"rollouts/s, {result['tokens_per_s']:.0f} sampled tokens/s; {result['turns']:.2f} turns per trained "
                  f"rollout, {result['withheld']} rollouts withheld as too old, {result['discarded']:.1%} of sampled "
                  f"tokens not trained), staleness max {result['staleness']}"
                  f"{in_flight}", flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    median = {side: statistics.median(r["samples_per_s"] for r in runs) for side, runs in results.items()}
    for side, rate in median.items():
        print(f"{side}: median {rate:.2f} trained samples/s over {args.rounds} round(s)")
    if set(results) != set(SIDES):
        print(f"only {', '.join(results)} run: no ratio; runs in {root}")
        return
    staleness = max(r["staleness"] for r in results["continuous"])
    tools = f", environment answers {args.reply_ms:g} ms" if args.reply_ms else ""
    print(f"continuous {median['continuous'] / median['step']:.2f}x trained samples/s of step-synchronous on a "
          f"long-tailed env (max_off_policy_steps {args.max_off_policy_steps}, staleness max {staleness}{tools})")


if __name__ == "__main__":
    main()
