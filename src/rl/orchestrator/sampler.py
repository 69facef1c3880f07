"""Deterministic task sampling: each epoch is a seeded permutation of the task indices, so a position
(epoch, offset) says exactly which tasks were drawn and a resumed run draws no task twice in an epoch."""

from __future__ import annotations

import random


class TaskSampler:
    def __init__(self, num_tasks: int, seed: int, epoch: int = 0, offset: int = 0):
        if num_tasks < 1:
            raise ValueError("the environment has no tasks to sample")
        self.num_tasks = num_tasks
        self.seed = seed
        self.epoch = epoch
        self.offset = offset
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_tasks))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def draw(self, count: int) -> list[int]:
        drawn = []
        for _ in range(count):
            if self.offset == self.num_tasks:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            drawn.append(self._order[self.offset])
            self.offset += 1
        return drawn

    def state_dict(self) -> dict:
        return {"num_tasks": self.num_tasks, "seed": self.seed, "epoch": self.epoch, "offset": self.offset}
