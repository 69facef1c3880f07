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
from rl.orchestrator.advantage import group_advantages
from rl.orchestrator.batch import balance_by_tokens
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.environment import Environment, EnvLoadError, load_environments, serving
from rl.renderer import chat_renderer
from rl.renderer import describe as describe_renderer
from rl.orchestrator.eval import eval_due, evaluate, to_sampling
from rl.orchestrator.inference_pool import InferenceError, InferencePool
from rl.orchestrator.rollouts import (
    GroupOutcome, InferenceClient, RolloutResult, TokenSegment, run_group_retried, tune_gc_for_serving,
)
from rl.orchestrator.sampler import TaskSampler
from rl.orchestrator.state import load_state, restore_samplers, save_state
from rl.orchestrator.stats import rollout_stats
from rl.protocol import RunPaths, Sample, stable_steps, wait_for_stable, write_batch
from rl.weights import TransferError
from rl.weights.offers import offered_steps, read_offer, read_sent, write_take
DOWN = "down"  # a server's instance while it does not answer
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

    def drop(self, reason: str, env: str, count: int) -> None:
        self.dropped[reason] += count
        self.dropped_by_env[env] += count


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, logger):
        self.config = config
        self.logger = logger
        self.paths = RunPaths(config.output_dir)
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
        self.samplers = [TaskSampler(env.num_tasks, config.seed + i) for i, env in enumerate(self.envs)]
        self.semaphore = asyncio.Semaphore(config.rollouts_in_flight)
        self.policy_step = 0
        self.served_steps = [0] * len(config.client.base_urls)  # per server, over the wire (they may differ)
        self.last_offer = 0  # the last step offered over the wire that was taken (or tried)
        self.offers_beyond: set[int] = set()  # offers of steps the trainer cannot have made yet, logged once each
        self.usable = list(range(len(config.client.base_urls)))  # servers given requests: up to date and up
        # per server, the process it last answered from (`DOWN`: it did not answer): a new one means it restarted
        self.instances: list[str | None] = [None] * len(config.client.base_urls)
        self.stale: set[int] = set()  # servers that restarted or went down since they were last brought up to date
        self.unlogged_served: list[dict] | None = None  # the step-0 adapter's load, logged with batch 0
        self.start_step = 0
        if config.resume_step is not None:
            self.restore(config.resume_step)
        self.metrics = MetricsLogger("orchestrator", self.paths, config.wandb, config.model_dump(mode="json"), logger)
        self.tokenizer = None

    def restore(self, step: int) -> None:
        """Continue after batch step - 1: samplers where they were; inference catches up in run()."""
        state = load_state(self.paths, step)
        self.samplers = restore_samplers(state, self.samplers)
        self.start_step = step
        self.logger.info(f"resuming at step {step}: samplers {[s.state_dict() for s in self.samplers]}")

    async def run(self) -> None:
        shown = [url_without_password(url) for url in self.config.client.base_urls]
        self.logger.info(f"waiting for inference servers {shown}")
        await self.pool.wait_healthy(self.config.client.startup_timeout_s)
        async with serving(self.envs + self.eval_envs):
            tune_gc_for_serving()
            if self.start_step and stable_steps(self.paths.weights_root):
                await self.load_newest_policy()
            elif self.config.adapter and self.config.transfer.collective:
                self.last_offer = -1  # the trainer offers its step-0 adapter first
                self.unlogged_served = await self.take_offers(0, 0, "the first batch (the trainer's step-0 adapter)")
            elif self.config.adapter:
                await self.load_first_adapter()
            for step in range(self.start_step, self.config.max_steps):
                await self.step(step)
            if self.config.transfer.collective:  # the trainer offers its last steps too, and waits until taken
                await self.take_offers(self.config.max_steps, self.config.max_steps, "the end of the run")
        await self.pool.close()
        self.metrics.close()

    async def step(self, step: int) -> None:
        wait_start = time.perf_counter()
        await self.check_servers()
        served = await self.ensure_policy(step) or self.unlogged_served
        self.unlogged_served = None
        gen_start = time.perf_counter()
        outcomes = await self.generate(step)
        outcomes = await self.remake_groups_of_changed_servers(outcomes, step)
        gen_time = time.perf_counter() - gen_start
        batch = self.build_batch(outcomes)
        write_batch(self.paths, step, balance_by_tokens(batch.samples, self.config.trainer_world_size))
        stats = self.step_stats(batch, outcomes) | {
            "policy_step": self.policy_step,
            "staleness": step - min(s.policy_version for s in batch.samples),
            "gen_s": gen_time,
            "wait_s": gen_start - wait_start,
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
            save_state(self.paths, step + 1, self.policy_step, self.samplers, self.config.ckpt.keep)

    async def ensure_policy(self, step: int) -> list[dict] | None:
        """Batch `step` may only use policies v_j with j >= step - async_level: wait for and load one. A server that
        restarted gets the run's newest policy before any request."""
        required = step - self.config.async_level
        await self.wait_for_a_server()
        if self.config.transfer.collective:
            return await self.take_offers(required, step, f"batch {step} (async_level={self.config.async_level})")
        up = self.up_servers()
        if self.policy_step >= required and not self.stale.intersection(up):
            self.usable = up
            return None
        if self.policy_step < required:
            what = f"weights of policy {required} (needed by batch {step} with async_level={self.config.async_level})"
            await asyncio.to_thread(wait_for_stable, self.paths.weights(required), self.config.weights_timeout_s, what)
        return await self.load_newest_policy()

    def up_servers(self) -> list[int]:
        return [i for i, instance in enumerate(self.instances) if instance != DOWN]

    async def check_servers(self) -> set[int]:
        """Ask every server what it serves; return those that restarted since the last answer (another instance: it
        serves what it loaded at start, not the run's policy) or stopped answering. Either gets no requests until
        it answers and is brought up to date (`ensure_policy`)."""
        changed = set()
        for i, reply in enumerate(await self.pool.current()):
            if isinstance(reply, str):
                if self.instances[i] != DOWN:
                    self.logger.warning(f"server {i} gets no requests until it answers again: {reply}")
                    changed.add(i)
                self.instances[i], self.served_steps[i] = DOWN, -1
                self.stale.add(i)
                continue
            if self.instances[i] is not None and reply["instance"] != self.instances[i]:
                was = "answers again" if self.instances[i] == DOWN else "restarted"
                self.logger.warning(f"server {i} {was}: it serves policy {reply['step']} and gets no requests until "
                                    "it is brought up to date")
                changed.add(i)
                self.served_steps[i] = reply["step"]
                self.stale.add(i)
            self.instances[i] = reply["instance"]
        return changed

    async def wait_for_a_server(self) -> None:
        """While no server answers, wait for one, at most client.startup_timeout_s (at once if one answers)."""
        deadline = time.monotonic() + self.config.client.startup_timeout_s
        while all(instance == DOWN for instance in self.instances):
            if time.monotonic() > deadline:
                raise InferenceError(f"no inference server answered for {self.config.client.startup_timeout_s:.0f} s "
                                     f"({[url_without_password(u) for u in self.config.client.base_urls]})")
            await asyncio.sleep(1.0)
            await self.check_servers()

    async def remake_groups_of_changed_servers(self, outcomes: list[GroupOutcome], step: int) -> list[GroupOutcome]:
        """Groups generated on a server that restarted or stopped answering meanwhile may come from other weights than
        the policy they are labelled with, or have failed for it: made again on the servers up to date, up to
        REMAKE_ROUNDS times (each waits for a server to answer), then dropped."""
        for _ in range(REMAKE_ROUNDS):
            changed = await self.check_servers()
            redo = [g for g, outcome in enumerate(outcomes) if outcome.server in changed]
            if not redo:
                return outcomes
            self.logger.warning(f"batch {step}: {len(redo)} groups of servers {sorted(changed)} are made again")
            await self.ensure_policy(step)
            remade = await asyncio.gather(*(self.run_one_group(outcomes[g].env, outcomes[g].task_index,
                                                               self.usable[g % len(self.usable)], step, g)
                                            for g in redo))
            for g, outcome in zip(redo, remade):
                outcomes[g] = outcome
        changed = await self.check_servers()
        for outcome in outcomes:
            if outcome.server in changed:
                outcome.results, outcome.error = None, "ServerChanged"
                outcome.message = f"server {outcome.server} restarted or stopped answering while batch {step} was made"
        return outcomes

    async def take_offers(self, required: int, newest: int, needed_by: str) -> list[dict] | None:
        """Over the wire the trainer waits on every step it offers until it is taken, so every offer is taken, in
        order, at each batch boundary; while no server serves `required` or newer, wait for the next offer, up to
        policy `newest` (the last the trainer can offer before this point). Servers left behind (their transfer
        failed, or they restarted) get no requests until an offer brings them up to date. No offer is taken while no
        server answers: it would reach nobody."""
        served = None
        deadline = time.monotonic() + self.config.weights_timeout_s
        while True:
            pending = [k for k in self.offered_up_to(newest) if k > self.last_offer]
            if pending:
                await self.check_servers()
                await self.wait_for_a_server()
                served = await self.take(pending[0]) or served
                continue
            self.usable = [i for i, s in enumerate(self.served_steps) if s >= required]
            if self.usable:
                self.policy_step = min(self.served_steps[i] for i in self.usable)
                return served
            if self.last_offer >= newest and (served := await self.catch_up_from_files(required)):
                continue  # no offer will come before this batch: a checkpoint's files brought servers up to date
            if self.last_offer >= newest:  # the last offer possible failed everywhere, and the next needs this batch
                raise InferenceError(f"{needed_by} needs policy {required}, but no server serves it (they serve "
                                     f"policies {self.served_steps}; -1: not answering): its transfer failed or the "
                                     "servers restarted since, and no checkpoint's files hold it (see the warnings "
                                     "above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.config.weights_timeout_s:.0f} s for the trainer's offer of policy "
                                   f"{required} (needed by {needed_by})")
            await asyncio.sleep(0.02)

    def offered_up_to(self, newest: int) -> list[int]:
        """The steps offered, up to `newest`: the trainer waits on each offer until it is taken, so it cannot have
        offered a later one; a file that says so is not the trainer's, and taking it would skip every real offer
        before its step."""
        offered = offered_steps(self.config.output_dir)
        for step in sorted(set(k for k in offered if k > newest) - self.offers_beyond):
            self.logger.warning(f"offer of policy {step} not taken: the trainer cannot have offered a policy after "
                                f"{newest} yet")
            self.offers_beyond.add(step)
        return [k for k in offered if k <= newest]

    async def take(self, step: int) -> list[dict] | None:
        """Take the trainer's offer of `step`: every server receives it at once; one that refuses or fails keeps the
        weights it verified last (the next offer brings it up to date). An offer that is not as the trainer writes
        them is not taken (read off the event loop: it may be anything)."""
        try:
            offer = await asyncio.to_thread(read_offer, self.config.output_dir, step, self.config.transfer.host)
        except TransferError as e:
            self.logger.warning(f"offer of policy {step} not taken: {e}")
            self.last_offer = step
            return None
        if offer is None:
            raise InferenceError(f"the trainer's offer of policy {step} disappeared before it was taken")
        self.last_offer = step
        up = self.up_servers()
        write_take(self.config.output_dir, step, len(up))
        results = await self.pool.receive_weights(step, offer.host, offer.port, self.config.transfer.timeout_s, up)
        results = await self.held_to_the_trainers_checksum(step, up, results)
        for i, result in zip(up, results):
            if isinstance(result, str):
                self.logger.warning(f"policy {step} did not reach server {i}: {result}")
            else:
                self.served_steps[i] = result["step"]
        taken = [r for r in results if not isinstance(r, str)]
        if len(taken) < len(results):
            await self.check_servers()  # one that stopped or restarted mid-transfer gets no requests until it is back
        self.logger.info(f"policy {step} went over the wire to {len(taken)} of {len(up)} servers (checksums "
                         f"{[r['weights_checksum'] for r in taken]}); they serve policies {self.served_steps}")
        return taken or None

    async def held_to_the_trainers_checksum(self, step: int, servers: list[int], results: list[dict | str]
                                            ) -> list[dict | str]:
        """A server that reports step `step` with a checksum other than the one the trainer sent (or where the
        trainer sent none) is refused as if its transfer had failed: it gets no requests until a later step brings it
        up to date."""
        if all(isinstance(r, str) for r in results):
            return results
        sent = await asyncio.to_thread(read_sent, self.config.output_dir, step, self.config.transfer.timeout_s)
        held = []
        for i, result in zip(servers, results):
            if not isinstance(result, str) and result.get("weights_checksum") != sent:
                result = (f"it reports it serves checksum {result.get('weights_checksum')}, but the trainer sent "
                          f"{sent or 'no step'}: its policy {step} is refused")
                self.logger.error(f"server {i} serves weights the trainer did not send as policy {step}: {result}")
            held.append(result)
        return held

    async def load_first_adapter(self) -> None:
        """With LoRA the servers start with the base model alone; requests name the adapter, so the trainer's
        step-0 adapter (B = 0: the base model's outputs) is served before the first rollout."""
        what = "the trainer's step-0 LoRA adapter (published once the trainer has loaded the model)"
        await asyncio.to_thread(wait_for_stable, self.paths.weights(0), self.config.weights_timeout_s, what)
        served = self.unlogged_served = await self.pool.update_weights(0, str(self.paths.weights(0).absolute()))
        self.logger.info(f"inference now serves adapter {self.config.adapter!r} of policy 0 ({len(served)} servers)")

    async def load_newest_policy(self) -> list[dict]:
        """Every server that answers loads the newest published weights (none yet: each serves the base model, policy
        0, as a restarted one does)."""
        up = self.up_servers()
        self.stale -= set(up)
        self.usable = up
        newest = max(stable_steps(self.paths.weights_root), default=None)
        if newest is None:
            return None
        served = await self.pool.update_weights(newest, str(self.paths.weights(newest).absolute()), up)
        self.logger.info(f"inference now serves policy {newest} ({len(served)} servers)")
        self.policy_step = self.last_offer = newest
        for i in up:
            self.served_steps[i] = newest
        return served

    async def catch_up_from_files(self, required: int) -> list[dict] | None:
        """Over the wire, servers behind `required` load the newest checkpoint's files where they hold it (a server
        restarted after the offer it needed was taken); what they now serve, or None where no files will do."""
        newest = max(stable_steps(self.paths.weights_root), default=-1)
        behind = [i for i in self.up_servers() if self.served_steps[i] < newest]
        if newest < required or not behind:
            return None
        served = await self.pool.update_weights(newest, str(self.paths.weights(newest).absolute()), behind)
        for i in behind:
            self.served_steps[i] = newest
        self.logger.info(f"servers {behind} load policy {newest} from its checkpoint's files (no offer of it is left)")
        return served

    async def generate(self, step: int) -> list[GroupOutcome]:
        config = self.config
        groups = config.batch_size // config.rollouts_per_example
        counts = groups_per_env(groups, [e.ratio for e in config.env])
        jobs = []
        for env, sampler, count in zip(self.envs, self.samplers, counts):
            for task_index in sampler.draw(count):
                g = len(jobs)
                jobs.append(self.run_one_group(env, task_index, self.usable[g % len(self.usable)], step, g))
        return await asyncio.gather(*jobs)

    async def run_one_group(self, env: Environment, task_index: int, server: int, step: int, g: int) -> GroupOutcome:
        """Run the group; retry it up to rollout.max_retries times, then drop it with its error counted."""
        s = self.config.sampling
        n = self.config.rollouts_per_example
        seed = None if s.seed is None else s.seed + (step * self.config.batch_size) + g * n
        policy_step = self.policy_step
        rollout = self.config.rollout
        outcome = await run_group_retried(
            env, task_index, n, self.clients[server], to_sampling(s, seed), self.semaphore, rollout.timeout_s,
            rollout.max_retries, self.logger.warning,
        )
        outcome.policy_step, outcome.server, outcome.task_index = policy_step, server, task_index
        return outcome

    def build_batch(self, outcomes: list[GroupOutcome]) -> StepBatch:
        batch = StepBatch([])
        for outcome in outcomes:
            if outcome.results is None:
                batch.drop(f"group_failed:{outcome.error}", outcome.env.name, self.config.rollouts_per_example)
                continue
            batch.kept.setdefault(outcome.env.name, []).extend(outcome.results)
            batch.samples.extend(self.group_samples(outcome, batch))
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
            batch.drop("zero_variance_group", env, len(results))
            return []
        samples = []
        for result, advantage, trainable in zip(results, *computed):
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
            "group_retries": sum(o.retries for o in outcomes if o.results is not None),
            "completion_tokens": sum(r.sampled_tokens for rs in batch.kept.values() for r in rs),
        }

    async def run_eval(self) -> dict:
        start = time.perf_counter()
        rollout = self.config.rollout
        stats = await evaluate(
            self.config.eval, self.eval_envs, self.clients, self.semaphore, rollout.timeout_s, rollout.max_retries,
            self.logger.warning,
        )
        return stats | {"eval/time_s": time.perf_counter() - start}

    def log_samples(self, step: int, batch: StepBatch) -> None:
        """A few completions per step in the W&B table (only when W&B is on)."""
        count = self.config.num_samples_logged
        if self.metrics.run is None or not count:
            return
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.config.model.name)
        decode = self.tokenizer.decode
        rows = [
            [step, name, decode(r.segments[-1].prompt_ids), decode(r.segments[-1].completion_ids), r.reward]
            for name, results in batch.kept.items()
            for r in results[:count]
        ]
        self.metrics.log_table("samples", ["step", "env", "prompt", "completion", "reward"], rows, step)


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
    config = run_cli(OrchestratorConfig)
    logger = setup_logging("orchestrator", quiet=PER_REQUEST_LOGGERS)
    try:
        orchestrator = Orchestrator(config, logger)
    except (ConfigError, EnvLoadError) as e:
        logger.error(str(e))
        sys.exit(2)
    asyncio.run(orchestrator.run())


if __name__ == "__main__":
    main()
