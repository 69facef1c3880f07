"""Evaluation: the first `num_examples` tasks of each eval environment, with eval sampling settings,
scored like training rollouts and logged as eval/reward/<env>."""

from __future__ import annotations

import asyncio

from rl.orchestrator.config import EvalConfig, SamplingConfig
from rl.orchestrator.rollouts import Environment, InferenceClient, RolloutResult, Sampling, run_group
from rl.orchestrator.stats import rollout_stats


def to_sampling(config: SamplingConfig, seed: int | None = None) -> Sampling:
    return Sampling(
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_tokens,
        seed=seed,
        extra=config.vllm_extra(),
    )


def eval_due(config: EvalConfig, step: int, max_steps: int) -> bool:
    """After batch `step` (0-based): every `interval` batches, and after the last one."""
    return config.interval is not None and ((step + 1) % config.interval == 0 or step + 1 == max_steps)


async def evaluate(
    config: EvalConfig,
    envs: list[Environment],
    clients: list[InferenceClient],
    semaphore: asyncio.Semaphore,
    timeout_s: float | None,
) -> dict:
    """Run every eval task of every env once (x rollouts_per_example); a failed eval rollout raises."""
    sampling = to_sampling(config.sampling, config.sampling.seed)
    jobs, owners = [], []
    for env in envs:
        for index in range(min(config.num_examples, env.num_tasks)):
            client = clients[len(jobs) % len(clients)]
            jobs.append(run_group(env, index, config.rollouts_per_example, client, sampling, semaphore, timeout_s))
            owners.append(env.env_id)
    groups = await asyncio.gather(*jobs)
    by_env: dict[str, list[RolloutResult]] = {}
    for env_id, results in zip(owners, groups):
        by_env.setdefault(env_id, []).extend(results)
    return rollout_stats(by_env, prefix="eval/")
