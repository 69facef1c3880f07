"""Split the visible GPUs between the trainer and the inference replicas (each inference.tensor_parallel_size
consecutive GPUs), name them for the children, and tell a GPU host from a CPU one without torch's help."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from rl.config import ConfigError

NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")  # one directory per GPU the NVIDIA driver sees
NVIDIA_SMI = ("nvidia-smi", "-L")  # one line per GPU
NVIDIA_SMI_TIMEOUT_S = 10.0
INSTALL_GPU_STACK = "RL_STACK=gpu bash scripts/install.sh"  # runs `uv sync --extra gpu`


@dataclass(frozen=True)
class DevicePlan:
    trainer_processes: int  # torchrun processes (one per GPU on a GPU host)
    trainer_gpus: list[int]  # GPU ids for the trainer ([] on a CPU host)
    inference_gpus: list[list[int]]  # GPU ids per inference replica, its TP group ([] each on a CPU host)
    teacher_gpus: tuple[int, ...] = ()  # GPU ids of the teacher's server rl starts (on-policy distillation)

    @property
    def replicas(self) -> int:
        return len(self.inference_gpus)

    @property
    def device(self) -> str:
        """"cuda" where this host runs anything on GPUs, else "cpu" (what the device defaults follow)."""
        return "cuda" if self.trainer_gpus or any(self.inference_gpus) else "cpu"


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
    """Give inference its GPUs first (consecutive from 0 unless ids are given), the trainer the next ones. One side
    given takes what it asks for and the other side the rest; neither given: half each."""
    if inference_gpu_ids is None:
        if inference_gpus is not None:
            inference_gpu_ids = list(range(inference_gpus))
        elif trainer_gpu_ids is not None:
            inference_gpu_ids = [i for i in range(available) if i not in trainer_gpu_ids]
        else:
            inference_gpu_ids = list(range(available - trainer_gpus if trainer_gpus is not None else available // 2))
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
    return DevicePlan(len(trainer_gpu_ids), trainer_gpu_ids, replicas_of(inference_gpu_ids, tensor_parallel_size))


INFERENCE_GPU_FLAGS = "--inference-gpus, --inference-gpu-ids"


def replicas_of(ids: list[int], tensor_parallel_size: int = 1, set_by: str = INFERENCE_GPU_FLAGS) -> list[list[int]]:
    """One inference replica per `tensor_parallel_size` consecutive ids of one host (a TP group never spans
    hosts). `set_by`: what gave the ids, named by the error."""
    n = tensor_parallel_size
    if len(ids) % n:
        raise ConfigError(f"{len(ids)} inference GPUs {ids} do not divide into servers of "
                          f"inference.tensor_parallel_size = {n} GPUs each: give inference a multiple of {n} GPUs "
                          f"({set_by}) or change inference.tensor_parallel_size")
    return [ids[k:k + n] for k in range(0, len(ids), n)]


def one_role_gpus(
    available: int,
    trainer_here: bool,
    inference_here: bool,
    trainer_gpus: int | None = None,
    inference_gpus: int | None = None,
    trainer_gpu_ids: list[int] | None = None,
    inference_gpu_ids: list[int] | None = None,
    tensor_parallel_size: int = 1,
) -> DevicePlan:
    """A host running the trainer or inference, not both: that one gets every visible GPU (or the ids given).
    A host without the trainer still needs the trainer's per-node size (`trainer_gpus`) to split batches by rank."""
    if inference_here:
        ids = inference_gpu_ids or list(range(inference_gpus or available))
        check_gpu_ids(ids, "--inference-gpu-ids", available)
        return DevicePlan(trainer_gpus or 1, [], replicas_of(ids, tensor_parallel_size))
    if trainer_here:
        ids = trainer_gpu_ids or list(range(trainer_gpus or available))
        check_gpu_ids(ids, "--trainer-gpu-ids", available)
        return DevicePlan(len(ids), ids, [])
    return DevicePlan(trainer_gpus or 1, [], [])


def with_teacher(available: int, teacher_gpus: int, split) -> DevicePlan:
    """The last `teacher_gpus` visible GPUs for the teacher's server, `split(rest)` planning the others."""
    rest = available - teacher_gpus
    if rest < 2:
        raise ConfigError(f"teacher.gpus = {teacher_gpus} of {available} visible GPUs leaves {max(rest, 0)} for the "
                          "trainer and inference, which need one each")
    plan = split(rest)  # the trainer's and inference's ids lie below `rest`, or are refused there
    return replace(plan, teacher_gpus=tuple(range(rest, available)))


def cpu_plan(trainer_processes: int, inference_replicas: int) -> DevicePlan:
    return DevicePlan(trainer_processes, [], [[] for _ in range(inference_replicas)])


def child_visible_devices(indices: list[int], parent: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries of a child given `indices` into the launcher's own visible GPUs: through the
    launcher's CUDA_VISIBLE_DEVICES (`parent`) when it is set, so a job given GPUs 4,5 puts index 0 on GPU 4.
    Entries pass through as written (GPU-/MIG- UUIDs included)."""
    if parent is None:
        return [str(i) for i in indices]
    entries = [e.strip() for e in parent.split(",") if e.strip()]
    beyond = [i for i in indices if i >= len(entries)]
    if beyond:
        raise ConfigError(f"GPU indices {beyond} are beyond this process's CUDA_VISIBLE_DEVICES={parent!r} "
                          f"({len(entries)} GPUs); GPU ids count from 0 within it")
    return [entries[i] for i in indices]


def nvidia_gpus_present(
    proc_gpus: Path = NVIDIA_PROC_GPUS, smi: tuple[str, ...] = NVIDIA_SMI, timeout_s: float = NVIDIA_SMI_TIMEOUT_S
) -> str | None:
    """How this host shows NVIDIA GPUs without torch (the driver's /proc entries, else `nvidia-smi -L`), or
    None where it shows none."""
    if proc_gpus.is_dir() and (count := len(list(proc_gpus.iterdir()))):
        return f"{proc_gpus} lists {count}"
    try:
        listed = subprocess.run(list(smi), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):  # not installed, or a hung driver: no evidence either way
        return None
    lines = [line for line in listed.stdout.splitlines() if line.strip()]
    return f"`{' '.join(smi)}` lists {len(lines)}" if listed.returncode == 0 and lines else None


def torch_build() -> str:
    """The installed torch, e.g. 'torch 2.13.0+cpu (a CPU-only build)'."""
    import torch

    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({f'built for CUDA {cuda}' if cuda else 'a CPU-only build'})"


def cuda_fix() -> str:
    import torch

    if torch.version.cuda is None:
        return f"install the CUDA stack with `{INSTALL_GPU_STACK}` (it runs `uv sync --extra gpu`)"
    return "check that the NVIDIA driver is loaded and new enough for this CUDA (nvidia-smi)"


def cuda_unavailable(evidence: str) -> ConfigError:
    """A host with NVIDIA GPUs whose torch cannot use them: refused, where rl would train on the CPU."""
    return ConfigError(
        f"this host has NVIDIA GPUs ({evidence}) but the installed {torch_build()} cannot use them "
        f"(torch.cuda.is_available() is False): {cuda_fix()}; to run on the CPU on purpose, "
        "export CUDA_VISIBLE_DEVICES=''"
    )


def gpu_flags_without_gpus() -> ConfigError:
    return ConfigError(
        f"no GPU is visible to the installed {torch_build()}, so --trainer-gpus/--inference-gpus/--*-gpu-ids "
        f"cannot be used: on a GPU host, {cuda_fix()}; on a CPU host set --trainer-processes N (gloo ranks) "
        "and --inference-replicas M instead"
    )


ONE_NODE = ["--standalone", "--local-addr=127.0.0.1"]
"""The trainer's ranks on one host meet at 127.0.0.1: torchrun would hand them this host's name, which a container's
runtime may leave unresolvable (the ranks then wait out the rendezvous timeout)."""


def trainer_launcher(processes: int, gpus: bool) -> list[str]:
    """The command that starts the trainer's ranks, before its flags for nodes: torchrun with trainer GPUs; without,
    `rl.trainer.ranks`, which takes torchrun's flags and forks the ranks from one process that imported the trainer
    once."""
    launcher = "torch.distributed.run" if gpus else "rl.trainer.ranks"
    return [sys.executable, "-m", launcher, f"--nproc-per-node={processes}"]
