"""In-process chat for offline verifiers environments, tools included.

verifiers' built-in `bash` and `null` harnesses launch a program through uv, which needs the network to
install it. verifiers only requires that every model call goes through the rollout's interception
`endpoint` with its `secret` (see `Harness.launch`), so `InProcessChatHarness` makes that call itself, in
the rollout's own process, and returns a synthetic success. Token ids and logprobs are recorded by
verifiers on the trace as usual. A rollout with toolsets gets their tools offered and its calls run
through their MCP servers (`tools.py`).

Model calls go through rl's chat calls (`rl.envs.chat_calls`): over one kept-alive HTTP session per event loop
while `shared_session()` is held (rl holds it while an environment serves; the `SharedChatSession` mixin does for an
`Env` run by other tools), or straight to the interception server's route handler where that server runs on the
same event loop.
"""

from __future__ import annotations

import json

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.dialects.chat import message_to_wire

from rl.envs.chat_calls import SharedChatSession, post, route_in_process, shared_session

from in_process_chat.tools import Toolbox

__all__ = ["SharedChatSession", "route_in_process", "shared_session"]  # rl's, named here for the environments


class ModelCallError(RuntimeError):
    """The interception endpoint answered a model call with an error status."""


async def complete(endpoint: str, secret: str, model: str, messages: list[dict]) -> str:
    """One chat completion through the rollout's interception endpoint; the reply's text."""
    return (await chat(endpoint, secret, model, messages)).get("content") or ""


async def chat(endpoint: str, secret: str, model: str, messages: list[dict], tools: list[dict] | None = None) -> dict:
    """One chat completion through the rollout's interception endpoint, offering `tools` (OpenAI function
    schemas); the reply's assistant message (`content`, and `tool_calls` where the model called tools)."""
    body = {"model": model, "messages": messages} | ({"tools": tools} if tools else {})
    url = f"{endpoint.rstrip('/')}/chat/completions"
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    status, content = await post(url, headers, body)
    if status >= 400:
        raise ModelCallError(f"POST {url} answered {status}: {content[:500].decode(errors='replace')}")
    return json.loads(content)["choices"][0]["message"]


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
