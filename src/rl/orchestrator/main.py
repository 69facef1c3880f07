"""Orchestrator entrypoint: for each step, make sure inference serves a recent enough policy, run groups
of rollouts, compute advantages and write the step's batch for the trainer."""

from __future__ import annotations

import asyncio
import sys
import time

from rl.config import ConfigError, run_cli, url_without_password
from rl.metrics import PER_REQUEST_LOGGERS, MetricsLogger, setup_logging
from rl.orchestrator.batch import StepBatch, balance_by_tokens, build_batch, off_policy_stats
from rl.orchestrator.config import OrchestratorConfig
from rl.envs.loading import (
    Environment, EnvLoadError, launched, load_environments, serving,
)
from rl.renderer import chat_renderer
from rl.renderer import describe as describe_renderer
from rl.orchestrator.eval import eval_due, evaluate
from rl.orchestrator.dispatch import group_source
from rl.orchestrator.engine_metrics import EngineMetrics
from rl.orchestrator.inference_pool import InferenceError, InferencePool
from rl.orchestrator.policy_sync import policy_sync
from rl.envs.rollouts import GroupOutcome, InferenceClient
from rl.envs.process_setup import apply_patches, tune_gc_for_serving
from rl.orchestrator.group_runner import GroupRunner
from rl.orchestrator.sampler import DifficultyPools, make_sampler
from rl.orchestrator.samples_text import COLUMNS, step_samples, table_rows, write_samples
from rl.orchestrator.servers import ServerBoard
from rl.orchestrator.state import load_state, pending_groups, restore_samplers, save_state
from rl.orchestrator.stats import rollout_stats
from rl.orchestrator.rescore import policy_scorers, rescore
from rl.orchestrator.teacher import Teacher, TeacherError
from rl.samples import Sample
from rl.protocol import RunPaths, write_batch
from rl.process import set_up_process

LINE_KEYS = ("reward", "eval/reward", "policy_step", "staleness", "off_policy/max", "off_policy/withheld", "dropped",
             "tokens_per_s",
             "rollouts_in_flight", "concurrency/cap", "time/wait_for_policy")


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, logger):
        self.config = config
        self.logger = logger
        self.paths = RunPaths(config.output_dir)
        self.paths.make_private()
        self.pool = InferencePool(config.client.base_urls, config.client.admin_token, config.client.timeout_s,
                                  log=logger.warning)
        served = config.adapter or config.model.name  # with LoRA, requests select the adapter by name
        self.envs: list[Environment] = load_environments(config.env, "env")
        self.eval_envs: list[Environment] = load_environments(config.eval.env, "eval.env") or self.envs
        for env in {id(e): e for e in self.envs + self.eval_envs}.values():
            logger.info(env.describe())
        renderer, why = chat_renderer(config.model.renderer, config.model.name, self.envs + self.eval_envs)
        logger.info(f"model {config.model.name!r} renders with {describe_renderer(renderer)} ({why})")
        clients = [InferenceClient(url, served, config.model.name, renderer, group_gap_s=config.client.group_gap_s)
                   for url in config.client.base_urls]
        self.samplers = [make_sampler(spec.sampler, env.num_tasks, config.seed + i)
                         for i, (spec, env) in enumerate(zip(config.env, self.envs))]
        self.servers = ServerBoard(self.pool, config.client, logger)
        self.sync = policy_sync(config, self.pool, self.servers, logger)  # files or offers, chosen once
        # what the servers loaded before the first batch (a resumed policy, the step-0 adapter), logged with it
        self.unlogged_served: list[dict] | None = None
        self.start_step, pending = 0, []
        if config.resume_step is not None:
            pending = self.restore(config.resume_step)
        self.runner = GroupRunner(config, self.envs, self.samplers, clients, self.servers, self.sync, logger)
        self.groups = group_source(config, self.runner, self.pool.metrics, pending, logger)
        self.metrics = MetricsLogger("orchestrator", self.paths, config.wandb, config, logger)
        self.tokenizer = None
        self.teacher = Teacher(config.teacher) if config.teacher is not None else None
        self.last_batch_at: float | None = None
        self.engine_metrics = EngineMetrics()  # the servers' /metrics between one step's record and the next

    def restore(self, step: int) -> list[tuple[int, int]]:
        """Continue after batch step - 1: samplers where they were; inference catches up in run(). The groups that
        were in flight or waiting then (environment, task), to run first."""
        state = load_state(self.paths, step)
        self.samplers = restore_samplers(state, self.samplers, [spec.sampler for spec in self.config.env])
        self.start_step = step
        pending = pending_groups(state, self.samplers)
        self.logger.info(f"resuming at step {step}: samplers {[s.state_dict() for s in self.samplers]}"
                         + (f", {len(pending)} groups not yet trained run first" if pending else ""))
        return pending

    async def run(self) -> None:
        shown = [url_without_password(url) for url in self.config.client.base_urls]
        with launched(self.envs + self.eval_envs):  # those this process starts load while inference starts
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
                self.groups.start()
                try:
                    for step in range(self.start_step, self.config.max_steps):
                        await self.step(step)
                finally:
                    await self.groups.close()
                await self.sync.finish()
        await self.pool.close()
        if self.teacher is not None:
            await self.teacher.close()
        self.metrics.close()

    async def step(self, step: int) -> None:
        wait_start = time.perf_counter()
        self.groups.servers_changed(await self.servers.check())
        served = await self.sync.ensure(step) or self.unlogged_served
        self.unlogged_served = None
        gen_start, cpu_start = time.perf_counter(), time.process_time()
        collected = await self.groups.collect(step)
        outcomes = collected.outcomes
        gen_time = time.perf_counter() - gen_start
        batch = build_batch(self.config, outcomes, collected.served_at_finish, self.runner.groups_per_step,
                            collected.oldest_allowed)
        teacher_start = time.perf_counter()
        if self.teacher is not None:
            batch.samples = await self.teacher.score(batch.samples)
        teacher_time = time.perf_counter() - teacher_start
        rescore_stats = {}
        if self.config.rescore:
            batch.samples, served, rescore_stats = await self.rescore(step, batch.samples, served)
        write_batch(self.paths, step, balance_by_tokens(batch.samples, self.config.trainer_world_size),
                    groups=[[o.env.name, o.task_index, len(o.results or ())] for o in outcomes])
        written, since = time.perf_counter(), self.last_batch_at or wait_start
        self.last_batch_at = written
        rollouts = sum(self.config.rollouts_per_example * (1 + o.retries) for o in outcomes)
        stats = self.step_stats(batch, outcomes) | collected.stats | self.curriculum_stats() | {
            "orchestrator/cpu_ms_per_rollout": 1000 * (time.process_time() - cpu_start) / max(rollouts, 1),
            **{f"env/{env.name}/workers": env.runner.workers for env in self.envs if env.runner.workers is not None},
            "policy_step": self.servers.policy_step,
            "staleness": step - min(s.policy_version for s in batch.samples),
            **off_policy_stats(step, batch),
            "gen_s": gen_time,
            "time/wait_for_policy": gen_start - wait_start,
            "time/step": written - since,
            **({"teacher_s": teacher_time} if self.teacher is not None else {}),
            **rescore_stats,
        }
        # tokens of the batch per second of the step: in continuous dispatch generation also runs while the
        # orchestrator waits for a policy, so the step's whole time is the denominator there
        stats["tokens_per_s"] = stats["completion_tokens"] / (written - since if self.config.continuous else gen_time)
        stats |= self.engine_metrics.step_stats(await self.pool.metrics())
        if served:
            stats["served_checksums"] = [s.get("weights_checksum") for s in served]
        if eval_due(self.config.eval, step, self.config.max_steps):
            stats |= await self.run_eval()
        self.metrics.log(step, stats, LINE_KEYS)
        self.log_samples(step, batch)
        # after the log: a resume from step + 1 never logs this step again
        if self.config.ckpt.due(step + 1, self.config.max_steps):
            save_state(self.paths, step + 1, self.servers.policy_step, self.samplers, self.config.ckpt.keep,
                       self.groups.pending())

    async def rescore(self, step: int, samples: list[Sample], served: list[dict] | None
                      ) -> tuple[list[Sample], list[dict] | None, dict]:
        """Batch `step`'s samples with inference's logprobs under policy `step`, which the servers load first (the
        batch waits for the trainer's step before), what the servers then serve, and the step's figures."""
        start = time.perf_counter()
        served = await self.sync.ensure(step, lag=0) or served
        loaded = time.perf_counter()
        urls = [self.pool.base_urls[i] for i in self.servers.usable if self.servers.served_steps[i] == step]
        if not urls:
            raise InferenceError(f"batch {step} is re-scored under policy {step}, but no server serves it (they "
                                 f"serve policies {self.servers.served_steps})")
        scorers = policy_scorers(urls, self.config.adapter or self.config.model.name, self.config.client.timeout_s)
        try:
            samples, count = await rescore(samples, step, scorers)
        finally:
            await asyncio.gather(*(scorer.close() for scorer in scorers))
        return samples, served, {"rescore/samples": count, "time/rescore_wait_for_policy": loaded - start,
                                 "time/rescore": time.perf_counter() - loaded}

    def curriculum_stats(self) -> dict:
        return {f"curriculum/{env.name}/{pool}": size for env, sampler in zip(self.envs, self.samplers)
                if isinstance(sampler, DifficultyPools) for pool, size in sampler.sizes().items()}

    def step_stats(self, batch: StepBatch, outcomes: list[GroupOutcome]) -> dict:
        return rollout_stats(batch.kept) | {
            "samples": len(batch.samples),
            "dropped": sum(batch.dropped.values()),
            **({"router_replay/unrouted": batch.unrouted} if batch.unrouted else {}),
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
            self.config.eval, self.eval_envs, self.runner.clients, self.runner.slots, rollout.timeout_s,
            rollout.max_retries, self.logger.warning,
        )
        return stats | {"eval/time_s": time.perf_counter() - start}

    def log_samples(self, step: int, batch: StepBatch) -> None:
        """A few of the step's rollouts as text: samples/step_k.jsonl, and W&B's samples table where W&B is on."""
        picks = self.config.samples.picks
        if not picks:
            return
        records = step_samples(step, batch.kept, picks, self.config.samples.max_chars, self.config.seed,
                               self.student_tokenizer().decode)
        write_samples(self.paths, step, records)
        if self.metrics.run is not None:
            self.metrics.log_table("samples", COLUMNS, table_rows(records), step)

    def student_tokenizer(self):
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.config.model.name)
        return self.tokenizer


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
