"""Episodes of an environment served by an env server (`env-server`, rl/env_server.py): the orchestrator keeps the
taskset and samples it; each episode goes to the server as its task's data with the model endpoint and sampling, runs
in one of the server's workers (which calls inference itself), and comes back as an episode to score into a batch.
An episode abandoned at its deadline is cancelled on the server (verifiers' `EnvClient` sends the cancel).

A server that stops answering, or is restarted (`rl` restarts a dead one at the same socket), has lost the episodes
it held: while any is out, a watchdog checks the server's health and, for an ipc:// socket, the socket's identity
(a restarted server binds a new one); either change fails every episode sent before it with EnvServerError, so its
group is run again (`rollout.max_retries`) rather than waiting for a reply that will not come."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Coroutine
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.serve import EnvClient

HEALTH_INTERVAL_S = 1.0  # while waiting for the server to answer first
WATCH_INTERVAL_S = 2.0  # between the watchdog's checks while episodes are out
HEALTH_TIMEOUT_S = 5.0  # a broker answers health itself; a single worker answers between its episodes' steps
MISSED_HEALTH_CHECKS = 2  # in a row, before the server counts as gone


class EnvServerError(RuntimeError):
    """An env server did not answer in time, refused an episode, or lost it."""


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


def verifiers_client(config: vf.ClientConfig) -> vf.ClientConfig:
    """verifiers' own training client config in place of rl's subclass (its extra fields would be refused)."""
    if isinstance(config, vf.TrainClientConfig) and type(config) is not vf.TrainClientConfig:
        return vf.TrainClientConfig(**config.model_dump(include=set(vf.TrainClientConfig.model_fields)))
    return config


class ServedEpisodes:
    """The orchestrator's connection to one environment's server at `address`."""

    def __init__(self, label: str, address: str):
        self.label, self.address = label, address
        self.client: EnvClient | None = None
        self.out: set[asyncio.Future] = set()  # episodes sent and not yet answered
        self.lost: set[asyncio.Future] = set()  # of those, the ones the watchdog gave up on
        self.identity: tuple[int, int] | None = None
        self.watchdog: asyncio.Task | None = None

    async def start(self, timeout_s: float) -> None:
        """Connect and wait until the server answers its health check, at most `timeout_s`."""
        self.client = EnvClient(self.address)
        try:
            await self.client.wait_for_server_startup(timeout=timeout_s, interval=HEALTH_INTERVAL_S)
        except TimeoutError:
            raise EnvServerError(f"the env server of {self.label!r} at {self.address} did not answer its health "
                                 f"check within {timeout_s:g} s") from None
        self.identity = socket_identity(self.address)
        self.watchdog = asyncio.create_task(self._watch())

    def runs(self, task: vf.Task, contexts: list[vf.ModelContext]) -> list[Coroutine[Any, Any, vf.Episode]]:
        """A group's episodes of `task` on the server, one per context. The training client's config goes as
        verifiers' own, which the server validates it as (made once per group, as the contexts share one): rl's
        grouping of a group's identical requests applies within a worker's process."""
        clients = {id(ctx.client): verifiers_client(ctx.client) for ctx in contexts}
        data = task.data.model_dump()
        return [self.run(data, clients[id(ctx.client)], ctx) for ctx in contexts]

    async def run(self, data: dict, client: vf.ClientConfig, ctx: vf.ModelContext) -> vf.Episode:
        assert self.client is not None, "start() first"
        episode = asyncio.ensure_future(self.client.run(client, ctx.model, ctx.sampling, data))
        self.out.add(episode)
        try:
            return await episode
        except asyncio.CancelledError:
            if episode in self.lost:
                raise EnvServerError(f"the env server of {self.label!r} at {self.address} stopped answering or was "
                                     "restarted: this episode was lost with it") from None
            raise
        except RuntimeError as e:  # the server's reply said the episode failed: its error, as data
            raise EnvServerError(f"the env server of {self.label!r} failed an episode: {e}") from None
        finally:
            self.out.discard(episode)
            self.lost.discard(episode)

    async def _watch(self) -> None:
        missed = 0
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if not self.out:
                missed, self.identity = 0, socket_identity(self.address) or self.identity
                continue
            try:  # bounded as a whole: with no server to connect to, even the send waits
                answered = await asyncio.wait_for(self.client.health(timeout=HEALTH_TIMEOUT_S), HEALTH_TIMEOUT_S)
            except TimeoutError:
                answered = False
            missed = 0 if answered else missed + 1
            identity = socket_identity(self.address)
            restarted = identity is not None and self.identity is not None and identity != self.identity
            if missed >= MISSED_HEALTH_CHECKS or restarted:
                self._lose_everything_out()
                missed, self.identity = 0, identity or self.identity

    def _lose_everything_out(self) -> None:
        for episode in list(self.out):
            self.lost.add(episode)
            episode.cancel()

    async def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.watchdog
            self.watchdog = None
        if self.client is not None:
            await self.client.close()
            self.client = None
