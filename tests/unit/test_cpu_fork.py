"""Our patch that lets vLLM's CPU platform start its engine core and workers by fork (rl.patches.vllm_cpu_fork),
without a server: the platform's own check still runs, fork is what is left in the environment after it, and a
forked child takes the cores and threads vLLM's environment names for it, as a spawned one would. Every CPU server
the integration tests start runs with it (test_inference.py checks a real server's forked worker)."""

import contextlib
import gc
import json
import os
import socket
import tempfile
import time

import psutil
import pytest
import torch
from vllm.platforms import cpu

from rl import patches
from rl import process
from rl.inference import cpu_fork, server


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
    # set, then deleted: monkeypatch restores only what it changed, and the patched check sets the variable; left
    # behind, it made every later server of this test worker start vLLM's processes by spawn
    monkeypatch.setenv(patches.START_METHOD_ENV, "")
    monkeypatch.delenv(patches.START_METHOD_ENV)
    return seen, hooks


def test_after_the_platforms_own_check_vllm_forks(platform_check):
    seen, hooks = platform_check
    patches.vllm_cpu_fork(cpu_fork.child)
    patches.vllm_cpu_fork(cpu_fork.child)  # applied once however often it is asked
    cpu.CpuPlatform().check_and_update_config("config")
    assert seen == ["config"]  # the platform's other settings are still made, once
    assert os.environ[patches.START_METHOD_ENV] == "fork"
    assert hooks == [{"before": process.before_fork, "after_in_child": cpu_fork.child}]


def test_a_users_fork_is_kept_over_the_platforms_spawn(platform_check, monkeypatch):
    """vLLM's CPU platform sets spawn whatever the environment says: a user's fork is made to hold."""
    monkeypatch.setenv(patches.START_METHOD_ENV, "fork")
    assert server.cpu_start_method() is True
    cpu.CpuPlatform().check_and_update_config("config")
    assert os.environ[patches.START_METHOD_ENV] == "fork"


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
    assert cpu_fork.omp_cores(environ) == cores


def in_a_fork(child) -> str:
    """What `child()` returns (a string), run in a forked child of this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports and leaves at once, whatever happens
        try:
            os.write(write, child().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as reader:
        reported = reader.read()
    os.waitpid(pid, 0)
    return reported


def test_a_forked_child_takes_the_cores_and_threads_its_environment_names(monkeypatch):
    """In a real fork: the child's cores and torch threads are those the environment names, the parent's unchanged."""
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("GOMP_CPU_AFFINITY", str(allowed[-1]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads_before = torch.get_num_threads()

    def child() -> str:
        cpu_fork.bind_threads_from_environment()
        return json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads()])

    assert json.loads(in_a_fork(child)) == [[allowed[-1]], 1]
    assert sorted(os.sched_getaffinity(0)) == allowed and torch.get_num_threads() == threads_before
    monkeypatch.setenv("GOMP_CPU_AFFINITY", f"{allowed[-1]} {max(allowed) + 1000}")  # a core not here is ignored
    monkeypatch.setenv("OMP_NUM_THREADS", "²")  # nor a count int() cannot read
    assert json.loads(in_a_fork(child)) == [[allowed[-1]], threads_before]


def test_a_forked_child_keeps_no_tcp_listener_of_its_parent():
    """A killed API server's forked engine core held its port: a server restarted there could not bind it."""
    with contextlib.ExitStack() as stack:
        listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        bound = stack.enter_context(socket.socket())  # vLLM binds its port first, and listens once the engine is up
        bound.bind(("127.0.0.1", 0))
        connected_pair = [stack.enter_context(s) for s in socket.socketpair()]
        unix = stack.enter_context(socket.socket(socket.AF_UNIX))
        unix.bind(os.path.join(stack.enter_context(tempfile.TemporaryDirectory()), "sock"))
        unix.listen()
        descriptors = {"tcp listener": listener.fileno(), "tcp bound": bound.fileno(), "unix listener": unix.fileno(),
                       "pair": connected_pair[0].fileno()}

        def child() -> str:
            process.close_inherited_listeners()
            still = {}
            for name, fd in descriptors.items():
                try:
                    os.fstat(fd)
                    still[name] = True
                except OSError:
                    still[name] = False
            return json.dumps(still)

        assert json.loads(in_a_fork(child)) == {"tcp listener": False, "tcp bound": False, "unix listener": True,
                                                 "pair": True}
        os.fstat(listener.fileno())  # the parent's own is open
        with socket.create_connection(listener.getsockname(), timeout=5):
            pass  # and still accepts


def test_the_process_that_registered_the_hooks_freezes_its_objects_before_it_forks_and_its_children_do_not(
        monkeypatch):
    """A forked child's collections skip its parent's objects; a child that forks again while it runs (a subprocess
    with a preexec_fn) must not freeze its garbage for good."""
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: None)
    monkeypatch.setattr(process, "_hooks_owner", None)
    process.register_fork_hooks(after_in_child=cpu_fork.child)
    gc.unfreeze()
    try:
        process.before_fork()
        assert gc.get_freeze_count() > 0
        gc.unfreeze()
        child = os.fork()
        if child == 0:  # the hooks are inherited, their owner is not
            gc.unfreeze()
            process.before_fork()
            os._exit(0 if gc.get_freeze_count() == 0 else 1)
        assert os.waitpid(child, 0)[1] == 0, "a child of the hooks' owner froze its objects"
    finally:
        gc.unfreeze()


def test_a_forked_child_ends_when_its_parent_dies():
    """The engine core of a killed API server lived on: a forked child gets SIGTERM when its parent dies."""
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:  # forks the child, reports its pid, then dies
        try:
            process.remember_forking_parent()
            child = os.fork()
            if child == 0:
                try:
                    process.end_with_parent()
                    time.sleep(60)
                finally:
                    os._exit(0)
            os.write(write, str(child).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as reader:
        child = int(reader.read())
    os.waitpid(middle, 0)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child outlived its parent by 10 s"
        time.sleep(0.05)

