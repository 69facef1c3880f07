"""Per-step numbers of the rollouts: reward overall, per environment and per reward component, and
completion lengths."""

from __future__ import annotations

import statistics
from collections import defaultdict

from rl.orchestrator.rollouts import RolloutResult


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def rollout_stats(results_by_env: dict[str, list[RolloutResult]], prefix: str = "") -> dict:
    """reward, reward/<env>, reward/<env>/<component>, completion_len(_max), truncated (fraction)."""
    everything = [r for rs in results_by_env.values() for r in rs]
    if not everything:
        return {}
    lengths = [r.sampled_tokens for r in everything]
    stats = {
        f"{prefix}reward": mean([r.reward for r in everything]),
        f"{prefix}completion_len": mean(lengths),
        f"{prefix}completion_len_max": max(lengths),
        f"{prefix}truncated": mean([float(r.is_truncated) for r in everything]),
        f"{prefix}num_turns": mean([r.num_turns for r in everything]),
        f"{prefix}segments": mean([len(r.segments) for r in everything]),
    }
    for env_id, results in results_by_env.items():
        stats[f"{prefix}reward/{env_id}"] = mean([r.reward for r in results])
        components: dict[str, list[float]] = defaultdict(list)
        for result in results:
            for name, score in result.rewards.items():
                components[name].append(score)
        stats |= {f"{prefix}reward/{env_id}/{name}": mean(scores) for name, scores in components.items()}
    return stats
