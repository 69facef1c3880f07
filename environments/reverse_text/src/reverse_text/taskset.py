"""Reverse a short string drawn from a seed; the reward is the LCS ratio to the reversed string.

Task `i` depends only on (`seed`, `i`), so `num_examples` can change without changing earlier tasks,
and every process that loads the taskset with the same arguments sees the same tasks.
"""

from __future__ import annotations

import random
import string
from typing import Self

import verifiers.v1 as vf
from in_process_chat import DataIdKey
from pydantic import Field, model_validator


class ReverseTextConfig(vf.TasksetConfig):
    """Taskset arguments (`--env.taskset.*`)."""

    num_examples: int = Field(1000, ge=1, description="Number of tasks.")
    min_len: int = Field(3, ge=1, description="Shortest string to reverse.")
    max_len: int = Field(8, ge=1, description="Longest string to reverse.")
    seed: int = Field(0, description="Seed the strings are drawn from.")
    alphabet: str = Field(string.ascii_lowercase, min_length=2, description="Characters drawn.")
    prompt_template: str = Field("{text}", description="User message; `{text}` is the string.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) must be <= max_len ({self.max_len})")
        if "{text}" not in self.prompt_template:
            raise ValueError("prompt_template must contain '{text}'")
        return self


class ReverseTextData(vf.TaskData):
    text: str
    answer: str


class ReverseTextTask(DataIdKey, vf.Task[ReverseTextData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def lcs_ratio(self, task: ReverseTextData, trace: vf.Trace) -> float:
        """Partial credit, so a tiny model gets a signal before it is ever exactly right."""
        return lcs_ratio(trace.last_reply, task.answer)

    @vf.metric
    async def exact_match(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self):
        config = self.config
        for i in range(config.num_examples):
            text = draw_text(config, i)
            data = ReverseTextData(
                id=f"s{config.seed}-{i}",
                prompt=config.prompt_template.format(text=text),
                text=text,
                answer=text[::-1],
            )
            yield ReverseTextTask(data, config.task)


def draw_text(config: ReverseTextConfig, index: int) -> str:
    """The string of task `index`: a generator seeded by (seed, index) alone (str seeds hash stably)."""
    rng = random.Random(f"reverse-text:{config.seed}:{index}")
    length = rng.randint(config.min_len, config.max_len)
    return "".join(rng.choice(config.alphabet) for _ in range(length))


def lcs_ratio(a: str, b: str) -> float:
    """2 * LCS(a, b) / (len(a) + len(b)), in [0, 1]; 1.0 only when a == b."""
    if not a and not b:
        return 1.0
    previous = [0] * (len(b) + 1)
    for char in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if char == other else max(previous[j + 1], current[j]))
        previous = current
    return 2 * previous[-1] / (len(a) + len(b))
