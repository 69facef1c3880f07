"""The orchestrator's view of its servers between batches (`ServerBoard.check`, `PolicySync.ensure`): a server
that restarted (another instance: it serves its start-up weights) or stopped answering gets no requests until it
answers and is brought up to date, and groups it generated meanwhile are dropped. A fake pool stands in for the
servers' admin routes; the weights are real files."""

import asyncio
import logging

import pytest

from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.main import Orchestrator
from rl.orchestrator.group_runner import GroupRunner
from rl.orchestrator.stepwise import StepwiseGroups
from rl.orchestrator.policy_sync import policy_sync
from rl.orchestrator.servers import DOWN, ServerBoard
from rl.envs.rollouts import GroupOutcome
from rl.protocol import RunPaths, mark_stable


class FakePool:
    """Each server's /policy_step reply (a dict, or why it did not answer), and the updates asked of them."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.updates: list[tuple[int, list[int]]] = []

    async def current(self):
        return list(self.replies)

    async def update_weights(self, step, path, servers=None):
        self.updates.append((step, servers))
        for i in servers:
            self.replies[i] = {"step": step, "instance": self.replies[i]["instance"]}
        return [{"step": step} for _ in servers]


def orchestrator(tmp_path, pool: FakePool, collective: bool = False) -> Orchestrator:
    config = OrchestratorConfig(output_dir=tmp_path, client={"base_urls": ["http://a:8000", "http://b:8000"]},
                                transfer={"type": "collective" if collective else "filesystem"})
    o = Orchestrator.__new__(Orchestrator)  # no environments: only the server bookkeeping is exercised
    o.config, o.logger, o.pool, o.paths = config, logging.getLogger("test"), pool, RunPaths(tmp_path)
    o.servers = ServerBoard(pool, config.client, o.logger)
    o.sync = policy_sync(config, pool, o.servers, o.logger)
    o.runner = GroupRunner(config, [], [], [], o.servers, o.sync, o.logger)
    return o


def publish(tmp_path, step: int) -> None:
    directory = RunPaths(tmp_path).weights(step)
    directory.mkdir(parents=True)
    mark_stable(directory)


def test_a_restarted_server_gets_the_newest_policy_before_any_request(tmp_path):
    pool = FakePool({"step": 0, "instance": "a1"}, {"step": 0, "instance": "b1"})
    o = orchestrator(tmp_path, pool)
    assert asyncio.run(o.servers.check()) == set()
    assert asyncio.run(o.sync.ensure(1)) is None and o.servers.usable == [0, 1] and pool.updates == []

    publish(tmp_path, 3)
    asyncio.run(o.sync.ensure(4))  # async_level 1: policy 3 is loaded on both
    assert pool.updates == [(3, [0, 1])] and o.servers.served_steps == [3, 3]
    pool.replies[1] = {"step": 0, "instance": "b2"}  # server b restarted: it serves its start-up weights
    assert asyncio.run(o.servers.check()) == {1}
    assert o.servers.served_steps == [3, 0]
    asyncio.run(o.sync.ensure(4))
    assert pool.updates[-1] == (3, [0, 1]) and o.servers.usable == [0, 1] and o.servers.served_steps == [3, 3]



@pytest.mark.parametrize("dispatch, loaded", [("continuous", [(2, [0, 1])]), ("step", [])])
def test_under_continuous_dispatch_servers_load_each_newer_policy_at_once(tmp_path, dispatch, loaded):
    """async_level 8: batch 3 could use policy 0, but under continuous dispatch groups are admitted by the policy
    served, so the servers load the newest published one (2); step by step they wait until a batch needs it."""
    pool = FakePool({"step": 0, "instance": "a1"}, {"step": 0, "instance": "b1"})
    o = orchestrator(tmp_path, pool)
    o.config.async_level, o.config.dispatch = 8, dispatch
    asyncio.run(o.servers.check())
    publish(tmp_path, 1)
    publish(tmp_path, 2)
    asyncio.run(o.sync.ensure(3))
    assert pool.updates == loaded


def test_a_server_first_heard_serving_a_later_step_is_not_asked_for_an_older_one(tmp_path):
    """A server the run did not start may already serve step 2 (a shared one): the board takes that from its first
    reply, and the newest published step (1) is not loaded into it (the server would refuse it: 409)."""
    pool = FakePool({"step": 2, "instance": "a1"}, {"step": 2, "instance": "b1"})
    o = orchestrator(tmp_path, pool)
    o.config.async_level = 2  # continuous: batch 2 could use policy 0, so only an eager load would load one
    asyncio.run(o.servers.check())
    assert o.servers.served_steps == [2, 2]
    publish(tmp_path, 1)
    asyncio.run(o.sync.ensure(2))
    assert pool.updates == []


def test_groups_made_on_a_server_that_changed_meanwhile_are_made_again_on_servers_up_to_date(tmp_path):
    pool = FakePool({"step": 0, "instance": "a1"}, {"step": 0, "instance": "b1"})
    o = orchestrator(tmp_path, pool)
    asyncio.run(o.servers.check())
    remade = []

    async def run_one_group(env, task_index, server, number):
        remade.append((task_index, server))
        return GroupOutcome(env, ["remade"], server=server, task_index=task_index)

    o.runner.run = run_one_group
    outcomes = [GroupOutcome(None, ["kept"], server=0, task_index=7), GroupOutcome(None, None, server=1, task_index=8)]
    pool.replies[1] = "http://b:8000 did not answer /policy_step: ConnectError()"  # b went down during the batch
    outcomes = asyncio.run(StepwiseGroups(o.runner).remake(outcomes, 1))
    assert remade == [(8, 0)]  # task 8 again, on a, the server left
    assert [outcome.results for outcome in outcomes] == [["kept"], ["remade"]]

    pool.replies[0] = {"step": 0, "instance": "a2"}  # every round finds a change: after the last, dropped
    o.servers.check = lambda: asyncio.sleep(0, {0})
    outcomes = asyncio.run(StepwiseGroups(o.runner).remake(outcomes, 1))
    assert [(outcome.results, outcome.error) for outcome in outcomes] == [(None, "ServerChanged")] * 2


def test_a_server_that_stops_answering_gets_no_requests_until_it_is_back(tmp_path):
    pool = FakePool({"step": 0, "instance": "a1"}, {"step": 0, "instance": "b1"})
    o = orchestrator(tmp_path, pool)
    asyncio.run(o.servers.check())
    pool.replies[0] = "http://a:8000 did not answer /policy_step: ConnectError()"
    assert asyncio.run(o.servers.check()) == {0}
    assert asyncio.run(o.servers.check()) == set()  # named once, when it went
    asyncio.run(o.sync.ensure(1))
    assert o.servers.instances[0] == DOWN and o.servers.usable == [1] and pool.updates == []
    publish(tmp_path, 0)
    pool.replies[0] = {"step": 0, "instance": "a2"}  # back, restarted: it serves the base model, as the others
    assert asyncio.run(o.servers.check()) == {0}
    asyncio.run(o.sync.ensure(1))
    assert o.servers.usable == [0, 1]


def test_no_server_answering_ends_the_wait_at_its_deadline_naming_the_servers(tmp_path):
    from rl.orchestrator.inference_pool import InferenceError

    pool = FakePool("a down", "b down")
    o = orchestrator(tmp_path, pool)
    o.config.client.startup_timeout_s = 0.5
    asyncio.run(o.servers.check())
    with pytest.raises(InferenceError, match=r"no inference server answered for 0 s \(\['http://a:8000'"):
        asyncio.run(o.sync.ensure(1))


def test_over_the_wire_a_server_restarted_after_its_offer_catches_up_from_the_checkpoints_files(tmp_path):
    from rl.orchestrator.inference_pool import InferenceError

    pool = FakePool({"step": 5, "instance": "a1"}, {"step": 0, "instance": "b2"})
    o = orchestrator(tmp_path, pool, collective=True)
    o.servers.instances, o.servers.served_steps, o.sync.last_offer = ["a1", "b1"], [5, 5], 5
    o.config.async_level = 0  # batch 5 needs policy 5, the last the trainer can offer before it
    assert asyncio.run(o.servers.check()) == {1}
    assert asyncio.run(o.sync.ensure(5)) is None and o.servers.usable == [0]  # the other still serves policy 5
    pool.replies[0] = {"step": 0, "instance": "a2"}
    asyncio.run(o.servers.check())
    with pytest.raises(InferenceError, match="no checkpoint's files hold it"):
        asyncio.run(o.sync.ensure(5))  # no offer of policy 5 is left, and no files of it
    publish(tmp_path, 5)
    asyncio.run(o.sync.ensure(5))
    assert pool.updates == [(5, [0, 1])] and o.servers.usable == [0, 1] and o.servers.policy_step == 5


def test_over_the_wire_a_server_gone_mid_transfer_gets_no_requests_and_the_run_goes_on(tmp_path):
    from rl.weights.offers import Offer, write_offer, write_sent

    class WirePool(FakePool):
        async def receive_weights(self, step, host, port, timeout_s, servers):
            write_sent(tmp_path, step, "c")  # the trainer's side: it sent checksum c
            self.replies[1] = "http://b:8000 did not answer /policy_step: ConnectError()"  # stopped mid-transfer
            self.replies[0] = {"step": step, "instance": "a1"}
            return [{"step": step, "weights_checksum": "c"}, "http://b:8000 did not answer /update_weights: ReadError"]

    pool = WirePool({"step": 0, "instance": "a1"}, {"step": 0, "instance": "b1"})
    o = orchestrator(tmp_path, pool, collective=True)
    asyncio.run(o.servers.check())
    write_offer(tmp_path, Offer(1, "127.0.0.1", 1234, 10))
    assert asyncio.run(o.sync.take(1)) == [{"step": 1, "weights_checksum": "c"}]
    assert o.servers.served_steps == [1, -1] and o.servers.instances[1] == DOWN and 1 in o.servers.stale
    asyncio.run(o.sync.ensure(1))
    assert o.servers.usable == [0]


def test_a_server_that_does_not_answer_an_offer_is_a_failed_receiver_not_the_end_of_the_run():
    from rl.orchestrator.inference_pool import InferencePool
    from tests.integration.launched import free_port

    async def offer() -> list:
        pool = InferencePool([f"http://127.0.0.1:{free_port()}"], None, 2.0)  # nothing listens there
        try:
            return await pool.receive_weights(1, "127.0.0.1", 1234, 0.1, [0])
        finally:
            await pool.close()

    (reply,) = asyncio.run(offer())
    assert "did not answer /update_weights for step 1 (over the wire): ConnectError" in reply


def test_over_the_wire_a_server_that_serves_a_checksum_the_trainer_did_not_send_is_refused_and_named(tmp_path, caplog):
    """Whatever a server says it loaded, the orchestrator holds it to the checksum the trainer sent: a server that
    reports another (or reports a step the trainer sent none of) serves it, gets no requests, and the log names it."""
    from rl.weights.offers import Offer, write_offer, write_sent

    class WirePool(FakePool):
        async def receive_weights(self, step, host, port, timeout_s, servers):
            if step == 1:
                write_sent(tmp_path, step, "trainers")
            return [{"step": step, "weights_checksum": "trainers"}, {"step": step, "weights_checksum": "forged"}]

    pool = WirePool({"step": 0, "instance": "a1"}, {"step": 0, "instance": "b1"})
    o = orchestrator(tmp_path, pool, collective=True)
    o.config.transfer.timeout_s = 0.5
    asyncio.run(o.servers.check())
    write_offer(tmp_path, Offer(1, "127.0.0.1", 1234, 10))
    with caplog.at_level(logging.ERROR):
        assert asyncio.run(o.sync.take(1)) == [{"step": 1, "weights_checksum": "trainers"}]
    assert o.servers.served_steps == [1, 1] and o.servers.refused == {1} and o.servers.use_those_serving(0) == [0]
    assert "server 1 serves weights the trainer did not send as policy 1" in caplog.text and "forged" in caplog.text
    write_offer(tmp_path, Offer(2, "127.0.0.1", 1234, 10))  # the trainer's transfer of step 2 failed: it sent none
    assert asyncio.run(o.sync.take(2)) is None and o.servers.served_steps == [2, 2] and o.servers.refused == {0, 1}
    assert o.servers.use_those_serving(0) == []


def test_over_the_wire_a_server_serving_refused_weights_gets_no_requests_until_it_serves_a_step_the_trainer_sent(
        tmp_path):
    """A server that reports a step with a checksum the trainer did not send serves those weights (it loaded them):
    it is not left usable at the step it served before, even where the batch may use that older policy
    (async_level 2), until a step the trainer sent reaches it."""
    from rl.weights.offers import Offer, write_offer, write_sent

    class WirePool(FakePool):
        async def receive_weights(self, step, host, port, timeout_s, servers):
            write_sent(tmp_path, step, f"sent {step}")
            for i in servers:
                self.replies[i] = {"step": step, "instance": self.replies[i]["instance"]}
            return [{"step": step, "weights_checksum": f"sent {step}"},
                    {"step": step, "weights_checksum": "forged" if step == 1 else f"sent {step}"}]

    pool = WirePool({"step": 0, "instance": "a1"}, {"step": 0, "instance": "b1"})
    o = orchestrator(tmp_path, pool, collective=True)
    o.config.async_level = 2
    asyncio.run(o.servers.check())
    write_offer(tmp_path, Offer(1, "127.0.0.1", 1234, 10))
    asyncio.run(o.sync.ensure(2))  # batch 2 may use policy 0 or newer: server 1 serves one, but not the trainer's
    assert o.servers.usable == [0] and [o.runner.server_of(g) for g in range(4)] == [0] * 4
    asyncio.run(o.servers.check())  # it still answers, as the same process: still refused
    asyncio.run(o.sync.ensure(2))
    assert o.servers.usable == [0]
    write_offer(tmp_path, Offer(2, "127.0.0.1", 1234, 10))
    asyncio.run(o.sync.ensure(3))  # policy 2 reaches both, as the trainer sent it
    assert o.servers.usable == [0, 1] and o.servers.served_steps == [2, 2] and o.servers.policy_step == 2
