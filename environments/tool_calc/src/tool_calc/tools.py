"""The tool set and the text protocol for calling it: `<tool_call>{json}</tool_call>` in, a
`<tool_response>` turn out."""

from __future__ import annotations

import json
import re

TOOLS = {
    "add": (lambda a, b: a + b, "add(a: int, b: int) -> a + b"),
    "multiply": (lambda a, b: a * b, "multiply(a: int, b: int) -> a * b"),
}
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tools_prompt() -> str:
    listed = "\n".join(f"- {signature}" for _, signature in TOOLS.values())
    return (
        "You can use these tools:\n"
        f"{listed}\n"
        'Call one with <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and wait for '
        "the <tool_response>. When you know the answer, reply with the number only."
    )


def find_call(text: str) -> str | None:
    """The first tool call's JSON text, or None when the reply calls no tool."""
    match = CALL.search(text or "")
    return match.group(1) if match else None


def run_call(call: str) -> str:
    """Execute one call; a bad call gets an error message the model can read (never an exception)."""
    try:
        request = json.loads(call)
        function, _ = TOOLS[request["name"]]
        arguments = request.get("arguments", {})
        return str(function(int(arguments["a"]), int(arguments["b"])))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        return f"error: {type(e).__name__}: {e}; tools are {sorted(TOOLS)}"


def response_message(result: str) -> dict:
    return {"role": "user", "content": f"<tool_response>{result}</tool_response>"}
