"""An `rl` launcher run for tests: its command line, its output collected line by line, and its processes."""

import contextlib
import random
import re
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import psutil

from tests.conftest import ROOT

STARTED_LOG = re.compile(r"rl: started (\S+) \(pid \d+\), log (\S+)")


KV_CACHE_GIB = "0.25"
"""The KV cache of every server the tests start, per worker: ~130k tokens of the tiny model, ample for any test's
batch. On CPU an explicit size also skips vLLM's warm-up pass and the default share's GiBs (a TP=2 server's start
took ~20 s longer under the suite's load without it)."""
SMALL_KV_CACHE = ("--inference.kv-cache-gib", KV_CACHE_GIB)


def free_port() -> int:
    """A free port below the kernel's ephemeral range. A port from that range (what binding port 0 gives)
    can be taken before the server binds it: by any outgoing connection, or by a health check connecting
    to it while nothing listens yet, which Linux may pair with itself (seen: vLLM failing with EADDRINUSE)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(10_000, low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 10000-{low - 1} after 200 tries")


def rl_command(model: Path, out: Path, max_steps: int, *extra: str) -> list[str]:
    configs = ROOT / "configs" / "reverse_text"
    return [
        sys.executable, "-m", "rl.launcher.main",
        "--trainer", "@", str(configs / "train.toml"),
        "--orchestrator", "@", str(configs / "orch.toml"),
        "--inference", "@", str(configs / "infer.toml"),
        "--model.name", str(model), "--output-dir", str(out), "--max-steps", str(max_steps),
        "--seq-len", "128", "--trainer-processes", "2", "--inference.port", str(free_port()),
        "--orchestrator.batch-size", "32",  # a quarter of the quickstart's batch: the tests check plumbing
        *SMALL_KV_CACHE, *extra,
    ]


def stop_process(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM (rl and rl's server then stop their children), SIGKILL if it still runs `grace_s` later."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


STARTED: weakref.WeakSet = weakref.WeakSet()
"""Every `Launched` run and test `Server` started and not yet collected: what a test left running when it failed or
timed out is stopped after it (tests/conftest.py), so that it does not slow every later test."""


class Launched:
    """An `rl` process whose output is collected line by line."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        STARTED.add(self)

    def stop(self) -> None:
        stop_process(self.proc)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = self.stacks()
            stop_process(self.proc)
            raise AssertionError("rl did not finish in time:\n" + "".join(self.lines[-60:]) + stacks)

    def stacks(self, settle_s: float = 2.0) -> str:
        """Where each of the run's processes waits: every rl process is asked for its threads' stacks (SIGUSR1,
        rl/process.py), which it writes to its log; the end of each log, and of the launcher's output."""
        from rl.process import STACKS_SIGNAL  # here: benchmarks/launch_phases.py runs older rl with this module

        rl_processes = [p for p in [psutil.Process(self.proc.pid), *self.descendants()] if is_rl_process(p)]
        for process in rl_processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(STACKS_SIGNAL)
        time.sleep(settle_s)
        logs = {m.group(1): Path(m.group(2)) for line in self.lines if (m := STARTED_LOG.match(line))}
        parts = [f"\n--- the stacks of {len(rl_processes)} rl processes; launcher:\n" + "".join(self.lines[-80:])]
        for name, log in logs.items():
            with contextlib.suppress(OSError):
                parts.append(f"\n--- {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-80:]))
        return "".join(parts)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def child_pid(self, name: str) -> int:
        """The pid of the child the launcher last reported as `started <name> (pid N)` (a restarted one's newest)."""
        for line in reversed(self.lines):
            if m := re.match(rf"rl: started {re.escape(name)} \(pid (\d+)\)", line):
                return int(m.group(1))
        raise AssertionError(f"rl never reported starting {name}:\n{self.output[-3000:]}")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)


def is_rl_process(process: psutil.Process) -> bool:
    """One of rl's own entry points (`python -m rl.<module>`), each of which answers SIGUSR1 with its stacks; to
    any other process (vLLM's forked ones, torchrun) the signal's default is death."""
    try:
        args = " ".join(process.cmdline()).split()  # a child forked from the launcher: its title, one string
    except psutil.Error:
        return False
    return any(a == "-m" and b.startswith("rl.") for a, b in zip(args, args[1:]))


def running(process: psutil.Process) -> bool:
    """Still running (a reused pid does not count, nor a zombie waiting for its parent)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def describe(process: psutil.Process) -> str:
    try:
        return f"{process.pid} {' '.join(process.cmdline())[:200]}"
    except psutil.Error:
        return f"{process.pid} (gone)"


def wait_gone(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    """Wait until every process has exited; describe those still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in processes if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [describe(p) for p in alive]
