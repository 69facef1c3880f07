"""Episodes of an environment served by an env server (`env-server`, rl/env_server.py): the orchestrator keeps the
taskset and samples it; each episode goes to the server as its task's data with the model endpoint and sampling, runs
in one of the server's workers (which calls inference itself), and comes back as an episode to score into a batch.
An episode abandoned at its deadline is cancelled on the server (verifiers' `EnvClient` sends the cancel)."""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers.v1.serve import EnvClient

HEALTH_INTERVAL_S = 1.0


class EnvServerError(RuntimeError):
    """An env server did not answer in time, or refused an episode."""


class ServedEpisodes:
    """The orchestrator's connection to one environment's server at `address`."""

    def __init__(self, label: str, address: str):
        self.label, self.address = label, address
        self.client: EnvClient | None = None

    async def start(self, timeout_s: float) -> None:
        """Connect and wait until the server answers its health check, at most `timeout_s`."""
        self.client = EnvClient(self.address)
        try:
            await self.client.wait_for_server_startup(timeout=timeout_s, interval=HEALTH_INTERVAL_S)
        except TimeoutError:
            raise EnvServerError(f"the env server of {self.label!r} at {self.address} did not answer its health "
                                 f"check within {timeout_s:g} s") from None

    async def run(self, task: vf.Task, ctx: vf.ModelContext) -> vf.Episode:
        """One episode of `task` on the server. The training client's config goes as verifiers' own (the server
        validates it as such): rl's grouping of a group's identical requests applies within a worker's process."""
        assert self.client is not None, "start() first"
        client = ctx.client
        if isinstance(client, vf.TrainClientConfig) and type(client) is not vf.TrainClientConfig:
            client = vf.TrainClientConfig(**client.model_dump(include=set(vf.TrainClientConfig.model_fields)))
        try:
            return await self.client.run(client, ctx.model, ctx.sampling, task.data.model_dump())
        except RuntimeError as e:  # the server's reply said the episode failed: its error, as data
            raise EnvServerError(f"the env server of {self.label!r} failed an episode: {e}") from None

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
