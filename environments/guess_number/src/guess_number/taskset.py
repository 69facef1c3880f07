"""Guess a number in [low, high] drawn from (seed, index); the environment says higher or lower."""

from __future__ import annotations

import random
import re
from typing import Self

import verifiers.v1 as vf
from in_process_chat import DataIdKey
from pydantic import Field, model_validator

PROMPT = "I am thinking of a whole number from {low} to {high}. Guess it: reply with one number."


class GuessNumberConfig(vf.TasksetConfig):
    """Taskset arguments."""

    num_examples: int = Field(1000, ge=1, description="Number of tasks.")
    low: int = Field(1, description="Smallest possible number.")
    high: int = Field(20, description="Largest possible number.")
    max_guesses: int = Field(3, ge=1, description="Environment replies before the game ends.")
    seed: int = Field(0, description="Seed the numbers are drawn from.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high})")
        return self


class GuessNumberData(vf.TaskData):
    target: int
    low: int
    high: int
    max_guesses: int


def parse_guess(text: str) -> int | None:
    match = re.search(r"-?\d+", text or "")
    return int(match.group()) if match else None


def feedback(guess: int | None, target: int) -> str:
    """The environment's reply to one guess."""
    if guess is None:
        return "Reply with a number."
    if guess == target:
        return "correct"
    return "higher" if guess < target else "lower"


class GuessNumberTask(DataIdKey, vf.Task[GuessNumberData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def closeness(self, task: GuessNumberData, trace: vf.Trace) -> float:
        guess = parse_guess(trace.last_reply)
        if guess is None:
            return 0.0
        return max(0.0, 1.0 - abs(guess - task.target) / (task.high - task.low))

    @vf.metric
    async def solved(self, task: GuessNumberData, trace: vf.Trace) -> float:
        return float(parse_guess(trace.last_reply) == task.target)

    @vf.metric
    async def guesses(self, task: GuessNumberData, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessNumberTaskset(vf.Taskset[GuessNumberTask, GuessNumberConfig]):
    def load(self):
        c = self.config
        for i in range(c.num_examples):
            target = random.Random(f"guess-number:{c.seed}:{i}").randint(c.low, c.high)
            data = GuessNumberData(
                id=f"s{c.seed}-{i}",
                prompt=PROMPT.format(low=c.low, high=c.high),
                target=target,
                low=c.low,
                high=c.high,
                max_guesses=c.max_guesses,
            )
            yield GuessNumberTask(data, c.task)
