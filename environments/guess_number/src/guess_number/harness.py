"""An in-process chat harness: one chat completion per segment through the rollout's interception
endpoint (verifiers records tokens and logprobs on the trace). Later segments are relaunched on the
whole conversation (`SUPPORTS_RESUME`), which is how the environment's replies reach the model."""

from __future__ import annotations

import ssl

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

# One TLS context for every rollout: httpx builds (and loads the CA bundle into) a new one per client
# otherwise, ~20 ms of CPU per rollout. The endpoint is plain http on localhost; this is only the default.
SSL_CONTEXT = ssl.create_default_context()


class GuessChatConfig(vf.HarnessConfig):
    """No knobs: the sampling settings come from the rollout's model context."""


class GuessChatHarness(vf.Harness[GuessChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(message) for message in prompt)
        async with httpx.AsyncClient(timeout=None, trust_env=False, verify=SSL_CONTEXT) as client:
            response = await client.post(
                f"{endpoint.rstrip('/')}/chat/completions",
                json={"model": ctx.model, "messages": messages},
                headers={"Authorization": f"Bearer {secret}"},
            )
        response.raise_for_status()
        return vf.ProgramResult(exit_code=0, stdout=response.text, stderr="")
