"""Evaluation: the first `num_examples` tasks of each eval environment, `rollouts_per_example` rollouts each
with eval sampling settings, scored like training rollouts. Shared by the orchestrator's periodic eval
(`eval/...` in metrics.jsonl) and the `eval` command.

pass@k is the unbiased estimate over a task's n rollouts of which c pass (reward >= pass_threshold),
averaged over tasks (Chen et al., 2021):

    pass@k = 1 - C(n - c, k) / C(n, k)            for k in 1, 2, 4, ... <= n, and n

avg@n is the mean over tasks of the mean reward of the task's n rollouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from math import comb

from rl.orchestrator.config import EvalConfig, EvalSettings, SamplingConfig
from rl.envs.loading import Environment
from rl.envs.rollouts import (
    ChatClient, InferenceClient, RolloutResult, Sampling, run_group_retried,
)
from rl.envs.slots import RolloutSlots
from rl.orchestrator.stats import mean, rollout_stats

Groups = dict[str, list[list[RolloutResult]]]
"""Per environment name, one group of rollouts per evaluated task."""


def to_sampling(config: SamplingConfig, seed: int | None = None, priority: int | None = None) -> Sampling:
    return Sampling(
        priority=priority,
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_tokens,
        seed=seed,
        extra=config.vllm_extra(),
    )


def eval_due(config: EvalConfig, step: int, max_steps: int) -> bool:
    """After batch `step` (0-based): every `interval` batches, and after the last one."""
    return config.interval is not None and ((step + 1) % config.interval == 0 or step + 1 == max_steps)


@dataclass
class EvalGroups:
    """Per environment name, one group of rollouts per evaluated task that finished, and the groups dropped
    after their retries (each error's type and text)."""

    groups: Groups
    dropped: dict[str, list[str]]
    group_size: int  # rollouts per group


async def run_eval_groups(
    settings: EvalSettings,
    envs: list[Environment],
    num_examples: int | None,
    clients: list[InferenceClient | ChatClient],
    slots: RolloutSlots,
    timeout_s: float | None,
    max_retries: int,
    log: Callable[[str], None],
) -> EvalGroups:
    """Every eval task (the first `num_examples` of each env; all if None) once, as one group; a failed group is
    run again up to `max_retries` times, then dropped and counted (as training groups are)."""
    sampling = to_sampling(settings.sampling, settings.sampling.seed)
    jobs = []
    for env in envs:
        for index in range(min(num_examples or env.num_tasks, env.num_tasks)):
            client = clients[len(jobs) % len(clients)]
            jobs.append(run_group_retried(
                env, index, settings.rollouts_per_example, client, sampling, slots, timeout_s, max_retries, log
            ))
    evaluated = EvalGroups(
        {env.name: [] for env in envs}, {env.name: [] for env in envs}, settings.rollouts_per_example
    )
    for outcome in await asyncio.gather(*jobs):
        if outcome.results is None:
            evaluated.dropped[outcome.env.name].append(f"{outcome.error}: {outcome.message}")
        else:
            evaluated.groups[outcome.env.name].append(outcome.results)
    return evaluated


def pass_at_k(n: int, passed: int, k: int) -> float:
    """Chance that at least one of k rollouts drawn from n, of which `passed` pass, passes."""
    return 1.0 - comb(n - passed, k) / comb(n, k)


def ks(n: int) -> list[int]:
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


def group_scores(groups: list[list[RolloutResult]], pass_threshold: float) -> dict[str, float]:
    """pass@k for k in 1, 2, 4, ... <= n and n, and avg@n, over groups of n rollouts (n: the smallest group)."""
    if not groups:
        return {}
    n = min(len(g) for g in groups)
    scores = {
        f"pass@{k}": mean([pass_at_k(len(g), sum(r.reward >= pass_threshold for r in g), k) for g in groups])
        for k in ks(n)
    }
    scores[f"avg@{n}"] = mean([mean([r.reward for r in g]) for g in groups])
    return scores


def eval_stats(evaluated: EvalGroups, pass_threshold: float, prefix: str = "eval/") -> dict:
    """rollout_stats of every rollout, plus pass@k and avg@n overall and per environment (`pass@1/<env>`), and
    the rollouts of dropped groups (`dropped`, `dropped/<env>`)."""
    groups = evaluated.groups
    stats = rollout_stats({name: [r for g in gs for r in g] for name, gs in groups.items()}, prefix)
    every_group = [g for gs in groups.values() for g in gs]
    stats |= {f"{prefix}{key}": value for key, value in group_scores(every_group, pass_threshold).items()}
    for name, env_groups in groups.items():
        stats |= {f"{prefix}{key}/{name}": value for key, value in group_scores(env_groups, pass_threshold).items()}
    dropped = {name: len(errors) * evaluated.group_size for name, errors in evaluated.dropped.items()}
    stats[f"{prefix}dropped"] = sum(dropped.values())
    stats |= {f"{prefix}dropped/{name}": count for name, count in dropped.items() if count}
    return stats


async def evaluate(
    config: EvalConfig,
    envs: list[Environment],
    clients: list[InferenceClient],
    slots: RolloutSlots,
    timeout_s: float | None,
    max_retries: int,
    log: Callable[[str], None],
) -> dict:
    """The orchestrator's periodic eval: eval/... metrics of one pass over the eval tasks."""
    evaluated = await run_eval_groups(
        config, envs, config.num_examples, clients, slots, timeout_s, max_retries, log
    )
    return eval_stats(evaluated, config.pass_threshold)
