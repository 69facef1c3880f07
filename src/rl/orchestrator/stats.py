"""Per-step numbers of the rollouts: reward overall and per environment, each environment's reward components
and own metrics, rollout counts, and completion lengths."""

from __future__ import annotations

import statistics
from collections import defaultdict

from rl.envs.rollouts import RolloutResult


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def rollout_stats(results_by_env: dict[str, list[RolloutResult]], prefix: str = "") -> dict:
    """reward, completion_len(_max), truncated (fraction), num_turns, segments over every rollout; per environment
    `reward/<env>`, `reward/<env>/<component>`, `metric/<env>/<metric>` (its own metrics), `rollouts/<env>`,
    `turns/<env>` and, where tools were offered, `tools/<env>/calls` and `tools/<env>/errors` (per rollout)."""
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
    for name, results in results_by_env.items():
        stats[f"{prefix}reward/{name}"] = mean([r.reward for r in results])
        stats[f"{prefix}rollouts/{name}"] = len(results)
        stats[f"{prefix}turns/{name}"] = mean([r.num_turns for r in results])
        stats |= {f"{prefix}tools/{name}/{key}": value for key, value in tool_stats(results).items()}
        stats |= {f"{prefix}reward/{name}/{key}": value for key, value in means(r.rewards for r in results).items()}
        stats |= {f"{prefix}metric/{name}/{key}": value for key, value in means(r.metrics for r in results).items()}
    return stats


def tool_stats(results: list[RolloutResult]) -> dict[str, float]:
    """Tool calls and failed calls per rollout, over the rollouts that were offered tools."""
    offered = [r for r in results if r.tool_calls is not None]
    if not offered:
        return {}
    return {"calls": mean([r.tool_calls for r in offered]), "errors": mean([r.tool_errors for r in offered])}


def means(records) -> dict[str, float]:
    """The mean of each key over the records that have it."""
    values: dict[str, list[float]] = defaultdict(list)
    for record in records:
        for key, value in record.items():
            values[key].append(value)
    return {key: mean(vs) for key, vs in values.items()}
