"""Children forked from the launcher (rl/launcher/forked.py): each runs its module's main() with its own command
line, environment, log and signal handlers, and its exit reaches the supervisor as a subprocess's would."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from rl.launcher.forked import ForkedChild, fork_child, module_of
from rl.launcher.supervisor import ChildSpec, Supervisor
from rl.protocol import RunPaths

CHILD = textwrap.dedent('''
    import os, signal, sys, time

    def main():
        print("argv", sys.argv[1:], "env", os.environ.get("FORKED_CHILD_VALUE"), "launcher var",
              os.environ.get("ONLY_IN_LAUNCHER"))
        print("sigterm", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, file=sys.stderr)
        what = sys.argv[1]
        if what == "exit":
            sys.exit(int(sys.argv[2]))
        if what == "message":
            sys.exit("the child's own message")
        if what == "raise":
            raise RuntimeError("boom in the child")
        if what == "sleep":
            time.sleep(60)

    if __name__ == "__main__":
        main()
''')


@pytest.fixture
def child_module(tmp_path, monkeypatch):
    (tmp_path / "forked_child_fixture.py").write_text(CHILD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "forked_child_fixture"


def fork(module: str, tmp_path, *args: str, env=None) -> tuple[ForkedChild, object]:
    log = tmp_path / "child.log"
    env = {"FORKED_CHILD_VALUE": "given", "PATH": os.environ["PATH"]} if env is None else env
    return fork_child([sys.executable, "-m", module, *args], env, log, lambda: None), log


def test_a_forked_child_runs_main_with_its_argv_environment_and_log(child_module, tmp_path, monkeypatch):
    monkeypatch.setenv("ONLY_IN_LAUNCHER", "x")
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as the supervisor's own handler
    try:
        child, log = fork(child_module, tmp_path, "exit", "0")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert child.wait(timeout=30) == 0
    text = log.read_text()
    assert "argv ['exit', '0'] env given launcher var None" in text  # the environment given, nothing else
    assert "sigterm True" in text  # the launcher's handlers are not the child's


def test_the_launchers_objects_are_frozen_before_it_forks(child_module, tmp_path):
    """A forked child's collections skip what the launcher holds (its full collection over the launcher's imports
    took ~0.65 s of CPU in each child, copying their pages)."""
    gc.unfreeze()
    try:
        child, _ = fork(child_module, tmp_path, "exit", "0")
        assert gc.get_freeze_count() > 0
        assert child.wait(timeout=30) == 0
    finally:
        gc.unfreeze()


def test_exit_codes_reach_the_supervisor_as_a_processes_would(child_module, tmp_path):
    for args, code, shown in ((("exit", "3"), 3, None), (("message",), 1, "the child's own message"),
                              (("raise",), 1, "RuntimeError: boom in the child")):
        child, log = fork(child_module, tmp_path, *args)
        assert child.wait(timeout=30) == code, log.read_text()
        if shown:
            assert shown in log.read_text()
    child, _ = fork(child_module, tmp_path, "sleep")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_the_child_shows_the_command_it_runs(child_module, tmp_path):
    child, _ = fork(child_module, tmp_path, "sleep")
    try:
        deadline = time.monotonic() + 10
        while " ".join(psutil.Process(child.pid).cmdline()).split()[1:3] != ["-m", child_module]:
            assert time.monotonic() < deadline, psutil.Process(child.pid).cmdline()
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)


def test_only_python_dash_m_of_this_interpreter_is_forked():
    assert module_of([sys.executable, "-m", "rl.envs.server", "@", "x.toml"]) == "rl.envs.server"
    assert module_of(["/usr/bin/python3", "-m", "rl.envs.server"]) is None
    assert module_of([sys.executable, "script.py"]) is None


@pytest.mark.parametrize("single_threaded", [True, False])
def test_the_supervisor_forks_a_child_with_preload_only_from_a_single_threaded_launcher(child_module, tmp_path,
                                                                                      monkeypatch, single_threaded):
    from rl.launcher import supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "can_fork", lambda: single_threaded)  # pytest's workers run threads
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # where an exec'd child finds the module
    supervisor = Supervisor(RunPaths(tmp_path / "run"), tail_lines=5, shutdown_timeout_s=5)
    forked = ChildSpec("forked", [sys.executable, "-m", child_module, "exit", "0"], [], tmp_path / "f.log",
                       preload=(child_module,))
    execd = ChildSpec("execd", [sys.executable, "-c", "pass"], [], tmp_path / "e.log")
    for spec in (forked, execd):
        supervisor.start(spec)
    assert isinstance(supervisor.procs["forked"], ForkedChild if single_threaded else subprocess.Popen)
    assert isinstance(supervisor.procs["execd"], subprocess.Popen)
    assert supervisor.procs["forked"].wait(timeout=30) == 0 and supervisor.procs["execd"].wait(timeout=30) == 0
    assert "argv ['exit', '0']" in (tmp_path / "f.log").read_text()


def test_the_launcher_beats_while_it_imports_what_it_forks(tmp_path, monkeypatch):
    """Other hosts stop a run whose launcher goes silent: its imports before forking must not silence it."""
    (tmp_path / "slow_import_fixture.py").write_text("import time\ntime.sleep(1.5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    beats = []

    class Board:
        def beat(self):
            beats.append(time.monotonic())

    supervisor = Supervisor(RunPaths(tmp_path / "run"), tail_lines=5, shutdown_timeout_s=5)
    start = time.monotonic()
    supervisor._warm_up(("slow_import_fixture",), Board())
    assert "slow_import_fixture" in sys.modules and time.monotonic() - start >= 1.5
    assert len(beats) >= 3 and beats[-1] - beats[0] >= 1.0  # every POLL_S while the import ran
