"""Orchestrator entrypoint: for each step, make sure inference serves a recent enough policy, run groups
of rollouts, compute advantages and write the step's batch for the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections import Counter
from dataclasses import dataclass

from rl.config import run_cli
from rl.metrics import MetricsLogger, setup_logging
from rl.orchestrator.advantage import compute_advantages
from rl.orchestrator.batch import balance_by_tokens
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.inference_pool import InferencePool
from rl.orchestrator.rollouts import (
    Environment,
    InferenceClient,
    RolloutResult,
    Sampling,
    load_environment,
    run_group,
)
from rl.orchestrator.sampler import TaskSampler
from rl.protocol import STABLE, RunPaths, Sample, atomic_write_text, stable_steps, wait_for_stable, write_batch

LINE_KEYS = ("reward", "policy_step", "staleness", "dropped", "tokens_per_s", "gen_s", "wait_s")


def groups_per_env(total: int, ratios: list[float]) -> list[int]:
    """Split `total` groups by ratio, largest remainders first, so the counts always add up."""
    exact = [total * r / sum(ratios) for r in ratios]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(ratios)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass
class GroupOutcome:
    env_id: str
    results: list[RolloutResult] | None
    error: str | None = None


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, logger):
        self.config = config
        self.logger = logger
        self.paths = RunPaths(config.output_dir)
        self.pool = InferencePool(config.client.base_urls, config.client.admin_token, config.client.timeout_s)
        self.clients = [InferenceClient(url, config.model.name, config.model.name) for url in config.client.base_urls]
        self.envs: list[Environment] = [load_environment(e.id, e.args) for e in config.env]
        self.samplers = [TaskSampler(env.num_tasks, config.seed + i) for i, env in enumerate(self.envs)]
        self.semaphore = asyncio.Semaphore(config.max_concurrent)
        self.policy_step = 0
        self.metrics = MetricsLogger("orchestrator", self.paths, config.wandb, config.model_dump(mode="json"), logger)

    async def run(self) -> None:
        self.logger.info(f"waiting for inference servers {self.config.client.base_urls}")
        await self.pool.wait_healthy(self.config.client.startup_timeout_s)
        async with contextlib.AsyncExitStack() as stack:
            for env in self.envs:
                await stack.enter_async_context(env.serving())
            for step in range(self.config.max_steps):
                await self.step(step)
        await self.pool.close()
        self.metrics.close()

    async def step(self, step: int) -> None:
        wait_start = time.perf_counter()
        served = await self.ensure_policy(step)
        gen_start = time.perf_counter()
        outcomes = await self.generate(step)
        gen_time = time.perf_counter() - gen_start
        samples, stats = self.build_samples(outcomes)
        write_batch(self.paths, step, balance_by_tokens(samples, self.config.trainer_world_size))
        if self.config.ckpt.due(step + 1, self.config.max_steps):
            self.save_state(step + 1)
        stats |= {
            "policy_step": self.policy_step,
            "staleness": step - self.policy_step,
            "gen_s": gen_time,
            "wait_s": gen_start - wait_start,
            "tokens_per_s": stats["completion_tokens"] / gen_time,
        }
        if served:
            stats["served_checksums"] = [s.get("weights_checksum") for s in served]
        self.metrics.log(step, stats, LINE_KEYS)

    def save_state(self, step: int) -> None:
        """What a resume from trainer checkpoint `step` needs: the sampler positions after batch step - 1."""
        state = {"step": step, "policy_step": self.policy_step, "samplers": [s.state_dict() for s in self.samplers]}
        directory = self.paths.checkpoint(step) / "orchestrator"
        atomic_write_text(directory / "state.json", json.dumps(state, indent=1) + "\n")
        atomic_write_text(directory / STABLE, json.dumps({"step": step}) + "\n")
        for old in sorted(int(p.parent.name[5:]) for p in self.paths.checkpoints_root.glob("step_*/orchestrator"))[
            : -self.config.ckpt.keep
        ]:
            shutil.rmtree(self.paths.checkpoint(old) / "orchestrator", ignore_errors=True)

    async def ensure_policy(self, step: int) -> list[dict] | None:
        """Batch `step` may only use policies v_j with j >= step - async_level: wait for and load one."""
        required = step - self.config.async_level
        if self.policy_step >= required:
            return None
        what = f"weights of policy {required} (needed by batch {step} with async_level={self.config.async_level})"
        await asyncio.to_thread(
            wait_for_stable, self.paths.weights(required), self.config.weights_timeout_s, what
        )
        newest = max(stable_steps(self.paths.weights_root))
        served = await self.pool.update_weights(newest, str(self.paths.weights(newest).absolute()))
        self.logger.info(f"inference now serves policy {newest} ({len(served)} servers)")
        self.policy_step = newest
        return served

    async def generate(self, step: int) -> list[GroupOutcome]:
        config = self.config
        groups = config.batch_size // config.rollouts_per_example
        counts = groups_per_env(groups, [e.ratio for e in config.env])
        jobs = []
        for env, sampler, count in zip(self.envs, self.samplers, counts):
            for task_index in sampler.draw(count):
                g = len(jobs)
                jobs.append(self.run_one_group(env, task_index, self.clients[g % len(self.clients)], step, g))
        return await asyncio.gather(*jobs)

    async def run_one_group(self, env: Environment, task_index: int, client, step: int, g: int) -> GroupOutcome:
        s = self.config.sampling
        n = self.config.rollouts_per_example
        seed = None if s.seed is None else s.seed + (step * self.config.batch_size) + g * n
        sampling = Sampling(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, seed=seed)
        try:
            results = await run_group(env, task_index, n, client, sampling, self.semaphore)
        except Exception as e:  # a failed group is dropped and counted by reason, never silently
            self.logger.warning(f"group of task {task_index} of {env.env_id} failed: {e!r}")
            return GroupOutcome(env.env_id, None, type(e).__name__)
        return GroupOutcome(env.env_id, results)

    def build_samples(self, outcomes: list[GroupOutcome]) -> tuple[list[Sample], dict]:
        samples: list[Sample] = []
        dropped: Counter[str] = Counter()
        rewards: dict[str, list[float]] = {}
        completion_tokens = 0
        for outcome in outcomes:
            if outcome.results is None:
                dropped[outcome.error] += self.config.rollouts_per_example
                continue
            group_rewards = [r.reward for r in outcome.results]
            rewards.setdefault(outcome.env_id, []).extend(group_rewards)
            advantages = compute_advantages(self.config.advantage.type, group_rewards)
            for result, advantage in zip(outcome.results, advantages):
                completion_tokens += sum(result.completion_mask)
                if len(result.prompt_ids) + len(result.completion_ids) > self.config.seq_len:
                    dropped["longer_than_seq_len"] += 1
                    continue
                samples.append(to_sample(result, advantage, self.policy_step))
        if not samples:
            raise RuntimeError(f"every rollout of the step failed ({dict(dropped)}); see the log above")
        keep = len(samples) - len(samples) % self.config.trainer_world_size
        dropped["uneven_for_ranks"] += len(samples) - keep
        all_rewards = [r for rs in rewards.values() for r in rs]
        stats = {
            "reward": sum(all_rewards) / len(all_rewards),
            **{f"reward/{env_id}": sum(rs) / len(rs) for env_id, rs in rewards.items()},
            "samples": keep,
            "dropped": sum(dropped.values()),
            "dropped_by_reason": {k: v for k, v in dropped.items() if v},
            "completion_tokens": completion_tokens,
        }
        return samples[:keep], stats


def to_sample(result: RolloutResult, advantage: float, policy_step: int) -> Sample:
    prompt = len(result.prompt_ids)
    return Sample(
        input_ids=result.prompt_ids + result.completion_ids,
        loss_mask=[0] * prompt + result.completion_mask,
        logprobs=[0.0] * prompt + result.completion_logprobs,
        advantage=advantage,
        reward=result.reward,
        policy_version=policy_step,
    )


def main() -> None:
    config = run_cli(OrchestratorConfig)
    logger = setup_logging("orchestrator")
    logging.getLogger("verifiers").setLevel(logging.WARNING)  # one line per rollout otherwise
    asyncio.run(Orchestrator(config, logger).run())


if __name__ == "__main__":
    main()
