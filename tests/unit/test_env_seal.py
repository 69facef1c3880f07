"""An env server beyond loopback is sealed with the run's secret (rl/envs/seal.py): a real env server on TCP, reached
by verifiers' own client sealed or not; a peer without the secret gets nothing run (the model it names is never
called), and neither end starts beyond loopback without a secret."""

import asyncio
import json
import os
import subprocess
import sys

import pytest
import verifiers.v1 as vf
from pydantic import ValidationError
from verifiers.v1.serve import EnvClient

from rl.envs.config import EnvConfig
from rl.envs.seal import beyond_loopback, seal_client
from rl.envs.server import EnvServerConfig
from rl.envs.loading import load_environment
from rl.envs.process_setup import apply_patches
from tests.conftest import ROOT
from tests.integration.launched import free_port, stop_process
from tests.unit.test_eval_chat_api import KEY, MODEL, FakeOpenAI, fake_openai  # noqa: F401, F811 - a fixture

SECRET = "a-run-secret-of-32-characters-xx"


def test_only_tcp_addresses_other_hosts_reach_count_as_beyond_loopback():
    beyond = ["tcp://0.0.0.0:5000", "tcp://*:5000", "tcp://10.0.0.2:5000", "tcp://envs.cluster:5000", "tcp://[::]:1"]
    local = ["tcp://127.0.0.1:5000", "tcp://127.0.0.2:5000", "tcp://localhost:5000", "tcp://[::1]:5000",
             "ipc:///tmp/x.sock", "inproc://x"]
    assert [beyond_loopback(a) for a in beyond] == [True] * len(beyond)
    assert [beyond_loopback(a) for a in local] == [False] * len(local)


def test_neither_end_goes_beyond_loopback_without_a_secret(monkeypatch):
    monkeypatch.delenv("RL_ENV_SERVER__SECRET", raising=False)
    with pytest.raises(ValidationError, match="reaches beyond this host.*set secret"):
        EnvServerConfig(env=EnvConfig(id="reverse-text"), address="tcp://0.0.0.0:5000")
    with pytest.raises(ValidationError, match="env server beyond this host.*set secret"):
        EnvConfig(id="reverse-text", address="tcp://10.0.0.2:5000")
    with pytest.raises(ValidationError, match="at least 16 characters"):
        EnvConfig(id="reverse-text", address="tcp://10.0.0.2:5000", secret="short")
    EnvServerConfig(env=EnvConfig(id="reverse-text"), address="tcp://127.0.0.1:5000")  # loopback: this host's
    monkeypatch.setenv("RL_ENV_SERVER__SECRET", SECRET)  # exported for the run, read by both ends
    assert EnvConfig(id="reverse-text", address="tcp://10.0.0.2:5000").secret == SECRET
    assert EnvServerConfig(env=EnvConfig(id="reverse-text"), address="tcp://0.0.0.0:5000").secret == SECRET


@pytest.fixture
def sealed_server(tmp_path, fake_openai):  # noqa: F811
    address = f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path / "env-server.log", "w")
    # its episodes send FAKE_KEY: only to the model endpoint named (without one, a key goes nowhere)
    proc = subprocess.Popen([sys.executable, "-m", "rl.envs.server", "--env.id", "reverse-text", "--env.args",
                             '{"num_examples": 4}', "--workers", "1", "--address", address, "--secret", SECRET,
                             "--client-env-vars", '["FAKE_KEY"]', "--model-endpoints", json.dumps([fake_openai])],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"FAKE_KEY": KEY})
    yield address, tmp_path / "env-server.log"
    stop_process(proc)
    log.close()


async def answered(health, timeout_s: float) -> bool:
    try:
        return await asyncio.wait_for(health, timeout_s)
    except TimeoutError:
        return False


def test_a_peer_without_the_secret_gets_nothing_run(sealed_server, fake_openai):  # noqa: F811
    address, log = sealed_server
    apply_patches()
    FakeOpenAI.requests.clear()
    task = load_environment(EnvConfig(id="reverse-text", args={"num_examples": 4})).task(0)

    async def scenario(url: str) -> None:
        sealed, strangers = EnvClient(address), [EnvClient(address), EnvClient(address)]
        seal_client(sealed, SECRET)
        seal_client(strangers[1], "another-secret-of-32-characters")
        try:
            await asyncio.wait_for(sealed.wait_for_server_startup(timeout=60, interval=0.5), 60)
            client = vf.EvalClientConfig(base_url=url, api_key_var="FAKE_KEY")
            sampling = vf.SamplingConfig(max_tokens=8)
            for stranger in strangers:
                # no answer: ZMQ may also hold the stranger's send while its handshake fails (a DEALER with no peer)
                assert not await answered(stranger.health(timeout=2.0), 5)
                run = asyncio.ensure_future(stranger.run(client, MODEL, sampling, task.data.model_dump()))
                done, _ = await asyncio.wait([run], timeout=5)
                assert not done  # no reply: the server never saw the request
                run.cancel()
            assert FakeOpenAI.requests == []  # no episode ran: the model was never called
            episode = await asyncio.wait_for(sealed.run(client, MODEL, sampling, task.data.model_dump()), 60)
            assert not episode.errors and len(FakeOpenAI.requests) == 1, episode.errors  # the run's client: it ran
        finally:
            for c in (sealed, *strangers):
                c.socket.close(linger=0)  # a client left waiting on a peer that never answered
                await c.close()

    asyncio.run(scenario(fake_openai))
    assert "is sealed: only clients that hold the run's secret are admitted" in log.read_text()
