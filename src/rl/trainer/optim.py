"""AdamW and the learning-rate schedule.

With peak LR lr, warmup W steps, final step S (max_steps), floor m = min_lr_ratio and p = (k - W) / (S - W),
the LR used by optimizer step k (0-based) is

    k < W      lr * (k + 1) / W                       linear warmup (the first step already moves)
    constant   lr
    linear     lr * (m + (1 - m) * (1 - p))
    cosine     lr * (m + (1 - m) * (1 + cos(pi p)) / 2)
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from rl.trainer.config import OptimConfig


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter, or with LoRA only A and B (the rest is frozen)."""
    return [p for p in model.parameters() if p.requires_grad]


def build_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        trained_parameters(model), lr=config.lr, weight_decay=config.weight_decay, betas=config.betas
    )


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
