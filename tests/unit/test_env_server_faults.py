"""What the orchestrator does when an env server misbehaves (rl/envs/client.py), against a fake server
that speaks rl's env-server protocol (a ZMQ ROUTER: verifiers' health and cancel, rl's run_group) and misbehaves on
purpose, and one real child server that dies."""

import asyncio
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from rl.envs.config import EnvConfig
from rl.envs import client as env_servers
from rl.envs.client import EnvServerError, ServedEpisodes
from rl.envs.loading import load_environment
from rl.envs.rollouts import ChatClient, RolloutError, Sampling, run_group, run_group_retried
from rl.envs.process_setup import apply_patches

OK = msgpack.packb({"success": True, "error": None})


class FakeEnvServer:
    """Answers health while `healthy`; a group's run is never answered (`runs = "hang"`) or fails (`runs = "fail"`)."""

    def __init__(self, address: str, runs: str, healthy: bool = True):
        self.address, self.runs, self.healthy = address, runs, healthy
        self.ran: list[str] = []  # run_group request ids, as received
        self.episodes: list[int] = []  # each one's number of episodes
        self.cancelled: list[str] = []  # the run request ids cancels named
        self.socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.task = asyncio.create_task(self.serve())

    async def serve(self) -> None:
        while True:
            client, request_id, method, payload = await self.socket.recv_multipart()
            if method == b"health" and self.healthy:
                await self.socket.send_multipart([client, request_id, b"reply", OK])
            elif method == b"cancel":
                self.cancelled.append(msgpack.unpackb(payload)["request_id"])
                await self.socket.send_multipart([client, request_id, b"reply", OK])
            elif method == b"run_group":
                self.ran.append(request_id.decode())
                self.episodes.append(len(msgpack.unpackb(payload)["samplings"]))
                if self.runs == "fail":
                    error = msgpack.packb({"success": False, "error": "ZeroDivisionError: the scorer divided by 0"})
                    await self.socket.send_multipart([client, request_id, b"reply", error])

    async def stop(self) -> None:
        self.task.cancel()
        self.socket.close()


@pytest.fixture(scope="module")
def environment():
    apply_patches()
    return load_environment(EnvConfig(id="reverse-text", args={"num_examples": 2}))


def served_by_fake(environment, tmp_path) -> str:
    address = f"ipc://{tmp_path}/fake.sock"
    environment.runner = ServedEpisodes("reverse-text", address)
    return address


CLIENT = ChatClient("http://127.0.0.1:9/v1", "m")  # never called: the fake runs nothing


def test_an_episode_that_hangs_is_cancelled_on_its_server_at_the_rollout_deadline(environment, tmp_path):
    async def scenario() -> None:
        fake = FakeEnvServer(served_by_fake(environment, tmp_path), runs="hang")
        await environment.runner.start(10)
        started = time.monotonic()
        with pytest.raises(RolloutError, match="group of 2 rollouts of task 0 timed out after 1.0s"):
            await run_group(environment, 0, 2, CLIENT, Sampling(), timeout_s=1.0)
        assert time.monotonic() - started < 3
        deadline = time.monotonic() + 5
        while not fake.cancelled and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert fake.cancelled == fake.ran and fake.episodes == [2]  # the group's one request, on its server
        await environment.runner.close()
        await fake.stop()

    asyncio.run(scenario())


def test_an_episode_that_raises_fails_its_group_which_is_run_again_then_dropped_with_the_error(environment, tmp_path):
    async def scenario() -> None:
        fake = FakeEnvServer(served_by_fake(environment, tmp_path), runs="fail")
        await environment.runner.start(10)
        warnings: list[str] = []
        outcome = await run_group_retried(environment, 1, 2, CLIENT, Sampling(), None, 30, 1, warnings.append)
        assert outcome.results is None and outcome.error == "EnvServerError" and outcome.retries == 1
        assert "failed a group: ZeroDivisionError: the scorer divided by 0" in outcome.message
        assert fake.episodes == [2, 2] and len(warnings) == 2  # a group of 2, 2 attempts, each failure logged
        await environment.runner.close()
        await fake.stop()

    asyncio.run(scenario())


def test_a_server_that_never_answers_fails_the_start_naming_it_within_its_deadline(environment, tmp_path):
    async def scenario() -> None:
        fake = FakeEnvServer(served_by_fake(environment, tmp_path), runs="hang", healthy=False)
        started = time.monotonic()
        with pytest.raises(EnvServerError, match=r"'reverse-text' at ipc://.*fake.sock did not answer its health "
                                                 r"check within 2 s"):
            await environment.runner.start(2)
        assert time.monotonic() - started < 4
        await environment.runner.close()
        await fake.stop()

    asyncio.run(scenario())


def test_a_server_that_stops_answering_loses_the_episodes_it_holds_at_once(environment, tmp_path, monkeypatch):
    monkeypatch.setattr(env_servers, "WATCH_INTERVAL_S", 0.2)
    monkeypatch.setattr(env_servers, "HEALTH_TIMEOUT_S", 0.3)

    async def scenario() -> None:
        fake = FakeEnvServer(served_by_fake(environment, tmp_path), runs="hang")
        await environment.runner.start(10)
        group = asyncio.ensure_future(run_group(environment, 0, 2, CLIENT, Sampling(), timeout_s=60))
        await asyncio.sleep(0.5)
        fake.healthy = False
        started = time.monotonic()
        with pytest.raises(EnvServerError, match="stopped answering or was restarted: this group's episodes were lost"):
            await group
        assert time.monotonic() - started < 3  # two missed checks, not the rollout's 60 s
        await environment.runner.close()
        await fake.stop()

    asyncio.run(scenario())


def test_a_group_run_again_after_its_server_died_waits_for_the_restarted_server_and_runs_there(
        environment, tmp_path, monkeypatch):
    """The server dies holding a group's episodes; `rl` restarts it (a new socket at the same path) a while later.
    The group's next attempt is sent once the new server answers, so the new socket showing does not lose it too:
    one retry, the second attempt's episodes on the new server."""
    monkeypatch.setattr(env_servers, "WATCH_INTERVAL_S", 0.2)
    monkeypatch.setattr(env_servers, "HEALTH_TIMEOUT_S", 0.3)

    async def scenario() -> None:
        address = served_by_fake(environment, tmp_path)
        first = FakeEnvServer(address, runs="hang")
        await environment.runner.start(10)
        group = asyncio.ensure_future(run_group_retried(environment, 0, 2, CLIENT, Sampling(), None, 30, 1,
                                                        lambda line: None))
        await asyncio.sleep(0.5)
        await first.stop()  # killed: its socket file stays until the new server binds its own
        await asyncio.sleep(2.0)  # the watchdog's missed checks lose the first attempt; the retry waits
        assert not group.done()
        second = FakeEnvServer(address, runs="fail")
        outcome = await asyncio.wait_for(group, 10)
        assert outcome.retries == 1 and second.episodes == [2], (outcome, second.ran)  # the group, once
        assert "failed a group: ZeroDivisionError" in outcome.message  # the new server's answer, not a loss
        await environment.runner.close()
        await second.stop()

    asyncio.run(scenario())


def test_a_server_down_past_its_recovery_deadline_fails_what_waits(environment, tmp_path, monkeypatch):
    monkeypatch.setattr(env_servers, "WATCH_INTERVAL_S", 0.2)
    monkeypatch.setattr(env_servers, "HEALTH_TIMEOUT_S", 0.3)

    async def scenario() -> None:
        fake = FakeEnvServer(served_by_fake(environment, tmp_path), runs="hang")
        await environment.runner.start(2)
        group = asyncio.ensure_future(run_group_retried(environment, 0, 2, CLIENT, Sampling(), None, 30, 1,
                                                        lambda line: None))
        await asyncio.sleep(0.5)
        fake.healthy = False
        started = time.monotonic()
        outcome = await asyncio.wait_for(group, 10)
        assert outcome.results is None and "has not answered since, for 2 s" in outcome.message, outcome
        assert time.monotonic() - started < 5
        await environment.runner.close()
        await fake.stop()

    asyncio.run(scenario())


def test_a_child_server_that_dies_ends_the_run_naming_it():
    """An orchestrator started by hand starts each environment's server as its child; when it dies, the run stops
    with an error that names it (nothing restarts it there), rather than waiting on episodes that will not come."""
    apply_patches()
    environment = load_environment(EnvConfig(id="reverse-text", args={"num_examples": 2}))

    async def scenario() -> None:
        async with environment.serving():
            deadline = time.monotonic() + 15
            while environment.runner.workers != 1 and time.monotonic() < deadline:  # its health reply says so
                await asyncio.sleep(0.1)
            assert environment.runner.workers == 1
            environment.runner.child.process.kill()
            await asyncio.sleep(30)

    started = time.monotonic()
    with pytest.raises(EnvServerError, match=r"the env server started for 'reverse-text' exited with code -9"):
        asyncio.run(scenario())
    assert time.monotonic() - started < 40
    assert environment.runner.child.directory is not None and not environment.runner.child.directory.exists()
