"""Continuous dispatch (as prime-rl's orchestrator and verl's fully async trainer do): groups of rollouts run across
steps, weights change under them, and a step's batch is made of groups that have finished.

- In flight: up to `capacity` groups at all times: the run's one in-flight count (`runner.slots`, in rollouts,
  shared with eval's groups and moved by the adaptive cap) over the group size: when one finishes, the
  next starts, so inference never serves the shrinking tail of a step's slowest episode. Dispatch pauses for an
  environment that has a batch's share of finished groups waiting (more would only age).
- Which environment: the one furthest below its share of the batch, counting its groups in flight and waiting, so
  that batches keep the environments' ratios whatever their episodes' lengths.
- Age, by admission (as SkyRL's staleness manager does): a group's tokens are at least as new as the oldest policy
  the servers served when it started, and the groups started before it and not yet taken fill the steps ahead of
  it, a batch each. A group starts only if the step that would train it is within `bound` (max_off_policy_steps) of
  that policy. Nothing is cancelled for age, and batches take the oldest finished groups first. A group at the last
  step it could train in goes in that step's batch in place of a newer one, and the batch waits for it if it is still
  in flight. An episode that still ends past the bound (its own tokens older than the bound) is withheld from the
  loss alone, in its group (orchestrator/batch.py).
- Servers lost: a group that failed on a server that has since restarted or stopped answering runs again first,
  elsewhere (as a step-synchronous batch remakes it), and the groups still in flight there are cancelled and run
  again too; while no server is up to date, a batch waits for the policy sync to bring one back.
- Resume: the tasks of the groups in flight or waiting when a checkpoint is saved go into it (`pending`) and run
  first after a resume; the samplers are already past them, so each task's group is trained once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rl.envs.rollouts import GroupOutcome
from rl.envs.slots import RolloutSlots
from rl.orchestrator.concurrency import AdaptiveCap, ConcurrencyController
from rl.config import ConfigError
from rl.orchestrator.group_runner import Collected, GroupRunner
from rl.orchestrator.stepwise import StepwiseGroups


def group_source(config, runner: GroupRunner, metrics: Callable[[], Awaitable[list]],
                 pending: list[tuple[int, int]], logger) -> Dispatcher | StepwiseGroups:
    """Where each step's groups come from: the continuous dispatcher, or step by step (`config.dispatch`). `pending`:
    the groups a checkpoint held in flight or waiting, which run first."""
    if config.continuous:
        return Dispatcher.for_config(config, runner, metrics, pending, logger)
    if pending:
        raise ConfigError(f"the checkpoint holds {len(pending)} groups of continuous dispatch not yet trained; resume "
                          "with dispatch = 'continuous', as the run was made")
    return StepwiseGroups(runner)


@dataclass
class Running:
    env: int  # index of the environment
    task_index: int
    server: int
    dispatched: int  # the oldest policy the servers served when it started: its tokens are no older
    job: asyncio.Task
    started_step: int = 0  # the step being collected when it started


@dataclass
class Finished:
    env: int
    outcome: GroupOutcome
    oldest: int  # the oldest policy among its sampled tokens
    newest_served: int  # the oldest policy the servers served when it finished (age gained waiting starts there)


@dataclass
class Taken:
    """A step's groups, oldest first."""

    groups: list[Finished] = field(default_factory=list)
    extra: int = 0  # with fill_batch, groups taken beyond the batch's (for those that were not trainable)
    short: int = 0  # with fill_batch, trainable groups missing when the extra groups ran out
    waited_s: float = 0.0
    last_chance: int = 0  # groups taken in place of newer ones at the last step they could train in


class Dispatcher:
    """Owns the groups in flight and the finished ones waiting for a batch, their age bound and their cap.

    `runner` (orchestrator/group_runner.py) draws an environment's next task (`draw`), runs a group, retries
    included (`start`), tells the oldest policy among a finished group's sampled tokens (`oldest`), and holds the
    servers' board (`servers`: `usable`, the oldest policy they serve as `policy_step`, and `check()`, which servers
    restarted or stopped answering since it last asked) and the policy sync (`sync.ensure(step)`).
    `slots`: the rollouts in flight, training's and eval's (the runner's); `group`: rollouts in a group;
    `bound`: the age bound groups are admitted by (None: none); `adaptive`: the cap's loop, where the engines' load
    moves the slots' count (orchestrator/concurrency.py)."""

    def __init__(self, slots: RolloutSlots, group: int, shares: list[int], runner, pending: list[tuple[int, int]] = (),
                 log: Callable[[str], None] = lambda message: None, bound: int | None = None):
        self.slots, self.group, self.shares, self.bound, self.step = slots, group, shares, bound, 0
        self.runner, self.log = runner, log
        self.again: collections.deque[tuple[int, int]] = collections.deque(pending)  # run before new draws
        self.running: list[Running] = []
        self.finished: list[Finished] = []
        self.arrived = asyncio.Event()
        self.started = 0  # groups started: numbers each (its seeds) and spreads them over the servers
        self.closed = False
        self.adaptive: AdaptiveCap | None = None

    @classmethod
    def for_config(cls, config, runner, metrics: Callable[[], Awaitable[list]], pending: list[tuple[int, int]],
                   logger) -> Dispatcher:
        """The run's dispatcher over the runner's slots (`rollouts_in_flight`, or the adaptive cap's start), its age
        bound `max_off_policy_steps`; with `concurrency.adaptive`, the cap read from the servers' `metrics()`."""
        n = config.rollouts_per_example
        dispatcher = cls(runner.slots, n, runner.shares, runner, pending, logger.warning, config.max_off_policy_steps)
        if config.concurrency.adaptive:
            controller = ConcurrencyController(config.concurrency, config.rollouts_in_flight, n)
            runner.slots.resize(controller.cap)
            dispatcher.adaptive = AdaptiveCap(controller, dispatcher, metrics, logger.info, logger.warning)
        return dispatcher

    def start(self) -> None:
        """The cap's loop, where it adapts; groups start with the first batch's `collect`."""
        if self.adaptive is not None:
            self.adaptive.start()

    @property
    def capacity(self) -> int:
        """Groups that may be in flight: the slots' count in whole groups."""
        return max(1, self.slots.capacity // self.group)

    def served(self) -> int:
        return self.runner.servers.policy_step

    def servers(self) -> list[int]:
        return self.runner.servers.usable

    async def collect(self, step: int) -> Collected:
        """The step's groups, admitted by age (`take`), with how they were gathered."""
        n, advantage = self.runner.config.rollouts_per_example, self.runner.config.advantage
        self.step = step
        self.top_up()
        taken = await self.take(self.runner.trainable if advantage.fill_batch else None,
                                advantage.max_extra_groups or sum(self.shares),
                                servers_back=lambda: self.runner.sync.ensure(step))
        if taken.short:
            self.log(f"batch {step}: {taken.short} of {sum(self.shares)} groups short after {taken.extra} extra "
                     "groups (advantage.max_extra_groups); the step trains on what it has")
        stats = {"rollouts_in_flight": len(self.running) * n, "rollouts_waiting": self.rollouts_waiting,
                 "time/wait_for_rollouts": taken.waited_s, "off_policy/last_chance_groups": taken.last_chance}
        if advantage.fill_batch:
            stats |= {"fill/extra_groups": taken.extra, "fill/short_groups": taken.short}
        if self.adaptive is not None:
            stats |= self.adaptive.stats()
        groups = taken.groups
        return Collected([g.outcome for g in groups], [g.newest_served for g in groups], stats, taken.short,
                         None if self.bound is None else step - self.bound)

    def top_up(self) -> None:
        """Start groups until `capacity` run or the next could not be trained within the bound, the next from the
        environment furthest below its share."""
        while not self.closed and len(self.running) < self.capacity and self.servers() and self.admissible():
            if self.again:
                env, task = self.again.popleft()
            elif (env := self.neediest()) is None:
                return
            else:
                task = self.runner.draw(env)
            self.launch(env, task)

    def admissible(self) -> bool:
        """Whether a group started now would be trained within the bound: the groups not yet taken are ahead of it,
        a batch each step. Always for the step being collected (its servers are as recent as the batch needs)."""
        ahead, per_step = len(self.running) + len(self.finished), sum(self.shares)
        return self.bound is None or ahead < per_step or self.step + ahead // per_step - self.served() <= self.bound

    def neediest(self) -> int | None:
        """The environment with the fewest groups in flight and waiting for its share, among those without a
        batch's share waiting; None when every one has."""
        counts = collections.Counter(r.env for r in self.running)
        waiting = collections.Counter(f.env for f in self.finished)
        open_envs = [i for i, share in enumerate(self.shares) if share and waiting[i] < share]
        return min(open_envs, key=lambda i: (counts[i] + waiting[i]) / self.shares[i], default=None)

    def launch(self, env: int, task: int) -> None:
        servers = self.servers()
        server, number = servers[self.started % len(servers)], self.started
        self.started += 1
        running = Running(env, task, server, self.served(), None, self.step)  # type: ignore[arg-type]
        running.job = asyncio.ensure_future(self.run(running, number))
        self.running.append(running)

    async def run(self, running: Running, number: int) -> None:
        outcome = await self.runner.start(running.env, running.task_index, running.server, number)
        self.running.remove(running)
        if outcome.results is None and await self.server_lost(running.server):
            self.log(f"group of task {running.task_index} failed on server {running.server}, which restarted or "
                     "stopped answering: it runs again first once a server is up to date")
            self.again.appendleft((running.env, running.task_index))
        else:
            self.finished.append(Finished(running.env, outcome, self.runner.oldest(outcome), self.served()))
        self.arrived.set()
        self.top_up()

    async def server_lost(self, server: int) -> bool:
        """Whether a group failed because its server restarted or stopped answering (it no longer gets requests);
        the other groups in flight on a changed server are cancelled and run again."""
        self.servers_changed(await self.runner.servers.check())
        return server not in self.servers()

    def cancel(self, which: Callable[[Running], bool]) -> list[Running]:
        """Cancel the groups in flight that `which` picks (their requests abort on the servers); them."""
        cancelled = [r for r in self.running if which(r)]
        for r in cancelled:
            r.job.cancel()
            self.running.remove(r)
        return cancelled

    def resize(self, rollouts: int, shed: bool) -> int:
        """Run up to `rollouts` from now, training's and eval's (the adaptive cap); with `shed`, cancel at once the
        youngest groups beyond it (their tasks run again first, later). How many groups were cancelled."""
        self.slots.resize(rollouts)
        if not shed or len(self.running) <= self.capacity:
            self.top_up()
            return 0
        youngest = {id(r) for r in self.running[self.capacity:]}  # in the order they started
        return self.run_again(lambda r: id(r) in youngest)

    def servers_changed(self, servers: set[int]) -> int:
        """Groups in flight on `servers` (they restarted or stopped answering) are cancelled and their tasks run
        first, elsewhere; how many."""
        return self.run_again(lambda r: r.server in servers)

    def run_again(self, which: Callable[[Running], bool]) -> int:
        """Cancel the groups in flight that `which` picks; their tasks run first, in their order. How many."""
        cancelled = self.cancel(which)
        self.again.extendleft((r.env, r.task_index) for r in reversed(cancelled))
        return len(cancelled)

    async def take(self, trainable: Callable[[GroupOutcome], bool] | None, max_extra: int,
                   servers_back: Callable[[], Awaitable[object]] | None = None) -> Taken:
        """Wait for the step's groups, the oldest finished first (by their oldest token, then as they finished):
        each environment's share of them; or with `trainable` (fill_batch) the batch's count of trainable groups
        from any environment (dispatch keeps the ratios), taking at most `max_extra` groups beyond the batch's (the
        untrainable ones are dropped when the batch is built). With no server to run on, `servers_back()` waits
        until one serves a policy recent enough (its deadlines say for how long)."""
        taken, start = Taken(), time.perf_counter()
        wanted = [sum(self.shares)] if trainable else list(self.shares)  # one pool, or one count per environment
        limit = sum(self.shares) + max_extra if trainable else None

        def room(group: Finished) -> bool:
            return bool(wanted[0 if trainable else group.env]) and (limit is None or len(taken.groups) < limit)

        while any(wanted) and (limit is None or len(taken.groups) < limit):
            for group in sorted((g for g in self.finished if room(g)), key=lambda g: g.oldest):
                if not room(group):
                    continue
                self.finished.remove(group)
                taken.groups.append(group)
                if not trainable or trainable(group.outcome):
                    wanted[0 if trainable else group.env] -= 1
            if any(wanted) and (limit is None or len(taken.groups) < limit):
                self.top_up()
                if not self.running and not self.servers() and servers_back is not None:
                    await servers_back()
                    self.top_up()
                if not self.running:
                    raise RuntimeError(f"no group in flight, yet the batch lacks {sum(wanted)} groups")
                self.arrived.clear()
                await self.arrived.wait()  # each group in flight ends within rollout.timeout_s per attempt
        await self.take_last_chances(taken, trainable)
        taken.short = sum(wanted)
        taken.extra = max(0, len(taken.groups) - sum(self.shares))
        self.step += 1  # the groups still to come train from the next step on
        self.top_up()
        taken.waited_s = time.perf_counter() - start
        return taken

    async def take_last_chances(self, taken: Taken, trainable: Callable[[GroupOutcome], bool] | None) -> None:
        """Groups for which this is the last step they could train in (started under, or holding tokens of, a policy
        `bound` steps old) go in this batch, each in place of the newest group taken of its environment, which waits
        for the next batch (it can still train then): a slow episode is trained late rather than withheld for its
        age. The batch waits for such groups still in flight; each ends within rollout.timeout_s per attempt."""
        if self.bound is None:
            return
        self.swap_in_last_chances(taken, trainable)
        while any(r.dispatched + self.bound == self.step for r in self.running):
            self.arrived.clear()
            await self.arrived.wait()
            self.swap_in_last_chances(taken, trainable)
        taken.groups.sort(key=lambda g: g.oldest)

    def swap_in_last_chances(self, taken: Taken, trainable: Callable[[GroupOutcome], bool] | None) -> None:
        for group in [f for f in self.finished if f.oldest + self.bound == self.step]:
            if trainable is not None and not trainable(group.outcome):
                continue  # nothing of it would train: it waits as any other
            same = [g for g in taken.groups if (trainable is not None or g.env == group.env) and g.oldest > group.oldest
                    and (trainable is None or trainable(g.outcome))]
            if not same:
                continue
            newest = max(same, key=lambda g: g.oldest)
            taken.groups[taken.groups.index(newest)] = group
            self.finished.remove(group)
            self.finished.append(newest)
            taken.last_chance += 1

    def oldest_age(self) -> int:
        """Steps since the oldest group in flight started (0: none in flight)."""
        return self.step - min((r.started_step for r in self.running), default=self.step)

    def age_used(self) -> float:
        """The share of the bound the oldest group in flight has used: its steps in flight beyond the one step
        boundary any group may span (the adaptive cap trims past `concurrency.age_high` of it)."""
        return max(0, self.oldest_age() - 1) / max(1, self.bound or 0)

    def pending(self) -> list[tuple[int, int]]:
        """(environment, task) of every group not yet in a batch: to run again first after a resume."""
        return [*self.again, *((r.env, r.task_index) for r in self.running),
                *((f.env, f.outcome.task_index) for f in self.finished)]

    @property
    def rollouts_waiting(self) -> int:
        return sum(len(f.outcome.results or ()) for f in self.finished)

    async def close(self) -> None:
        self.closed = True
        if self.adaptive is not None:
            self.adaptive.stop()
        jobs = [r.job for r in self.running]
        self.cancel(lambda r: True)
        await asyncio.gather(*jobs, return_exceptions=True)
