"""In-process chat for offline verifiers environments, tools included.

verifiers' built-in `bash` and `null` harnesses launch a program through uv, which needs the network to
install it. verifiers only requires that every model call goes through the rollout's interception
`endpoint` with its `secret` (see `Harness.launch`), so `InProcessChatHarness` makes that call itself, in
the rollout's own process, and returns a synthetic success. Token ids and logprobs are recorded by
verifiers on the trace as usual. A rollout with toolsets gets their tools offered and its calls run
through their MCP servers (`tools.py`).

Model calls share one kept-alive HTTP session per event loop while `shared_session()` is held: rl's
orchestrator holds it while an environment serves, and the `SharedChatSession` mixin does for an `Env` run
by other tools. A new client per rollout cost a TCP handshake on both ends of localhost and measurable
orchestrator CPU per rollout (rl's docs/architecture.md, Measurements).

Where the interception server runs on this event loop, its owner may offer its route handler
(`route_in_process`): model calls to that URL then call the handler directly, with the same headers and body,
instead of going through HTTP on localhost (~0.7 ms of CPU per call on both ends, of a few ms per rollout).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.dialects.chat import message_to_wire

from in_process_chat.tools import Toolbox

_shared: dict[asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, int]] = {}
"""Per event loop: the session serving environments share, and how many environments hold it."""

LocalRoute = Callable[[dict[str, str], bytes], Awaitable[tuple[int, bytes]]]
"""A server's handler for one route, called in its own process: (request headers, body) -> (status, body)."""

_local_routes: dict[tuple[asyncio.AbstractEventLoop, str], LocalRoute] = {}
"""Per event loop and URL: the handler of the server that serves that URL on this loop."""


class ModelCallError(RuntimeError):
    """The interception endpoint answered a model call with an error status."""


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
    """While held, model calls on this event loop share one kept-alive session (holders nest)."""
    await _hold()
    try:
        yield
    finally:
        await _release()


class SharedChatSession:
    """`Env` mixin: hold the event loop's shared session while the environment serves."""

    async def start(self) -> None:
        await _hold()
        await super().start()

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            await _release()


def route_in_process(url: str, handler: LocalRoute | None) -> None:
    """Model calls to `url` made on the running event loop call `handler` instead of going over HTTP; None: they
    go over HTTP again. The handler must answer as the server at `url` would."""
    key = (asyncio.get_running_loop(), url)
    if handler is None:
        _local_routes.pop(key, None)
    else:
        _local_routes[key] = handler


async def complete(endpoint: str, secret: str, model: str, messages: list[dict]) -> str:
    """One chat completion through the rollout's interception endpoint; the reply's text."""
    return (await chat(endpoint, secret, model, messages)).get("content") or ""


async def chat(endpoint: str, secret: str, model: str, messages: list[dict], tools: list[dict] | None = None) -> dict:
    """One chat completion through the rollout's interception endpoint, offering `tools` (OpenAI function
    schemas); the reply's assistant message (`content`, and `tool_calls` where the model called tools)."""
    body = {"model": model, "messages": messages} | ({"tools": tools} if tools else {})
    url = f"{endpoint.rstrip('/')}/chat/completions"
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    local = _local_routes.get((asyncio.get_running_loop(), url))
    if local is not None:
        status, content = await local(headers, json.dumps(body).encode())
    else:
        status, content = await _post(url, headers, body)
    if status >= 400:
        raise ModelCallError(f"POST {url} answered {status}: {content[:500].decode(errors='replace')}")
    return json.loads(content)["choices"][0]["message"]


async def _post(url: str, headers: dict[str, str], body: dict) -> tuple[int, bytes]:
    shared = _shared.get(asyncio.get_running_loop())
    if shared is not None:
        return await _send(shared[0], url, headers, body)
    async with new_session() as session:
        return await _send(session, url, headers, body)


async def _send(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict) -> tuple[int, bytes]:
    async with session.post(url, json=body, headers=headers) as response:
        return response.status, await response.read()


def chat_messages(system: str | None, prompt: str | vf.Messages | None) -> list[dict]:
    """OpenAI chat messages for a system prompt plus a text or Messages prompt."""
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt is not None:
        messages.extend(message_to_wire(message) for message in prompt)
    return messages


class DataIdKey:
    """`Task` mixin: the task's key is its data's durable `id` when it has one, as verifiers suggests for
    datasets that provide one. The default key, a sha256 of the task's JSON, is recomputed on every read
    (twice per rollout), a visible share of the orchestrator's CPU (rl's docs/architecture.md, Measurements)."""

    @property
    def key(self) -> str:
        return self.data.id or super().key


class InProcessChatConfig(vf.HarnessConfig):
    """The sampling settings come from the rollout's model context; `tool_timeout` (verifiers') bounds each
    tool call."""

    max_tool_calls: int = Field(8, ge=0, description="tool calls run per rollout; then the rollout ends")


class InProcessChatHarness(vf.Harness[InProcessChatConfig]):
    """One chat completion per segment; where the rollout has toolsets, the tool loop of `tools.py`.
    Later segments resume on the whole conversation."""

    APPENDS_SYSTEM_PROMPT = True  # a task's system prompt stays a system message
    SUPPORTS_MCP = True  # tools run through the rollout's MCP servers, called from this process
    SUPPORTS_RESUME = True  # multi-turn: the default `resume` relaunches on the conversation
    EXECUTES_CODE = False  # the model runs nothing itself: tools are the toolsets' own code
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        """Send the conversation; the interception server records every turn on `trace`."""
        messages = chat_messages(*self.resolve_prompt(data))
        if not mcp_urls:
            reply = await complete(endpoint, secret, ctx.model, messages)
            return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")
        async with Toolbox.connect(mcp_urls, self.config.tool_timeout) as toolbox:
            reply = await self.tool_loop(toolbox, endpoint, secret, ctx.model, messages)
        return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")

    async def tool_loop(self, toolbox: Toolbox, endpoint: str, secret: str, model: str, messages: list[dict]) -> str:
        calls = 0
        while True:
            reply = await chat(endpoint, secret, model, messages, toolbox.schemas)
            tool_calls = reply.get("tool_calls") or []
            if not tool_calls or calls >= self.config.max_tool_calls:
                return reply.get("content") or ""
            messages.append({"role": "assistant", "content": reply.get("content") or "", "tool_calls": tool_calls})
            for call in tool_calls[: self.config.max_tool_calls - calls]:
                result = await toolbox.call(call)
                call_id = call.get("id", "") if isinstance(call, dict) else ""  # a malformed call gets its error too
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
                calls += 1


__all__ = [
    "DataIdKey",
    "InProcessChatConfig",
    "InProcessChatHarness",
    "ModelCallError",
    "SharedChatSession",
    "Toolbox",
    "chat",
    "chat_messages",
    "complete",
    "route_in_process",
    "shared_session",
]
