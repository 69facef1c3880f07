"""tool-calc: an offline tool-use verifiers environment with an in-process tool loop (see README)."""

import verifiers.v1 as vf
from in_process_chat import SharedChatSession

from tool_calc.harness import ToolCalcHarness, ToolCalcHarnessConfig
from tool_calc.taskset import ToolCalcConfig, ToolCalcData, ToolCalcTask, ToolCalcTaskset, last_number
from tool_calc.tools import TOOLS, find_call, run_call


class ToolCalcEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())


class ToolCalcEnv(SharedChatSession, vf.Env[ToolCalcEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        await agents.agent.run(task)


__all__ = [
    "TOOLS",
    "ToolCalcConfig",
    "ToolCalcData",
    "ToolCalcEnv",
    "ToolCalcEnvConfig",
    "ToolCalcHarness",
    "ToolCalcHarnessConfig",
    "ToolCalcTask",
    "ToolCalcTaskset",
    "find_call",
    "last_number",
    "run_call",
]
