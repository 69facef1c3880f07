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
from typing import TYPE_CHECKING, Callable

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

if TYPE_CHECKING:  # torch is imported where a batch is encoded or decoded: the launcher needs none
    import torch

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


@dataclass
class Sample:
    """One rollout as the trainer sees it: prompt and completion tokens in one sequence."""

    input_ids: list[int]
    loss_mask: list[int]  # 1 where the policy sampled the token (it is trained on)
    logprobs: list[float]  # inference logprob of each token (0 where loss_mask is 0)
    advantage: float
    reward: float
    policy_version: int
    teacher_logprobs: list[float] | None = None  # a teacher's logprob of each token (on-policy distillation)
    # and, per token, its k likeliest tokens given the ones before (teacher.top_k > 0): ids and logprobs, [T][k]
    teacher_top_ids: list[list[int]] | None = None
    teacher_top_logprobs: list[list[float]] | None = None
    token_versions: list[int] | None = None  # the policy version behind each token (its sampler's, where sampled)
    # MoE: the experts inference routed each token to, [T, layers, top_k] int16 (-1: not recorded); router replay
    routed_experts: torch.Tensor | None = None

    def __post_init__(self):
        if not len(self.input_ids) == len(self.loss_mask) == len(self.logprobs):
            raise ValueError("input_ids, loss_mask and logprobs must have the same length")
        if self.token_versions is not None and len(self.token_versions) != len(self.input_ids):
            raise ValueError("token_versions must have one entry per token")
        if self.routed_experts is not None and (self.routed_experts.ndim != 3
                                                or len(self.routed_experts) != len(self.input_ids)):
            raise ValueError("routed_experts must be [tokens, layers, top_k], one row per token")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != len(self.input_ids):
            raise ValueError("teacher_logprobs must have one entry per token")
        if (self.teacher_top_ids is None) != (self.teacher_top_logprobs is None):
            raise ValueError("teacher_top_ids and teacher_top_logprobs come together")
        if self.teacher_top_ids is not None:
            rows = [*self.teacher_top_ids, *self.teacher_top_logprobs]
            if not len(self.teacher_top_ids) == len(self.teacher_top_logprobs) == len(self.input_ids):
                raise ValueError("teacher_top_ids and teacher_top_logprobs must have one row per token")
            if not rows[0] or any(len(row) != len(rows[0]) for row in rows):
                raise ValueError("teacher_top_ids and teacher_top_logprobs rows must all hold the same k > 0 entries")


def encode_samples(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Flatten samples into tensors: tokens concatenated, per-sample values in parallel arrays; `teacher_logprobs`
    only where every sample has them, `token_policy_versions` only where every sample has its `token_versions`."""
    import torch

    scored = [s.teacher_logprobs is not None for s in samples]
    if any(scored) and not all(scored):
        raise ValueError(f"{scored.count(False)} of {len(samples)} samples lack the teacher logprobs the others have")
    teacher = {"teacher_logprobs": torch.tensor([lp for s in samples for lp in s.teacher_logprobs],
                                                dtype=torch.float32)} if samples and all(scored) else {}
    ranked = [s.teacher_top_ids is not None for s in samples]
    if any(ranked) and not all(ranked):
        raise ValueError(f"{ranked.count(False)} of {len(samples)} samples lack the teacher's top-k the others have")
    if samples and all(s.token_versions is not None for s in samples):
        teacher["token_policy_versions"] = torch.tensor([v for s in samples for v in s.token_versions],
                                                        dtype=torch.int64)  # [T]
    routed = [s.routed_experts is not None for s in samples]
    if any(routed) and not all(routed):
        raise ValueError(f"{routed.count(False)} of {len(samples)} samples lack the routed experts the others have")
    if samples and all(routed):
        teacher["routed_experts"] = torch.cat([s.routed_experts.to(torch.int16) for s in samples])  # [T, L, k]
    if samples and all(ranked):
        teacher |= {  # [T, k]
            "teacher_top_ids": torch.tensor([row for s in samples for row in s.teacher_top_ids], dtype=torch.int64),
            "teacher_top_logprobs": torch.tensor([row for s in samples for row in s.teacher_top_logprobs],
                                                 dtype=torch.float32),
        }
    return teacher | {
        "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int64),  # [T]
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.bool),  # [T]
        "logprobs": torch.tensor([lp for s in samples for lp in s.logprobs], dtype=torch.float32),  # [T]
        "lengths": torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64),  # [N]
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),  # [N]
        "rewards": torch.tensor([s.reward for s in samples], dtype=torch.float32),  # [N]
        "policy_versions": torch.tensor([s.policy_version for s in samples], dtype=torch.int64),  # [N]
    }


BATCH_FIELDS = {  # name -> (torch dtype, counted per token or per sample, dimensions)
    "input_ids": ("int64", "token", 1),
    "loss_mask": ("bool", "token", 1),
    "logprobs": ("float32", "token", 1),
    "lengths": ("int64", "sample", 1),
    "advantages": ("float32", "sample", 1),
    "rewards": ("float32", "sample", 1),
    "policy_versions": ("int64", "sample", 1),
}
OPTIONAL_FIELDS = {  # on-policy distillation: [T], and [T, k] with teacher.top_k
    "teacher_logprobs": ("float32", "token", 1),
    "teacher_top_ids": ("int64", "token", 2),
    "teacher_top_logprobs": ("float32", "token", 2),
    "token_policy_versions": ("int64", "token", 1),  # Sample.token_versions
    "routed_experts": ("int16", "token", 3),  # Sample.routed_experts
}


def check_batch(tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first field that does not fit the batch format."""
    import torch

    fields = BATCH_FIELDS | {name: spec for name, spec in OPTIONAL_FIELDS.items() if name in tensors}
    if ("teacher_top_ids" in tensors) != ("teacher_top_logprobs" in tensors):
        raise ValueError("the batch holds one of teacher_top_ids and teacher_top_logprobs without the other")
    for name, (dtype, _, ndim) in fields.items():
        if name not in tensors:
            raise ValueError(f"the batch lacks {name}")
        tensor = tensors[name]
        if tensor.dtype != getattr(torch, dtype):
            raise ValueError(f"{name} must be {dtype}, not {tensor.dtype}")
        if tensor.ndim != ndim:
            words = ("one", "two", "three")[ndim - 1]
            raise ValueError(f"{name} must be {words}-dimensional, not of shape {list(tensor.shape)}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{name} holds NaN or infinity")
    lengths = tensors["lengths"].tolist()  # Python integers: a sum of int64 lengths could overflow
    if any(n <= 0 for n in lengths):
        raise ValueError(f"lengths must be positive: {lengths[:10]}")
    counts = {"token": sum(lengths), "sample": len(lengths)}
    for name, (_, per, _) in fields.items():
        if tensors[name].shape[0] != counts[per]:
            raise ValueError(f"{name} has {tensors[name].shape[0]} entries for {counts[per]} {per}s")
    if "teacher_top_ids" in tensors:
        ids, logprobs = tensors["teacher_top_ids"], tensors["teacher_top_logprobs"]
        if ids.shape != logprobs.shape or not ids.shape[1]:
            raise ValueError(f"teacher_top_ids {list(tensors['teacher_top_ids'].shape)} and teacher_top_logprobs "
                             f"{list(tensors['teacher_top_logprobs'].shape)} must both be [tokens, k], k > 0")


def decode_samples(tensors: dict[str, torch.Tensor]) -> list[Sample]:
    check_batch(tensors)
    lengths = tensors["lengths"].tolist()
    ids, mask, lps = (tensors[k].split(lengths) for k in ("input_ids", "loss_mask", "logprobs"))
    teacher, top_ids, top_logprobs, versions, routed = (
        tensors[k].split(lengths) if k in tensors else [None] * len(lengths)
        for k in ("teacher_logprobs", "teacher_top_ids", "teacher_top_logprobs", "token_policy_versions",
                  "routed_experts"))
    return [
        Sample(i.tolist(), m.int().tolist(), lp.tolist(), a, r, v,
               *(None if x is None else x.tolist() for x in (t, ti, tl, tv)), re)
        for i, m, lp, a, r, v, t, ti, tl, tv, re in zip(
            ids,
            mask,
            lps,
            tensors["advantages"].tolist(),
            tensors["rewards"].tolist(),
            tensors["policy_versions"].tolist(),
            teacher,
            top_ids,
            top_logprobs,
            versions,
            routed,
            strict=True,
        )
    ]


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
