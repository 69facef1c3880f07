"""Compute (a + b) * c, numbers drawn from (seed, index); the tools add and multiply are offered."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf
from in_process_chat import DataIdKey
from in_process_chat.tools import ERROR_PREFIX
from rl.envs.chat_calls import tool_messages
from pydantic import Field

from tool_calc.tools import CalcToolset

SYSTEM_PROMPT = "Use the tools to compute. When you know the answer, reply with the number only."


class ToolCalcConfig(vf.TasksetConfig):
    """Taskset arguments."""

    num_examples: int = Field(1000, ge=1, description="Number of tasks.")
    max_operand: int = Field(9, ge=1, description="Operands are drawn from 0..max_operand.")
    seed: int = Field(0, description="Seed the operands are drawn from.")
    tools: vf.SharedToolsetConfig = Field(vf.SharedToolsetConfig(), description="Where the tool server runs.")


class ToolCalcData(vf.TaskData):
    answer: int


def last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text or "")
    return int(numbers[-1]) if numbers else None


class ToolCalcTask(DataIdKey, vf.Task[ToolCalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ToolCalcData, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply) == task.answer)

    @vf.reward(weight=0.2)
    async def tool_use(self, task: ToolCalcData, trace: vf.Trace) -> float:
        return float(any(not m.startswith(ERROR_PREFIX) for m in tool_messages(trace.messages)))


class ToolCalcTaskset(vf.Taskset[ToolCalcTask, ToolCalcConfig]):
    @classmethod
    def toolsets(cls, config: ToolCalcConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    def load(self):
        c = self.config
        for i in range(c.num_examples):
            rng = random.Random(f"tool-calc:{c.seed}:{i}")
            a, b, k = (rng.randint(0, c.max_operand) for _ in range(3))
            data = ToolCalcData(
                id=f"s{c.seed}-{i}",
                system_prompt=SYSTEM_PROMPT,
                prompt=f"What is ({a} + {b}) * {k}?",
                answer=(a + b) * k,
            )
            yield ToolCalcTask(data, c.task)
