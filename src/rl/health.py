"""Waiting for servers to come up: one poll with a deadline, which says what it waited for.

The orchestrator waits for its inference servers, `eval` for the server it started or for the one at its
base URL; each gives a probe (None: not ready yet) and `wait_ready` polls it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

PROBE_TIMEOUT_S = 5.0  # one probe request; a server still starting may not answer at all
POLL_INTERVAL_S = 1.0
T = TypeVar("T")


async def wait_ready(probe: Callable[[], Awaitable[T | None]], timeout_s: float, waiting_for: Callable[[], str]) -> T:
    """Call `probe` every POLL_INTERVAL_S until it returns a value; TimeoutError after `timeout_s`, naming
    `waiting_for()` (what was still missing). A probe raises to stop waiting early (a server that exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await probe()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {waiting_for()}")
        await asyncio.sleep(POLL_INTERVAL_S)


async def healthy(http: httpx.AsyncClient, url: str) -> bool:
    """vLLM's GET /health answers 200 once the engine serves."""
    try:
        return (await http.get(f"{url}/health", timeout=PROBE_TIMEOUT_S)).status_code == 200
    except httpx.HTTPError:
        return False


async def wait_healthy(http: httpx.AsyncClient, urls: list[str], timeout_s: float,
                       exited: Callable[[], str | None] = lambda: None) -> None:
    """Until every server answers /health. `exited`: why waiting is pointless (the server started for this
    caller has exited: its code and log), checked before each poll."""
    pending = list(urls)

    async def all_healthy() -> bool | None:
        nonlocal pending
        if (why := exited()) is not None:
            raise RuntimeError(why)
        answers = await asyncio.gather(*(healthy(http, url) for url in pending))
        pending = [url for url, ok in zip(pending, answers) if not ok]
        return True if not pending else None

    await wait_ready(all_healthy, timeout_s, lambda: f"inference servers {pending} to answer GET /health with 200")
