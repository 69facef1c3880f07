"""Compute (a + b) * c, numbers drawn from (seed, index); tools add and multiply are offered."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf
from in_process_chat import DataIdKey
from pydantic import Field

from tool_calc.tools import tools_prompt


class ToolCalcConfig(vf.TasksetConfig):
    """Taskset arguments."""

    num_examples: int = Field(1000, ge=1, description="Number of tasks.")
    max_operand: int = Field(9, ge=1, description="Operands are drawn from 0..max_operand.")
    max_tool_calls: int = Field(3, ge=0, description="Tool calls the harness runs per rollout.")
    seed: int = Field(0, description="Seed the operands are drawn from.")


class ToolCalcData(vf.TaskData):
    answer: int
    max_tool_calls: int


def last_number(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text or "")
    return int(numbers[-1]) if numbers else None


def tool_responses(trace: vf.Trace) -> list[str]:
    return [
        m.content
        for m in trace.messages
        if m.role == "user" and isinstance(m.content, str) and m.content.startswith("<tool_response>")
    ]


class ToolCalcTask(DataIdKey, vf.Task[ToolCalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ToolCalcData, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply) == task.answer)

    @vf.reward(weight=0.2)
    async def tool_use(self, task: ToolCalcData, trace: vf.Trace) -> float:
        return float(any("error" not in r for r in tool_responses(trace)))

    @vf.metric
    async def tool_calls(self, task: ToolCalcData, trace: vf.Trace) -> float:
        return float(len(tool_responses(trace)))


class ToolCalcTaskset(vf.Taskset[ToolCalcTask, ToolCalcConfig]):
    def load(self):
        c = self.config
        for i in range(c.num_examples):
            rng = random.Random(f"tool-calc:{c.seed}:{i}")
            a, b, k = (rng.randint(0, c.max_operand) for _ in range(3))
            data = ToolCalcData(
                id=f"s{c.seed}-{i}",
                system_prompt=tools_prompt(),
                prompt=f"What is ({a} + {b}) * {k}?",
                answer=(a + b) * k,
                max_tool_calls=c.max_tool_calls,
            )
            yield ToolCalcTask(data, c.task)
