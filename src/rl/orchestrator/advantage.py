"""Group-relative advantages.

For a group of G rollouts of one task with rewards r_1..r_G, mean(r) = (1/G) sum_j r_j and
std(r) the population standard deviation:

    grpo:     A_i = (r_i - mean(r)) / (std(r) + eps)
    dr_grpo:  A_i = r_i - mean(r)                              (Dr. GRPO: no std normalisation)
    rloo:     A_i = r_i - (1/(G-1)) sum_{j != i} r_j = G/(G-1) * (r_i - mean(r))

A group whose rewards are all equal gets A_i = 0 for every variant (it carries no learning signal);
`drop_zero_variance` drops such groups from the batch instead. `gate = [low, high]` admits a rollout only when
low <= |A_i| <= high (computed as above, over the whole group).

Truncated completions (stopped by max_tokens or a turn limit) are treated by `truncated`:
    keep:  used as they are
    zero:  A_i = 0 (after the group statistics are computed with their reward)
    mask:  excluded from the loss (loss mask all zero), also after the group statistics
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.orchestrator.config import AdvantageConfig

EPS = 1e-6


def grpo_advantages(rewards: list[float]) -> list[float]:
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    return [(r - mean) / (std + EPS) for r in rewards]


def dr_grpo_advantages(rewards: list[float]) -> list[float]:
    mean = statistics.fmean(rewards)
    return [r - mean for r in rewards]


def rloo_advantages(rewards: list[float]) -> list[float]:
    """Leave-one-out baseline; a group of one has no baseline and gets 0."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


ADVANTAGES = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}


def is_zero_variance(rewards: list[float]) -> bool:
    return max(rewards) - min(rewards) <= EPS


def compute_advantages(kind: str, rewards: list[float]) -> list[float]:
    if kind not in ADVANTAGES:
        raise ValueError(f"unknown advantage type {kind!r}; choose one of {sorted(ADVANTAGES)}")
    if is_zero_variance(rewards):
        return [0.0] * len(rewards)
    return ADVANTAGES[kind](rewards)


def group_advantages(
    config: AdvantageConfig, rewards: list[float], truncated: list[bool]
) -> tuple[list[float], list[bool]] | None:
    """Advantages and a per-rollout `trainable` flag for one group; None if the group is dropped."""
    if config.drop_zero_variance and is_zero_variance(rewards):
        return None
    advantages = compute_advantages(config.type, rewards)
    trainable = [True] * len(rewards)
    for i, was_truncated in enumerate(truncated):
        if was_truncated and config.truncated == "zero":
            advantages[i] = 0.0
        elif was_truncated and config.truncated == "mask":
            trainable[i] = False
    return advantages, trainable


def admitted(config: AdvantageConfig, advantage: float) -> bool:
    """Whether the advantage gate lets a rollout with this advantage into the batch."""
    return config.gate is None or config.gate[0] <= abs(advantage) <= config.gate[1]
