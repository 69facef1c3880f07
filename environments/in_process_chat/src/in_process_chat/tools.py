"""The in-process harness's tool loop: the rollout's MCP toolsets offered to the model, its calls executed.

verifiers serves each toolset of a rollout as an MCP server and hands the harness their URLs
(`mcp_urls`, name -> URL). The loop lists their tools once, offers them with every chat call (the
renderer writes them into the prompt and parses the model's tool calls), runs each call through its
server's `call_tool` and appends the result as a `tool` message, until the model answers without a call
or `max_tool_calls` calls ran. A call that cannot run (an unknown tool, arguments that are not a JSON
object, a tool that raised) is answered with an `error: ...` tool message the model can read: the
rollout goes on. Tool messages reach the model as prompt tokens of its next turn, so the trainer never
trains on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from verifiers.v1.harnesses.utils.mcp import MCPConnection, connect_mcp, mcp_content_to_chat_content

ERROR_PREFIX = "error: "
"""Starts every tool message that reports a failed call (the `tool_errors` metric counts them)."""


class Toolbox:
    """The rollout's MCP tools: their OpenAI function schemas and how to call each."""

    def __init__(self, schemas: list[dict], dispatch: dict[str, tuple[str, str]], servers: dict[str, MCPConnection],
                 timeout_s: float) -> None:
        self.schemas = schemas
        self.dispatch = dispatch  # offered name -> (server, the tool's own name)
        self.servers = servers
        self.timeout_s = timeout_s

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, mcp_urls: dict[str, str], timeout_s: float) -> AsyncIterator[Toolbox]:
        """List the tools of every server (names are qualified `<server>_<tool>` where the server has a
        prefix, as verifiers' own chat program offers them); the connections close on exit."""
        config = {"mcpServers": {name: {"url": url, "timeout": timeout_s} for name, url in mcp_urls.items()}}
        async with contextlib.AsyncExitStack() as stack:
            schemas, dispatch, servers = await asyncio.wait_for(connect_mcp(config, stack), timeout_s)
            yield cls(schemas, dispatch, servers, timeout_s)

    async def call(self, tool_call: dict) -> str:
        """Run one OpenAI-format tool call; its result as text, or an `error: ...` message."""
        function = tool_call.get("function") or {}
        name = function.get("name")
        if name not in self.dispatch:
            return f"{ERROR_PREFIX}unknown tool {name!r}; the tools are {', '.join(sorted(self.dispatch))}"
        arguments = parse_arguments(function.get("arguments"))
        if isinstance(arguments, str):
            return arguments
        server, tool = self.dispatch[name]
        try:
            result = await asyncio.wait_for(
                self.servers[server].run(lambda client: client.call_tool(tool, arguments)), self.timeout_s
            )
        except TimeoutError:
            return f"{ERROR_PREFIX}tool {name!r} did not answer within {self.timeout_s:g} s"
        content = mcp_content_to_chat_content(result.content)
        text = content if isinstance(content, str) else json.dumps(content)
        return f"{ERROR_PREFIX}{text}" if result.is_error else text


def parse_arguments(arguments: Any) -> dict | str:
    """A call's arguments as a dict, or the error message telling the model what was wrong."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except (TypeError, json.JSONDecodeError) as e:
        return f"{ERROR_PREFIX}the arguments are not valid JSON ({e}); call again with a JSON object"
    if not isinstance(parsed, dict):
        return f"{ERROR_PREFIX}the arguments must be a JSON object, not {type(parsed).__name__}"
    return parsed


def tool_messages(messages) -> list[str]:
    """The contents of a conversation's tool messages (verifiers Messages or OpenAI dicts)."""
    contents = []
    for message in messages or []:
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if role == "tool":
            contents.append(content if isinstance(content, str) else json.dumps(content, default=str))
    return contents
