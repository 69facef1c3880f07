"""An in-process tool-calling harness: the model is asked through the rollout's interception endpoint
(verifiers records every call on the trace); each `<tool_call>` in a reply is executed here and
answered with a `<tool_response>` user turn, until a reply calls no tool or `max_tool_calls` ran."""

from __future__ import annotations

import verifiers.v1 as vf
from in_process_chat import chat_messages, complete

from tool_calc.tools import find_call, response_message, run_call


class ToolCalcHarnessConfig(vf.HarnessConfig):
    """No knobs: the tool budget is the task's `max_tool_calls`."""


class ToolCalcHarness(vf.Harness[ToolCalcHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False  # the tools are pure functions of two integers
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        messages = chat_messages(*self.resolve_prompt(data))
        for _ in range(data.max_tool_calls + 1):
            reply = await complete(endpoint, secret, ctx.model, messages)
            call = find_call(reply)
            if call is None:
                break
            messages += [{"role": "assistant", "content": reply}, response_message(run_call(call))]
        return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")
