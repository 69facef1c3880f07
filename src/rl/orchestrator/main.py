"""Orchestrator entrypoint: for each step, make sure inference serves a recent enough policy, run groups
of rollouts, compute advantages and write the step's batch for the trainer."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from rl.config import ConfigError, run_cli, url_without_password
from rl.metrics import PER_REQUEST_LOGGERS, MetricsLogger, setup_logging
from rl.orchestrator.advantage import admitted, group_advantages
from rl.orchestrator.batch import balance_by_tokens
from rl.orchestrator.config import OrchestratorConfig
from rl.envs.loading import (
    Environment, EnvLoadError, load_environments, serving, start_env_servers, stop_env_servers,
)
from rl.renderer import chat_renderer
from rl.renderer import describe as describe_renderer
from rl.orchestrator.eval import eval_due, evaluate, to_sampling
from rl.orchestrator.fill import Filled, fill_batch
from rl.orchestrator.inference_pool import InferencePool
from rl.orchestrator.policy_sync import policy_sync
from rl.envs.rollouts import GroupOutcome, InferenceClient, RolloutResult, TokenSegment, run_group_retried
from rl.envs.worker import apply_patches, tune_gc_for_serving
from rl.orchestrator.sampler import DifficultyPools, make_sampler
from rl.envs.slots import RolloutSlots
from rl.orchestrator.servers import ServerBoard
from rl.orchestrator.state import load_state, restore_samplers, save_state
from rl.orchestrator.stats import rollout_stats
from rl.orchestrator.teacher import Teacher, TeacherError
from rl.protocol import RunPaths, Sample, write_batch
from rl.process import set_up_process

REMAKE_ROUNDS = 3  # a batch's groups made again after servers changed under them
LINE_KEYS = ("reward", "eval/reward", "policy_step", "staleness", "dropped", "tokens_per_s", "gen_s", "wait_s")


def groups_per_env(total: int, ratios: list[float]) -> list[int]:
    """Split `total` groups by ratio, largest remainders first, so the counts always add up."""
    exact = [total * r / sum(ratios) for r in ratios]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(ratios)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass
class StepBatch:
    samples: list[Sample]
    kept: dict[str, list[RolloutResult]] = field(default_factory=dict)  # scored results by env name
    dropped: Counter = field(default_factory=Counter)  # rollouts (samples, once split) dropped, by reason
    dropped_by_env: Counter = field(default_factory=Counter)  # the same, by env name
    dropped_groups: Counter = field(default_factory=Counter)  # groups left out whole, by env name

    def drop(self, reason: str, env: str, count: int) -> None:
        self.dropped[reason] += count
        self.dropped_by_env[env] += count

    def drop_group(self, reason: str, env: str, count: int) -> None:
        self.drop(reason, env, count)
        self.dropped_groups[env] += 1


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, logger):
        self.config = config
        self.logger = logger
        self.paths = RunPaths(config.output_dir)
        self.paths.make_private()
        self.pool = InferencePool(config.client.base_urls, config.client.admin_token, config.client.timeout_s)
        served = config.adapter or config.model.name  # with LoRA, requests select the adapter by name
        self.envs: list[Environment] = load_environments(config.env, "env")
        self.eval_envs: list[Environment] = load_environments(config.eval.env, "eval.env") or self.envs
        for env in {id(e): e for e in self.envs + self.eval_envs}.values():
            logger.info(env.describe())
        renderer, why = chat_renderer(config.model.renderer, config.model.name, self.envs + self.eval_envs)
        logger.info(f"model {config.model.name!r} renders with {describe_renderer(renderer)} ({why})")
        self.clients = [InferenceClient(url, served, config.model.name, renderer, group_gap_s=config.client.group_gap_s)
                        for url in config.client.base_urls]
        self.samplers = [make_sampler(spec.sampler, env.num_tasks, config.seed + i)
                         for i, (spec, env) in enumerate(zip(config.env, self.envs))]
        self.slots = RolloutSlots(config.rollouts_in_flight)
        self.servers = ServerBoard(self.pool, config.client, logger)
        self.sync = policy_sync(config, self.pool, self.servers, logger)  # files or offers, chosen once
        self.unlogged_served: list[dict] | None = None  # the step-0 adapter's load, logged with batch 0
        self.start_step = 0
        if config.resume_step is not None:
            self.restore(config.resume_step)
        self.metrics = MetricsLogger("orchestrator", self.paths, config.wandb, config, logger)
        self.tokenizer = None
        self.teacher = Teacher(config.teacher) if config.teacher is not None else None

    def restore(self, step: int) -> None:
        """Continue after batch step - 1: samplers where they were; inference catches up in run()."""
        state = load_state(self.paths, step)
        self.samplers = restore_samplers(state, self.samplers, [spec.sampler for spec in self.config.env])
        self.start_step = step
        self.logger.info(f"resuming at step {step}: samplers {[s.state_dict() for s in self.samplers]}")

    async def run(self) -> None:
        shown = [url_without_password(url) for url in self.config.client.base_urls]
        start_env_servers(self.envs + self.eval_envs)  # those this process starts load while inference starts
        try:
            self.logger.info(f"waiting for inference servers {shown}")
            await self.pool.wait_healthy(self.config.client.startup_timeout_s)
            if self.teacher is not None:
                await self.teacher.start(self.student_tokenizer(), self.config.model.name,
                                         self.config.client.startup_timeout_s)
                self.logger.info(f"teacher {self.teacher.model!r} at {self.config.teacher.base_url} scores every "
                                 "sample")
            async with serving(self.envs + self.eval_envs):
                tune_gc_for_serving()
                self.unlogged_served = await self.sync.start(resumed=self.start_step > 0)
                for step in range(self.start_step, self.config.max_steps):
                    await self.step(step)
                await self.sync.finish()
        finally:
            stop_env_servers(self.envs + self.eval_envs)
        await self.pool.close()
        if self.teacher is not None:
            await self.teacher.close()
        self.metrics.close()

    async def step(self, step: int) -> None:
        wait_start = time.perf_counter()
        await self.servers.check()
        served = await self.sync.ensure(step) or self.unlogged_served
        self.unlogged_served = None
        gen_start, cpu_start = time.perf_counter(), time.process_time()
        outcomes = await self.generate(step, self.groups_per_step)
        outcomes = await self.remake_groups_of_changed_servers(outcomes, step)
        filled = await self.fill(outcomes, step)
        outcomes = filled.outcomes
        gen_time = time.perf_counter() - gen_start
        self.observe(outcomes)
        batch = self.build_batch(outcomes)
        teacher_start = time.perf_counter()
        if self.teacher is not None:
            batch.samples = await self.teacher.score(batch.samples)
        teacher_time = time.perf_counter() - teacher_start
        write_batch(self.paths, step, balance_by_tokens(batch.samples, self.config.trainer_world_size))
        rollouts = sum(self.config.rollouts_per_example * (1 + o.retries) for o in outcomes)
        stats = self.step_stats(batch, outcomes) | self.fill_stats(filled) | self.curriculum_stats() | {
            "orchestrator/cpu_ms_per_rollout": 1000 * (time.process_time() - cpu_start) / rollouts,
            **{f"env/{env.name}/workers": env.runner.workers for env in self.envs if env.runner.workers is not None},
            "policy_step": self.servers.policy_step,
            "staleness": step - min(s.policy_version for s in batch.samples),
            "gen_s": gen_time,
            "wait_s": gen_start - wait_start,
            **({"teacher_s": teacher_time} if self.teacher is not None else {}),
        }
        stats["tokens_per_s"] = stats["completion_tokens"] / gen_time
        if served:
            stats["served_checksums"] = [s.get("weights_checksum") for s in served]
        if eval_due(self.config.eval, step, self.config.max_steps):
            stats |= await self.run_eval()
        self.metrics.log(step, stats, LINE_KEYS)
        self.log_samples(step, batch)
        # after the log: a resume from step + 1 never logs this step again
        if self.config.ckpt.due(step + 1, self.config.max_steps):
            save_state(self.paths, step + 1, self.servers.policy_step, self.samplers, self.config.ckpt.keep)

    async def remake_groups_of_changed_servers(self, outcomes: list[GroupOutcome], step: int) -> list[GroupOutcome]:
        """Groups generated on a server that restarted or stopped answering meanwhile may come from other weights than
        the policy they are labelled with, or have failed for it: made again on the servers up to date, up to
        REMAKE_ROUNDS times (each waits for a server to answer), then dropped."""
        for _ in range(REMAKE_ROUNDS):
            changed = await self.servers.check()
            redo = [g for g, outcome in enumerate(outcomes) if outcome.server in changed]
            if not redo:
                return outcomes
            self.logger.warning(f"batch {step}: {len(redo)} groups of servers {sorted(changed)} are made again")
            await self.sync.ensure(step)
            remade = await asyncio.gather(*(self.run_one_group(outcomes[g].env, outcomes[g].task_index,
                                                               self.server_of(g), step, g) for g in redo))
            for g, outcome in zip(redo, remade):
                outcomes[g] = outcome
        changed = await self.servers.check()
        for outcome in outcomes:
            if outcome.server in changed:
                outcome.results, outcome.error = None, "ServerChanged"
                outcome.message = f"server {outcome.server} restarted or stopped answering while batch {step} was made"
        return outcomes

    @property
    def groups_per_step(self) -> int:
        return self.config.batch_size // self.config.rollouts_per_example

    async def generate(self, step: int, count: int, first: int = 0) -> list[GroupOutcome]:
        """Run `count` groups, split between the environments by ratio; `first` numbers the first of them in the
        step (its server and seed)."""
        counts = groups_per_env(count, [e.ratio for e in self.config.env])
        drawn = [(env, task) for env, sampler, n in zip(self.envs, self.samplers, counts) for task in sampler.draw(n)]
        return await asyncio.gather(*(self.run_one_group(env, task, self.server_of(g), step, g)
                                      for g, (env, task) in enumerate(drawn, start=first)))

    async def fill(self, outcomes: list[GroupOutcome], step: int) -> Filled[GroupOutcome]:
        """With advantage.fill_batch, more groups until the step has its groups' worth of trainable ones
        (rl/orchestrator/fill.py); otherwise the outcomes as they are."""
        advantage = self.config.advantage
        if not advantage.fill_batch:
            return Filled(outcomes)

        async def run_more(count: int, outcomes: list[GroupOutcome]) -> list[GroupOutcome]:
            extra = await self.generate(step, count, first=len(outcomes))
            return await self.remake_groups_of_changed_servers(outcomes + extra, step)

        wanted = self.groups_per_step
        filled = await fill_batch(outcomes, wanted, advantage.max_extra_groups or wanted, self.trainable, run_more)
        if filled.short:
            self.logger.warning(f"batch {step}: {filled.short} of {wanted} groups short after {filled.extra_groups} "
                                f"extra groups (advantage.max_extra_groups); the step trains on what it has")
        return filled

    def observe(self, outcomes: list[GroupOutcome]) -> None:
        """Each group's mean reward to its environment's sampler (a curriculum pools tasks by it), in draw order."""
        for outcome in outcomes:
            if outcome.results is not None:
                sampler = self.samplers[self.envs.index(outcome.env)]
                sampler.observe(outcome.task_index, sum(r.reward for r in outcome.results) / len(outcome.results))

    def curriculum_stats(self) -> dict:
        return {f"curriculum/{env.name}/{pool}": size for env, sampler in zip(self.envs, self.samplers)
                if isinstance(sampler, DifficultyPools) for pool, size in sampler.sizes().items()}

    def trainable(self, outcome: GroupOutcome) -> bool:
        """Whether a group reaches the batch: it ran, and its advantages do not drop it."""
        results = outcome.results
        return results is not None and group_advantages(
            self.config.advantage, [r.reward for r in results], [r.is_truncated for r in results]) is not None

    def fill_stats(self, filled: Filled[GroupOutcome]) -> dict:
        if not self.config.advantage.fill_batch:
            return {}
        extra = Counter(o.env.name for o in filled.outcomes[self.groups_per_step:])
        return {"fill/extra_groups": filled.extra_groups, "fill/rounds": filled.rounds,
                "fill/short_groups": filled.short, **{f"extra_groups/{env.name}": extra[env.name] for env in self.envs}}

    def server_of(self, group: int) -> int:
        """The server a batch's group runs on: the usable ones in turn."""
        return self.servers.usable[group % len(self.servers.usable)]

    async def run_one_group(self, env: Environment, task_index: int, server: int, step: int, g: int) -> GroupOutcome:
        """Run the group; retry it up to rollout.max_retries times, then drop it with its error counted."""
        s = self.config.sampling
        n = self.config.rollouts_per_example
        seed = None if s.seed is None else s.seed + (step * self.config.batch_size) + g * n
        policy_step = self.servers.policy_step
        rollout = self.config.rollout
        outcome = await run_group_retried(
            env, task_index, n, self.clients[server], to_sampling(s, seed), self.slots, rollout.timeout_s,
            rollout.max_retries, self.logger.warning,
        )
        outcome.policy_step, outcome.server, outcome.task_index = policy_step, server, task_index
        return outcome

    def build_batch(self, outcomes: list[GroupOutcome]) -> StepBatch:
        """The step's samples, group by group in draw order; with fill_batch, at most the batch's groups (a fill
        round that overshot leaves its last trainable groups out, as `batch_full`)."""
        batch, groups, n = StepBatch([]), 0, self.config.rollouts_per_example
        for outcome in outcomes:
            if outcome.results is None:
                batch.drop_group(f"group_failed:{outcome.error}", outcome.env.name, n)
                continue
            if self.config.advantage.fill_batch and groups == self.groups_per_step:
                batch.drop_group("batch_full", outcome.env.name, n)
                continue
            batch.kept.setdefault(outcome.env.name, []).extend(outcome.results)
            samples = self.group_samples(outcome, batch)
            groups += bool(samples)
            batch.samples.extend(samples)
        if not batch.samples:
            raise RuntimeError(f"no rollout of the step is trainable ({dict(batch.dropped)}){failures(outcomes)}")
        keep = len(batch.samples) - len(batch.samples) % self.config.trainer_world_size
        batch.dropped["uneven_for_ranks"] += len(batch.samples) - keep
        batch.samples = batch.samples[:keep]
        return batch

    def group_samples(self, outcome: GroupOutcome, batch: StepBatch) -> list[Sample]:
        results, env = outcome.results, outcome.env.name
        computed = group_advantages(
            self.config.advantage, [r.reward for r in results], [r.is_truncated for r in results]
        )
        if computed is None:
            batch.drop_group("zero_variance_group", env, len(results))
            return []
        samples = []
        for result, advantage, trainable in zip(results, *computed):
            if not admitted(self.config.advantage, advantage):
                batch.drop("advantage_gate", env, len(result.segments))
                continue
            for segment in result.segments:
                if len(segment.prompt_ids) + len(segment.completion_ids) > self.config.seq_len:
                    batch.drop("longer_than_seq_len", env, 1)
                    continue
                samples.append(to_sample(segment, result.reward, advantage, outcome.policy_step, trainable))
        return samples

    def step_stats(self, batch: StepBatch, outcomes: list[GroupOutcome]) -> dict:
        return rollout_stats(batch.kept) | {
            "samples": len(batch.samples),
            "dropped": sum(batch.dropped.values()),
            "dropped_by_reason": {k: v for k, v in batch.dropped.items() if v},
            **{f"dropped/{name}": count for name, count in batch.dropped_by_env.items()},
            **{f"dropped_groups/{name}": count for name, count in batch.dropped_groups.items()},
            "group_retries": sum(o.retries for o in outcomes if o.results is not None),
            "completion_tokens": sum(r.sampled_tokens for rs in batch.kept.values() for r in rs),
        }

    async def run_eval(self) -> dict:
        start = time.perf_counter()
        rollout = self.config.rollout
        stats = await evaluate(
            self.config.eval, self.eval_envs, self.clients, self.slots, rollout.timeout_s, rollout.max_retries,
            self.logger.warning,
        )
        return stats | {"eval/time_s": time.perf_counter() - start}

    def log_samples(self, step: int, batch: StepBatch) -> None:
        """A few completions per step in the W&B table (only when W&B is on)."""
        count = self.config.num_samples_logged
        if self.metrics.run is None or not count:
            return
        decode = self.student_tokenizer().decode
        rows = [
            [step, name, decode(r.segments[-1].prompt_ids), decode(r.segments[-1].completion_ids), r.reward]
            for name, results in batch.kept.items()
            for r in results[:count]
        ]
        self.metrics.log_table("samples", ["step", "env", "prompt", "completion", "reward"], rows, step)

    def student_tokenizer(self):
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.config.model.name)
        return self.tokenizer


def failures(outcomes: list[GroupOutcome]) -> str:
    """Per environment with failed groups: how its seats run, how many groups failed, and the first error."""
    lines = []
    for env in {id(o.env): o.env for o in outcomes if o.results is None}.values():
        failed = [o for o in outcomes if o.env is env and o.results is None]
        total = sum(o.env is env for o in outcomes)
        first = failed[0]
        lines.append(f"\n  {env.describe()}\n    {len(failed)} of {total} groups failed, "
                     f"first: {first.error}: {first.message}")
    return "".join(lines)


def to_sample(
    segment: TokenSegment, reward: float, advantage: float, policy_step: int, trainable: bool = True
) -> Sample:
    """Prompt tokens and environment tokens are masked; an untrainable (masked) rollout has no loss tokens."""
    prompt = len(segment.prompt_ids)
    mask = segment.completion_mask if trainable else [0] * len(segment.completion_mask)
    return Sample(
        input_ids=segment.prompt_ids + segment.completion_ids,
        loss_mask=[0] * prompt + mask,
        logprobs=[0.0] * prompt + segment.completion_logprobs,
        advantage=advantage,
        reward=reward,
        policy_version=policy_step,
    )


def main() -> None:
    set_up_process()
    apply_patches()
    config = run_cli(OrchestratorConfig)
    logger = setup_logging("orchestrator", quiet=PER_REQUEST_LOGGERS)
    try:
        orchestrator = Orchestrator(config, logger)
    except (ConfigError, EnvLoadError) as e:
        logger.error(str(e))
        sys.exit(2)
    try:
        asyncio.run(orchestrator.run())
    except TeacherError as e:
        logger.error(str(e))
        sys.exit(2)


if __name__ == "__main__":
    main()
