"""How a rollout's chat calls reach verifiers' interception server, for any harness that makes them in the rollout's
own process (rl's default, `environments/in_process_chat`, is one): over one kept-alive HTTP session per event loop
while an environment serves, or, where that server runs on the same event loop, straight to its route handler.

A new client per rollout cost a TCP handshake on both ends of localhost and measurable orchestrator CPU per rollout;
the HTTP round trip to a server on the same loop ~0.7 ms of CPU per call on both ends, of a few ms per rollout
(benchmarks/RESULTS.md). rl's env-server workers and the in-process runner hold the session (`shared_session`);
verifiers' interception server offers its routes once started (rl/patches/verifiers.py, `route_in_process`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

LocalRoute = Callable[[dict[str, str], bytes], Awaitable[tuple[int, bytes]]]
"""A server's handler for one route, called in its own process: (request headers, body) -> (status, body)."""

_shared: dict[asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, int]] = {}
"""Per event loop: the session serving environments share, and how many hold it."""

_local_routes: dict[tuple[asyncio.AbstractEventLoop, str], LocalRoute] = {}
"""Per event loop and URL: the handler of the server that serves that URL on this loop."""


def new_session() -> aiohttp.ClientSession:
    # trust_env=False: a proxy from the environment must never sit between us and localhost.
    # limit=0: one connection per rollout in flight (aiohttp would queue beyond 100).
    # total=None: the orchestrator's per-rollout deadline bounds a call, not a client default (300 s).
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), trust_env=False, timeout=aiohttp.ClientTimeout(total=None)
    )


async def _hold() -> None:
    loop = asyncio.get_running_loop()
    session, holders = _shared.get(loop) or (new_session(), 0)
    _shared[loop] = (session, holders + 1)


async def _release() -> None:
    loop = asyncio.get_running_loop()
    session, holders = _shared[loop]
    if holders > 1:
        _shared[loop] = (session, holders - 1)
    else:
        del _shared[loop]
        await session.close()


@contextlib.asynccontextmanager
async def shared_session() -> AsyncIterator[None]:
    """While held, chat calls on this event loop share one kept-alive session (holders nest)."""
    await _hold()
    try:
        yield
    finally:
        await _release()


class SharedChatSession:
    """`Env` mixin: hold the event loop's shared session while the environment serves (for tools other than rl)."""

    async def start(self) -> None:
        await _hold()
        await super().start()

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            await _release()


def route_in_process(url: str, handler: LocalRoute | None) -> None:
    """Chat calls to `url` made on the running event loop call `handler` instead of going over HTTP; None: they go
    over HTTP again. The handler must answer as the server at `url` would."""
    key = (asyncio.get_running_loop(), url)
    if handler is None:
        _local_routes.pop(key, None)
    else:
        _local_routes[key] = handler


async def post(url: str, headers: dict[str, str], body: dict) -> tuple[int, bytes]:
    """POST `body` as JSON to `url`: to its route handler where one serves it on this loop, else over the shared
    session where one is held, else over a session of its own. (status, body)."""
    local = _local_routes.get((asyncio.get_running_loop(), url))
    if local is not None:
        return await local(headers, json.dumps(body).encode())
    shared = _shared.get(asyncio.get_running_loop())
    if shared is not None:
        return await _send(shared[0], url, headers, body)
    async with new_session() as session:
        return await _send(session, url, headers, body)


async def _send(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict) -> tuple[int, bytes]:
    async with session.post(url, json=body, headers=headers) as response:
        return response.status, await response.read()


def tool_messages(messages) -> list[str]:
    """The contents of a conversation's tool messages (verifiers Messages or OpenAI dicts), whichever harness ran
    the tools."""
    contents = []
    for message in messages or []:
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if role == "tool":
            contents.append(content if isinstance(content, str) else json.dumps(content, default=str))
    return contents
