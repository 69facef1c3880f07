"""An in-process tool-calling harness: the model is asked through the rollout's interception endpoint
(verifiers records every call on the trace); each `<tool_call>` in a reply is executed here and
answered with a `<tool_response>` user turn, until a reply calls no tool or `max_tool_calls` ran."""

from __future__ import annotations

import ssl

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from tool_calc.tools import find_call, response_message, run_call

# One TLS context for every rollout: httpx builds (and loads the CA bundle into) a new one per client
# otherwise, ~20 ms of CPU per rollout. The endpoint is plain http on localhost; this is only the default.
SSL_CONTEXT = ssl.create_default_context()


class ToolCalcHarnessConfig(vf.HarnessConfig):
    """No knobs: the tool budget is the task's `max_tool_calls`."""


class ToolCalcHarness(vf.Harness[ToolCalcHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False  # the tools are pure functions of two integers
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(message) for message in prompt)
        async with httpx.AsyncClient(timeout=None, trust_env=False, verify=SSL_CONTEXT) as client:
            for _ in range(data.max_tool_calls + 1):
                reply = await self.complete(client, endpoint, secret, ctx.model, messages)
                call = find_call(reply)
                if call is None:
                    break
                messages += [{"role": "assistant", "content": reply}, response_message(run_call(call))]
        return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")

    async def complete(self, client: httpx.AsyncClient, endpoint: str, secret: str, model: str, messages) -> str:
        response = await client.post(
            f"{endpoint.rstrip('/')}/chat/completions",
            json={"model": model, "messages": messages},
            headers={"Authorization": f"Bearer {secret}"},
        )
        response.raise_for_status()
        return response.json()["choices"][0]["message"].get("content") or ""
