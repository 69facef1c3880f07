"""Continuous dispatch (rl/orchestrator/dispatch.py) against fake groups: each group's episode is a coroutine that
ends when the test says, so which groups are in flight, finished, cancelled or taken is exact."""

import asyncio

import pytest

from rl.envs.rollouts import GroupOutcome
from rl.envs.slots import RolloutSlots
from rl.orchestrator.dispatch import Dispatcher


class Env:
    def __init__(self, name):
        self.name = name


class FakeGroups:
    """The dispatcher's runner. Each started group waits for `finish(task)`; `policy` is what the servers serve;
    tokens carry the policy served when the group finished unless `oldest` says otherwise."""

    def __init__(self, tasks_per_env=(1000,), servers=(0, 1)):
        self.next_task = [0] * len(tasks_per_env)
        self.policy = 0
        self.usable = list(servers)
        self.gates: dict[tuple[int, int], asyncio.Event] = {}
        self.started: list[tuple[int, int, int]] = []  # (env, task, server)
        self.cancelled: list[tuple[int, int]] = []
        self.oldest_of: dict[int, int] = {}  # task -> its oldest token's policy, where it differs from the dispatch one
        self.untrainable: set[int] = set()
        self.down: set[int] = set()  # servers whose requests fail; `check` reports each once and stops using it
        self.checks = 0

    def draw(self, env):
        task = self.next_task[env]
        self.next_task[env] += 1
        return task

    async def start(self, env, task, server, number):
        self.started.append((env, task, server))
        dispatched = self.policy
        gate = self.gates.setdefault((env, task), asyncio.Event())
        try:
            await gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append((env, task))
            raise
        if server in self.down:
            return GroupOutcome(Env(f"env{env}"), None, "RolloutError", "connection refused", server=server,
                                task_index=task)
        outcome = GroupOutcome(Env(f"env{env}"), ["result"], server=server, task_index=task)
        outcome.policy_step = dispatched
        return outcome

    async def check(self):
        self.checks += 1
        changed = {i for i in self.down if i in self.usable}
        self.usable = [i for i in self.usable if i not in changed]
        return changed

    def oldest(self, outcome):
        return self.oldest_of.get(outcome.task_index, outcome.policy_step)

    def finish(self, env, *tasks):
        for task in tasks:
            self.gates.setdefault((env, task), asyncio.Event()).set()

    def trainable(self, outcome):
        return outcome.task_index not in self.untrainable

    @property
    def servers(self):  # the runner's board: usable, policy_step, check()
        return self

    @property
    def policy_step(self):
        return self.policy

    def dispatcher(self, capacity, shares=(2,), pending=(), bound=None):
        return Dispatcher(RolloutSlots(capacity), 1, list(shares), self, list(pending), bound=bound)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_slow_group_does_not_hold_the_batch_and_the_servers_stay_busy():
    async def scenario():
        fake = FakeGroups()
        d = fake.dispatcher(capacity=4, shares=[2])
        d.top_up()
        await settle()
        assert [task for _, task, _ in fake.started] == [0, 1, 2, 3]
        assert [server for _, _, server in fake.started] == [0, 1, 0, 1]  # spread over the servers in turn
        fake.finish(0, 1, 2)  # task 0 is the long tail: it goes on
        taken = await asyncio.wait_for(d.take(None, 0), 5)
        assert [g.outcome.task_index for g in taken.groups] == [1, 2]
        await settle()
        # as each group finished the next started: 4 in flight again, task 0 among them, across the step
        assert len(d.running) == 4 and 0 in [r.task_index for r in d.running]
        fake.finish(0, 0, 3)
        taken = await asyncio.wait_for(d.take(None, 0), 5)
        assert sorted(g.outcome.task_index for g in taken.groups) == [0, 3]
        await d.close()
        assert len(fake.cancelled) == 4  # those still in flight at the end
    asyncio.run(scenario())


def test_a_group_starts_only_if_it_can_be_trained_within_the_bound():
    """One group a step, bound 2: at step 0 under policy 0 the groups not yet taken train at steps 0, 1, 2; a fourth
    would train at step 3, three policies on: it waits though there is room for 10."""
    async def scenario():
        fake = FakeGroups()
        d = fake.dispatcher(capacity=10, shares=[1], bound=2)
        d.top_up()
        await settle()
        assert [task for _, task, _ in fake.started] == [0, 1, 2]
        fake.finish(0, 2)  # a later group finishes first: the step takes it, and one more may start
        taken = await asyncio.wait_for(d.take(None, 0), 5)
        assert [g.outcome.task_index for g in taken.groups] == [2]
        await settle()
        assert [task for _, task, _ in fake.started] == [0, 1, 2]  # steps 1, 2 hold tasks 0, 1; a third: step 3
        fake.policy = 1  # the servers move on: a group started now trains at step 3 with policy 1, within 2
        d.top_up()
        await settle()
        assert [task for _, task, _ in fake.started] == [0, 1, 2, 3] and not fake.cancelled
        await d.close()
    asyncio.run(scenario())


def test_a_group_at_its_last_trainable_step_is_waited_for_and_trains_in_place_of_a_newer_one():
    """Bound 1, a group a step: task 0, started under policy 0, can train at steps 0 and 1 only. At step 1 a newer
    group (task 2) has finished and task 0 has not: the batch waits for task 0 and takes it; task 2 trains at step 2,
    still within its bound. Before, step 1 took task 2 and task 0 arrived too old for step 2: withheld."""
    async def scenario():
        fake = FakeGroups()
        d = fake.dispatcher(capacity=3, shares=[1], bound=1)
        d.top_up()
        await settle()
        fake.finish(0, 1)
        taken = await asyncio.wait_for(d.take(None, 0), 5)  # step 0: task 0 has a step left
        assert [g.outcome.task_index for g in taken.groups] == [1] and taken.last_chance == 0
        fake.policy = 1
        d.top_up()
        await settle()
        assert [task for _, task, _ in fake.started] == [0, 1, 2]
        fake.finish(0, 2)
        step_1 = asyncio.ensure_future(d.take(None, 0))
        await settle()
        assert not step_1.done()  # task 2 is there, but task 0's last chance is this step
        fake.finish(0, 0)
        taken = await asyncio.wait_for(step_1, 5)
        assert [g.outcome.task_index for g in taken.groups] == [0] and taken.last_chance == 1
        taken = await asyncio.wait_for(d.take(None, 0), 5)  # step 2: task 2 (policy 1) within the bound
        assert [g.outcome.task_index for g in taken.groups] == [2] and not fake.cancelled
        await d.close()
    asyncio.run(scenario())


def test_nothing_is_cancelled_for_age_and_the_oldest_finished_train_first():
    async def scenario():
        fake = FakeGroups()
        d = fake.dispatcher(capacity=3, shares=[2])
        d.top_up()  # tasks 0, 1, 2 under policy 0
        await settle()
        fake.policy = 20  # far past any bound: nothing in flight is cancelled
        fake.oldest_of.update({1: 5, 2: 3})
        fake.finish(0, 1, 2)
        await settle()
        fake.finish(0, 0)
        await settle()
        taken = await asyncio.wait_for(d.take(None, 0), 5)
        assert [g.outcome.task_index for g in taken.groups] == [0, 2]  # oldest tokens first: 0 (policy 0), 2 (3)
        assert not fake.cancelled
        await d.close()
    asyncio.run(scenario())


def test_batches_keep_the_environments_ratios_whatever_their_speed():
    async def scenario():
        fake = FakeGroups(tasks_per_env=(100, 100))
        d = fake.dispatcher(capacity=4, shares=[3, 1])
        d.top_up()
        await settle()
        assert sorted(env for env, _, _ in fake.started) == [0, 0, 0, 1]
        for task in range(10):
            fake.finish(1, task)  # env 1 is fast, but dispatch pauses for it once its share waits for a batch
        await settle()
        envs = [env for env, _, _ in fake.started]
        assert envs.count(1) == 1 and len(d.running) == 4  # env 0's groups took its place
        fake.finish(0, 0, 1, 2)
        taken = await asyncio.wait_for(d.take(None, 0), 5)
        assert sorted(g.env for g in taken.groups) == [0, 0, 0, 1]
        await d.close()
    asyncio.run(scenario())


def test_fill_batch_takes_untrainable_groups_as_extra_until_the_bound():
    async def scenario():
        fake = FakeGroups()
        fake.untrainable = {0, 1, 3}
        d = fake.dispatcher(capacity=2, shares=[2])
        d.top_up()
        await settle()
        fake.finish(0, *range(6))
        taken = await asyncio.wait_for(d.take(fake.trainable, max_extra=3), 5)
        assert [g.outcome.task_index for g in taken.groups] == [0, 1, 2, 3, 4]
        assert (taken.extra, taken.short) == (3, 0)
        fake.untrainable = set(range(6, 100))
        fake.finish(0, *range(5, 40))
        taken = await asyncio.wait_for(d.take(fake.trainable, max_extra=2), 5)
        assert taken.extra == 2 and taken.short == 1  # task 5 trainable, then two untrainable: the bound
        await d.close()
    asyncio.run(scenario())


def test_groups_on_a_changed_server_run_again_first_elsewhere():
    async def scenario():
        fake = FakeGroups()
        d = fake.dispatcher(capacity=2, shares=[2])
        d.top_up()
        await settle()
        fake.usable = [0]
        assert d.servers_changed({1}) == 1
        await settle()
        assert fake.cancelled == [(0, 1)] and len(fake.started) == 2  # nothing starts on servers not yet up to date
        d.top_up()  # (the orchestrator tops up once the servers are brought up to date)
        await settle()
        assert fake.started[-1] == (0, 1, 0)  # task 1 again, on server 0, before any new draw
        await d.close()
    asyncio.run(scenario())


def test_groups_failed_on_a_server_that_went_down_run_again_once_a_server_is_back_not_trained_as_failures():
    async def scenario():
        fake = FakeGroups(servers=(0,))
        d = fake.dispatcher(capacity=2, shares=[2])
        d.top_up()
        await settle()
        fake.down = {0}  # killed: the groups in flight fail, and so would any started on it
        fake.finish(0, 0, 1)

        async def servers_back():  # the policy sync: a new process on the port, brought up to date
            fake.down, fake.usable = set(), [0]

        taken = await asyncio.wait_for(d.take(None, 0, servers_back=servers_back), 5)
        assert [g.outcome.task_index for g in taken.groups] == [0, 1]
        assert all(g.outcome.results for g in taken.groups)  # made again, not taken as failed groups
        assert [task for _, task, _ in fake.started][:4] == [0, 1, 1, 0] or \
            [task for _, task, _ in fake.started][:4] == [0, 1, 0, 1]  # each failed task ran again, before new draws
        assert fake.next_task == [len(fake.started) - 2]
        await d.close()
    asyncio.run(scenario())


def test_a_group_that_fails_on_a_server_still_up_is_a_failure_of_the_batch():
    async def scenario():
        fake = FakeGroups(servers=(0,))
        d = fake.dispatcher(capacity=1, shares=[1])

        async def start(env, task, server, number):
            return GroupOutcome(Env("env0"), None, "RolloutError", "the environment raised", server=server,
                                task_index=task)

        fake.start = start  # the runner's
        taken = await asyncio.wait_for(d.take(None, 0), 5)
        assert taken.groups[0].outcome.error == "RolloutError" and fake.checks >= 1  # asked: the server is fine
        await d.close()
    asyncio.run(scenario())


def test_pending_groups_of_a_checkpoint_run_first_after_a_resume():
    async def scenario():
        fake = FakeGroups()
        d = fake.dispatcher(capacity=3, shares=[1])
        d.top_up()
        await settle()
        fake.finish(0, 1)
        await settle()
        pending = d.pending()
        assert sorted(pending) == [(0, 0), (0, 1), (0, 2)]  # in flight, and finished not yet in a batch
        await d.close()

        resumed = FakeGroups()
        resumed.next_task = [3]  # the sampler, restored, is past them
        d = resumed.dispatcher(capacity=3, shares=[1], pending=pending)
        d.top_up()
        await settle()
        assert [task for _, task, _ in resumed.started] == [task for _, task in pending][:3]
        assert resumed.next_task == [3]  # none of them drawn again
        resumed.finish(0, *range(10))
        await asyncio.wait_for(d.take(None, 0), 5)
        await d.close()
    asyncio.run(scenario())


def test_a_take_with_nothing_in_flight_and_nothing_to_start_says_so():
    async def scenario():
        fake = FakeGroups(servers=())
        d = fake.dispatcher(capacity=2, shares=[1])
        with pytest.raises(RuntimeError, match="no group in flight"):
            await d.take(None, 0)
    asyncio.run(scenario())


def test_with_fill_batch_an_environment_that_never_trains_does_not_hold_the_batch():
    async def scenario():
        fake = FakeGroups(tasks_per_env=(100, 100))
        d = fake.dispatcher(capacity=4, shares=[2, 2])
        fake.trainable = lambda outcome: outcome.env.name == "env0"  # env 1's groups all score alike
        d.top_up()
        await settle()
        for task in range(20):
            fake.finish(0, task)
            fake.finish(1, task)
        taken = await asyncio.wait_for(d.take(fake.trainable, max_extra=8), 5)
        trained = [g for g in taken.groups if g.env == 0]
        assert len(trained) == 4 and taken.short == 0  # the batch's 4 trainable groups, all from env 0
        assert taken.extra == len(taken.groups) - 4 <= 8
        await d.close()
    asyncio.run(scenario())
