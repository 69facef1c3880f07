"""rl's env server (`env-server`, rl/env_server.py): an environment served by verifiers' env-server pool, its
episodes run in worker processes that call the real inference server themselves, sent and received through
verifiers' own `EnvClient`."""

import asyncio
import re
import subprocess
import sys

import pytest
import verifiers.v1 as vf
from verifiers.v1.serve import EnvClient

from rl.config import EnvConfig
from rl.orchestrator.environment import load_environment
from rl.orchestrator.rollouts import to_result
from rl.renderer import renderer_config
from rl.tiny_model import build_tiny_model
from tests.conftest import ROOT
from tests.integration.inference_server import Server, stop_process

pytestmark = pytest.mark.integration
ARGS = {"num_examples": 20}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("env_server")
    build_tiny_model(root / "model")
    server = Server(root / "model", root, root / "inference.log")
    yield server
    server.stop()


def start_env_server(tmp_path, workers: int) -> tuple[subprocess.Popen, str]:
    address = f"ipc://{tmp_path}/reverse-text.sock"
    log = open(tmp_path / "env-server.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "rl.env_server", "--env.id", "reverse-text", "--env.args", str(ARGS).replace("'", '"'),
         "--workers", str(workers), "--address", address], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return process, address


def train_client(server) -> vf.TrainClientConfig:
    renderer = renderer_config("auto", str(server.model))[0]
    return vf.TrainClientConfig(base_url=f"{server.url}/v1", renderer=renderer, renderer_model_name=str(server.model))


def test_episodes_run_in_the_pools_workers_and_come_back_as_token_samples(server, tmp_path):
    environment = load_environment(EnvConfig(id="reverse-text", args=ARGS))  # the orchestrator's side: the taskset
    process, address = start_env_server(tmp_path, workers=2)

    async def go():
        client = EnvClient(address)
        try:
            await client.wait_for_server_startup(timeout=120)
            sampling = vf.SamplingConfig(temperature=1.0, max_tokens=12)
            tasks = [environment.task(i) for i in range(4)]
            episodes = await asyncio.gather(*(
                client.run(train_client(server), str(server.model), sampling, task.data.model_dump())
                for task in tasks))
            return tasks, episodes
        finally:
            await client.close()

    try:
        tasks, episodes = asyncio.run(go())
    finally:
        stop_process(process)
    log = (tmp_path / "env-server.log").read_text()
    for i, (task, episode) in enumerate(zip(tasks, episodes)):
        result = to_result(i, task, episode)
        assert result.segments and 0.0 <= result.reward <= 1.0
        segment = result.segments[0]
        assert segment.prompt_ids and 1 <= len(segment.completion_ids) <= 12
        assert all(lp <= 0.0 for lp in segment.completion_logprobs)
    assert "2 workers; seat 'agent': harness 'reverse-text'" in log, log[-2000:]
    workers = set(re.findall(r"env-server\[(\d+)\] INFO EnvServer up: taskset=reverse-text address=ipc://", log))
    assert len(workers) == 2, log[-2000:]  # each its own process, loaded before the first episode was sent


def test_a_wrong_env_table_fails_the_start_naming_the_key(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rl.env_server", "--env.id", "reverse-text", "--env.args",
                           '{"num_examples": "many"}', "--address", f"ipc://{tmp_path}/x.sock"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "num_examples" in done.stderr, done.stderr[-2000:]
