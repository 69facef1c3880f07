"""The HTTP transport of verifiers' training client: vLLM's `/inference/v1/generate` over aiohttp.

verifiers' `TrainClient` renders the prompt and parses the engine's reply itself; for the request it
holds an OpenAI SDK client, of which `renderers.client.generate` uses only `base_url`, `post` (an
absolute URL, `cast_to=httpx.Response`) and `get("/models")`. The SDK's request path (options models,
header building, httpx over anyio, a connection-pool scan per request) cost more orchestrator CPU per turn
than the whole raw client of benchmarks/orchestrator_throughput.py (docs/architecture.md, Measurements); on
a host where vLLM needs every core that CPU is generation lost. `EngineClient` offers the same three members
over one aiohttp session and raises the SDK's error types, so verifiers maps failures to the same
statuses (4xx not retried; connection 503; timeout 504). verifiers' own retries are off (MAX_RETRIES 0),
so none are lost.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import httpx
import msgspec
import openai
from verifiers.v1.configs.client import BaseClientConfig, resolve_api_key, resolve_headers

IDLE_CONNECTION_S = 15.0


class EngineClient:
    """`base_url`, `post`, `get` and `close` of `openai.AsyncOpenAI`, as the training client uses them."""

    def __init__(self, config: BaseClientConfig) -> None:
        self.base_url = config.base_url.rstrip("/")
        self.headers = {
            "Authorization": f"Bearer {resolve_api_key(config)}",
            "Content-Type": "application/json",
            **resolve_headers(config),
        }
        timeout = config.timeout
        # aiohttp's `connect` covers waiting for a pooled connection (the SDK's `pool`) and has no write
        # timeout; the orchestrator's per-rollout deadline bounds the whole turn either way.
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeout.connect, sock_read=timeout.read, connect=timeout.pool
        )
        self.session: aiohttp.ClientSession | None = None  # made on first use, inside the serving loop

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            # trust_env=False: the engine is reached directly (aiohttp would re-read proxies and ~/.netrc
            # on every request otherwise); limit=0: the rollouts multiplexed here bound the connections;
            # idle connections close well before the inference server's (75 s), so none is closed under
            # a request being sent on it.
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S),
                timeout=self.timeout,
                trust_env=False,
            )
        return self.session

    def _url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else f"{self.base_url}/{path.lstrip('/')}"

    async def post(self, path: str, *, cast_to: type, body: Any = None, options: dict | None = None) -> Any:
        # msgspec: a 2,000-token prompt's body in 0.01 ms against json's 0.11 ms
        return await self._request("POST", self._url(path), cast_to, options, msgspec.json.encode(body))

    async def get(self, path: str, *, cast_to: type, options: dict | None = None) -> Any:
        return await self._request("GET", self._url(path), cast_to, options, None)

    async def _request(self, method: str, url: str, cast_to: type, options: dict | None, data: bytes | None) -> Any:
        headers = self.headers | dict((options or {}).get("headers") or {})  # per-request headers, as the SDK's
        try:
            async with self._session().request(method, url, data=data, headers=headers) as response:
                content = await response.read()
                status = response.status
        except TimeoutError as e:  # before ClientError: aiohttp's timeouts are both
            raise openai.APITimeoutError(request=httpx.Request(method, url)) from e
        except aiohttp.ClientError as e:
            raise openai.APIConnectionError(message=f"{method} {url}: {e!r}", request=httpx.Request(method, url)) from e
        if status >= 400:
            raise status_error(method, url, status, content)
        if cast_to is httpx.Response:  # no request attached: building its URL cost as much as the rest
            return httpx.Response(status, content=content)
        if cast_to is dict or getattr(cast_to, "__origin__", None) is dict:
            return json.loads(content)
        raise TypeError(f"EngineClient returns httpx.Response or dict, not {cast_to!r}")

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def status_error(method: str, url: str, status: int, content: bytes) -> openai.APIStatusError:
    """The SDK's error for an error status, with the engine's reply as its message and body."""
    text = content.decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = text
    response = httpx.Response(status, content=content, request=httpx.Request(method, url))
    return openai.APIStatusError(f"Error code: {status} - {text[:2000]}", response=response, body=body)
