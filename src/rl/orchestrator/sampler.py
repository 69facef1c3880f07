"""Deterministic task sampling, one sampler per environment, its state in the orchestrator's checkpoint.

- `TaskSampler` (`sampler.type = "epoch"`, the default): each epoch is a seeded permutation of the task indices, so a
  position (epoch, offset) says exactly which tasks were drawn and a resumed run draws no task twice in an epoch.
- `DifficultyPools` (`sampler.type = "difficulty"`), a curriculum: each task is in one pool by the mean reward of
  its latest group (easy >= `easy`, hard <= `hard`, medium between; a task not yet seen is medium). A draw picks a
  pool by `weights` (among the pools that hold tasks), then a task of it uniformly. Pools are kept sorted and the
  i-th draw uses a generator seeded by (seed, i), so the state (the means and the draw count) decides every later
  draw: a resumed run draws as an unbroken one would, given the same rewards.
"""

from __future__ import annotations

import bisect
import random

from rl.envs.config import DifficultySampling, EpochSampling


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

    def observe(self, task: int, mean_reward: float) -> None:
        """Every task once per epoch, whatever its rewards."""

    def state_dict(self) -> dict:
        return {"num_tasks": self.num_tasks, "seed": self.seed, "epoch": self.epoch, "offset": self.offset}


POOLS = ("easy", "medium", "hard")


class DifficultyPools:
    def __init__(self, num_tasks: int, seed: int, config: DifficultySampling, draws: int = 0,
                 means: dict[int, float] | None = None):
        if num_tasks < 1:
            raise ValueError("the environment has no tasks to sample")
        self.num_tasks, self.seed, self.config, self.draws = num_tasks, seed, config, draws
        self.means: dict[int, float] = {}
        self.pools: dict[str, list[int]] = {"easy": [], "medium": list(range(num_tasks)), "hard": []}
        for task, mean in sorted((means or {}).items()):
            self.observe(task, mean)

    def pool_of(self, mean: float | None) -> str:
        if mean is None:
            return "medium"
        return "easy" if mean >= self.config.easy else "hard" if mean <= self.config.hard else "medium"

    def observe(self, task: int, mean_reward: float) -> None:
        """The task's latest group had this mean reward: it moves to the pool that mean falls in."""
        old, new = self.pool_of(self.means.get(task)), self.pool_of(mean_reward)
        self.means[task] = mean_reward
        if old != new:
            pool = self.pools[old]
            del pool[bisect.bisect_left(pool, task)]
            bisect.insort(self.pools[new], task)

    def draw(self, count: int) -> list[int]:
        drawn = []
        for _ in range(count):
            rng = random.Random(f"{self.seed}-{self.draws}")
            self.draws += 1
            held = [(name, weight) for name, weight in zip(POOLS, self.config.weights) if self.pools[name]]
            if sum(weight for _, weight in held) <= 0:  # only zero-weight pools hold tasks: draw among them alike
                held = [(name, 1.0) for name, _ in held]
            name = rng.choices([n for n, _ in held], weights=[w for _, w in held])[0]
            drawn.append(self.pools[name][rng.randrange(len(self.pools[name]))])
        return drawn

    def sizes(self) -> dict[str, int]:
        return {name: len(self.pools[name]) for name in POOLS}

    def state_dict(self) -> dict:
        return {"type": "difficulty", "num_tasks": self.num_tasks, "seed": self.seed, "draws": self.draws,
                "means": {str(task): mean for task, mean in sorted(self.means.items())}}


Sampler = TaskSampler | DifficultyPools


def make_sampler(config: EpochSampling | DifficultySampling, num_tasks: int, seed: int) -> Sampler:
    if isinstance(config, DifficultySampling):
        return DifficultyPools(num_tasks, seed, config)
    return TaskSampler(num_tasks, seed)


def restored_sampler(config: EpochSampling | DifficultySampling, state: dict) -> Sampler:
    """The sampler a checkpoint saved (its type must be the config's); an epoch state has no `type`."""
    saved = state.get("type", "epoch")
    if saved != config.type:
        raise ValueError(f"the saved sampler is of type {saved!r}, the config's {config.type!r}: resume with the same "
                         "[[env]] sampler")
    if isinstance(config, DifficultySampling):
        means = {int(task): float(mean) for task, mean in state["means"].items()}
        return DifficultyPools(state["num_tasks"], state["seed"], config, state["draws"], means)
    return TaskSampler(**state)
