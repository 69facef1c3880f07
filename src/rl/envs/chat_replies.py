"""Bounds on every reply of a chat server that eval samples through (`client.api = "chat"`): its size, and the time
to read it.

verifiers' eval client reads each chat completion whole (httpx), then parses it and records it on the trace, with
the event loop busy throughout: a 100 MiB reply took minutes and GBs of memory, and the rollout's deadline fired only
after. So the bounds sit where the bytes arrive: for a `BoundedChatConfig`, verifiers builds its httpx client here
(`build_client`, installed by rl/patches/'s `bound_eval_client`, which the process's main() applies), which
refuses a reply whose bytes pass `max_reply_bytes` or that is not read whole `deadline_s` after its request went
out, as it streams, and closes the connection: the rest is never read. Replies are asked for uncompressed
(`Accept-Encoding: identity`) and a compressed one is refused, so the bytes counted are the bytes held.
"""

from __future__ import annotations

import asyncio

import httpx
import verifiers.v1 as vf
from verifiers.v1.clients.base import build_async_httpx


MAX_REPLY_BYTES = 8 << 20
DEADLINE = "rl.reply_deadline"
"""Request extension: the event loop's time by which the reply must be read whole."""


class BoundedChatConfig(vf.EvalClientConfig):
    """verifiers' eval client config, with the bounds on each reply."""

    max_reply_bytes: int = MAX_REPLY_BYTES
    deadline_s: float | None = None  # from sending a request to the last byte of its reply; None: no deadline


class ReplyRefused(httpx.TransportError):
    """A reply past its size bound, or compressed (its size in memory unbounded)."""


def build_client(config: vf.EvalClientConfig) -> httpx.AsyncClient:
    """verifiers' httpx client; for a `BoundedChatConfig`, with each reply bounded as it streams."""
    client = build_async_httpx(config)
    if isinstance(config, BoundedChatConfig):
        client.headers["Accept-Encoding"] = "identity"
        client.event_hooks = {"request": [Deadline(config.deadline_s)], "response": [Bound(config.max_reply_bytes)]}
    return client


class Deadline:
    """Request hook: the reply's deadline, counted from now."""

    def __init__(self, deadline_s: float | None) -> None:
        self.deadline_s = deadline_s

    async def __call__(self, request: httpx.Request) -> None:
        if self.deadline_s is None:
            return
        request.extensions[DEADLINE] = (asyncio.get_running_loop().time() + self.deadline_s, self.deadline_s)
        timeouts = request.extensions["timeout"]  # httpx's, per request: the wait for the headers within it too
        timeouts["read"] = min(timeouts["read"] or self.deadline_s, self.deadline_s)


class Bound:
    """Response hook, run once the headers are in and before any of the body is read."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    async def __call__(self, response: httpx.Response) -> None:
        request = response.request
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise ReplyRefused(f"{request.url} sent a reply compressed with {encoding!r}, asked for none: its size "
                               f"could not be bounded (client.max_reply_bytes)", request=request)
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise ReplyRefused(too_large(request, self.max_bytes, f"announced {length} bytes"), request=request)
        response.stream = BoundedStream(response.stream, request, self.max_bytes)


def too_large(request: httpx.Request, max_bytes: int, what: str) -> str:
    return (f"the reply of {request.url} {what}, over client.max_reply_bytes = {max_bytes}; refused unread past "
            f"the bound (raise client.max_reply_bytes for larger replies)")


class BoundedStream(httpx.AsyncByteStream):
    """A reply's body, refused once its bytes pass `max_bytes` or its deadline passes."""

    def __init__(self, stream: httpx.AsyncByteStream, request: httpx.Request, max_bytes: int) -> None:
        self.stream, self.request, self.max_bytes = stream, request, max_bytes
        self.deadline, self.deadline_s = request.extensions.get(DEADLINE, (None, None))

    async def __aiter__(self):
        received = 0
        chunks = aiter(self.stream)
        while True:
            try:
                async with asyncio.timeout_at(self.deadline):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise httpx.ReadTimeout(
                    f"the reply of {self.request.url} was not read whole within rollout.timeout_s = "
                    f"{self.deadline_s:g}s of its request ({received} bytes by then)", request=self.request,
                ) from None
            received += len(chunk)
            if received > self.max_bytes:
                raise ReplyRefused(too_large(self.request, self.max_bytes, f"passed {received} bytes"),
                                   request=self.request)
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()

