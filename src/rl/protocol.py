"""The on-disk protocol between the processes: run-directory paths, atomic writes, STABLE markers and the
rollout batch format. The orchestrator, trainer and inference import this; none builds a path itself.

A directory counts only once its STABLE marker exists; every file is written under a temporary name and
renamed, so readers never see half a file. The marker is the directory's exact manifest (rl/manifest.py):
a reader refuses a file that was truncated or changed after it was published, and a directory holding
anything unlisted. Batches are safetensors (no pickle crosses processes).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError

from rl.atomic import atomic_write_text, temp_path  # noqa: F401 - re-exported: writers import them from here
from rl.listed_files import read_listed, verify_stable  # noqa: F401 - re-exported with the marker API
from rl.metrics_file import append_metrics, read_metrics  # noqa: F401 - re-exported: tests and benchmarks read them here
from rl.manifest import (  # noqa: F401 - the marker API, re-exported: readers and writers import it from here
    STABLE,
    CorruptFileError,
    Entry,
    file_crc32,
    is_temp,
    mark_stable,
    read_manifest,
    recorded_files,
    stable_info,
)
from rl.samples import Sample, decode_samples, encode_samples

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class RunPaths:
    """Every path of a run directory."""

    root: Path

    def make_private(self) -> None:
        """Create the run directory readable by its user only (0700), or make an existing one of theirs so: what rl
        and the libraries it runs write in it (configs, logs, weights, W&B's files, env servers' sockets) is then out
        of other users' reach, whatever mode each file has. One owned by another user (a shared volume) is left be."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = self.root.stat()
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o077:
            os.chmod(self.root, stat.S_IMODE(info.st_mode) & 0o700)

    @property
    def configs(self) -> Path:
        return self.root / "configs"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def rollouts_root(self) -> Path:
        return self.root / "rollouts"

    @property
    def weights_root(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints_root(self) -> Path:
        return self.root / "checkpoints"

    @property
    def hosts(self) -> Path:
        return self.root / "hosts"  # each launcher's heartbeat file (launcher/hosts.py)

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"  # the sbatch script, its config and the job's log

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def reward_plot(self) -> Path:
        return self.root / "reward.png"

    def wandb_run_id(self, process: str) -> Path:
        return self.root / "wandb" / f"{process}.run_id"

    def partial_weights(self, step: int) -> Path:
        """Where the trainer's ranks write step `step` before it is renamed to weights/step_k."""
        return self.weights_root / f".step_{step}.tmp"

    def partial_step_dirs(self) -> list[Path]:
        """Step directories of weights and rollouts that were still being written (temporary names)."""
        roots = [r for r in (self.rollouts_root, self.weights_root) if r.is_dir()]
        return [p for root in roots for p in sorted(root.glob(".step_*.tmp*"))]

    def rollouts(self, step: int) -> Path:
        return self.rollouts_root / f"step_{step}"

    def samples(self, step: int) -> Path:
        """A few of the step's rollouts as text (orchestrator/samples_text.py)."""
        return self.root / "samples" / f"step_{step}.jsonl"

    def rollout_file(self, step: int, rank: int) -> Path:
        return self.rollouts(step) / f"rank_{rank}.safetensors"

    def weights(self, step: int) -> Path:
        return self.weights_root / f"step_{step}"

    @property
    def transfer(self) -> Path:
        return self.root / "transfer"  # offers and takes of steps that go over the wire (rl/weights/offers.py)

    def offer(self, step: int) -> Path:
        return self.transfer / f"offer_{step}.json"

    def take(self, step: int) -> Path:
        return self.transfer / f"take_{step}.json"

    def sent(self, step: int) -> Path:
        return self.transfer / f"sent_{step}.json"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints_root / f"step_{step}"

    def checkpoint_steps(self, part: str, complete: bool = False) -> list[int]:
        """Steps holding checkpoints/step_k/<part> (only STABLE ones if `complete`), ascending."""
        if not self.checkpoints_root.is_dir():
            return []
        steps = []
        for directory in self.checkpoints_root.glob("step_*"):
            if (directory / part).is_dir() and directory.name[5:].isdigit():
                if not complete or (directory / part / STABLE).is_file():
                    steps.append(int(directory.name[5:]))
        return sorted(steps)

    def complete_checkpoints(self) -> list[int]:
        """Steps whose trainer and orchestrator parts are both complete (a resume needs both), ascending."""
        trainer = self.checkpoint_steps("trainer", complete=True)
        return sorted(set(trainer) & set(self.checkpoint_steps("orchestrator", complete=True)))

    def prunable_checkpoint_steps(self, part: str, keep: int) -> list[int]:
        """Steps of `part` older than the `keep` newest complete checkpoints. Each process writes its own
        part, at its own pace: pruning by its own newest parts alone could leave no step with both."""
        complete = self.complete_checkpoints()
        if len(complete) < keep:
            return []
        oldest_kept = complete[-keep]
        return [s for s in self.checkpoint_steps(part) if s < oldest_kept]

    def prune_checkpoint_parts(self, part: str, keep: int) -> None:
        """Delete this process's parts that `prunable_checkpoint_steps` allows, and each step directory
        once the other process's part is gone from it too."""
        for step in self.prunable_checkpoint_steps(part, keep):
            shutil.rmtree(self.checkpoint(step) / part, ignore_errors=True)
            try:
                self.checkpoint(step).rmdir()
            except OSError:
                pass  # the other part is still there; its owner removes the directory


# ---------------------------------------------------------------------------------------------------
# Atomic writes and STABLE markers
# ---------------------------------------------------------------------------------------------------


def publish_dir(tmp_dir: Path, final_dir: Path, written: dict | None = None, **info) -> None:
    """Move a fully written directory into place, then mark it STABLE (recording `info` in the marker; `written`:
    files whose writers took their size and CRC-32, see `mark_stable`)."""
    if final_dir.exists():
        shutil.rmtree(final_dir)
    tmp_dir.replace(final_dir)
    mark_stable(final_dir, written, **info)


def is_stable(directory: Path) -> bool:
    return (directory / STABLE).is_file()


def wait_for_stable(
    directory: Path, timeout_s: float, what: str, poll_s: float = 0.1, check: Callable[[], None] | None = None
) -> None:
    """Block until `directory/STABLE` exists; raise TimeoutError naming `what` after `timeout_s`.

    `check` is called on every poll and may raise to abort the wait (e.g. a peer died)."""
    deadline = time.monotonic() + timeout_s
    while not is_stable(directory):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what} ({directory / STABLE}) and it never appeared")
        time.sleep(poll_s)


def stable_steps(root: Path) -> list[int]:
    """Steps under `root` (step_k directories) that are complete, ascending."""
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_stable(p)]
    return sorted(steps)


# ---------------------------------------------------------------------------------------------------
# Rollout batches: one safetensors file per trainer rank
# ---------------------------------------------------------------------------------------------------


def write_batch(paths: RunPaths, step: int, per_rank: list[list[Sample]], **info) -> Path:
    """Write one file per trainer rank for `step`, atomically, and mark the step STABLE (with `info`)."""
    from safetensors.torch import save_file

    final = paths.rollouts(step)
    tmp = temp_path(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for rank, samples in enumerate(per_rank):
        save_file(encode_samples(samples), str(tmp / f"rank_{rank}.safetensors"), metadata={"step": str(step)})
    publish_dir(tmp, final, **info)
    return final


def read_batch(paths: RunPaths, step: int, rank: int) -> list[Sample]:
    """This rank's samples of `step`, its file read once (checked against the step's manifest as it is read)."""
    from safetensors.torch import load

    path = paths.rollout_file(step, rank)
    try:
        manifest = read_manifest(path.parent)
        if path.name not in manifest:
            raise CorruptFileError(f"{path} is not listed in {path.parent / STABLE}")
        return decode_samples(load(bytes(read_listed(path.parent, path.name, manifest[path.name]))))
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as e:
        raise ValueError(f"rollout batch {path} is missing or corrupt: {e}") from e
