"""reasoning-gym-env: reasoning-gym's procedural datasets as a verifiers 0.4 Taskset (see README).

Task i is entry i of `reasoning_gym.create_dataset(dataset, seed=seed, size=num_examples, **dataset_args)`,
so every process that loads the taskset with the same args sees the same tasks; scoring rebuilds the
entry from those args (the dataset's `score_answer` may need the entry's metadata, which is not JSON)."""

from __future__ import annotations

import functools
import json
from typing import Any, Self

import reasoning_gym
import verifiers.v1 as vf
from pydantic import Field, model_validator
from reasoning_gym.utils import extract_answer

INSTRUCTION = "Reply with the final answer only."


class ReasoningGymConfig(vf.TasksetConfig):
    """Taskset arguments."""

    dataset: str = Field("basic_arithmetic", description="A reasoning-gym dataset name.")
    dataset_args: dict[str, Any] = Field({}, description="The dataset's own config fields.")
    num_examples: int = Field(500, ge=1, description="Number of tasks.")
    seed: int = Field(0, description="Seed the dataset is generated from.")
    instruction: str = Field(INSTRUCTION, description="System prompt of every task.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        try:
            generator(self.dataset, json.dumps(self.dataset_args, sort_keys=True), self.num_examples, self.seed)
        except (ValueError, TypeError, AssertionError) as e:
            raise ValueError(f"reasoning-gym dataset {self.dataset!r} with {self.dataset_args}: {e}") from e
        return self


@functools.lru_cache(maxsize=16)
def generator(dataset: str, dataset_args: str, size: int, seed: int):
    """The reasoning-gym dataset (cached: scoring looks entries up per rollout)."""
    return reasoning_gym.create_dataset(dataset, size=size, seed=seed, **json.loads(dataset_args))


class ReasoningGymData(vf.TaskData):
    answer: str
    dataset: str
    dataset_args: str  # JSON, sorted keys: the generator's cache key
    size: int
    seed: int
    index: int


def reply_answer(reply: str) -> str:
    """The last <answer>...</answer> of the reply, else the whole reply, stripped."""
    return extract_answer(reply or "") or (reply or "").strip()


class ReasoningGymTask(vf.Task[ReasoningGymData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def dataset_score(self, task: ReasoningGymData, trace: vf.Trace) -> float:
        """Named apart from `Task.score`, the method verifiers scores a trace with."""
        return entry_score(task, trace.last_reply)

    @vf.metric
    async def exact(self, task: ReasoningGymData, trace: vf.Trace) -> float:
        return float(entry_score(task, trace.last_reply) == 1.0)

    @property
    def key(self) -> str:
        return self.data.id or super().key


def entry_score(task: ReasoningGymData, reply: str) -> float:
    data = generator(task.dataset, task.dataset_args, task.size, task.seed)
    return float(data.score_answer(reply_answer(reply), data[task.index]))


class ReasoningGymTaskset(vf.Taskset[ReasoningGymTask, ReasoningGymConfig]):
    def load(self):
        c = self.config
        dataset_args = json.dumps(c.dataset_args, sort_keys=True)
        data = generator(c.dataset, dataset_args, c.num_examples, c.seed)
        for i in range(c.num_examples):
            entry = data[i]
            yield ReasoningGymTask(
                ReasoningGymData(
                    id=f"{c.dataset}-s{c.seed}-{i}",
                    system_prompt=c.instruction,
                    prompt=entry["question"],
                    answer=str(entry["answer"]),
                    dataset=c.dataset,
                    dataset_args=dataset_args,
                    size=c.num_examples,
                    seed=c.seed,
                    index=i,
                ),
                c.task,
            )


__all__ = ["ReasoningGymConfig", "ReasoningGymData", "ReasoningGymTask", "ReasoningGymTaskset", "reply_answer"]
