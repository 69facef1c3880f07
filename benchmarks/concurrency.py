"""The adaptive in-flight cap against fixed caps, on a server with a deliberately small KV cache: sampled tokens/s.

The long-tail environment of benchmarks/continuous.py (every 8th task `--long-turns` model turns, the rest one), the
tiny model, continuous dispatch at async level 1, and a server whose KV cache holds `--kv-cache-gib` (about 2,000
tokens at the default: ~16 of vLLM's 128-token CPU blocks, where a long episode's context takes 3-4). Three sides
run the real `rl` launcher, the same steps and batch, their order rotated over `--rounds`:

- low: `max_concurrent` `--low` (the engine decodes few sequences at a time: idle capacity);
- high: `max_concurrent` `--high` (more than the cache holds: vLLM preempts and recomputes);
- high-fcfs: the same, with the servers scheduling first come, first served instead of by the groups' numbers (rl's
  default: the episodes started first are served first and preempted last);
- adaptive: `concurrency.adaptive`, starting at `--start`, between a group and `--high` rollouts.

All sides run with vLLM's statistics on, so every side's preemptions are counted. Per run, from the orchestrator's
records: sampled tokens of the trained batches per second past the warm-up (steps 1..N-1 over the time from step 0's
record to the last one's; trained samples/s beside it), the server's preemptions over those steps, the mean KV
usage at the step records and the mean in-flight cap; and what was trained: turns per rollout (long episodes
starved by an overloaded server show as ~1), the rollouts withheld as older than `max_off_policy_steps` and the share
of sampled tokens not trained. The last line reads (ratios of medians over rounds; p: the adaptive side's
preemptions per run, q: the high side's):

adaptive <A>x tokens/s of the best fixed cap, <B>x of the worst, preemptions <p> vs <q>; turns per trained rollout:
high <t> (first come first served <u>), low <v>

    uv run --no-sync python benchmarks/concurrency.py --model /tmp/tiny [--rounds 2] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
from pathlib import Path

from continuous import FIXTURES, add_run_arguments, discarded_share, past_warm_up, rl_command, run

SIDES = ("low", "high", "high-fcfs", "adaptive")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, steps=12, max_tokens=24, seq_len=512, long_turns=8)
    parser.add_argument("--kv-cache-gib", type=float, default=0.004, help="the server's KV cache")
    parser.add_argument("--low", type=int, default=4, help="the low fixed cap, rollouts")
    parser.add_argument("--high", type=int, default=128, help="the high fixed cap, and the adaptive ceiling")
    parser.add_argument("--start", type=int, default=32, help="the adaptive cap's start")
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between the controller's readings")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"sides to run, comma-separated ({','.join(SIDES)})")
    args = parser.parse_args()
    args.sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if not args.sides or set(args.sides) - set(SIDES):
        parser.error(f"--sides {','.join(args.sides)}: choose from {','.join(SIDES)}")
    return args


def side_flags(args) -> dict[str, list[str]]:
    """Each side's flags beside the run's."""
    return {"low": ["--orchestrator.max-concurrent", str(args.low)],
            "high": ["--orchestrator.max-concurrent", str(args.high)],
            "high-fcfs": ["--orchestrator.max-concurrent", str(args.high),
                          "--inference.extra-args", '["--scheduling-policy", "fcfs"]'],
            "adaptive": ["--orchestrator.max-concurrent", str(args.start),
                         "--orchestrator.concurrency.adaptive", "true",
                         "--orchestrator.concurrency.max-rollouts", str(args.high),
                         "--orchestrator.concurrency.interval-s", str(args.interval_s)]}


def run_flags(args) -> list[str]:
    """Every side's: continuous dispatch, the small cache, vLLM's statistics on."""
    return ["--orchestrator.dispatch", "continuous", "--inference.kv-cache-gib", str(args.kv_cache_gib),
            "--inference.log-stats", "true"]


def measure(steps: list[dict]) -> dict:
    """Sampled tokens/s of the trained batches past the warm-up, the preemptions over those steps, the mean cap."""
    window, seconds = past_warm_up(steps)
    caps = [r["concurrency/cap"] for r in window if "concurrency/cap" in r]
    kv = [r["engine/kv_cache_usage"] for r in window if "engine/kv_cache_usage" in r]
    return {"tokens_per_s": sum(r["completion_tokens"] for r in window) / seconds, "seconds": seconds,
            "samples_per_s": sum(r["samples"] for r in window) / seconds,
            "turns": statistics.fmean(r.get("num_turns", 0) for r in window),
            "withheld": sum(r.get("off_policy/withheld", 0) for r in steps),
            "discarded": discarded_share(window),
            "preemptions": sum(r.get("engine/preemptions", 0) for r in window),
            "cap": statistics.fmean(caps) if caps else None, "kv": statistics.fmean(kv) if kv else None,
            "shed": sum(r.get("concurrency/shed", 0) for r in window)}


def summary(results: dict[str, list[dict]]) -> str:
    """The last line, from each side's runs."""
    median = {side: statistics.median(r["tokens_per_s"] for r in runs) for side, runs in results.items()}
    preempted = {side: statistics.median(r["preemptions"] for r in runs) for side, runs in results.items()}
    fixed = [median["low"], median["high"]]
    turns = {side: statistics.median(r["turns"] for r in runs) for side, runs in results.items()}
    return (f"adaptive {median['adaptive'] / max(fixed):.2f}x tokens/s of the best fixed cap, "
            f"{median['adaptive'] / min(fixed):.2f}x of the worst, preemptions {preempted['adaptive']:g} vs "
            f"{preempted['high']:g}; turns per trained rollout: high {turns['high']:.2f} (first come first served "
            f"{turns['high-fcfs']:.2f}), low {turns['low']:.2f}")


def main() -> None:
    args = parse_args()
    flags = side_flags(args)
    if args.dry_run:
        root = args.out or Path(tempfile.gettempdir()) / "rl-concurrency-XXXX"
        for side in args.sides:
            command = rl_command(args.model, root / f"{side}-0", args, *run_flags(args), *flags[side])
            print(f"{side}: PYTHONPATH={shlex.quote(str(FIXTURES))} {shlex.join(command)}")
        return
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-concurrency-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {side: [] for side in args.sides}
    for round_ in range(args.rounds):
        turn = round_ % len(args.sides)
        for side in args.sides[turn:] + args.sides[:turn]:  # each side first in turn
            result = measure(run(args.model, root / f"{side}-{round_}", args, *run_flags(args), *flags[side]))
            results[side].append(result)
            cap = f", mean cap {result['cap']:.0f}, {result['shed']} shed" if result["cap"] is not None else ""
            kv = f", mean KV usage {result['kv']:.2f}" if result["kv"] is not None else ""
            print(f"round {round_ + 1} {side}: {result['tokens_per_s']:.0f} sampled tokens/s over "
                  f"{result['seconds']:.1f} s ({result['samples_per_s']:.2f} trained samples/s, "
                  f"{result['turns']:.2f} turns per rollout, {result['withheld']} rollouts withheld as too old, "
                  f"{result['discarded']:.1%} of sampled tokens not trained), "
                  f"{result['preemptions']:g} preemptions{kv}{cap}", flush=True)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(summary(results) if set(results) == set(SIDES) else f"only {', '.join(results)} run: no ratio; in {root}")


if __name__ == "__main__":
    main()
