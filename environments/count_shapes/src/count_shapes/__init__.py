"""count-shapes: an offline verifiers environment whose prompts carry images.

verifiers resolves the id `count-shapes` to this module and picks the plugin classes out of `__all__`: the
`Taskset`, its default `Harness` and the `Env` (whose `agent` seat defaults to the local subprocess runtime).
"""

import verifiers.v1 as vf

from count_shapes.taskset import CountShapesConfig, CountShapesData, CountShapesTask, CountShapesTaskset, first_number
from in_process_chat import InProcessChatConfig, InProcessChatHarness, SharedChatSession


class CountShapesEnvConfig(vf.EnvConfig):
    """One seat; its default runtime is local (verifiers' default is a remote sandbox)."""

    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())


class CountShapesEnv(SharedChatSession, vf.Env[CountShapesEnvConfig]):
    """The single-agent episode: the one seat plays the task."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.agent.run(task)


__all__ = [
    "CountShapesConfig",
    "CountShapesData",
    "CountShapesEnv",
    "CountShapesEnvConfig",
    "CountShapesTask",
    "CountShapesTaskset",
    "InProcessChatConfig",
    "InProcessChatHarness",
    "first_number",
]
