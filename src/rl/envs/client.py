"""Episodes of an environment served by an env server (`env-server`, rl/envs/server.py): the orchestrator keeps the
taskset and samples it; each group goes to the server as one request (rl/envs/groups.py: its task's data, the model
endpoint and each episode's sampling), runs in one of the server's workers (which calls inference itself), and comes
back as episodes to score into a batch. A group abandoned at its deadline is cancelled on the server.

An environment's episodes run in an env server unless its table says `workers = 0` (rl/envs/runner.py): one `rl`
starts (supervised, restarted when it dies), one started elsewhere (`[[env]] address`), or, for an orchestrator or
`eval` started by hand, one this process starts as its child (`ChildEnvServer`): it dies with this process, and its
death ends the run, naming it.

A server that stops answering, or is restarted (`rl` restarts a dead one at the same socket), has lost the episodes
it held: while any is out, a watchdog checks the server's health and, for an ipc:// socket, the socket's identity
(a restarted server binds a new one); either change fails every group sent before it with EnvServerError, so it is
run again (`rollout.max_retries`) rather than waiting for a reply that will not come."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import verifiers.v1 as vf

from rl.config import write_config
from rl.envs.config import EnvConfig, started_for
from rl.envs.groups import GroupClient, GroupRunRequest
from rl.envs.runner import Bound, EpisodeRunner
from rl.envs.seal import seal_client
from rl.envs.trust import ANY
from rl.process import die_with_parent

HEALTH_INTERVAL_S = 1.0  # while waiting for the server to answer first
WATCH_INTERVAL_S = 2.0  # between the watchdog's checks while groups are out
HEALTH_TIMEOUT_S = 5.0  # a broker answers health itself; a single worker answers between its episodes' steps
MISSED_HEALTH_CHECKS = 2  # in a row, before the server counts as gone
CHILD_STOP_S = 30.0  # a child server's grace to stop its workers after SIGTERM
ENV_SERVER_START_S = 300.0
"""Longest this process waits for an environment's server to answer: its workers import the environment's package
and load it (verifiers, a tokenizer, the environment's own dependencies) before the broker answers."""


class EnvServerError(RuntimeError):
    """An env server did not answer in time, failed a group, or lost it."""


def socket_identity(address: str) -> tuple[int, int] | None:
    """An ipc:// socket's inode and change time (a server that binds again makes a new socket, which may reuse the
    inode number), None for other transports or where there is no socket now."""
    if not address.startswith("ipc://"):
        return None
    try:
        found = os.stat(address.removeprefix("ipc://"))
    except OSError:
        return None
    return found.st_ino, found.st_ctime_ns


class ChildEnvServer:
    """An env server this process starts for one `[[env]]` and owns: its config and socket in a directory of its own
    (made when it starts), its output beside this process's own."""

    def __init__(self, spec: EnvConfig):
        self.spec = spec
        self.directory: Path | None = None
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        """Start it, unless it was started and not stopped since; its address."""
        if self.process is None:
            self.directory = Path(tempfile.mkdtemp(prefix="rl-env-server-"))
            # its socket is in a directory only this user enters: it calls what this process names
            config = started_for(self.spec, self.address, [ANY], [ANY], renderer_models=[ANY])
            write_config(config, self.directory / "env-server.toml")
            cmd = [sys.executable, "-m", "rl.envs.server", "@", str(self.directory / "env-server.toml")]
            self.process = subprocess.Popen(cmd, preexec_fn=die_with_parent)  # it ends with this process
        return self.address

    @property
    def address(self) -> str:
        assert self.directory is not None, "start() first"
        return f"ipc://{self.directory / 'env.sock'}"

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(CHILD_STOP_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
        self.process = None  # the next start() starts another (a new serving of the environment)


class ServedEpisodes(EpisodeRunner):
    """The orchestrator's connection to one environment's server at `address`, or to `child`'s: the runner of an
    environment whose episodes an env server runs."""

    def __init__(self, label: str, address: str | None = None, child: ChildEnvServer | None = None,
                 secret: str | None = None):
        assert (address is None) != (child is None), "a server's address, or a child server to start"
        self.label, self.child, self.address = label, child, address
        self.secret = secret  # a tcp:// server's, which seals the connection (rl/envs/seal.py)
        self.died: str | None = None  # why the child server this process started is gone
        self.owner: asyncio.Task | None = None  # cancelled when the child dies: the run ends, naming it
        self.client: GroupClient | None = None
        self.out: set[asyncio.Future] = set()  # groups sent and not yet answered
        self.lost: set[asyncio.Future] = set()  # of those, the ones the watchdog gave up on
        self.identity: tuple[int, int] | None = None
        self.watchdog: asyncio.Task | None = None
        # Cleared while the server is down (from the watchdog's loss of what was out until it answers again): a
        # group sent then waits, at most `recovery_s`, rather than be lost with a server that is not there. Made by
        # start(), in the event loop that uses it.
        self.answering: asyncio.Event | None = None
        self.recovery_s = 0.0
        self.workers: int | None = None  # live, as its last health reply said (a server not rl's does not say)

    def where(self) -> str:
        return self.address or "a server this process starts"

    def launch(self) -> None:
        if self.child is not None:
            self.child.start()

    def shut_down(self) -> None:
        if self.child is not None:
            self.child.stop()

    @contextlib.asynccontextmanager
    async def serving(self, env: vf.Env) -> AsyncIterator[None]:
        """Connected to the server once it answers (started first, where this process starts it); a child server's
        death ends what runs inside, with EnvServerError naming it."""
        try:
            await self.start(ENV_SERVER_START_S)
            yield
        except asyncio.CancelledError:
            if self.died:
                raise EnvServerError(self.died) from None
            raise
        finally:
            await self.close()

    async def run_group(self, env: vf.Env, task: vf.Task, contexts: list[vf.ModelContext], bound: Bound
                        ) -> list[vf.Episode]:
        """The group as one request, its slots and deadline taken as one."""
        return await bound(self.run_served(task, contexts), len(contexts))

    async def start(self, timeout_s: float) -> None:
        """Start the child server if there is one; connect and wait until the server answers its health check, at
        most `timeout_s` (a child that exits first fails the start at once)."""
        if self.child is not None:
            self.address = self.child.start()
            self.owner = asyncio.current_task()
        self.client = GroupClient(self.address)
        if self.secret is not None and self.address.startswith("tcp://"):
            seal_client(self.client, self.secret)
        healthy = asyncio.ensure_future(self.client.wait_for_server_startup(timeout=timeout_s,
                                                                           interval=HEALTH_INTERVAL_S))
        deadline = time.monotonic() + timeout_s  # verifiers' bounds the replies, not a send no peer takes
        try:
            while not healthy.done():
                await asyncio.wait([healthy], timeout=HEALTH_INTERVAL_S)
                if self.child is not None and self.child.exit_code() is not None and not healthy.done():
                    raise EnvServerError(f"the env server started for {self.label!r} exited with code "
                                         f"{self.child.exit_code()} before it answered (its output is above)")
                if time.monotonic() > deadline and not healthy.done():
                    raise TimeoutError
            healthy.result()
        except TimeoutError:
            sealed = " (sealed with its secret: does the server hold the same one?)" if self.secret else ""
            raise EnvServerError(f"the env server of {self.label!r} at {self.address} did not answer its health "
                                 f"check within {timeout_s:g} s{sealed}") from None
        finally:
            healthy.cancel()
        self.identity = socket_identity(self.address)
        await self.check_health()
        self.recovery_s = timeout_s  # a restarted server has as long to answer again as a new one to start
        self.answering = asyncio.Event()
        self.answering.set()
        self.watchdog = asyncio.create_task(self._watch())

    async def run_served(self, task: vf.Task, contexts: list[vf.ModelContext]) -> list[vf.Episode]:
        """A group's episodes of `task` on the server, one per context, sent as one request (rl/envs/groups.py).
        The contexts share their client config, which goes with rl's fields whole, so the worker groups the
        group's identical requests as this process would."""
        assert self.client is not None, "start() first"
        first = contexts[0]
        assert all(ctx.client is first.client and ctx.model == first.model for ctx in contexts), "one client per group"
        request = GroupRunRequest(task_data=task.data.model_dump(), client=first.client, model=first.model,
                                  samplings=[ctx.sampling for ctx in contexts])
        await self._until_answering()
        group = asyncio.ensure_future(self.client.run_group(request))
        self.out.add(group)
        try:
            return await group
        except asyncio.CancelledError:
            if group in self.lost:
                raise EnvServerError(f"the env server of {self.label!r} at {self.address} stopped answering or was "
                                     "restarted: this group's episodes were lost with it") from None
            raise
        except RuntimeError as e:  # the server's reply said the group failed: its error, as data
            raise EnvServerError(f"the env server of {self.label!r} failed a group: {e}") from None
        finally:
            self.out.discard(group)
            self.lost.discard(group)

    async def _watch(self) -> None:
        missed = 0
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if self.child is not None and self.child.exit_code() is not None:
                self.died = (f"the env server started for {self.label!r} exited with code {self.child.exit_code()} "
                             "(its output is above)")
                self._lose_everything_out()
                self.owner.cancel()
                return
            answered = await self.check_health()
            identity = socket_identity(self.address)
            if not self.out or not self.answering.is_set():  # nothing to lose: follow the server (a new socket)
                missed, self.identity = 0, identity or self.identity
                if answered:
                    self.answering.set()
                continue
            missed = 0 if answered else missed + 1
            restarted = identity is not None and self.identity is not None and identity != self.identity
            if missed >= MISSED_HEALTH_CHECKS or restarted:
                self._lose_everything_out()
                self.answering.clear()
                missed, self.identity = 0, identity or self.identity

    async def _until_answering(self) -> None:
        """Wait while the server is down. Sent then, a group would be lost again when the restarted server's new
        socket shows (counted as another of its attempts), or queue for a server that never comes back."""
        try:
            await asyncio.wait_for(self.answering.wait(), self.recovery_s)
        except TimeoutError:
            raise EnvServerError(f"the env server of {self.label!r} at {self.address} lost its episodes and has not "
                                 f"answered since, for {self.recovery_s:g} s") from None

    async def check_health(self) -> bool:
        """Whether the server answered its health check in time; its live workers as it said (0 if it did not)."""
        try:
            reply = await self.client.health_reply(HEALTH_TIMEOUT_S)
        except TimeoutError:
            self.workers = 0 if self.workers is not None else None
            return False
        self.workers = reply.workers
        return reply.success

    def _lose_everything_out(self) -> None:
        for group in list(self.out):
            self.lost.add(group)
            group.cancel()

    async def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watchdog
            self.watchdog = None
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.child is not None:
            await asyncio.to_thread(self.child.stop)
