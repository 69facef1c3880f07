"""The HTTP transport of verifiers' training client: vLLM's `/inference/v1/generate` over aiohttp.

verifiers' `TrainClient` renders the prompt and parses the engine's reply itself; for the request it
holds an OpenAI SDK client, of which `renderers.client.generate` uses only `base_url`, `post` (an
absolute URL, `cast_to=httpx.Response`) and `get("/models")`. The SDK's request path (options models,
header building, httpx over anyio, a connection-pool scan per request) cost more orchestrator CPU per turn
than the whole raw client of benchmarks/orchestrator_throughput.py (benchmarks/RESULTS.md); on
a host where vLLM needs every core that CPU is generation lost. `EngineClient` offers the same three members
over one aiohttp session and raises the SDK's error types, so verifiers maps failures to the same
statuses (4xx not retried; connection 503; timeout 504). verifiers' own retries are off (MAX_RETRIES 0),
so none are lost.

A group's rollouts send identical generate requests for their first turn (the same prompt, the same sampling
settings). `EngineClient` sends those as one request with `n` samples and hands each rollout its own choice
(`RequestGrouper`), as TRL and verl sample a group: the server then parses, schedules and prefills the prompt once
per group, not once per rollout (benchmarks/RESULTS.md). A rollout's first generate request waits for
identical ones at most `group_gap_s` after the last one joined, and a full group (`group_size`) goes at once; its
later requests do not wait. Seeded requests are never grouped: n samples of one seeded request are not the n
seeds' samples.

A `priority` sampling setting (the orchestrator's group number under continuous dispatch) goes to the request's
top level, where vLLM's priority scheduling reads it.

Each generate reply's weight-version spans (which policy sampled each token) are recorded under the rollout's
session id for its turn's commit to take (rl/envs/policy_versions.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import msgspec
import openai
import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.clients.client import SESSION_ID_HEADER
from verifiers.v1.configs.client import BaseClientConfig, resolve_api_key, resolve_headers

from rl.envs.config import GROUP_GAP_S
from rl.envs.policy_versions import POLICY_VERSIONS

IDLE_CONNECTION_S = 15.0
GENERATE_ROUTE = "/inference/v1/generate"
MAX_SAMPLES_PER_REQUEST = 64  # vLLM refuses n above its max_num_seqs (by default 128 on CPU, 256-1024 on GPUs)
SESSIONS_REMEMBERED = 65_536  # rollouts whose first request was seen: more than are ever in flight at once


class GroupedTrainClientConfig(vf.TrainClientConfig):
    """verifiers' training client config, plus how `EngineClient` groups identical generate requests."""

    group_size: int = Field(1, ge=1, description="rollouts per group: a group's requests go as soon as all joined")
    group_gap_s: float = Field(GROUP_GAP_S, ge=0, description="wait for an identical request after the last "
                                                               "joined; 0: every request goes alone")


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
        group_size, gap_s = getattr(config, "group_size", 1), getattr(config, "group_gap_s", 0.0)
        self.grouper = RequestGrouper(self._generate, group_size, gap_s) if group_size > 1 and gap_s > 0 else None

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
        url = self._url(path)
        generate = cast_to is httpx.Response and url.endswith(GENERATE_ROUTE)
        body = with_priority_on_top(body) if generate else body
        # msgspec: a 2,000-token prompt's body in 0.01 ms against json's 0.11 ms
        if generate and self.grouper is not None and groupable(body):
            response = httpx.Response(200, content=await self.grouper.submit(url, body, options))
        else:
            response = await self._request("POST", url, cast_to, options, msgspec.json.encode(body))
        session = ((options or {}).get("headers") or {}).get(SESSION_ID_HEADER) if generate else None
        if session is not None:  # which policy sampled each token, for the turn's commit (rl/envs/policy_versions.py)
            POLICY_VERSIONS.record(session, response.content)
        return response

    async def _generate(self, url: str, body: dict, options: dict | None) -> bytes:
        return (await self._request("POST", url, httpx.Response, options, msgspec.json.encode(body))).content

    async def get(self, path: str, *, cast_to: type, options: dict | None = None) -> Any:
        return await self._request("GET", self._url(path), cast_to, options, None)

    async def _request(self, method: str, url: str, cast_to: type, options: dict | None, data: bytes | None) -> Any:
        headers = self.headers | dict((options or {}).get("headers") or {})  # per-request headers, as the SDK's
        try:
            # no redirect followed: the headers (a key among them) would go to a server no one allowed
            async with self._session().request(method, url, data=data, headers=headers,
                                               allow_redirects=False) as response:
                content = await response.read()
                status = response.status
                location = response.headers.get("Location", "")
        except TimeoutError as e:  # before ClientError: aiohttp's timeouts are both
            raise openai.APITimeoutError(request=httpx.Request(method, url)) from e
        except aiohttp.ClientError as e:
            raise openai.APIConnectionError(message=f"{method} {url}: {e!r}", request=httpx.Request(method, url)) from e
        if status >= 400 or 300 <= status < 400:
            if status < 400:
                content = f"a redirect to {location[:200]!r}, not followed (rl follows none)".encode()
            raise status_error(method, url, status, content)
        if cast_to is httpx.Response:  # no request attached: building its URL cost as much as the rest
            return httpx.Response(status, content=content)
        if cast_to is dict or getattr(cast_to, "__origin__", None) is dict:
            return json.loads(content)
        raise TypeError(f"EngineClient returns httpx.Response or dict, not {cast_to!r}")

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def with_priority_on_top(body: Any) -> Any:
    """The generate request with a `priority` sampling setting moved to the request's top level, where vLLM reads
    it (verifiers forwards every sampling setting inside `sampling_params`)."""
    sampling = body.get("sampling_params") if isinstance(body, dict) else None
    if not isinstance(sampling, dict) or "priority" not in sampling:
        return body
    return body | {"sampling_params": {k: v for k, v in sampling.items() if k != "priority"},
                   "priority": sampling["priority"]}


def groupable(body: Any) -> bool:
    """A generate request that n samples of one request can stand for: one sample, not seeded."""
    sampling = body.get("sampling_params") if isinstance(body, dict) else None
    return isinstance(sampling, dict) and sampling.get("n", 1) == 1 and sampling.get("seed") is None


class RequestGrouper:
    """Sends identical generate requests as one with `n` samples; each caller gets a reply with its own choice.

    Requests are identical when their bodies and headers are, the rollout's session id aside (it only names the
    rollout). Each waits at most `gap_s` after the last identical one joined; `group_size` of them (at most
    `MAX_SAMPLES_PER_REQUEST`) go at once. Only a rollout's first request waits: a later one (a session id seen
    before) joins an identical request already waiting, else goes at once.
    A caller cancelled before its group goes is left out of it; once it has gone, its sample is dropped.
    """

    def __init__(self, send: Callable[[str, dict, dict | None], Awaitable[bytes]], group_size: int, gap_s: float):
        self.send, self.group_size, self.gap_s = send, min(group_size, MAX_SAMPLES_PER_REQUEST), gap_s
        self.forming: dict[bytes, PendingGroup] = {}
        self.answering: set[asyncio.Task] = set()  # the loop holds tasks weakly
        self.sessions: dict[str, None] = {}  # the session ids seen, oldest first

    async def submit(self, url: str, body: dict, options: dict | None) -> bytes:
        headers = dict((options or {}).get("headers") or {})
        later_turn = self._seen(headers.pop(SESSION_ID_HEADER, None))
        key = msgspec.json.encode([url, body, sorted(headers.items())])
        group = self.forming.get(key)
        if group is None:
            group = self.forming[key] = PendingGroup(url, body, options)
        reply = asyncio.get_running_loop().create_future()
        group.callers.append(reply)
        if group.timer is not None:
            group.timer.cancel()
        if len(group.callers) >= self.group_size or (later_turn and len(group.callers) == 1):
            self._go(key)
        else:
            group.timer = asyncio.get_running_loop().call_later(self.gap_s, self._go, key)
        return await reply

    def _seen(self, session: str | None) -> bool:
        """Whether this session (a rollout) has sent a request before; remembers it."""
        if session is None:
            return False
        if session in self.sessions:
            return True
        self.sessions[session] = None
        if len(self.sessions) > SESSIONS_REMEMBERED:
            del self.sessions[next(iter(self.sessions))]
        return False

    def _go(self, key: bytes) -> None:
        group = self.forming.pop(key)
        if group.timer is not None:
            group.timer.cancel()
        callers = [reply for reply in group.callers if not reply.done()]  # the cancelled ones are out
        if callers:
            task = asyncio.ensure_future(self._answer(group, callers))
            self.answering.add(task)
            task.add_done_callback(self.answering.discard)

    async def _answer(self, group: "PendingGroup", callers: list[asyncio.Future]) -> None:
        n = len(callers)
        body = group.body if n == 1 else group.body | {"sampling_params": group.body["sampling_params"] | {"n": n}}
        request = asyncio.ensure_future(self.send(group.url, body, group.options))
        for reply in callers:  # nobody left to answer: the request is cancelled (and vLLM aborts it)
            reply.add_done_callback(lambda _: all(r.cancelled() for r in callers) and request.cancel())
        try:
            content = await request
            replies = [content] if n == 1 else split_reply(group.url, content, n)
        except asyncio.CancelledError:
            for reply in callers:
                reply.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - every caller gets the request's error, as its own
            for reply in callers:
                if not reply.done():
                    reply.set_exception(e)
            return
        for reply, one in zip(callers, replies):
            if not reply.done():
                reply.set_result(one)


class PendingGroup:
    def __init__(self, url: str, body: dict, options: dict | None):
        self.url, self.body, self.options = url, body, options
        self.callers: list[asyncio.Future] = []
        self.timer: asyncio.TimerHandle | None = None


class TokenCount(msgspec.Struct):
    token_ids: list[int] | None = None


def split_reply(url: str, content: bytes, n: int) -> list[bytes]:
    """vLLM's reply with n choices -> n replies of one choice each, as n requests would have had them: that
    choice's usage, request ids told apart; each choice keeps its index. The choices are copied as bytes, not
    parsed (their logprobs are two dicts per token, parsed again by the caller): 1.2 ms against 12.9 ms for 8
    choices of 400 tokens."""
    try:
        reply = msgspec.json.decode(content, type=dict[str, msgspec.Raw])
        choices = msgspec.json.decode(reply.pop("choices", b"[]"), type=list[msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise openai.APIError(f"{url} answered a request for {n} samples with no JSON object of choices: {e}",
                              request=httpx.Request("POST", url), body=None) from e
    if len(choices) != n:
        raise openai.APIError(f"{url} answered a request for {n} samples with {len(choices)}",
                              request=httpx.Request("POST", url), body=None)
    usage = msgspec.json.decode(reply["usage"]) if "usage" in reply else None
    request_id = msgspec.json.decode(reply.get("request_id", b'""')) or ""
    replies = []
    for i, choice in enumerate(choices):
        one = reply | {"request_id": f"{request_id}-{i}", "choices": [choice]}
        if isinstance(usage, dict):
            completion = len(msgspec.json.decode(choice, type=TokenCount).token_ids or ())
            one["usage"] = usage | {"completion_tokens": completion,
                                    "total_tokens": (usage.get("prompt_tokens") or 0) + completion}
        replies.append(msgspec.json.encode(one))
    return replies


def status_error(method: str, url: str, status: int, content: bytes) -> openai.APIStatusError:
    """The SDK's error for an error status, with the engine's reply as its message and body."""
    text = content.decode(errors="replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = text
    response = httpx.Response(status, content=content, request=httpx.Request(method, url))
    return openai.APIStatusError(f"Error code: {status} - {text[:2000]}", response=response, body=body)
