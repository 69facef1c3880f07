"""The orchestrator against one real inference server per module: every environment kind, env mixing, each
advantage type, the staleness bound at async_level 0 and 2 (weights published by copying the model, no
trainer), eval, and W&B offline files."""

import asyncio
import dataclasses
import logging
import re
import shutil
import threading
import time

import httpx
import psutil
import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from rl.orchestrator.advantage import compute_advantages
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.main import Orchestrator
from rl.envs.config import EnvConfig
from rl.envs.loading import load_environment
from rl.envs.rollouts import InferenceClient, Sampling, run_group
from rl.renderer import renderer_config
from rl.protocol import RunPaths, is_stable, mark_stable, read_batch, read_metrics
from rl.tiny_model import build_tiny_model
from tests.conftest import ROOT
from tests.integration.inference_server import Server

pytestmark = pytest.mark.integration
ENVS = {
    "reverse-text": {"num_examples": 50},
    "guess-number": {"num_examples": 50, "max_guesses": 2},
    "tool-calc": {"num_examples": 50},
    "reasoning-gym-env": {"dataset": "basic_arithmetic", "num_examples": 50, "dataset_args": {"max_terms": 2}},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tmp_path_factory.mktemp("orchestrator") / "model"
    build_tiny_model(model)
    return model


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")  # the runs below publish into their own run dirs
    server = Server(model_dir, weights.parent, weights / "inference.log", max_model_len=2048)  # tool-calc: tool schemas
    yield server
    server.stop()


def client(server) -> InferenceClient:
    renderer = renderer_config("auto", str(server.model))[0]
    return InferenceClient(server.url, str(server.model), str(server.model), renderer)


def env_servers_started() -> list[str]:
    """The env servers this process started (its children; their workers, forked, are theirs)."""
    return [" ".join(p.cmdline()) for p in psutil.Process().children() if "rl.envs.server" in p.cmdline()]


@pytest.mark.parametrize("workers", [None, 0], ids=["env-server", "in-process"])
@pytest.mark.parametrize("env_id", list(ENVS))
def test_each_environment_returns_scored_token_samples(server, env_id, workers):
    env = load_environment(EnvConfig(id=env_id, args=ENVS[env_id], workers=workers))

    async def go():
        async with env.serving():
            started = env_servers_started()
            return await run_group(env, 0, 4, client(server), Sampling(max_tokens=12), timeout_s=120), started

    results, started = asyncio.run(go())
    assert len(started) == (0 if workers == 0 else 1), started  # workers = 0: the episodes ran in this process
    assert len(results) == 4
    for r in results:
        assert 0.0 <= r.reward <= 1.2 and r.segments
        # every sampled token is counted once, whatever the number of segments
        assert 1 <= r.sampled_tokens <= 12 * r.num_turns
        for segment in r.segments:
            assert segment.prompt_ids and segment.completion_ids and segment.completion_mask[0] == 1
            assert len(segment.completion_ids) == len(segment.completion_mask) == len(segment.completion_logprobs)
            pairs = list(zip(segment.completion_logprobs, segment.completion_mask))
            assert all(lp <= 0.0 for lp, m in pairs if m) and all(lp == 0.0 for lp, m in pairs if not m)
    if env_id == "guess-number":
        assert_env_turns_masked(server, results)
    if env_id == "tool-calc":
        assert set(results[0].rewards) == {"correct", "tool_use"}
    if env_id == "reasoning-gym-env":  # a Taskset-only package: scored by its own reward and metric
        assert set(results[0].rewards) == {"dataset_score"} and set(results[0].metrics) == {"exact"}


def generate_requests(server) -> float:
    """The generate requests the server has answered, from its Prometheus metrics."""
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    answered = r'http_requests_total\{handler="/inference/v1/generate",method="POST",status="2xx"\} (\S+)'
    found = re.search(answered, metrics)
    return float(found.group(1)) if found else 0.0


def test_a_groups_first_turns_reach_vllm_as_one_request_and_each_rollout_gets_its_own_sample(server):
    env = load_environment(EnvConfig(id="reverse-text", args=ENVS["reverse-text"]))

    async def group(gap_s: float):
        async with env.serving():
            sampler = dataclasses.replace(client(server), group_gap_s=gap_s)
            return await run_group(env, 1, 8, sampler, Sampling(max_tokens=12), timeout_s=120)

    before = generate_requests(server)
    grouped = asyncio.run(group(5.0))  # a full group goes at once: the gap is never waited
    between = generate_requests(server)
    alone = asyncio.run(group(0.0))
    assert (between - before, generate_requests(server) - between) == (1, 8)
    for results in (grouped, alone):
        completions = {tuple(r.segments[0].completion_ids) for r in results}
        assert len(completions) > 1  # eight samples, not one sample eight times
        assert all(len(r.segments[0].completion_logprobs) == len(r.segments[0].completion_ids) for r in results)


def assert_env_turns_masked(server, results):
    """The tiny model never guesses right, so the env answered; its reply is never a trained token."""
    tokenizer = AutoTokenizer.from_pretrained(server.model)
    multi = [r for r in results if r.num_turns > 1]
    assert multi, [r.num_turns for r in results]
    for r in multi:
        masked, trained = [], []
        for segment in r.segments:
            masked += segment.prompt_ids
            for token, m in zip(segment.completion_ids, segment.completion_mask):
                (trained if m else masked).append(token)
        assert any(w in tokenizer.decode(masked) for w in ("higher", "lower", "Reply with a number"))
        assert not any(w in tokenizer.decode(trained) for w in ("<|im_start|>user", "Reply with a number"))


class Publisher:
    """Stands in for the trainer: after batch j-1 is STABLE, publish weights/step_j (the model, with
    lm_head.weight written) so the orchestrator can move inference forward."""

    def __init__(self, model_dir, paths: RunPaths, max_steps: int):
        self.model_dir, self.paths, self.max_steps = model_dir, paths, max_steps
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        for step in range(1, self.max_steps + 1):
            while not is_stable(self.paths.rollouts(step - 1)):
                if self.stop.wait(0.2):
                    return
            self.publish(step)

    def publish(self, step: int):
        out = self.paths.weights(step)
        tmp = out.with_name(out.name + ".tmp")
        shutil.copytree(self.model_dir, tmp)
        state = load_file(tmp / "model.safetensors")
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        save_file(state, tmp / "model.safetensors")
        tmp.rename(out)
        mark_stable(out, step=step)  # as the trainer marks it: the exact manifest of the step


def orchestrator_config(server, out, async_level: int, max_steps: int = 3, **extra) -> OrchestratorConfig:
    """Two environments mixed, groups of 2, 8 samples a step; `extra` sets or replaces fields."""
    return OrchestratorConfig(**{
        "model": {"name": str(server.model)},
        "output_dir": out,
        "max_steps": max_steps,
        "async_level": async_level,
        "seq_len": 512,
        "env": [
            {"id": "reverse-text", "args": ENVS["reverse-text"], "ratio": 1.0},
            {"id": "guess-number", "args": ENVS["guess-number"], "ratio": 1.0},
        ],
        "batch_size": 8,
        "rollouts_per_example": 2,
        "sampling": {"max_tokens": 12},
        "client": {"base_urls": [server.url], "admin_token": server.token, "startup_timeout_s": 60},
        "weights_timeout_s": 120,
    } | extra)


def run_orchestrator(config: OrchestratorConfig, model_dir) -> list[dict]:
    paths = RunPaths(config.output_dir)
    publisher = Publisher(model_dir, paths, config.max_steps)
    try:
        asyncio.run(Orchestrator(config, logging.getLogger("test")).run())
    finally:
        publisher.stop.set()
        publisher.thread.join(10)
    return [m for m in read_metrics(paths) if m["process"] == "orchestrator"]


@pytest.mark.parametrize("async_level", [0, 2])
def test_env_mixing_and_staleness_bound(server, model_dir, tmp_path, async_level):
    """async_level 0: step by step, on-policy; 2: continuous dispatch, tokens at most 2 policies old."""
    bound = {"max_off_policy_steps": async_level} if async_level else {}
    config = orchestrator_config(server, tmp_path / "run", async_level, **bound)
    metrics = run_orchestrator(config, server.model)
    paths = RunPaths(config.output_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for k, m in enumerate(metrics):
        versions = [s.policy_version for s in read_batch(paths, k, 0)]
        assert len(versions) >= 1 and m["samples"] == len(versions)
        assert min(versions) >= k - async_level, (k, versions)  # the staleness bound
        assert m["staleness"] <= async_level
        assert {"reward/reverse-text", "reward/guess-number", "reward/guess-number/closeness"} <= set(m)
    if async_level == 0:
        assert [m["policy_step"] for m in metrics] == [0, 1, 2]  # on-policy: inference moved every step


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_each_advantage_type_reaches_the_batch(server, tmp_path, kind):
    """The batch's advantages are the configured estimator's of each group's rewards. Single-turn rollouts give
    one sample each, and a group's samples share their prompt, which identifies the group in the batch."""
    config = orchestrator_config(
        server, tmp_path / "run", 0, max_steps=1, advantage={"type": kind}, batch_size=16, rollouts_per_example=4,
        env=[{"id": "reverse-text", "args": ENVS["reverse-text"]}],
    )
    run_orchestrator(config, server.model)
    groups: dict[tuple[int, ...], list] = {}
    for sample in read_batch(RunPaths(config.output_dir), 0, 0):
        groups.setdefault(tuple(sample.input_ids[:sample.loss_mask.index(1)]), []).append(sample)
    assert sorted(len(group) for group in groups.values()) == [4, 4, 4, 4]
    assert any(len({s.reward for s in group}) > 1 for group in groups.values()), "every group scored alike"
    for group in groups.values():
        expected = compute_advantages(kind, [s.reward for s in group])
        # rewards are stored as float32
        assert [s.advantage for s in group] == pytest.approx(expected, rel=1e-3, abs=1e-6), kind


def test_a_step_is_logged_before_its_state_is_saved(server, tmp_path):
    """A resume from checkpoint k never runs step k - 1 again, so its metrics record must be written before the
    state is: here the record cannot be written (metrics.jsonl is a directory), and no state may follow."""
    config = orchestrator_config(server, tmp_path / "run", 0, max_steps=1, ckpt={"interval": 1})
    RunPaths(config.output_dir).metrics.mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        run_orchestrator(config, server.model)
    assert RunPaths(config.output_dir).checkpoint_steps("orchestrator") == []


def test_eval_and_wandb_offline(server, tmp_path):
    out = tmp_path / "run"
    config = orchestrator_config(
        server, out, 2,
        eval={"interval": 2, "num_examples": 3, "sampling": {"max_tokens": 8}},
        wandb={"project": "rl-test", "mode": "offline"},
    )
    metrics = run_orchestrator(config, server.model)
    evaluated = [m["step"] for m in metrics if "eval/reward" in m]
    assert evaluated == [1, 2]  # every 2 steps, and at the end
    for m in metrics:
        if m["step"] in evaluated:
            assert {"eval/reward/reverse-text", "eval/reward/guess-number"} <= set(m)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    (log,) = runs[0].glob("run-*.wandb")
    # W&B's service process writes the file; under load it can land a moment after finish() returns.
    expected = [b"orchestrator/samples", b"orchestrator/reward/reverse-text/lcs_ratio"]  # table, components
    deadline = time.monotonic() + 60
    while not all(key in log.read_bytes() for key in expected) and time.monotonic() < deadline:
        time.sleep(1)
    content = log.read_bytes()
    assert all(key in content for key in expected), f"{log} ({len(content)} bytes) lacks {expected}"


def test_a_harness_that_cannot_start_is_named_with_its_reason(server, tmp_path, monkeypatch, taskset_only_installed):
    """Every group of a step fails: the orchestrator stops naming the environment, how its seat runs, and the error."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fixtures" / "environments"))  # and its env server's (fixture)
    env = {"id": "taskset-only", "harness": {"id": "failing-harness"}}
    config = orchestrator_config(server, tmp_path / "run", 0, max_steps=1, env=[env], rollout={"max_retries": 0})
    with pytest.raises(RuntimeError) as error:
        run_orchestrator(config, server.model)
    message = str(error.value)
    assert "no rollout of the step is trainable" in message
    assert "seat 'agent': harness 'failing-harness' (as configured), runtime 'subprocess'" in message
    assert "4 of 4 groups failed, first: RolloutError" in message and "the network is unreachable" in message


def test_fill_batch_replaces_dropped_groups_until_the_step_is_full(server, tmp_path, monkeypatch,
                                                                   taskset_only_installed):
    """DAPO's dynamic sampling: cpu-score's groups are all 0 (the tiny model never repeats the word) and dropped;
    reverse-text's mostly differ in reward, and are drawn by a difficulty curriculum (the tiny model's rewards are
    low: its tasks go to the hard pool). Each step draws more groups, by ratio, until it has its 4 groups or
    has drawn its bound (the bound's cut: tests/unit/test_fill.py)."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "fixtures" / "environments"))
    env = [{"id": "reverse-text", "args": ENVS["reverse-text"], "sampler": {"type": "difficulty", "easy": 0.9}},
           {"id": "cpu-score", "args": {"score_ms": 0}}]
    max_extra = 16
    advantage = {"drop_zero_variance": True, "fill_batch": True, "max_extra_groups": max_extra}
    config = orchestrator_config(server, tmp_path / "run", 2, max_steps=2, env=env, advantage=advantage,
                                 dispatch="step")  # no loads; continuous fill: tests/unit/test_dispatch.py
    metrics = run_orchestrator(config, server.model)
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["samples"] == 2 * (4 - m["fill/short_groups"])  # groups of 2
        assert m["reward/cpu-score"] == 0 and m["dropped_groups/cpu-score"] == 2 + m["extra_groups/cpu-score"]
        assert m["extra_groups/reverse-text"] + m["extra_groups/cpu-score"] == m["fill/extra_groups"] <= max_extra
        # full, or short only once the bound is drawn (a tiny model's reverse-text group may score alike too)
        assert m["fill/rounds"] >= 1 and (m["fill/short_groups"] == 0 or m["fill/extra_groups"] == max_extra), m
        # reverse-text draws from a curriculum: its 50 tasks in pools, those seen out of medium unless mid-reward
        pools = [m[f"curriculum/reverse-text/{pool}"] for pool in ("easy", "medium", "hard")]
        assert sum(pools) == 50 and pools[1] < 50 and not any(k.startswith("curriculum/cpu-score") for k in m)
