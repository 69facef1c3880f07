"""The orchestrator's continuous dispatch end to end, with the real Orchestrator, its batch files and checkpoints, and
fake groups in place of inference: episodes of different lengths, weights that change while they run (each token
labelled with the policy its server served), a kill and a resume with groups in flight."""

import asyncio
import logging

import pytest

from rl.envs.rollouts import GroupOutcome, RolloutResult, TokenSegment
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.main import Orchestrator
from rl.protocol import RunPaths, read_batch, read_metrics, stable_steps

PROMPT_BASE = 10_000  # a sample's prompt token names its task: PROMPT_BASE + task
TRAIN_S, TOKEN_S = 0.015, 0.005


def tokens_of(task: int) -> int:
    """Long-tailed: every 7th task samples 20 tokens a rollout (~7 trainer steps), every 3rd 6 (~2), the rest 1."""
    return 20 if task % 7 == 0 else 6 if task % 3 == 0 else 1


class FakeSync:
    """The servers serve policy step - 1 (async_level 1) from the moment a batch asks for it, after a trainer step of
    TRAIN_S."""

    def __init__(self, orchestrator):
        self.o = orchestrator

    async def start(self, resumed):
        return None

    async def ensure(self, step):
        await asyncio.sleep(TRAIN_S)
        self.o.servers.policy_step = max(self.o.servers.policy_step, step - 1)
        return None

    async def finish(self):
        pass


class FakeServers:
    """One server, always up; `policy_step` is what it serves."""

    def __init__(self):
        self.policy_step, self.usable = 0, [0]

    async def check(self):
        return set()


def orchestrator(tmp_path, model, resume_step=None, **overrides) -> Orchestrator:
    config = OrchestratorConfig(model={"name": str(model)}, output_dir=tmp_path / "run", batch_size=4,
                                rollouts_per_example=2, max_concurrent=8,
                                max_steps=8, ckpt={"interval": 1, "keep": 20}, resume_step=resume_step,
                                **overrides)
    o = Orchestrator(config, logging.getLogger("test"))
    o.servers = o.runner.servers = FakeServers()
    o.sync = o.runner.sync = FakeSync(o)
    o.pool.metrics = lambda: asyncio.sleep(0, [None])  # no server's /metrics
    o.runner.run = lambda env, task, server, number: episode(o, env, task, server)
    return o


async def episode(o: Orchestrator, env, task: int, server: int) -> GroupOutcome:
    """`tokens_of(task)` tokens per rollout, TOKEN_S apart, each labelled with the policy served as it is sampled."""
    dispatched = o.servers.policy_step
    results = []
    for j in range(o.config.rollouts_per_example):
        versions = []
        for _ in range(tokens_of(task)):
            versions.append(o.servers.policy_step)
            await asyncio.sleep(TOKEN_S)
        segment = TokenSegment([PROMPT_BASE + task], list(range(len(versions))), [1] * len(versions),
                               [-0.5] * len(versions), completion_versions=versions)
        results.append(RolloutResult(task, str(task), [segment], float(j), {}, {}, False, len(versions)))
    outcome = GroupOutcome(env, results, server=server, task_index=task)
    outcome.policy_step = dispatched
    return outcome


def trained_tasks(paths: RunPaths, step: int) -> list[int]:
    return sorted({s.input_ids[0] - PROMPT_BASE for s in read_batch(paths, step, 0)})


async def run_steps(o: Orchestrator, steps) -> None:
    for step in steps:
        await o.step(step)


def test_a_kill_with_groups_in_flight_then_a_resume_trains_each_task_once(tmp_path, tiny_model):
    paths = RunPaths(tmp_path / "run")
    first = orchestrator(tmp_path, tiny_model)

    async def until_killed():
        await run_steps(first, range(5))
        pending = first.groups.pending()
        for running in first.groups.running:  # kill -9: nothing more happens; no close
            running.job.cancel()
        return pending

    in_flight_at_kill = asyncio.run(until_killed())
    assert in_flight_at_kill, "the test needs groups in flight at the kill"
    # the checkpoint the resume starts from: after batch 3, before batch 4 was written (batch 4 is made again)
    saved = __import__("json").loads((paths.checkpoint(4) / "orchestrator" / "state.json").read_text())
    pending_at_checkpoint = {task for _, task in saved["pending"]}
    assert pending_at_checkpoint

    resumed = orchestrator(tmp_path, tiny_model, resume_step=4)
    asyncio.run(run_steps(resumed, range(4, 8)))
    per_step = [trained_tasks(paths, step) for step in stable_steps(paths.rollouts_root)]
    trained = [task for tasks in per_step for task in tasks]
    assert len(trained) == len(set(trained)), f"a task trained twice: {per_step}"
    later = {task for tasks in per_step[4:] for task in tasks}
    left = {task for _, task in resumed.groups.pending()}
    assert pending_at_checkpoint <= later | left, "groups in flight at the checkpoint were lost"
    assert later - pending_at_checkpoint  # and the samplers went on past them


def test_long_episodes_span_weight_updates_token_by_token_and_nothing_trains_past_the_bound(tmp_path, tiny_model):
    o = orchestrator(tmp_path, tiny_model, max_off_policy_steps=3)
    asyncio.run(run_steps(o, range(10)))
    paths = RunPaths(tmp_path / "run")
    orchestrator_records = [m for m in read_metrics(paths) if m["process"] == "orchestrator"]
    assert [m["step"] for m in orchestrator_records] == list(range(10))
    spanning = []
    for step in range(10):
        for sample in read_batch(paths, step, 0):
            sampled = [v for v, m in zip(sample.token_versions, sample.loss_mask) if m]
            assert step - min(sampled) <= 3, f"step {step} trains a token of policy {min(sampled)}"
            assert sample.policy_version == min(sampled)
            if len(set(sampled)) > 1:
                spanning.append(sample)
    assert spanning, "no rollout spanned a weight update"
    assert any(m["rollouts_in_flight"] > 0 for m in orchestrator_records)
    assert any(m["off_policy/in_flight"] > 0 for m in orchestrator_records)
    # the long ones outlive the bound: withheld, alone, never cancelled
    assert sum(m["off_policy/withheld"] for m in orchestrator_records) > 0
    assert all(m["off_policy/max"] <= 3 for m in orchestrator_records)
    assert all("time/wait_for_policy" in m for m in orchestrator_records)


def test_continuous_dispatch_refuses_on_policy_batches_and_a_bound_below_async_level():
    with pytest.raises(ValueError, match="async_level = 0"):
        OrchestratorConfig(dispatch="continuous", async_level=0)
    with pytest.raises(ValueError, match="max_off_policy_steps >= 2"):
        OrchestratorConfig(async_level=2, max_off_policy_steps=1)
    assert not OrchestratorConfig(async_level=0).continuous and OrchestratorConfig().continuous
