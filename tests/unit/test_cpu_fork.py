"""Our patch that lets vLLM's CPU platform start its engine core and workers by fork (rl.patches.vllm_cpu_fork),
without a server: the platform's own check still runs, and fork is what is left in the environment after it. Every
CPU server the integration tests start runs with it."""

import os

import pytest
from vllm.platforms import cpu

from rl import patches
from rl.inference import server


@pytest.fixture
def platform_check(monkeypatch):
    """A stand-in for the platform's check that sets spawn as vLLM's does, put back after the test."""
    seen = []

    def check(cls, vllm_config):
        seen.append(vllm_config)
        os.environ[patches.START_METHOD_ENV] = "spawn"

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(check))
    monkeypatch.delenv(patches.START_METHOD_ENV, raising=False)
    return seen


def test_after_the_platforms_own_check_vllm_forks(platform_check):
    patches.vllm_cpu_fork()
    patches.vllm_cpu_fork()  # applied once however often it is asked
    cpu.CpuPlatform().check_and_update_config("config")
    assert platform_check == ["config"]  # the platform's other settings are still made, once
    assert os.environ[patches.START_METHOD_ENV] == "fork"


def test_a_start_method_the_user_set_is_kept(platform_check, monkeypatch):
    monkeypatch.setenv(patches.START_METHOD_ENV, "spawn")
    assert server.cpu_start_method() is False
    assert not getattr(cpu.CpuPlatform.check_and_update_config, "rl_forks", False)
