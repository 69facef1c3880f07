"""Our vLLM plugin that makes vLLM's shared-memory queues sleep between polls, without a server."""

import time
from importlib.metadata import entry_points

import pytest
from vllm.distributed.device_communicators import shm_broadcast

from rl import patches


@pytest.fixture
def vllm_yield(monkeypatch):
    """vLLM's own `sched_yield` in the queue module, put back after the test."""
    monkeypatch.setattr(shm_broadcast, "sched_yield", shm_broadcast.sched_yield)
    return shm_broadcast.sched_yield


def test_vllm_finds_the_plugin():
    plugins = {plugin.name: plugin.value for plugin in entry_points(group="vllm.general_plugins")}
    assert plugins.get("rl-shm-polling") == "rl.patches:vllm_shm_polling"


def test_a_poll_sleeps_the_interval_asked_for(monkeypatch, vllm_yield):
    monkeypatch.setenv(patches.POLL_ENV, "0.05")
    patches.vllm_shm_polling()
    start = time.perf_counter()
    shm_broadcast.sched_yield()
    assert time.perf_counter() - start >= 0.05


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_keeps_vllms_spinning(monkeypatch, vllm_yield, value):
    if value is None:
        monkeypatch.delenv(patches.POLL_ENV, raising=False)
    else:
        monkeypatch.setenv(patches.POLL_ENV, value)
    patches.vllm_shm_polling()
    assert shm_broadcast.sched_yield is vllm_yield


@pytest.mark.parametrize("value", ["fast", "-0.001", "5", "nan"])
def test_a_bad_interval_is_refused_by_name(monkeypatch, vllm_yield, value):
    monkeypatch.setenv(patches.POLL_ENV, value)
    with pytest.raises(ValueError, match=patches.POLL_ENV):
        patches.vllm_shm_polling()
    assert shm_broadcast.sched_yield is vllm_yield


def test_a_vllm_without_the_polled_function_is_refused_as_every_patch_target_is(monkeypatch, vllm_yield):
    monkeypatch.setenv(patches.POLL_ENV, "0.05")
    monkeypatch.delattr(shm_broadcast, "sched_yield")
    with pytest.raises(patches.PatchTargetMissing, match="shm_broadcast.sched_yield is gone in vllm"):
        patches.vllm_shm_polling()
