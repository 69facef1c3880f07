"""Where an environment's episodes run: one `EpisodeRunner` per environment, chosen once from its `[[env]]` table
(rl/envs/loading.py). Nothing outside rl/envs/ asks which one it is.

- `ServedEpisodes` (rl/envs/client.py): an env server's workers run them (one `rl` starts, one started elsewhere, or
  a child of this process); a group goes as one request.
- `InProcessEpisodes` (`workers = 0`): this process runs them, each episode on its own; cheaper on a small host, but
  an environment that crashes or blocks takes the process down.

A runner runs a group's episodes under `bound(run, n)`, which its caller gives (rl/envs/rollouts.py: the slots and
the deadline of `n` rollouts): a served group is bound as one, an in-process group episode by episode."""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import verifiers.v1 as vf

from rl.envs.chat_calls import shared_session

Bound = Callable[[Coroutine[Any, Any, Any], int], Awaitable[Any]]


class EpisodeRunner(ABC):
    """Runs an environment's episodes: started early where it can load meanwhile, serving while the process uses
    the environment, a group's episodes at a time."""

    workers: int | None = None  # env-server workers alive, as last seen; None where there is no such count

    def launch(self) -> None:
        """Start now what the episodes will run on, so that it loads while the process does other things."""

    def shut_down(self) -> None:
        """Stop what `launch` started (a no-op where nothing runs)."""

    @abstractmethod
    def where(self) -> str:
        """Where the episodes run, for the log."""

    @abstractmethod
    def serving(self, env: vf.Env) -> contextlib.AbstractAsyncContextManager[None]:
        """Ready to run `env`'s episodes while entered."""

    @abstractmethod
    async def run_group(self, env: vf.Env, task: vf.Task, contexts: list[vf.ModelContext], bound: Bound
                        ) -> list[vf.Episode]:
        """One episode of `task` per context, in their order."""


class InProcessEpisodes(EpisodeRunner):
    """Episodes run by this process (`workers = 0`)."""

    def where(self) -> str:
        return "this process"

    @contextlib.asynccontextmanager
    async def serving(self, env: vf.Env) -> AsyncIterator[None]:
        """verifiers' interception server kept up across groups (otherwise each episode starts one), and the
        in-process harness's HTTP session open (otherwise each model call opens one), as an env server's worker
        keeps them."""
        async with shared_session(), env.serving():
            yield

    async def run_group(self, env: vf.Env, task: vf.Task, contexts: list[vf.ModelContext], bound: Bound
                        ) -> list[vf.Episode]:
        runs = [env.run_slot(slot, ctx) for slot, ctx in zip(env.slots(task, len(contexts)), contexts)]
        return list(await asyncio.gather(*(bound(run, 1) for run in runs)))
