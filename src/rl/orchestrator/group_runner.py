"""What every group of a run is run with, whichever source gathers the groups into batches (continuously,
orchestrator/dispatch.py, or step by step, orchestrator/stepwise.py): the environments and their samplers, a client
per server, the slots every rollout holds while it runs (training's and eval's), the servers' board and the policy
sync."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl.envs.loading import Environment
from rl.envs.rollouts import GroupOutcome, InferenceClient, run_group_retried
from rl.envs.slots import RolloutSlots
from rl.orchestrator.advantage import group_advantages
from rl.orchestrator.batch import group_oldest_version
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.eval import to_sampling


def groups_per_env(total: int, ratios: list[float]) -> list[int]:
    """Split `total` groups by ratio, largest remainders first, so the counts always add up."""
    exact = [total * r / sum(ratios) for r in ratios]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(ratios)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


@dataclass
class Collected:
    """A step's groups, in order, each with the oldest policy served when it ended, and how they were gathered."""

    outcomes: list[GroupOutcome]
    served_at_finish: list[int]
    stats: dict = field(default_factory=dict)
    short: int = 0  # with fill_batch, trainable groups missing when the extra groups ran out
    oldest_allowed: int | None = None  # the oldest policy a trained token may come from (None: any)


class GroupRunner:
    """Runs one group of a run: its task drawn from its environment's sampler, its rollouts (retried) on a server,
    its reward told to the sampler (a curriculum pools tasks by it)."""

    oldest = staticmethod(group_oldest_version)  # the oldest policy among a finished group's sampled tokens

    def __init__(self, config: OrchestratorConfig, envs: list[Environment], samplers: list,
                 clients: list[InferenceClient], servers, sync, logger):
        self.config, self.envs, self.samplers, self.clients = config, envs, samplers, clients
        # the run's one in-flight count, training's and eval's; continuous dispatch's adaptive cap moves it
        self.slots = RolloutSlots(config.rollouts_in_flight)
        self.servers, self.sync, self.logger = servers, sync, logger  # ServerBoard; policy_sync's files or offers

    @property
    def groups_per_step(self) -> int:
        return self.config.batch_size // self.config.rollouts_per_example

    @property
    def shares(self) -> list[int]:
        """Each environment's groups in a step's batch."""
        return groups_per_env(self.groups_per_step, [e.ratio for e in self.config.env])

    def draw(self, env: int) -> int:
        return self.samplers[env].draw(1)[0]

    def server_of(self, group: int) -> int:
        """The server a batch's group runs on: the usable ones in turn."""
        return self.servers.usable[group % len(self.servers.usable)]

    def trainable(self, outcome: GroupOutcome) -> bool:
        """Whether a group reaches the batch: it ran, and its advantages do not drop it."""
        results = outcome.results
        return results is not None and group_advantages(
            self.config.advantage, [r.reward for r in results], [r.is_truncated for r in results]) is not None

    def observe(self, outcomes: list[GroupOutcome]) -> None:
        """Each group's mean reward to its environment's sampler, in draw order."""
        for outcome in outcomes:
            if outcome.results is not None:
                sampler = self.samplers[self.envs.index(outcome.env)]
                sampler.observe(outcome.task_index, sum(r.reward for r in outcome.results) / len(outcome.results))

    async def start(self, env: int, task_index: int, server: int, number: int) -> GroupOutcome:
        """The group of environment `env` (its index) run and observed: continuous dispatch's unit of work."""
        outcome = await self.run(self.envs[env], task_index, server, number)
        self.observe([outcome])
        return outcome

    async def run(self, env: Environment, task_index: int, server: int, number: int) -> GroupOutcome:
        """Run the run's group `number` (its rollouts' seeds follow from it); retry it up to rollout.max_retries
        times, then drop it with its error counted."""
        s, rollout, n = self.config.sampling, self.config.rollout, self.config.rollouts_per_example
        seed = None if s.seed is None else s.seed + number * n
        sampling = to_sampling(s, seed, priority=number if self.config.continuous else None)
        return await run_group_retried(
            env, task_index, n, self.clients[server], sampling, self.slots, rollout.timeout_s,
            rollout.max_retries, self.logger.warning, server=server, policy_step=self.servers.policy_step,
        )
