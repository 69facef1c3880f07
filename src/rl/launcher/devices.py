"""Split the visible GPUs between the trainer and the inference replicas."""

from __future__ import annotations

from dataclasses import dataclass

from rl.config import ConfigError


@dataclass(frozen=True)
class DevicePlan:
    trainer_processes: int  # torchrun processes (one per GPU on a GPU host)
    trainer_gpus: list[int]  # GPU ids for the trainer ([] on a CPU host)
    inference_gpus: list[list[int]]  # GPU ids per inference replica ([] each on a CPU host)

    @property
    def replicas(self) -> int:
        return len(self.inference_gpus)


def check_gpu_ids(ids: list[int], name: str, available: int) -> None:
    bad = [i for i in ids if not 0 <= i < available]
    if bad:
        raise ConfigError(f"{name} {bad} do not exist: {available} GPUs are visible (ids 0..{available - 1})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{name} {ids} lists a GPU twice")


def split_gpus(
    available: int,
    trainer_gpus: int | None = None,
    inference_gpus: int | None = None,
    trainer_gpu_ids: list[int] | None = None,
    inference_gpu_ids: list[int] | None = None,
    tensor_parallel_size: int = 1,
) -> DevicePlan:
    """Give inference its GPUs first (consecutive from 0 unless ids are given), the trainer the next ones.

    One inference replica per `tensor_parallel_size` GPUs."""
    if inference_gpu_ids is None:
        count = inference_gpus if inference_gpus is not None else max(available - (trainer_gpus or 0), 0) // 2
        inference_gpu_ids = list(range(count))
    if trainer_gpu_ids is None:
        count = trainer_gpus if trainer_gpus is not None else available - len(inference_gpu_ids)
        start = max(inference_gpu_ids, default=-1) + 1
        trainer_gpu_ids = list(range(start, start + count))
    if len(inference_gpu_ids) + len(trainer_gpu_ids) > available:
        raise ConfigError(
            f"asked for {len(trainer_gpu_ids)} trainer + {len(inference_gpu_ids)} inference GPUs "
            f"but only {available} are visible"
        )
    check_gpu_ids(trainer_gpu_ids, "--trainer-gpu-ids", available)
    check_gpu_ids(inference_gpu_ids, "--inference-gpu-ids", available)
    if set(trainer_gpu_ids) & set(inference_gpu_ids):
        raise ConfigError(f"trainer GPUs {trainer_gpu_ids} and inference GPUs {inference_gpu_ids} overlap")
    if not trainer_gpu_ids or not inference_gpu_ids:
        raise ConfigError("both the trainer and inference need at least one GPU (--trainer-gpus, --inference-gpus)")
    if len(inference_gpu_ids) % tensor_parallel_size:
        raise ConfigError(
            f"{len(inference_gpu_ids)} inference GPUs do not split into replicas of "
            f"inference.tensor_parallel_size={tensor_parallel_size}"
        )
    tp = tensor_parallel_size
    replicas = [inference_gpu_ids[i : i + tp] for i in range(0, len(inference_gpu_ids), tp)]
    return DevicePlan(len(trainer_gpu_ids), trainer_gpu_ids, replicas)


def one_role_gpus(
    available: int,
    trainer_here: bool,
    inference_here: bool,
    trainer_gpus: int | None = None,
    inference_gpus: int | None = None,
    trainer_gpu_ids: list[int] | None = None,
    inference_gpu_ids: list[int] | None = None,
) -> DevicePlan:
    """A host running the trainer or inference, not both: that one gets every visible GPU (or the ids given).
    A host without the trainer still needs the trainer's per-node size (`trainer_gpus`) to split batches by rank."""
    if inference_here:
        ids = inference_gpu_ids or list(range(inference_gpus or available))
        check_gpu_ids(ids, "--inference-gpu-ids", available)
        return DevicePlan(trainer_gpus or 1, [], [[i] for i in ids])
    if trainer_here:
        ids = trainer_gpu_ids or list(range(trainer_gpus or available))
        check_gpu_ids(ids, "--trainer-gpu-ids", available)
        return DevicePlan(len(ids), ids, [])
    return DevicePlan(trainer_gpus or 1, [], [])


def cpu_plan(trainer_processes: int, inference_replicas: int) -> DevicePlan:
    return DevicePlan(trainer_processes, [], [[] for _ in range(inference_replicas)])
