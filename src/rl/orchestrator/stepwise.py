"""Step-synchronous dispatch (`dispatch = "step"`): each step's groups start together once the servers serve a recent
enough policy, and the batch waits for the slowest. Strictly on-policy training (async_level 0) needs it: no group
outlives the policy it started under. Continuous dispatch (rl/orchestrator/dispatch.py) is the default otherwise."""

from __future__ import annotations

import asyncio

from rl.envs.rollouts import GroupOutcome
from rl.orchestrator.fill import fill_batch
from rl.orchestrator.group_runner import Collected, GroupRunner, groups_per_env

REMAKE_ROUNDS = 3  # a batch's groups made again after servers changed under them


class StepwiseGroups:
    """Generate, remake (servers that changed under a group) and fill each step's groups, then hand them over."""

    def __init__(self, runner: GroupRunner):
        self.runner = runner

    def start(self) -> None:
        """Nothing runs between steps."""

    def servers_changed(self, servers: set[int]) -> None:
        """Groups are checked against changed servers once they all finished (`remake`)."""

    async def collect(self, step: int) -> Collected:
        outcomes = await self.generate(step, self.runner.groups_per_step)
        outcomes = await self.remake(outcomes, step)
        if self.runner.config.advantage.fill_batch:
            filled = await self.fill(outcomes, step)
            outcomes = filled.outcomes
            extra = [o.env.name for o in outcomes[self.runner.groups_per_step:]]
            stats = {"fill/extra_groups": filled.extra_groups, "fill/rounds": filled.rounds,
                     "fill/short_groups": filled.short,
                     **{f"extra_groups/{env.name}": extra.count(env.name) for env in self.runner.envs}}
        else:
            stats, filled = {}, None
        self.runner.observe(outcomes)
        return Collected(outcomes, [o.policy_step for o in outcomes], stats, filled.short if filled else 0)

    def pending(self) -> list[tuple[int, int]]:
        return []  # every group of a step is in its batch, or dropped, when the step ends

    async def close(self) -> None:
        pass

    async def generate(self, step: int, count: int, first: int = 0) -> list[GroupOutcome]:
        """Run `count` groups, split between the environments by ratio; `first` numbers the first of them in the
        step (its server and seed)."""
        r = self.runner
        counts = groups_per_env(count, [e.ratio for e in r.config.env])
        drawn = [(env, task) for env, sampler, n in zip(r.envs, r.samplers, counts) for task in sampler.draw(n)]
        return await asyncio.gather(*(r.run(env, task, r.server_of(g), step * r.groups_per_step + g)
                                      for g, (env, task) in enumerate(drawn, start=first)))

    async def remake(self, outcomes: list[GroupOutcome], step: int) -> list[GroupOutcome]:
        """Groups generated on a server that restarted or stopped answering meanwhile may come from other weights than
        the policy they are labelled with, or have failed for it: made again on the servers up to date, up to
        REMAKE_ROUNDS times (each waits for a server to answer), then dropped."""
        r = self.runner
        for _ in range(REMAKE_ROUNDS):
            changed = await r.servers.check()
            redo = [g for g, outcome in enumerate(outcomes) if outcome.server in changed]
            if not redo:
                return outcomes
            r.logger.warning(f"batch {step}: {len(redo)} groups of servers {sorted(changed)} are made again")
            await r.sync.ensure(step)
            remade = await asyncio.gather(*(r.run(outcomes[g].env, outcomes[g].task_index, r.server_of(g),
                                                            step * r.groups_per_step + g) for g in redo))
            for g, outcome in zip(redo, remade):
                outcomes[g] = outcome
        changed = await r.servers.check()
        for outcome in outcomes:
            if outcome.server in changed:
                outcome.results, outcome.error = None, "ServerChanged"
                outcome.message = f"server {outcome.server} restarted or stopped answering while batch {step} was made"
        return outcomes

    async def fill(self, outcomes: list[GroupOutcome], step: int):
        """More groups until the step has its groups' worth of trainable ones (rl/orchestrator/fill.py)."""
        r = self.runner

        async def run_more(count: int, outcomes: list[GroupOutcome]) -> list[GroupOutcome]:
            extra = await self.generate(step, count, first=len(outcomes))
            return await self.remake(outcomes + extra, step)

        wanted = r.groups_per_step
        filled = await fill_batch(outcomes, wanted, r.config.advantage.max_extra_groups or wanted, r.trainable,
                                  run_more)
        if filled.short:
            r.logger.warning(f"batch {step}: {filled.short} of {wanted} groups short after {filled.extra_groups} "
                             f"extra groups (advantage.max_extra_groups); the step trains on what it has")
        return filled
