"""An in-process chat harness: the model is asked through the rollout's interception endpoint.

verifiers' built-in `bash` and `null` harnesses launch a program through uv, which needs the network
to install it. verifiers only requires that every model call goes through `endpoint` with `secret`
(see `Harness.launch`), so this harness makes that call itself, in the rollout's own process, and
returns a synthetic success. Token ids and logprobs are recorded by verifiers on the trace as usual.
"""

from __future__ import annotations

import ssl

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

# Built once: httpx builds a TLS context per client otherwise (~20 ms per rollout, unused on localhost).
SSL_CONTEXT = ssl.create_default_context()


class InProcessChatConfig(vf.HarnessConfig):
    """No knobs: the sampling settings come from the rollout's model context."""


class InProcessChatHarness(vf.Harness[InProcessChatConfig]):
    """One chat completion per segment, no tools; later segments resume on the whole conversation."""

    APPENDS_SYSTEM_PROMPT = True  # a task's system prompt stays a system message
    SUPPORTS_RESUME = True  # multi-turn: the default `resume` relaunches on the conversation
    EXECUTES_CODE = False  # the model gets no execution, so the subprocess runtime is safe
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
    ) -> vf.ProgramResult:
        """Send the conversation once; the interception server records the turn on `trace`."""
        system, prompt = self.resolve_prompt(data)
        body = {"model": ctx.model, "messages": chat_messages(system, prompt)}
        # trust_env=False: a proxy from the environment must never sit between us and localhost.
        async with httpx.AsyncClient(timeout=None, trust_env=False, verify=SSL_CONTEXT) as client:
            response = await client.post(
                f"{endpoint.rstrip('/')}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {secret}"},
            )
        response.raise_for_status()
        return vf.ProgramResult(exit_code=0, stdout=response.text, stderr="")


def chat_messages(system: str | None, prompt: str | vf.Messages | None) -> list[dict]:
    """OpenAI chat messages for a system prompt plus a text or Messages prompt."""
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt is not None:
        messages.extend(message_to_wire(message) for message in prompt)
    return messages
