"""The distributed world: ranks, device and backend. Chosen here and nowhere else."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


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
