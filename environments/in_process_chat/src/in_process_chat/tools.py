"""The in-process harness's tool loop: the rollout's MCP toolsets offered to the model, its calls executed.

verifiers serves each toolset of a rollout as an MCP server and hands the harness their URLs
(`mcp_urls`, name -> URL). The loop lists their tools once, offers them with every chat call (the
renderer writes them into the prompt and parses the model's tool calls), runs each call through its
server's `call_tool` and appends the result as a `tool` message, until the model answers without a call
or `max_tool_calls` calls ran. A call that cannot run (a call of the wrong shape, an unknown tool,
arguments that are not a JSON object or are past `MAX_ARGUMENT_BYTES` or `MAX_ARGUMENT_DEPTH`, a tool that
raised) is answered with an `error: ...` tool message the model can read: the rollout goes on. Tool
messages reach the model as prompt tokens of its next turn, so the trainer never trains on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from verifiers.v1.harnesses.utils.mcp import MCPConnection, connect_mcp, mcp_content_to_chat_content

ERROR_PREFIX = "error: "
"""Starts every tool message that reports a failed call (the `tool_errors` metric counts them)."""
MAX_ARGUMENT_BYTES = 1 << 20
"""A call's arguments (JSON text, UTF-8) past this are refused unparsed."""
MAX_ARGUMENT_DEPTH = 64
"""Arrays and objects nested deeper than this are refused unparsed (Python's parser recurses per level)."""
JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"')


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

    async def call(self, tool_call: Any) -> str:
        """Run one OpenAI-format tool call; its result as text, or an `error: ...` message (a call of the wrong
        shape, an unknown tool or arguments that cannot run included: the rollout goes on)."""
        function = tool_call.get("function") if isinstance(tool_call, dict) else None
        if not isinstance(function, dict):
            return f"{ERROR_PREFIX}a tool call is an object with a function {{name, arguments}}"
        name = function.get("name")
        if not isinstance(name, str):
            return f"{ERROR_PREFIX}the tool's name must be a string, not {type(name).__name__}"
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
    """A call's arguments as a dict, or the error message telling the model what was wrong. Their size and
    nesting are checked before they are parsed, so arguments too long or too deep cost no parse."""
    if isinstance(arguments, dict):  # already parsed: checked as the text it would be sent as
        try:
            arguments = json.dumps(arguments)
        except (ValueError, TypeError, RecursionError) as e:
            return f"{ERROR_PREFIX}the arguments cannot be written as JSON ({type(e).__name__})"
    if arguments is None or arguments == "":
        return {}
    if not isinstance(arguments, str):
        return f"{ERROR_PREFIX}the arguments must be a JSON object in a string, not {type(arguments).__name__}"
    # UTF-8 takes a byte or more per character: a long text is refused before it is encoded.
    if len(arguments) > MAX_ARGUMENT_BYTES or len(arguments.encode(errors="replace")) > MAX_ARGUMENT_BYTES:
        return f"{ERROR_PREFIX}the arguments are longer than {MAX_ARGUMENT_BYTES} bytes; call with shorter ones"
    if nesting_depth(arguments) > MAX_ARGUMENT_DEPTH:
        return f"{ERROR_PREFIX}the arguments are nested deeper than {MAX_ARGUMENT_DEPTH} levels; call with flatter ones"
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer past Python's digit limit, ...
        return f"{ERROR_PREFIX}the arguments are not valid JSON ({e}); call again with a JSON object"
    if not isinstance(parsed, dict):
        return f"{ERROR_PREFIX}the arguments must be a JSON object, not {type(parsed).__name__}"
    return parsed


def nesting_depth(text: str) -> int:
    """How deeply the JSON text's arrays and objects nest (brackets inside strings do not count)."""
    steps = [1 if c in "[{" else -1 for c in JSON_STRING.sub("", text) if c in "[]{}"]
    return max(itertools.accumulate(steps), default=0)
