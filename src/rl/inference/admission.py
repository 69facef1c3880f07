"""Which generation requests may run now. AdminMiddleware (rl.inference.gate) counts the requests inside vLLM
(`in_flight`); while the weights change, new ones wait at `admitting` and only those already in flight are frozen
(vLLM's `pause_generation(mode="keep")`), so that no token is sampled between the reload and the new weight version.
Weights found broken abort what runs and keep vLLM paused."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

ADMIT_TIMEOUT_S = 900  # longest a generation request waits for a weight update (a large model's reload)


class Admission:
    """The generation requests of one server: how many are in flight, whether new ones may enter, whether vLLM is
    paused."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight = 0
        self.admitting = asyncio.Event()
        self.admitting.set()
        self.engine_paused = False

    async def wait(self) -> str | None:
        """Wait while the weights change; None once a request may enter, else why it may not."""
        deadline = time.monotonic() + ADMIT_TIMEOUT_S
        while not self.admitting.is_set():  # re-checked on waking: another update may have begun since
            try:
                await asyncio.wait_for(self.admitting.wait(), max(deadline - time.monotonic(), 0))
            except TimeoutError:
                return f"waited {ADMIT_TIMEOUT_S} s for a weight update to finish"
        return None

    @contextlib.asynccontextmanager
    async def held(self, broken: Callable[[], bool],
                   on_failure: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[int]:
        """New requests wait and those in flight are frozen (their number is yielded) until the block ends; then
        they resume, or, where `broken()`, are aborted with vLLM kept paused. A block that failed runs `on_failure`
        before requests are admitted again."""
        self.admitting.clear()
        failed = True
        try:
            yield await self._freeze_in_flight()
            failed = False
        finally:
            try:
                await self._release(broken())
                if failed and on_failure is not None:
                    await on_failure()
            finally:
                self.admitting.set()

    async def abort(self) -> None:
        """Abort every request vLLM runs and keep it paused (the weights are broken)."""
        await self.engine.pause_generation(mode="abort", clear_cache=False)
        self.engine_paused = True

    async def _freeze_in_flight(self) -> int:
        """Freeze the requests vLLM is running (vLLM labels each output token with the weight version that sampled
        it). New requests wait at `admitting`, so with none in flight there is nothing to pause."""
        frozen = self.in_flight
        if frozen and not self.engine_paused:
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            self.engine_paused = True
        return frozen

    async def _release(self, broken: bool) -> None:
        """Resume what was frozen; if the weights are broken, abort it and keep vLLM paused instead."""
        if broken:
            await self.abort()
        elif self.engine_paused:
            await self.engine.resume_generation()
            self.engine_paused = False
