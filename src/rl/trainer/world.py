"""The distributed world: ranks, device and backend. Chosen here and nowhere else."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy


@dataclass
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) each value over every rank."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor.tolist()

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def mixed_precision(self, dtype: str) -> MixedPrecisionPolicy:
        """bf16 computation with fp32 gradient reduction on GPUs when asked; fp32 throughout otherwise."""
        if dtype == "bfloat16" and self.on_gpu:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def peak_memory_gib(self) -> float:
        """GPU: the most memory torch has allocated; CPU: the process's maximum resident set size."""
        if self.on_gpu:
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux

    def reset_peak_memory(self) -> None:
        """Start the GPU's peak counters afresh, so each step reports its own peak (the CPU's maximum resident set
        size cannot be reset: there it is the process's peak so far)."""
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_reserved_gib(self) -> float | None:
        """GPU: the most memory torch's caching allocator has held from the device (allocated plus cached
        blocks: what other processes on the GPU cannot use); None on CPU."""
        return torch.cuda.max_memory_reserved(self.device) / 2**30 if self.on_gpu else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_world(timeout_s: float = 1800) -> World:
    """Join the process group torchrun set up: NCCL on GPUs, gloo on CPU."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device, backend, device_type = torch.device("cuda", local_rank), "nccl", "cuda"
        torch.cuda.set_device(device)
    else:
        device, backend, device_type = torch.device("cpu"), "gloo", "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    return World(rank, local_rank, world_size, device, backend, mesh)
