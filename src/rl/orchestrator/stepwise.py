"""Step-synchronous dispatch (`dispatch = "step"`): each step's groups start together once the servers serve a recent
enough policy, and the batch waits for the slowest. Strictly on-policy training (async_level 0) needs it: no group
outlives the policy it started under. Continuous dispatch (rl/orchestrator/dispatch.py) is the default otherwise."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from rl.envs.rollouts import GroupOutcome
from rl.orchestrator.fill import fill_batch

REMAKE_ROUNDS = 3  # a batch's groups made again after servers changed under them


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


class Runs(Protocol):
    """What of the orchestrator (rl/orchestrator/main.py) a step's groups are made with."""

    config: Any
    envs: list
    samplers: list
    servers: Any
    sync: Any
    logger: Any
    groups_per_step: int

    async def run_one_group(self, env, task_index: int, server: int, number: int) -> GroupOutcome: ...
    def server_of(self, group: int) -> int: ...
    def trainable(self, outcome: GroupOutcome) -> bool: ...
    def observe(self, outcomes: list[GroupOutcome]) -> None: ...


class StepwiseGroups:
    """Generate, remake (servers that changed under a group) and fill each step's groups, then hand them over."""

    def __init__(self, orchestrator: Runs):
        self.o = orchestrator

    def servers_changed(self, servers: set[int]) -> None:
        """Groups are checked against changed servers once they all finished (`remake`)."""

    async def collect(self, step: int) -> Collected:
        outcomes = await self.generate(step, self.o.groups_per_step)
        outcomes = await self.remake(outcomes, step)
        if self.o.config.advantage.fill_batch:
            filled = await self.fill(outcomes, step)
            outcomes = filled.outcomes
            extra = [o.env.name for o in outcomes[self.o.groups_per_step:]]
            stats = {"fill/extra_groups": filled.extra_groups, "fill/rounds": filled.rounds,
                     "fill/short_groups": filled.short,
                     **{f"extra_groups/{env.name}": extra.count(env.name) for env in self.o.envs}}
        else:
            stats, filled = {}, None
        self.o.observe(outcomes)
        return Collected(outcomes, [o.policy_step for o in outcomes], stats, filled.short if filled else 0)

    def pending(self) -> list[tuple[int, int]]:
        return []  # every group of a step is in its batch, or dropped, when the step ends

    async def close(self) -> None:
        pass

    async def generate(self, step: int, count: int, first: int = 0) -> list[GroupOutcome]:
        """Run `count` groups, split between the environments by ratio; `first` numbers the first of them in the
        step (its server and seed)."""
        o = self.o
        counts = groups_per_env(count, [e.ratio for e in o.config.env])
        drawn = [(env, task) for env, sampler, n in zip(o.envs, o.samplers, counts) for task in sampler.draw(n)]
        return await asyncio.gather(*(o.run_one_group(env, task, o.server_of(g), step * o.groups_per_step + g)
                                      for g, (env, task) in enumerate(drawn, start=first)))

    async def remake(self, outcomes: list[GroupOutcome], step: int) -> list[GroupOutcome]:
        """Groups generated on a server that restarted or stopped answering meanwhile may come from other weights than
        the policy they are labelled with, or have failed for it: made again on the servers up to date, up to
        REMAKE_ROUNDS times (each waits for a server to answer), then dropped."""
        o = self.o
        for _ in range(REMAKE_ROUNDS):
            changed = await o.servers.check()
            redo = [g for g, outcome in enumerate(outcomes) if outcome.server in changed]
            if not redo:
                return outcomes
            o.logger.warning(f"batch {step}: {len(redo)} groups of servers {sorted(changed)} are made again")
            await o.sync.ensure(step)
            remade = await asyncio.gather(*(o.run_one_group(outcomes[g].env, outcomes[g].task_index, o.server_of(g),
                                                            step * o.groups_per_step + g) for g in redo))
            for g, outcome in zip(redo, remade):
                outcomes[g] = outcome
        changed = await o.servers.check()
        for outcome in outcomes:
            if outcome.server in changed:
                outcome.results, outcome.error = None, "ServerChanged"
                outcome.message = f"server {outcome.server} restarted or stopped answering while batch {step} was made"
        return outcomes

    async def fill(self, outcomes: list[GroupOutcome], step: int):
        """More groups until the step has its groups' worth of trainable ones (rl/orchestrator/fill.py)."""
        o = self.o

        async def run_more(count: int, outcomes: list[GroupOutcome]) -> list[GroupOutcome]:
            extra = await self.generate(step, count, first=len(outcomes))
            return await self.remake(outcomes + extra, step)

        wanted = o.groups_per_step
        filled = await fill_batch(outcomes, wanted, o.config.advantage.max_extra_groups or wanted, o.trainable,
                                  run_more)
        if filled.short:
            o.logger.warning(f"batch {step}: {filled.short} of {wanted} groups short after {filled.extra_groups} "
                             f"extra groups (advantage.max_extra_groups); the step trains on what it has")
        return filled
