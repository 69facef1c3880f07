"""reverse-text: an offline verifiers environment.

verifiers resolves the id `reverse-text` to this module (`-` becomes `_`) and picks the plugin classes
out of `__all__`: exactly one `Taskset`, and here also the `Harness` (so it is the taskset's default
harness) and the `Env` (whose `agent` seat defaults to the local subprocess runtime).
"""

import verifiers.v1 as vf

from in_process_chat import InProcessChatConfig, InProcessChatHarness, SharedChatSession
from reverse_text.taskset import (
    ReverseTextConfig,
    ReverseTextData,
    ReverseTextTask,
    ReverseTextTaskset,
    lcs_ratio,
)


class ReverseTextEnvConfig(vf.EnvConfig):
    """One seat; its default runtime is local (verifiers' default is a remote sandbox)."""

    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())


class ReverseTextEnv(SharedChatSession, vf.Env[ReverseTextEnvConfig]):
    """The single-agent episode: the one seat plays the task."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.agent.run(task)


__all__ = [
    "InProcessChatConfig",
    "InProcessChatHarness",
    "ReverseTextConfig",
    "ReverseTextData",
    "ReverseTextEnv",
    "ReverseTextEnvConfig",
    "ReverseTextTask",
    "ReverseTextTaskset",
    "lcs_ratio",
]
