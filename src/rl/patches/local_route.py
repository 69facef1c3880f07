"""An aiohttp route handler called in process, without HTTP: what `interception_in_process` (rl/patches/verifiers.py)
offers rl's in-process chat harness for each of verifiers' interception routes."""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


def local_route(handler, path: str, max_body: int):
    """An aiohttp route handler called in process: (headers, body) -> (status, body), as HTTP would have answered.
    Requests with streamed replies are not served here (in_process_chat asks for none)."""
    from multidict import CIMultiDict, CIMultiDictProxy

    async def call(headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        if len(body) > max_body:  # aiohttp's client_max_size, which the server sets
            return 413, f"request body of {len(body)} bytes exceeds {max_body}".encode()
        request = LocalRequest(path, CIMultiDictProxy(CIMultiDict(headers)), body)
        del body  # the request holds it until the handler has parsed it
        served = asyncio.ensure_future(handler(request))
        try:
            await asyncio.wait([served])
        except asyncio.CancelledError:  # the caller is gone, as a client that disconnects
            served.cancel()
            raise
        if served.cancelled():
            return 503, f"{path}: the handler was cancelled (its rollout concluded)".encode()
        if served.exception() is not None:
            logger.error("in-process request to %s failed", path, exc_info=served.exception())
            return 500, f"{path}: {served.exception()!r}".encode()
        response = served.result()
        if not isinstance(getattr(response, "body", None), (bytes, bytearray)):
            return 500, f"{path}: the handler answered with a stream, which is served over HTTP only".encode()
        return response.status, bytes(response.body)

    return call


class LocalRequest(dict):
    """What verifiers' interception handler reads of an `aiohttp.web.Request`: its path, headers (case-insensitive)
    and body, and a mapping for per-request state."""

    def __init__(self, path: str, headers, body: bytes) -> None:
        super().__init__()
        self.path, self.headers, self.content_length = path, headers, len(body)
        self._read_bytes: bytes | None = body  # aiohttp's cache of the body, which the handler drops once parsed

    async def read(self) -> bytes:
        return self._read_bytes if self._read_bytes is not None else b""  # once dropped, as a drained stream
