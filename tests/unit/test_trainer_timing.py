"""The step's memory figures: peak allocated everywhere, peak reserved (the allocator's cache included) on GPUs."""

import torch

from rl.trainer.main import timing_stats
from rl.trainer.world import World


class FakeWorld:
    """Two ranks' figures, reduced as the real all_reduce(op="max") would."""

    world_size = 2

    def __init__(self, reserved: list[float] | None):
        self.reserved = reserved

    def peak_memory_gib(self) -> float:
        return 1.0

    def peak_reserved_gib(self) -> float | None:
        return None if self.reserved is None else self.reserved[0]

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        assert op == "max"
        other_rank = [3.0] + ([] if self.reserved is None else [self.reserved[1]])
        return [max(a, b) for a, b in zip(values, other_rank, strict=True)]


STATS = {"tokens": 100, "flops": 0.0}


def test_gpu_steps_log_peak_reserved_beside_allocated():
    timing = timing_stats(STATS, 0.5, 2.0, 2.5, FakeWorld(reserved=[4.0, 6.0]), None)
    assert timing["peak_mem_gib"] == 3.0 and timing["peak_reserved_gib"] == 6.0
    assert timing["tokens_per_s"] == 50.0


def test_cpu_steps_log_no_reserved_memory():
    assert "peak_reserved_gib" not in timing_stats(STATS, 0.5, 2.0, 2.5, FakeWorld(reserved=None), None)
    cpu = World(0, 0, 1, torch.device("cpu"), "gloo", mesh=None)
    assert cpu.peak_reserved_gib() is None and cpu.peak_memory_gib() > 0
