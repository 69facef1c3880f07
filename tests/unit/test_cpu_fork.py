"""Our patch that lets vLLM's CPU platform start its engine core and workers by fork (rl.patches.vllm_cpu_fork),
without a server: the platform's own check still runs, fork is what is left in the environment after it, and a
forked child takes the cores and threads vLLM's environment names for it, as a spawned one would. Every CPU server
the integration tests start runs with it (test_inference.py checks a real server's forked worker)."""

import json
import os

import pytest
import torch
from vllm.platforms import cpu

from rl import patches
from rl.inference import server


@pytest.fixture
def platform_check(monkeypatch):
    """A stand-in for the platform's check that sets spawn as vLLM's does, put back after the test; fork hooks
    are recorded, not registered in the test process."""
    seen, hooks = [], []

    def check(cls, vllm_config):
        seen.append(vllm_config)
        os.environ[patches.START_METHOD_ENV] = "spawn"

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(check))
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: hooks.append(hook))
    monkeypatch.delenv(patches.START_METHOD_ENV, raising=False)
    return seen, hooks


def test_after_the_platforms_own_check_vllm_forks(platform_check):
    seen, hooks = platform_check
    patches.vllm_cpu_fork()
    patches.vllm_cpu_fork()  # applied once however often it is asked
    cpu.CpuPlatform().check_and_update_config("config")
    assert seen == ["config"]  # the platform's other settings are still made, once
    assert os.environ[patches.START_METHOD_ENV] == "fork"
    assert hooks == [{"after_in_child": patches.bind_threads_from_environment}]


def test_a_start_method_the_user_set_is_kept(platform_check, monkeypatch):
    monkeypatch.setenv(patches.START_METHOD_ENV, "spawn")
    assert server.cpu_start_method() is False
    assert not getattr(cpu.CpuPlatform.check_and_update_config, "rl_forks", False)
    assert platform_check[1] == []


@pytest.mark.parametrize("environ, cores", [
    ({"GOMP_CPU_AFFINITY": "3"}, {3}),  # vLLM's form when it preloads libgomp: the cores, space-separated
    ({"GOMP_CPU_AFFINITY": "0 2 5"}, {0, 2, 5}),
    ({"GOMP_CPU_AFFINITY": "0-3,8"}, {0, 1, 2, 3, 8}),
    ({"GOMP_CPU_AFFINITY": "0-6:3"}, {0, 3, 6}),
    ({"OMP_PLACES": "{1,4}"}, {1, 4}),  # vLLM's form otherwise: one place
    ({"GOMP_CPU_AFFINITY": "1", "OMP_PLACES": "{0}"}, {1}),  # libgomp reads GOMP_CPU_AFFINITY first
    ({}, None),
    ({"OMP_PLACES": "cores"}, None),  # OpenMP's abstract names are not read: the cores stay as they are
    ({"OMP_PLACES": "{0:4}"}, None),
    ({"GOMP_CPU_AFFINITY": "0 x"}, None),
])
def test_the_cores_openmp_would_bind_to(environ, cores):
    assert patches.omp_cores(environ) == cores


def test_a_forked_child_takes_the_cores_and_threads_its_environment_names(monkeypatch):
    """In a real fork: the child's cores and torch threads are those the environment names, the parent's unchanged."""
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(allowed[-1]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads_before = torch.get_num_threads()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports and leaves at once, whatever happens
        try:
            patches.bind_threads_from_environment()
            os.write(write, json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads()]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as reader:
        reported = reader.read()
    os.waitpid(pid, 0)
    assert json.loads(reported) == [[allowed[-1]], 1]
    assert sorted(os.sched_getaffinity(0)) == allowed and torch.get_num_threads() == threads_before
