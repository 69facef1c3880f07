"""AdamW and the learning-rate schedule.

With peak LR lr, warmup W steps, final step S (max_steps), floor m = min_lr_ratio and p = (k - W) / (S - W),
the LR used by optimizer step k (0-based) is

    k < W      lr * (k + 1) / W                       linear warmup (the first step already moves)
    constant   lr
    linear     lr * (m + (1 - m) * (1 - p))
    cosine     lr * (m + (1 - m) * (1 + cos(pi p)) / 2)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from rl.host_memory import HostArena
from rl.trainer.config import OptimConfig


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter, or with LoRA only A and B (the rest is frozen)."""
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    kind = HostStateAdamW if config.offload else torch.optim.AdamW
    # fused: one kernel over all of a parameter's state (CUDA and CPU), as torchtitan's default. Unset, torch takes
    # foreach on CUDA and a loop of ~10 tensor ops per parameter on CPU: at ~117M parameters on this CPU a step
    # took 0.26 s, 0.32 s foreach, 0.056 s fused (benchmarks/RESULTS.md).
    return kind(trained_parameters(model), lr=config.lr, weight_decay=config.weight_decay, betas=config.betas,
                fused=True)


@dataclass
class HostCopy:
    tensor: torch.Tensor  # the state tensor (a DTensor's local shard), whose data is swapped between the two
    host: torch.Tensor  # its persistent host buffer (pinned with CUDA: asynchronous copies)
    device: torch.device  # where it computes


class HostStateAdamW(torch.optim.AdamW):
    """AdamW whose moments live in host memory between steps (`optim.offload`), as prime-rl's optimizer state
    offload: each step copies them to the device, steps there and copies them back, so the device holds them
    only during the optimizer step, not beside forward/backward's activations. Parameters and gradients stay
    on the device. The state tensors keep their identity (their `.data` is swapped), so the LR scheduler and
    torch.distributed.checkpoint see a plain AdamW; a checkpoint reads and writes the state on the device
    (`state_on_device`). `offloaded` and `on_device` record where the state is."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.offloaded: list[HostCopy] = []  # the tensors in host memory now
        self.on_device = False
        self.arena: HostArena | None = None  # every state tensor's host buffer, in `_offload`'s order
        self._arena_keys: list[tuple[int, str]] = []  # whose buffer each of the arena's tensors is

    @torch.no_grad()
    def step(self, closure=None):
        with self.state_on_device():
            return super().step(closure)

    @contextlib.contextmanager
    def state_on_device(self):
        """The state on the device inside (a step, a checkpoint), in host memory after; re-entrant (torch's
        checkpoint state dict may run a step to create the state)."""
        if self.on_device:
            yield
            return
        self._fetch()
        try:
            yield
        finally:
            self._offload()

    def _fetch(self) -> None:
        for copy in self.offloaded:  # ordered after the offload's copies on the same stream
            copy.tensor.data = copy.host.to(copy.device, non_blocking=True, copy=True)
        self.offloaded, self.on_device = [], True

    def _offload(self) -> None:
        """Every state tensor but the scalar step counters (which AdamW keeps on the host) into its host buffer,
        state created or replaced (a checkpoint load) inside included."""
        held = [(param, key, value._local_tensor if isinstance(value, DTensor) else value)
                for param, state in self.state.items() for key, value in state.items()]
        held = [(param, key, local) for param, key, local in held if isinstance(local, torch.Tensor) and local.ndim]
        buffers = self._host_buffers([(id(param), key) for param, key, _ in held], [local for _, _, local in held])
        for (_, _, local), host in zip(held, buffers, strict=True):
            host.copy_(local, non_blocking=True)
            self.offloaded.append(HostCopy(local, host, local.device))
            local.data = host
        self.on_device = False

    def _host_buffers(self, keys: list[tuple[int, str]], like: list[torch.Tensor]) -> list[torch.Tensor]:
        """The state's host buffers: one arena for the whole run, made again only if the state's tensors change
        (pinning host memory is slow). With CUDA it is pinned at its exact size (rl/host_memory.py)."""
        layout = [(t.shape, t.dtype) for t in like]
        if self.arena is None or self._arena_keys != keys or self.arena.layout != layout:
            if self.arena is not None:
                self.arena.close()
            self.arena = HostArena(layout, pin=any(t.device.type == "cuda" for t in like))
            self._arena_keys = keys
        return self.arena.tensors


def state_on_device(optimizer: torch.optim.Optimizer):
    """A context in which the optimizer's state is on the device (where a checkpoint reads and writes it)."""
    return optimizer.state_on_device() if isinstance(optimizer, HostStateAdamW) else contextlib.nullcontext()


def lr_factor(step: int, config: OptimConfig, max_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = min((step - config.warmup_steps) / max(max_steps - config.warmup_steps, 1), 1.0)
    floor = config.min_lr_ratio
    if config.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    if config.schedule == "cosine":
        return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2
    raise AssertionError(f"unknown schedule {config.schedule!r}")


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """Scale gradients so that their global norm (over every rank's shards) is at most `max_norm`; return
    the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(trained_parameters(model), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, max_steps: int) -> LambdaLR:
    """Call `scheduler.step()` after every optimizer step; `get_last_lr()` is the LR of the next one."""
    return LambdaLR(optimizer, lambda step: lr_factor(step, config, max_steps))
