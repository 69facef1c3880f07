"""The adaptive in-flight cap (rl/orchestrator/concurrency.py) against fake /metrics texts, and the dispatcher that
follows it."""

import asyncio

import pytest
from pydantic import ValidationError

from rl.orchestrator.concurrency import ConcurrencyController
from rl.orchestrator.config import ConcurrencyConfig, OrchestratorConfig
from tests.unit.test_dispatch import FakeGroups, settle


def metrics(kv: float, running: int = 0, waiting: int = 0, preemptions: int = 0) -> str:
    """A /metrics text as vLLM 0.32 writes it (one engine)."""
    labels = '{engine="0",model_name="m"}'
    return "\n".join([
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{labels} {kv}",
        f"vllm:num_requests_running{labels} {running}",
        f"vllm:num_requests_waiting{labels} {waiting}",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{labels} {preemptions}",
    ])


def controller(start=32, group=4, **settings) -> ConcurrencyController:
    return ConcurrencyController(ConcurrencyConfig(adaptive=True, **settings), start, group)


def test_the_cap_grows_while_it_limits_and_the_engines_have_headroom_up_to_the_ceiling():
    c = controller(start=32, max_rollouts=48)
    caps = [c.update([metrics(0.2, running=c.cap)], in_flight=c.cap).cap for _ in range(6)]
    assert caps == [36, 40, 44, 48, 48, 48]  # x1.1 in whole groups of 4 (a group at least), then the ceiling
    assert all(cap % 4 == 0 for cap in caps)


def test_the_cap_holds_where_it_does_not_limit_or_requests_wait():
    c = controller(start=32)
    assert c.update([metrics(0.2)], in_flight=16).why == "hold"  # half the cap in flight: the cap is not what limits
    assert c.update([metrics(0.2, waiting=3)], in_flight=32).why == "trim"  # a queue that grew
    assert c.update([metrics(0.2, waiting=3)], in_flight=c.cap).why == "hold"  # waiting, not growing: no growth
    assert c.update([metrics(0.8)], in_flight=c.cap).why == "hold"  # between the growth mark and the high-water one


def test_the_cap_is_trimmed_softly_at_the_high_water_mark_without_cancelling():
    c = controller(start=40)
    decision = c.update([metrics(0.95, running=40)], in_flight=40)
    assert (decision.why, decision.cap, decision.cancel) == ("trim", 36, False)
    assert c.update([metrics(0.95, running=40)], in_flight=40).why == "drain"  # not trimmed again meanwhile


def test_a_preemption_cuts_the_cap_waits_for_the_drain_cuts_harder_if_overload_outlives_it_never_below_the_floor():
    c = controller(start=64, min_rollouts=8)
    c.update([metrics(0.5, preemptions=2)], in_flight=64)  # the counter as the controller first reads it
    decision = c.update([metrics(1.0, preemptions=7)], in_flight=64)
    assert (decision.why, decision.cap, decision.cancel) == ("cut", 48, False)  # 0.75 of those in flight
    assert c.update([metrics(1.0, preemptions=9)], in_flight=60).why == "drain"  # no cut on the old load
    assert c.update([metrics(1.0, preemptions=11)], in_flight=48).cap == 24  # overload outlived the drain: x0.5
    assert c.update([metrics(0.5, preemptions=11)], in_flight=24).why == "grow"  # clear: the cuts start over
    assert c.update([metrics(1.0, preemptions=12)], in_flight=28).cap == 20  # x0.75 again (21 in whole groups)
    for preemptions in (13, 14, 15):
        decision = c.update([metrics(1.0, preemptions=preemptions)], in_flight=c.cap)
    assert decision.cap == 8  # the floor, whatever the engines say
    assert c.update([metrics(1.0, preemptions=15)], in_flight=8).why == "trim"  # no new preemption: no cut
    shedding = controller(start=64, shed=True)
    shedding.update([metrics(0.5)], in_flight=64)
    assert shedding.update([metrics(1.0, preemptions=1)], in_flight=64).cancel  # with shed: cancel beyond the cap


def test_servers_are_read_together_the_fullest_kv_and_every_preemption_count_and_a_restart_counts_from_zero():
    c = controller(start=32)
    c.update([metrics(0.1, preemptions=50), metrics(0.1)], in_flight=32)
    load = c.load([metrics(0.3, waiting=1, preemptions=50), metrics(0.92, waiting=2)])
    assert (load.kv_usage, load.waiting, load.preempted) == (0.92, 3, 0)
    load = c.load([metrics(0.3, preemptions=2), None])  # server 0 restarted, server 1 did not answer
    assert load.preempted == 2


def test_servers_without_vllms_statistics_leave_the_cap_where_it_is():
    c = controller(start=32)
    assert c.update(["# no vllm metrics here\nprocess_cpu_seconds_total 3.0", None], in_flight=32).why == "no metrics"
    assert c.cap == 32


def test_the_dispatcher_follows_the_cap_and_a_cut_runs_the_youngest_groups_again_first():
    async def scenario():
        fake = FakeGroups()
        d = fake.dispatcher(capacity=4, shares=[8])
        d.top_up()
        await settle()
        assert d.resize(6, shed=False) == 0 and len(d.running) == 6  # grown: two more started at once
        assert d.resize(2, shed=False) == 0 and len(d.running) == 6  # trimmed: none cancelled, none started
        fake.finish(0, 0)
        await settle()
        assert len(d.running) == 5  # the finished group is not replaced while over the cap
        assert d.resize(2, shed=True) == 3  # cut: the three youngest cancelled
        assert [r.task_index for r in d.running] == [1, 2] and list(d.again) == [(0, 3), (0, 4), (0, 5)]
        await settle()
        assert sorted(fake.cancelled) == [(0, 3), (0, 4), (0, 5)]  # their requests aborted
        fake.finish(0, 1)
        await settle()
        assert fake.started[-1][1] == 3  # the first cancelled task runs again before any new draw
        await d.close()
    asyncio.run(scenario())


def test_adaptive_concurrency_is_refused_where_no_cap_moves_and_with_marks_out_of_order():
    with pytest.raises(ValidationError, match="dispatch = 'step'"):
        OrchestratorConfig(concurrency=ConcurrencyConfig(adaptive=True), dispatch="step")
    with pytest.raises(ValidationError, match="kv_grow_below"):
        ConcurrencyConfig(kv_high=0.7, kv_grow_below=0.8)
    with pytest.raises(ValidationError, match="min_rollouts"):
        ConcurrencyConfig(min_rollouts=64, max_rollouts=32)


def test_a_cap_with_room_in_the_engines_is_trimmed_once_the_oldest_group_has_used_half_the_age_bound():
    """Episodes waiting on tools hold no KV cache: the engines' load alone would grow the cap until the slowest
    episodes outlive max_off_policy_steps. Past `age_high` of it, the oldest group's age trims the cap instead."""
    c = controller(start=32)
    assert c.update([metrics(0.1, running=32)], in_flight=32, age=0.5).why == "grow"  # at the mark: still grows
    decision = c.update([metrics(0.1, running=32)], in_flight=32, age=0.625)
    assert (decision.why, decision.cap, decision.cancel) == ("age", 28, False)  # x0.9 of what is in flight
    preempting = controller(start=32)
    preempting.update([metrics(0.5, preemptions=1)], in_flight=32)
    assert preempting.update([metrics(1.0, preemptions=3)], in_flight=32, age=0.9).why == "cut"  # overload cuts harder


def test_the_age_the_controller_reads_counts_steps_past_the_first_boundary_over_the_bound():
    """A group in flight across one step boundary is every continuous run's normal: only steps beyond it count."""
    from types import SimpleNamespace

    from rl.envs.slots import RolloutSlots
    from rl.orchestrator.dispatch import Dispatcher

    groups = Dispatcher(RolloutSlots(4), 1, [1], runner=None, bound=8)
    groups.step, groups.running = 10, [SimpleNamespace(started_step=9), SimpleNamespace(started_step=5)]
    assert groups.oldest_age() == 5 and groups.age_used() == 0.5
    groups.running = [SimpleNamespace(started_step=9)]
    assert groups.age_used() == 0.0
    groups.running = []
    assert groups.oldest_age() == 0
