"""What an env server takes from its peers (rl/envs/trust.py, rl/envs/watch.py), against a real env server: a frame
it cannot decode is answered and its worker lives; a message past the size bound is dropped whole; a hung worker takes
the server down, named, by a deadline that exists by default; a request's client reads only the variables the server
allows and calls only the endpoints it allows. And the launcher's children that run environments' code get none of
its secrets but the ones they need (rl/launcher/supervisor.py)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgpack
import psutil
import pytest
import verifiers.v1 as vf
import zmq
import zmq.asyncio
from verifiers.v1.serve import EnvClient

from rl.config import API_KEY_VAR
from rl.envs.config import EnvConfig, EnvServerConfig
from rl.envs.loading import load_environment
from rl.envs.trust import ClientPolicy
from rl.envs.watch import WORKER_DIED
from rl.envs.process_setup import apply_patches
from rl.launcher.supervisor import ChildSpec, Supervisor, inherited_environment, is_secret
from rl.protocol import RunPaths
from tests.conftest import ROOT
from tests.integration.launched import free_port, stop_process
from tests.unit.test_eval_chat_api import KEY, MODEL, FakeOpenAI, fake_openai  # noqa: F401, F811 - a fixture

TRANSFER_SECRET = "the-transfer-secret-no-request-may-read"


def start_server(tmp_path, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str, object]:
    address = f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path / "env-server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "rl.envs.server", "--env.id", "reverse-text", "--env.args",
                             '{"num_examples": 4}', "--workers", "1", "--address", address, *flags],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ | (env or {}))
    return proc, address, log


@pytest.fixture
def server(tmp_path):
    started = []

    def start(*flags: str, env: dict | None = None):
        proc, address, log = start_server(tmp_path, *flags, env=env)
        started.append((proc, log))
        asyncio.run(wait_healthy(address))
        return proc, address

    yield start
    for proc, log in started:
        for child in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else ():
            child.send_signal(signal.SIGCONT)
        stop_process(proc)
        log.close()


async def wait_healthy(address: str) -> None:
    client = EnvClient(address)
    try:
        await asyncio.wait_for(client.wait_for_server_startup(timeout=120, interval=0.5), 120)
    finally:
        await client.close()


def worker_of(proc: subprocess.Popen) -> psutil.Process:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = [c for c in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]
        if children:
            return children[0]
        time.sleep(0.2)
    raise AssertionError("the env server forked no worker")


async def raw_request(address: str, frames: list[bytes], timeout_s: float = 20) -> list[bytes] | None:
    """Frames sent as a peer of the broker (a DEALER), the reply's frames, or None where none came in time."""
    ctx = zmq.asyncio.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    try:
        await socket.send_multipart(frames)
        return await asyncio.wait_for(socket.recv_multipart(), timeout_s)
    except TimeoutError:
        return None
    finally:
        socket.close()
        ctx.term()


def test_a_request_id_that_is_not_text_is_answered_and_its_worker_lives(server):
    """verifiers' worker decoded a `run` request's id outside its try: one such frame ended the worker, and with it the
    env server."""
    proc, address = server()
    worker = worker_of(proc)
    for _ in range(3):
        reply = asyncio.run(raw_request(address, [b"\xff\xfe\xfd", b"run", msgpack.packb({})]))
        assert reply is not None and reply[1] == b"reply", reply
        assert "not ASCII text" in msgpack.unpackb(reply[2])["error"]
    time.sleep(2)  # the watch would have seen a dead worker by now
    assert proc.poll() is None and worker.is_running()
    # the worker still answers: a well-formed id with a payload that is not a request fails as data
    reply = asyncio.run(raw_request(address, [uuid.uuid4().hex.encode(), b"run", msgpack.packb({})]))
    assert reply is not None and msgpack.unpackb(reply[2])["success"] is False


def test_a_message_past_the_bound_is_dropped_whole_and_the_server_lives(server):
    """No size bound: one 1 GiB frame took the broker from 0.64 to 2.74 GB, 1.69 GB of it for good."""
    proc, address = server("--max-message-bytes", str(1 << 20))
    broker = psutil.Process(proc.pid)
    before = broker.memory_info().rss
    huge = [uuid.uuid4().hex.encode(), b"run", b"x" * (256 << 20)]
    assert asyncio.run(raw_request(address, huge, timeout_s=10)) is None  # the peer is disconnected: no reply
    time.sleep(1)
    assert broker.memory_info().rss - before < 64 << 20
    assert proc.poll() is None
    asyncio.run(wait_healthy(address))  # and it answers the next peer


def test_a_hung_worker_stops_the_server_naming_it_by_a_deadline_of_its_own(server, tmp_path):
    """verifiers' broker answers health itself: a worker stopped for 90 s gave 90 s without a step or a warning."""
    assert EnvServerConfig(env=EnvConfig(id="reverse-text")).worker_stall_s > 0  # a deadline by default
    proc, address = server("--worker-stall-s", "3")
    worker = worker_of(proc)
    deadline = time.monotonic() + 120

    def beats() -> list[Path]:  # its beat file, in the broker's directory of them (rl/envs/watch.py)
        return list(Path(tempfile.gettempdir()).glob(f"rl-env-beats-*/{worker.pid}"))

    while not beats() and time.monotonic() < deadline:  # it has loaded its environment and serves
        time.sleep(0.2)
    time.sleep(2)  # and beats past the stall bound's first seconds
    assert beats() and proc.poll() is None
    worker.send_signal(signal.SIGSTOP)
    assert proc.wait(30) == WORKER_DIED
    log = (tmp_path / "env-server.log").read_text()
    assert f"(pid {worker.pid}) hung: its event loop has not run for" in log, log[-2000:]
    with pytest.raises(psutil.NoSuchProcess):  # killed, though stopped
        psutil.wait_procs([worker], timeout=10)
        worker.status()


def test_a_request_reads_only_the_variables_and_calls_only_the_endpoints_the_server_allows(server, fake_openai):  # noqa: F811
    """An env-server request names its client's `base_url`, `api_key_var` and `headers_from_env`: a local user's one
    request had the worker send the transfer secret and the admin token to the user's own URL."""
    apply_patches()
    FakeOpenAI.requests.clear()
    # a server that sends a key names where it may go (without model_endpoints it would send none)
    _, address = server("--model-endpoints", json.dumps([fake_openai]),
                        env={API_KEY_VAR: KEY, "RL_TRANSFER__SECRET": TRANSFER_SECRET})
    task = load_environment(EnvConfig(id="reverse-text", args={"num_examples": 4})).task(0)
    sampling = vf.SamplingConfig(max_tokens=8)
    elsewhere = fake_openai.replace("127.0.0.1", "10.255.255.1")

    async def run(client) -> vf.Episode:
        peer = EnvClient(address)
        try:
            return await asyncio.wait_for(peer.run(client, MODEL, sampling, task.data.model_dump()), 60)
        finally:
            await peer.close()

    refused = [vf.EvalClientConfig(base_url=fake_openai, api_key_var="RL_TRANSFER__SECRET"),
               vf.EvalClientConfig(base_url=fake_openai, api_key_var=API_KEY_VAR,
                                   headers_from_env={"X-Leak": "RL_TRANSFER__SECRET"}),
               vf.EvalClientConfig(base_url=elsewhere, api_key_var=API_KEY_VAR)]
    for client in refused:
        with pytest.raises(RuntimeError, match="does not allow"):
            asyncio.run(run(client))
    assert FakeOpenAI.requests == []  # nothing was sent anywhere
    episode = asyncio.run(run(vf.EvalClientConfig(base_url=fake_openai, api_key_var=API_KEY_VAR)))
    assert not episode.errors and len(FakeOpenAI.requests) == 1, episode.errors  # the run's own client: it ran
    assert TRANSFER_SECRET not in json.dumps(FakeOpenAI.requests)


def test_without_model_endpoints_no_key_leaves_and_only_allowed_tokenizers_are_loaded(monkeypatch, tmp_path):
    """A hand-started env server without model_endpoints allows any loopback port, where another local user may
    listen: a client that would send a key there is refused, naming model_endpoints; one without a key goes. A
    training client renders with a local directory or an allowed name, never a hub id the worker would fetch."""
    loopback = ClientPolicy.of([API_KEY_VAR], None)
    monkeypatch.setenv(API_KEY_VAR, "sk-inference")
    with pytest.raises(ValueError, match=f"would send {API_KEY_VAR} to http://127.0.0.1:9999.*set model_endpoints"):
        loopback.check(vf.EvalClientConfig(base_url="http://127.0.0.1:9999/v1", api_key_var=API_KEY_VAR))
    monkeypatch.delenv(API_KEY_VAR)
    loopback.check(vf.EvalClientConfig(base_url="http://127.0.0.1:9999/v1", api_key_var=API_KEY_VAR))
    pinned = ClientPolicy.of([API_KEY_VAR], ["http://127.0.0.1:8000"], ["Qwen/Qwen3-0.6B"])
    client = vf.TrainClientConfig(base_url="http://127.0.0.1:8000/v1", api_key_var=API_KEY_VAR,
                                  renderer_model_name="someone/else-tokenizer")
    with pytest.raises(ValueError, match="renders with 'someone/else-tokenizer', which is no local directory"):
        pinned.check(client)
    pinned.check(client.model_copy(update={"renderer_model_name": str(tmp_path)}))
    pinned.check(client.model_copy(update={"renderer_model_name": None}), model="Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="renders with 'evil/model'"):
        pinned.check(client.model_copy(update={"renderer_model_name": None}), model="evil/model")


def test_the_client_policy_names_what_it_refuses(monkeypatch):
    monkeypatch.delenv(API_KEY_VAR, raising=False)
    policy = ClientPolicy.of([API_KEY_VAR], ["http://10.0.0.5:8000/v1"])
    policy.check(vf.EvalClientConfig(base_url="http://10.0.0.5:8000/v1", api_key_var=API_KEY_VAR))
    with pytest.raises(ValueError, match=r"calls http://127.0.0.1:8000.*model_endpoints = \['http://10.0.0.5:8000'\]"):
        policy.check(vf.EvalClientConfig(base_url="http://127.0.0.1:8000/v1", api_key_var=API_KEY_VAR))
    with pytest.raises(ValueError, match="environment variables this env server does not allow: HOME"):
        policy.check(vf.EvalClientConfig(base_url="http://10.0.0.5:8000/v1", api_key_var="HOME"))
    loopback = ClientPolicy.of([API_KEY_VAR], None)
    loopback.check(vf.EvalClientConfig(base_url="http://localhost:9/v1", api_key_var=API_KEY_VAR))
    with pytest.raises(ValueError, match="loopback only"):
        loopback.check(vf.EvalClientConfig(base_url="https://api.example.com/v1", api_key_var=API_KEY_VAR))
    ClientPolicy.of(["*"], ["*"]).check(vf.EvalClientConfig(base_url="https://api.example.com/v1", api_key_var="X"))


def test_children_that_run_environments_code_get_no_secret_they_do_not_need(tmp_path):
    """The launcher started every child with its whole environment: the orchestrator and every env-server worker held
    the transfer secret, the admin token and any W&B or hub token."""
    names = ["RL_TRANSFER__SECRET", "RL_INFERENCE__ADMIN_TOKEN", "WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY",
             "SSH_AUTH_SOCK", "OPENAI_API_KEY"]
    assert all(is_secret(name) for name in names)
    assert not any(is_secret(name) for name in ["TOKENIZERS_PARALLELISM", "PATH", "KEYBOARD_LAYOUT_X", "MONKEY"])
    environ = {name: "s3cr3t" for name in names} | {"PATH": "/bin", "TOKENIZERS_PARALLELISM": "false"}
    assert inherited_environment(environ, None) == environ
    assert inherited_environment(environ, ("HF_TOKEN",)) == {"PATH": "/bin", "TOKENIZERS_PARALLELISM": "false",
                                                             "HF_TOKEN": "s3cr3t"}
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir(parents=True)
    supervisor = Supervisor(paths, tail_lines=5, shutdown_timeout_s=5)
    os.environ["RL_TRANSFER__SECRET"] = TRANSFER_SECRET
    try:
        for keep in (None, (API_KEY_VAR,)):
            name = f"child-{keep is None}"
            cmd = [sys.executable, "-c", "import os, json; print(json.dumps(sorted(os.environ)))"]
            supervisor.start(ChildSpec(name, cmd, [], tmp_path / f"{name}.log", secret_env={API_KEY_VAR: "k"},
                                       keep_secrets=keep))
            assert supervisor.procs[name].wait(timeout=30) == 0
            seen = json.loads((tmp_path / f"{name}.log").read_text().splitlines()[-1])
            assert API_KEY_VAR in seen and "PATH" in seen
            assert ("RL_TRANSFER__SECRET" in seen) == (keep is None)
    finally:
        del os.environ["RL_TRANSFER__SECRET"]


def test_rls_env_servers_call_the_runs_servers_only_and_a_child_server_what_its_parent_names(tmp_path):
    from rl.envs.client import ChildEnvServer
    from rl.envs.placement import place_env_servers

    spec = EnvConfig(id="reverse-text")
    servers = place_env_servers(tmp_path, {"env": [spec]}, ["http://10.0.0.5:8000"])
    assert servers["env-reverse-text"].model_endpoints == ["http://10.0.0.5:8000"]
    assert servers["env-reverse-text"].client_env_vars == [API_KEY_VAR]
    child = ChildEnvServer(EnvConfig(id="reverse-text"))
    try:
        child.start()
        written = (child.directory / "env-server.toml").read_text()
        assert "model_endpoints = [\n    \"*\",\n]" in written or 'model_endpoints = ["*"]' in written, written
        assert oct(child.directory.stat().st_mode & 0o777) == "0o700"  # only its user reaches its socket
    finally:
        child.stop()


def test_children_that_run_environments_code_are_forked_only_from_a_launcher_holding_nothing_they_may_not_have(
        tmp_path, monkeypatch):
    """A child forked from the launcher holds what the launcher holds (its configs' secrets, its first environment
    block): env servers never are, the orchestrator only while the launcher holds no transfer secret or other secret
    variable."""
    from rl.launcher.main import child_specs
    from tests.unit.test_deploy import FILES, load

    def specs(*argv: str) -> dict:
        config, host = load(FILES + ["--output-dir", str(tmp_path / "run"), *argv])
        return {spec.name: spec for spec in child_specs(config, host, RunPaths(tmp_path / "run"))}

    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    files = specs()
    assert files["env-reverse-text"].preload == () and files["env-reverse-text"].keep_secrets == (API_KEY_VAR,)
    assert files["orchestrator"].preload and files["orchestrator"].keep_secrets is not None
    assert specs("--transfer.backend", "gloo")["orchestrator"].preload == ()  # the launcher made a transfer secret
    monkeypatch.setenv("GITHUB_TOKEN", "x")
    assert specs()["orchestrator"].preload == ()


def test_a_worker_still_loading_its_environment_is_not_counted_hung_by_the_stall_bound(tmp_path):
    from rl.envs.watch import FIRST_BEAT_S, stalled_for

    started = time.time()
    assert stalled_for(tmp_path, 4242, started, started + 200) == (200, False)  # no beat yet: loading
    assert FIRST_BEAT_S >= EnvServerConfig(env=EnvConfig(id="reverse-text")).worker_stall_s
    (tmp_path / "4242").touch()
    stalled, beaten = stalled_for(tmp_path, 4242, started, time.time() + 5)
    assert beaten and 4 < stalled < 6
