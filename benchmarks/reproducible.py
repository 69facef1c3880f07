"""Every run reproducible (issue 90), on the quickstart: replay, bitwise synchronous runs, and what samples cost.

From the tiny model after the quickstart's SFT (`--model`):

- async: the quickstart's RL run (async level 1, `--steps`), every batch kept, then `rl replay` of it: how many steps'
  checksums were compared and how many equal, and the replay's time against the run's;
- plain: the same run with no samples written (`--orchestrator.samples.picks '[]'`): the trainer's time over steps
  5.. with samples against without;
- sync-a, sync-b: two runs at async level 0 with one sampling seed (`--sync-steps`): the first step whose batch tokens
  or served checksums differ.

The last line reads:

reproducible: replay <same>/<compared> steps bitwise in <t> s (run <T> s); sync runs first differ at step
<k|none of N>; samples <r>x steps/s   (one line)

    uv run --no-sync python benchmarks/reproducible.py --model /tmp/tiny-sft [--steps 60] [--sync-steps 20] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from router_replay import ROOT, quickstart_command
from safetensors.torch import load_file

SIDES = {
    "async": ["--async-level", "1", "--trainer.keep-rollouts", "1000"],
    "plain": ["--async-level", "1", "--orchestrator.samples.picks", "[]"],
    "sync-a": ["--async-level", "0", "--orchestrator.sampling.seed", "7", "--trainer.keep-rollouts", "1000"],
    "sync-b": ["--async-level", "0", "--orchestrator.sampling.seed", "7", "--trainer.keep-rollouts", "1000"],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="the tiny model after the quickstart's SFT")
    parser.add_argument("--steps", type=int, default=60, help="steps of the async runs")
    parser.add_argument("--sync-steps", type=int, default=20, help="steps of each synchronous run")
    parser.add_argument("--out", type=Path, help="runs' directory (default: a new temporary one)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="print each side's command line and run nothing")
    return parser.parse_args()


def rl_command(args, out: Path, side: str) -> list[str]:
    steps = args.sync_steps if side.startswith("sync") else args.steps
    return quickstart_command(args.model, out, steps, *SIDES[side])


def run(command: list[str], log: Path, timeout: float) -> str:
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command[:6])} ... exited {done.returncode}; see {log}")
    return log.read_text()


def records(out: Path, process: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return sorted((r for r in map(json.loads, lines) if r.get("process") == process), key=lambda r: r["step"])


def trainer_seconds(out: Path, first: int = 5) -> float:
    steps = records(out, "trainer")
    return steps[-1]["time"] - steps[first]["time"]


def first_difference(a: Path, b: Path, steps: int) -> int | None:
    served = [{r["step"]: r.get("served_checksums") for r in records(run_dir, "orchestrator")} for run_dir in (a, b)]
    for step in range(steps):
        tokens = [[load_file(str(f))["input_ids"].tolist() for f in sorted((d / "rollouts" / f"step_{step}").glob(
            "rank_*.safetensors"))] for d in (a, b)]
        if tokens[0] != tokens[1] or served[0].get(step) != served[1].get(step):
            return step
    return None


def main() -> None:
    args = parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="rl-reproducible-"))
    if args.dry_run:
        for side in SIDES:
            print(f"{side}: {shlex.join(rl_command(args, root / side, side))}")
        return
    root.mkdir(parents=True, exist_ok=True)
    for side in SIDES:
        print("+", side, flush=True)
        run(rl_command(args, root / side, side), root / f"{side}.log", args.timeout)
    replay = run([sys.executable, "-m", "rl.launcher.main", "replay", str(root / "async"), "--output-dir",
                  str(root / "replay")], root / "replay.log", args.timeout)
    match = re.search(r"(\d+) steps in (\d+) s; (\d+) compared", replay)
    same = replay.count(": same (")
    run_s = json.loads((root / "async" / "summary.json").read_text())["time_s"]
    ratio = trainer_seconds(root / "plain") / trainer_seconds(root / "async")
    differ = first_difference(root / "sync-a", root / "sync-b", args.sync_steps)
    print(f"reproducible: replay {same}/{match.group(3)} steps bitwise in {match.group(2)} s (run {run_s:.0f} s); "
          f"sync runs first differ at step {differ if differ is not None else f'none of {args.sync_steps}'}; "
          f"samples {ratio:.2f}x steps/s")


if __name__ == "__main__":
    main()
