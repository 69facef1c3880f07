"""In-process chat for offline verifiers environments.

verifiers' built-in `bash` and `null` harnesses launch a program through uv, which needs the network to
install it. verifiers only requires that every model call goes through the rollout's interception
`endpoint` with its `secret` (see `Harness.launch`), so `InProcessChatHarness` makes that call itself, in
the rollout's own process, and returns a synthetic success. Token ids and logprobs are recorded by
verifiers on the trace as usual.

Model calls share one kept-alive HTTP session per event loop while `shared_session()` is held: rl's
orchestrator holds it while an environment serves, and the `SharedChatSession` mixin does for an `Env` run
by other tools. A new client per rollout cost a TCP handshake on both ends of localhost and measurable
orchestrator CPU per rollout (rl's docs/architecture.md, Measurements).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

_shared: dict[asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, int]] = {}
"""Per event loop: the session serving environments share, and how many environments hold it."""


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


async def complete(endpoint: str, secret: str, model: str, messages: list[dict]) -> str:
    """One chat completion through the rollout's interception endpoint; the reply's text."""
    shared = _shared.get(asyncio.get_running_loop())
    if shared is not None:
        return await _post(shared[0], endpoint, secret, model, messages)
    async with new_session() as session:
        return await _post(session, endpoint, secret, model, messages)


async def _post(session: aiohttp.ClientSession, endpoint: str, secret: str, model: str, messages) -> str:
    url = f"{endpoint.rstrip('/')}/chat/completions"
    body = {"model": model, "messages": messages}
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {secret}"}) as response:
        text = await response.text()
    if response.status >= 400:
        raise ModelCallError(f"POST {url} answered {response.status}: {text[:500]}")
    return json.loads(text)["choices"][0]["message"].get("content") or ""


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
    """No knobs: the sampling settings come from the rollout's model context."""


class InProcessChatHarness(vf.Harness[InProcessChatConfig]):
    """One chat completion per segment, no tools; later segments resume on the whole conversation."""

    APPENDS_SYSTEM_PROMPT = True  # a task's system prompt stays a system message
    SUPPORTS_RESUME = True  # multi-turn: the default `resume` relaunches on the conversation
    EXECUTES_CODE = False  # the model gets no execution, so the subprocess runtime is safe
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        """Send the conversation once; the interception server records the turn on `trace`."""
        reply = await complete(endpoint, secret, ctx.model, chat_messages(*self.resolve_prompt(data)))
        return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")


__all__ = [
    "DataIdKey",
    "InProcessChatConfig",
    "InProcessChatHarness",
    "ModelCallError",
    "SharedChatSession",
    "chat_messages",
    "complete",
    "shared_session",
]
