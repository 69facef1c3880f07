"""Resuming a run: pick the checkpoint, and discard what was produced after it so nothing stale is read
and every step appears once in metrics.jsonl."""

from __future__ import annotations

import json
import shutil

from rl.config import ConfigError
from rl.protocol import STABLE, CorruptFileError, RunPaths, atomic_write_text, stable_steps, verify_stable


def choose_checkpoint(paths: RunPaths, requested: int | None) -> int:
    """The requested checkpoint, or the newest one whose files verify; a damaged one is never resumed from."""
    available = paths.complete_checkpoints()
    if not available:
        raise ConfigError(f"cannot resume: {paths.checkpoints_root} holds no complete checkpoint")
    if requested is not None and requested not in available:
        raise ConfigError(f"cannot resume from step {requested}: complete checkpoints are {available}")
    damaged = []
    for step in [requested] if requested is not None else reversed(available):
        problem = checkpoint_problem(paths, step)
        if problem is None:
            if damaged:
                print(f"rl: skipped damaged checkpoints: {'; '.join(damaged)}")
            return step
        damaged.append(problem)
    raise ConfigError(f"cannot resume: every checkpoint is damaged: {'; '.join(damaged)}")


def checkpoint_problem(paths: RunPaths, step: int) -> str | None:
    """Why checkpoint `step` cannot be resumed from (a file missing, truncated or changed), or None."""
    try:
        for part in ("trainer", "orchestrator"):
            verify_stable(paths.checkpoint(step) / part)
    except CorruptFileError as e:
        return f"step {step}: {e}"
    return None


def discard_after(paths: RunPaths, step: int) -> list[str]:
    """Delete rollouts of steps >= step, weights and transfer offers of steps > step, and metrics records of steps
    >= step."""
    removed = []
    for s in stable_steps(paths.rollouts_root) + _unstable(paths.rollouts_root):
        if s >= step:
            shutil.rmtree(paths.rollouts(s), ignore_errors=True)
            removed.append(f"rollouts/step_{s}")
    for s in stable_steps(paths.weights_root) + _unstable(paths.weights_root):
        if s > step:
            shutil.rmtree(paths.weights(s), ignore_errors=True)
            removed.append(f"weights/step_{s}")
    for tmp in paths.partial_step_dirs():
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(f"{tmp.parent.name}/{tmp.name}")
    from rl.weights.offers import clear_transfers, offered_steps  # here: it imports torch, which the launcher needs not

    if offers := [s for s in offered_steps(paths.root) if s > step]:  # they name the dead trainer's store
        clear_transfers(paths.root, step + 1)
        removed.append(f"transfer offers of steps {offers}")
    if paths.metrics.exists():
        lines = paths.metrics.read_text().splitlines()
        kept = [line for line in lines if line.strip() and _step_of(line) < step]
        atomic_write_text(paths.metrics, "".join(f"{line}\n" for line in kept))
        if len(kept) != len(lines):
            removed.append(f"{len(lines) - len(kept)} metrics records")
    return removed


def _unstable(root) -> list[int]:
    """step_k directories without a STABLE marker (half written when the run died)."""
    if not root.is_dir():
        return []
    return [int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and not (p / STABLE).exists()]


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line from a crash: drop it
