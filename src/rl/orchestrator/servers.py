"""The inference servers as the orchestrator sees them: which answer, which policy each serves, and which get
generation requests."""

from __future__ import annotations

import asyncio
import time

from rl.config import url_without_password
from rl.orchestrator.config import ClientConfig
from rl.orchestrator.inference_pool import InferenceError, InferencePool

DOWN = "down"  # a server's instance while it does not answer


class ServerBoard:
    """One owner of the servers' state: `served_steps` (per server; -1: not answering), `usable` (the servers given
    requests: up to date and up), `policy_step` (the oldest policy the usable ones serve), `instances` (the process
    each last answered from: a new one means it restarted), `stale` (restarted or gone down since they were last
    brought up to date) and `refused` (they serve weights the trainer did not send: no requests until they serve a
    step it sent, or restart). Changed only through its methods; the policy sync and the orchestrator read it."""

    def __init__(self, pool: InferencePool, client: ClientConfig, logger):
        self.pool, self.client, self.logger = pool, client, logger
        servers = len(client.base_urls)
        self.policy_step = 0
        self.served_steps = [0] * servers
        self.usable = list(range(servers))
        self.instances: list[str | None] = [None] * servers
        self.stale: set[int] = set()
        self.refused: set[int] = set()

    def up(self) -> list[int]:
        return [i for i, instance in enumerate(self.instances) if instance != DOWN]

    def use(self, servers: list[int]) -> None:
        """Give generation requests to `servers` (up, and up to date) alone; never to a refused one."""
        self.usable = [i for i in servers if i not in self.refused]

    def caught_up(self, servers: list[int]) -> None:
        """`servers` are being brought up to date: no longer stale, and the ones given requests."""
        self.stale -= set(servers)
        self.use(servers)

    def serve(self, servers: list[int], step: int) -> None:
        """`servers` now serve policy `step`, as the trainer made it."""
        for i in servers:
            self.served_steps[i] = step
        self.refused -= set(servers)

    def refuse(self, servers: list[int], step: int) -> None:
        """`servers` now serve, as policy `step`, weights the trainer did not send (they loaded them: what they
        served before is gone): no requests from now until they serve a step the trainer sent (`serve`)."""
        for i in servers:
            self.served_steps[i] = step
        self.refused |= set(servers)
        self.use(self.usable)

    def serving(self, required: int) -> list[int]:
        """The servers that serve policy `required` or newer as the trainer made it."""
        return [i for i, served in enumerate(self.served_steps) if served >= required and i not in self.refused]

    def all_serve(self, servers: list[int], step: int) -> None:
        """`servers` (the usable ones) now serve policy `step`, the oldest one in use."""
        self.serve(servers, step)
        self.policy_step = step

    def use_those_serving(self, required: int) -> list[int]:
        """Give requests to the servers that serve policy `required` or newer (the oldest of theirs becomes
        `policy_step`); those servers."""
        self.use(self.serving(required))
        if self.usable:
            self.policy_step = min(self.served_steps[i] for i in self.usable)
        return self.usable

    async def check(self) -> set[int]:
        """Ask every server what it serves; return those that restarted since the last answer (another instance: it
        serves what it loaded at start, not the run's policy) or stopped answering. Either gets no requests until
        it answers and is brought up to date (the policy sync's `ensure`)."""
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
                self.refused.discard(i)  # another process: it serves its start-up weights, not the refused ones
            if self.instances[i] is None:  # first heard of: what it serves now (a server the run did not start, or
                self.served_steps[i] = reply["step"]  # one resumed, may serve a later step than 0)
            self.instances[i] = reply["instance"]
        self.use([i for i in self.usable if i not in changed and self.instances[i] != DOWN])
        return changed

    async def wait_for_one(self) -> None:
        """While no server answers, wait for one, at most client.startup_timeout_s (at once if one answers)."""
        deadline = time.monotonic() + self.client.startup_timeout_s
        while all(instance == DOWN for instance in self.instances):
            if time.monotonic() > deadline:
                raise InferenceError(f"no inference server answered for {self.client.startup_timeout_s:.0f} s "
                                     f"({[url_without_password(u) for u in self.client.base_urls]})")
            await asyncio.sleep(1.0)
            await self.check()
