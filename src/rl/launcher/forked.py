"""Children forked from the launcher: a `python -m <module> ...` child started as a fork of the launcher, which has
imported that module (and verifiers, transformers and the environments' packages with it) once, instead of a fresh
interpreter importing them all again.

The orchestrator is forked so, where the launcher holds no secret it may not have (rl/launcher/main.py; env servers
never are): a new interpreter spent seconds of a core importing what the launcher's environment check had just
imported (benchmarks/RESULTS.md). The launcher holds no accelerator and runs
no thread of its own when it forks (a fork is refused otherwise, and the child exec'd as before); a forked child
takes the command line it would have run (its process title, its `sys.argv`), its own environment, log, session and
signal handlers, and runs the module's `main()` as `python -m` would."""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.util
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE)
"""Signals the launcher handles, which the child gets back as a fresh interpreter has them."""


def module_of(cmd: list[str]) -> str | None:
    """`module` of `[python, "-m", module, ...]` run by this interpreter; None for any other command."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m":
        return cmd[2]
    return None


def can_fork() -> bool:
    """Only a launcher with no other thread forks (a thread holding a lock at the fork leaves it held forever in
    the child)."""
    return threading.active_count() == 1


def warm_up(modules: tuple[str, ...]) -> None:
    """Import what the forked children will run, once, in the launcher."""
    for name in modules:
        importlib.import_module(name)


class ForkedChild:
    """A forked child as the supervisor sees a `subprocess.Popen`: pid, poll, wait, returncode (negative: the
    signal that killed it)."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode


def fork_child(cmd: list[str], env: dict[str, str], log: Path, set_up: Callable[[], None]) -> ForkedChild:
    """Fork a child that runs `cmd` (`python -m module args...`) with `env` as its whole environment and its
    output appended to `log`; `set_up` runs first in the child (the supervisor's own session and parent-death
    signal)."""
    module = module_of(cmd)
    if module is None:
        raise ValueError(f"not a `python -m` command of this interpreter: {cmd}")
    sys.stdout.flush()
    sys.stderr.flush()
    launcher_mask = signal.pthread_sigmask(signal.SIG_BLOCK, RESET_SIGNALS)  # none lands before the child resets them
    gc.freeze()  # the child's collections skip the launcher's objects (`rl.process.before_fork`)
    pid = os.fork()
    if pid == 0:
        os._exit(_run_child(module, cmd, env, log, set_up, launcher_mask))
    signal.pthread_sigmask(signal.SIG_SETMASK, launcher_mask)
    return ForkedChild(pid, cmd)


def _run_child(module: str, cmd: list[str], env: dict[str, str], log: Path, set_up, launcher_mask) -> int:
    """In the child: never returns into the launcher's code (its caller exits with the code)."""
    code = 1
    try:
        for signum in RESET_SIGNALS:
            signal.signal(signum, signal.SIG_DFL if signum != signal.SIGPIPE else signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, launcher_mask)
        set_up()
        _redirect_output(log)
        _set_title(cmd)  # before the environment changes: setproctitle finds the title's room there
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [importlib.util.find_spec(module).origin, *cmd[3:]]  # as `python -m` sets it
        code = _run_module(module)
        atexit._run_exitfuncs()  # the child's own, as an interpreter's exit runs them
    except BaseException:  # noqa: BLE001 - whatever happens in the child ends it, never the launcher's stack
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - its log may be gone; the exit code still tells
                pass
    return code


def _run_module(module: str) -> int:
    """`python -m module`'s exit code, the module's `main()` run (every entry point of rl's has one; its body
    was imported in the launcher): 0 on return, SystemExit's code (a message: printed, 1), a traceback: 1."""
    try:
        importlib.import_module(module).main()
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        return 1


def _redirect_output(log: Path) -> None:
    """stdin from /dev/null, stdout and stderr appended to `log`, unbuffered as PYTHONUNBUFFERED makes them."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own, for its whole life
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                  errors="backslashreplace")
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # noqa: PLW0127 - what faulthandler and logging fall back to


def _set_title(cmd: list[str]) -> None:
    """`ps` and psutil show the command the child runs, not the launcher's."""
    try:
        import setproctitle
    except ImportError:  # vLLM depends on it; without it the child keeps the launcher's title
        return
    setproctitle.setproctitle(" ".join(cmd))
