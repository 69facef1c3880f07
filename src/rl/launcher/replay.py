"""`rl replay <run-dir>`: train a run again from the batches it trained on, and say whether every step's weights
come out bitwise as the run's servers proved them (issue 90). An asynchronous run cannot be sampled again alike
(which request ends first is timing), but its trainer's input is on disk: `rollouts/step_k/` holds each step's batch
as trained, per rank, with the policy version of every token. The replay runs the run's own trainer config (its
`configs/trainer.toml`) with as many ranks as the batches have files, into a directory of its own, from step 0 or
from one of the run's checkpoints; then each step it published is checksummed as a server proves a step
(`weights_checksum`) and compared with the checksums the run's orchestrator recorded (`served_checksums`, by
`policy_step`) and with those of the run's own weight files it still keeps (`trainer.keep_weights`). The first step
that differs is where to look: its batch and samples are in the run directory.

The run must have kept its batches: `--trainer.keep-rollouts` at least its step count (the default keeps 2)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import tomli_w

from rl.launcher.devices import ONE_NODE, trainer_launcher
from rl.protocol import RunPaths, is_stable, read_metrics

USAGE = "rl replay <run-dir> --output-dir DIR [--from-step K]"
KEPT = 1_000_000  # what the replay keeps of its own batches and weights: everything


class ReplayError(Exception):
    """The run cannot be replayed as asked (what is missing is said)."""


def plan(run: RunPaths, out: RunPaths, from_step: int) -> tuple[dict, int, int]:
    """The replay's trainer config, its first and last step; ReplayError naming what is missing."""
    config_file = run.configs / "trainer.toml"
    if not config_file.is_file():
        raise ReplayError(f"{config_file} does not exist: {run.root} is not an rl run directory")
    config = tomllib.loads(config_file.read_text())
    max_steps = trained_steps(run) or config["max_steps"]
    missing = [k for k in range(from_step, max_steps) if not is_stable(run.rollouts(k))]
    if missing:
        raise ReplayError(f"{run.root} lacks the batches of steps {missing[:10]}{' ...' if len(missing) > 10 else ''} "
                          "(pruned once trained: run with --trainer.keep-rollouts at least its step count)")
    if from_step and not is_stable(run.checkpoint(from_step) / "trainer"):
        raise ReplayError(f"{run.root} has no complete trainer checkpoint of step {from_step} "
                          f"(complete: {run.complete_checkpoints()})")
    if out.root.exists() and any(out.root.iterdir()):
        raise ReplayError(f"{out.root} is not empty: replay into a new directory")
    config |= {"output_dir": str(out.root), "max_steps": max_steps, "keep_rollouts": KEPT, "keep_weights": KEPT,
               "publish_in_background": False, "transfer": {}}  # files: no server takes the steps
    config["wandb"] = {k: v for k, v in config.get("wandb", {}).items() if k != "project"}  # no project: no W&B
    config.pop("resume_step", None)
    if from_step:
        config["resume_step"] = from_step
    return config, from_step, max_steps


def trained_steps(run: RunPaths) -> int:
    return 1 + max((r["step"] for r in read_metrics(run) if r.get("process") == "trainer"), default=-1)


def link_inputs(run: RunPaths, out: RunPaths, first: int, last: int) -> int:
    """The run's batches of steps first..last-1 (and the checkpoint resumed from) in the replay's directory, as hard
    links (nothing copied); the number of ranks the batches were written for."""
    for k in range(first, last):
        shutil.copytree(run.rollouts(k), out.rollouts(k), copy_function=_link)
    if first:
        shutil.copytree(run.checkpoint(first), out.checkpoint(first), copy_function=_link)
    return len(list(run.rollouts(first).glob("rank_*.safetensors")))


def _link(src: str, dst: str) -> None:
    try:
        Path(dst).hardlink_to(src)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def train(out: RunPaths, config: dict, ranks: int) -> int:
    out.configs.mkdir(parents=True, exist_ok=True)
    (out.configs / "trainer.toml").write_text(tomli_w.dumps(config))
    out.logs.mkdir(parents=True, exist_ok=True)
    import torch

    cmd = [*trainer_launcher(ranks, torch.cuda.is_available()), *ONE_NODE,
           "-m", "rl.trainer.main", "@", str(out.configs / "trainer.toml")]
    with open(out.logs / "trainer.log", "wb") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def compare(run: RunPaths, out: RunPaths, first: int, last: int, dtype: str) -> tuple[list[str], int, int | None]:
    """One line per replayed step the run has a checksum of, how many were compared, the first that differs."""
    import torch

    from rl.inference.fingerprint import checkpoint_fingerprint

    recorded: dict[int, set[str]] = {}
    for r in read_metrics(run):
        if r.get("process") == "orchestrator" and r.get("served_checksums") and "policy_step" in r:
            recorded.setdefault(r["policy_step"], set()).update(c for c in r["served_checksums"] if c)
    def checksum(directory: Path) -> str:
        return checkpoint_fingerprint(directory, getattr(torch, dtype), tied=True)[1]

    for k in range(first + 1, last + 1):  # the run's own files of a step, where it still keeps them
        if is_stable(run.weights(k)):
            recorded.setdefault(k, set()).add(checksum(run.weights(k)))
    lines, compared, first_diff = [], 0, None
    for k in range(first + 1, last + 1):
        if k not in recorded or not is_stable(out.weights(k)):
            continue
        checksum_k = checksum(out.weights(k))
        same = checksum_k in recorded[k]
        compared += 1
        if not same and first_diff is None:
            first_diff = k
        lines.append(f"step {k}: {'same' if same else 'DIFFERS'} ({checksum_k}; the run's: "
                     f"{', '.join(sorted(recorded[k]))})")
    return lines, compared, first_diff


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="rl replay", usage=USAGE, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--output-dir", type=Path, required=True, help="a new directory for the replay")
    parser.add_argument("--from-step", type=int, default=0, help="start from the run's checkpoint of this step")
    args = parser.parse_args(argv)
    run, out = RunPaths(args.run_dir.absolute()), RunPaths(args.output_dir.absolute())
    try:
        config, first, last = plan(run, out, args.from_step)
    except (ReplayError, OSError, tomllib.TOMLDecodeError, KeyError) as e:
        print(f"rl replay: error: {e}", file=sys.stderr)
        sys.exit(2)
    ranks = link_inputs(run, out, first, last)
    start = time.perf_counter()
    print(f"rl replay: steps {first}..{last - 1} of {run.root} on {ranks} rank(s) into {out.root}", flush=True)
    if (code := train(out, config, ranks)) != 0:
        print(f"rl replay: the trainer failed (exit {code}); its log: {out.logs / 'trainer.log'}", file=sys.stderr)
        sys.exit(1)
    lines, compared, first_diff = compare(run, out, first, last, config.get("publish_dtype", "float32"))
    print(*lines, sep="\n")
    verdict = ("every one bitwise the same" if first_diff is None else f"the first that differs: step {first_diff}")
    print(f"rl replay: {last - first} steps in {time.perf_counter() - start:.0f} s; {compared} compared with the run's "
          f"checksums: {verdict}")
    if first_diff is not None or not compared:
        sys.exit(1)
