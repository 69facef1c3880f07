"""tool-calc: an offline tool-use verifiers environment; its tools are an MCP toolset (see README)."""

import verifiers.v1 as vf
from in_process_chat import SharedChatSession

from tool_calc.taskset import ToolCalcConfig, ToolCalcData, ToolCalcTask, ToolCalcTaskset, last_number
from tool_calc.tools import CalcToolset


class ToolCalcEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())


class ToolCalcEnv(SharedChatSession, vf.Env[ToolCalcEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.agent.run(task)


__all__ = [
    "CalcToolset",
    "ToolCalcConfig",
    "ToolCalcData",
    "ToolCalcEnv",
    "ToolCalcEnvConfig",
    "ToolCalcTask",
    "ToolCalcTaskset",
    "last_number",
]
