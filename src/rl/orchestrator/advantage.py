"""Group-relative advantages.

For a group of G rollouts of one task with rewards r_1..r_G:

    grpo:  A_i = (r_i - mean(r)) / (std(r) + eps)

A group whose rewards are all equal gets A_i = 0 (it carries no learning signal).
"""

from __future__ import annotations

import statistics

EPS = 1e-6


def grpo_advantages(rewards: list[float]) -> list[float]:
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    return [(r - mean) / (std + EPS) for r in rewards]


def compute_advantages(kind: str, rewards: list[float]) -> list[float]:
    if kind == "grpo":
        return grpo_advantages(rewards)
    raise ValueError(f"unknown advantage type {kind!r}")
