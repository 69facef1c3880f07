"""Start the child processes, show one line per step, and stop everything when one of them fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rl.launcher.forked import ForkedChild, can_fork, fork_child, warm_up
from rl.process import die_with_parent
from rl.launcher.hosts import FINISHING, Host, HostBoard
from rl.launcher.report import PACE_WINDOW, duration, format_summary, progress, summarize, time_left_s
from rl.launcher.run_report import NoRun, write_report
from rl.protocol import RunPaths

POLL_S = 0.5


@dataclass
class ChildSpec:
    name: str
    cmd: list[str]
    gpus: list[str] | None  # the child's CUDA_VISIBLE_DEVICES entries ([]: none); None leaves the launcher's
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    secret_env: dict[str, str] = field(default_factory=dict)  # added too, and never printed (not in extra_env)
    # None: the launcher's whole environment; else none of its secrets (`is_secret`) but these, for a child that
    # runs environments' code (the orchestrator, env servers), which then holds only what it needs
    keep_secrets: tuple[str, ...] | None = None
    restarts: int = 0  # a server restarted this often when it exits during the run (then its exit fails the run)
    # Non-empty: the child is forked from the launcher (rl/launcher/forked.py) once these modules are imported
    # there; `cmd` must then be `python -m <module> ...` of the launcher's interpreter.
    preload: tuple[str, ...] = ()

    @property
    def extra_env(self) -> dict[str, str]:
        """What the child's environment adds to or changes in the launcher's."""
        gpus = {} if self.gpus is None else {"CUDA_VISIBLE_DEVICES": ",".join(self.gpus)}
        return self.env | gpus


SECRET_WORDS = {"SECRET", "SECRETS", "TOKEN", "TOKENS", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "AUTH",
                "KEY", "APIKEY"}


def is_secret(name: str) -> bool:
    """A variable whose name says it holds a credential: a word of it (between underscores) is one of SECRET_WORDS
    (RL_TRANSFER__SECRET, RL_INFERENCE__ADMIN_TOKEN, WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, SSH_AUTH_SOCK;
    not TOKENIZERS_PARALLELISM)."""
    return any(word in SECRET_WORDS for word in name.upper().split("_"))


def inherited_environment(environ, keep_secrets: tuple[str, ...] | None) -> dict[str, str]:
    """The launcher's environment as a child gets it: whole, or without the secrets it is not given."""
    if keep_secrets is None:
        return dict(environ)
    return {name: value for name, value in environ.items() if not is_secret(name) or name in keep_secrets}


def _die_with_parent() -> None:
    """Runs in the child before exec: its own session, and SIGTERM if the launcher dies, even by SIGKILL."""
    os.setsid()
    die_with_parent()


class Stop(Exception):
    """Raised by the signal handler to unwind the supervision loop."""

    def __init__(self, signum: int):
        self.signum = signum


class Supervisor:
    def __init__(self, paths: RunPaths, tail_lines: int, shutdown_timeout_s: float, max_steps: int | None = None):
        """`max_steps`: the run's, for the time left on each step line and in the summary (None: not said)."""
        self.paths = paths
        self.max_steps = max_steps
        self.tail_lines = tail_lines
        self.shutdown_timeout_s = shutdown_timeout_s
        self.procs: dict[str, subprocess.Popen | ForkedChild] = {}
        self.specs: dict[str, ChildSpec] = {}
        # Show only records written from now on (a resumed run keeps the earlier ones in the file).
        self.metrics_offset = paths.metrics.stat().st_size if paths.metrics.exists() else 0
        # Every descendant seen so far, per child: a process that leaves the group (torchrun starts its
        # ranks in sessions of their own) or outlives its parent is still found and stopped.
        self.descendants: dict[str, dict[int, psutil.Process]] = {}
        self.restarted: dict[str, int] = {}
        self.started, self.launched_at = time.monotonic(), time.time()  # set again when run() starts
        self.shown: list[dict] = []  # the trainer's last records shown: the pace of this launch's steps

    def start(self, spec: ChildSpec) -> None:
        env = inherited_environment(os.environ, spec.keep_secrets) | spec.extra_env | spec.secret_env
        env |= {"PYTHONUNBUFFERED": "1"}
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        if spec.preload and can_fork():  # run() imported the preload; a child imports what is missing itself
            self.procs[spec.name] = fork_child(spec.cmd, env, spec.log, _die_with_parent)
        else:
            with open(spec.log, "ab") as log:
                self.procs[spec.name] = subprocess.Popen(
                    spec.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    preexec_fn=_die_with_parent,
                )
        self.specs[spec.name] = spec
        how = " (forked from the launcher)" if isinstance(self.procs[spec.name], ForkedChild) else ""
        print(f"rl: started {spec.name} (pid {self.procs[spec.name].pid}), log {spec.log}{how}", flush=True)

    def run(self, specs: list[ChildSpec], board: HostBoard) -> int:
        """Supervise until the run finishes (0: this host's trainer and orchestrator, and every other host's,
        finished) or fails here or on another host (1)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.started, self.launched_at = time.monotonic(), time.time()
        board.join()
        try:
            for spec in [s for s in specs if not s.preload]:
                self.start(spec)
            forked = [s for s in specs if s.preload]
            self._warm_up(tuple(dict.fromkeys(m for s in forked for m in s.preload)), board)
            for spec in forked:
                self.start(spec)
            code = self._watch(board)
        except Stop as stop:
            print(f"rl: received {signal.Signals(stop.signum).name}, stopping every process", flush=True)
            board.beat("failed", f"its launcher received {signal.Signals(stop.signum).name}", force=True)
            code = 128 + stop.signum
        finally:
            self.stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if code != 0 and board.peers():
            self._name_first_host_down(board)
        elapsed = time.monotonic() - self.started
        if code == 0:
            summary = summarize(self.paths, elapsed, self.max_steps, self.launched_at)
            print(f"rl: finished: {format_summary(summary)}", flush=True)
            print(f"rl: plot {self.paths.reward_plot}, logs in {self.paths.logs}", flush=True)
        else:
            print(f"rl: failed after {elapsed:.0f}s (exit {code}); logs in {self.paths.logs}", flush=True)
        self._write_report()
        return code

    def _write_report(self) -> None:
        """report.html of the run as it ended, failed or not (`rl report`); a run with no step recorded has none."""
        try:
            print(f"rl: report {write_report(self.paths)}", flush=True)
        except NoRun as e:
            print(f"rl: no report: {e}", flush=True)
        except Exception as e:  # the run's outcome stands; a report that cannot be drawn is said, not raised
            print(f"rl: no report: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _warm_up(self, modules: tuple[str, ...], board: HostBoard) -> None:
        """Import what the forked children run (seconds of a core) in a thread, the launcher beating meanwhile (other
        hosts stop a run whose host goes silent); started after the exec'd children, so that no thread runs while
        they fork, and joined before any fork of the launcher."""
        warming = threading.Thread(target=warm_up, args=(modules,), name="warm-up", daemon=True)
        warming.start()
        while warming.is_alive():
            board.beat()
            warming.join(POLL_S)

    def _restart(self, name: str, code: int) -> None:
        for left in self.descendants.pop(name, {}).values():  # what the dead child started must not outlive it:
            _signal_process(left, signal.SIGKILL)  # trainer ranks would go on reading the calls beside new ones
        self.restarted[name] = self.restarted.get(name, 0) + 1
        print(f"rl: {name} {_why_ended(code)}; restarting it ({self.restarted[name]} of at most "
              f"{self.specs[name].restarts} restarts)", file=sys.stderr, flush=True)
        self.start(self.specs[name])

    def _on_signal(self, signum, frame) -> None:
        raise Stop(signum)

    def _watch(self, board: HostBoard) -> int:
        done: set[str] = set()
        finishing = {name for name in self.procs if name in FINISHING}  # inference serves until the run ends
        while True:
            self._remember_descendants()
            self._show_new_metrics()
            polled = {name: proc.poll() for name, proc in self.procs.items() if name not in done}
            ended = {name: code for name, code in polled.items() if code is not None}
            for name in [name for name in ended if self.restarted.get(name, 0) < self.specs[name].restarts]:
                self._restart(name, ended.pop(name))
            failed = {name: code for name, code in ended.items()
                      if code != 0 or name.startswith("inference") or self.specs[name].restarts}
            if failed:
                cause = self._report_failures(failed)
                board.beat("failed", f"{cause} {_why_ended(failed[cause])}", force=True)
                return 1
            for name in ended:
                done.add(name)
                print(f"rl: {name} finished", flush=True)
            if finishing and finishing <= done and board.me.state == "running":
                board.beat("finished", force=True)
            if board.run_finished():
                self._show_new_metrics()
                board.beat("finished", force=True)
                return 0
            if (peer := board.trouble()) is not None:
                print(f"rl: {peer.describe()} {_host_down(peer)}; stopping this host's processes", file=sys.stderr)
                board.beat("failed", f"stopped: {peer.describe()} {_host_down(peer)}", force=True)
                return 1
            board.beat()
            time.sleep(POLL_S)

    def _name_first_host_down(self, board: HostBoard) -> None:
        """A run over several hosts: wait for the others to settle, then name the host that went down first
        (a host killed outright leaves no message, but its processes' peers here fail soon after)."""
        first = board.settle()
        if first.name != board.me.name:
            print(f"rl: the first host to go down was {first.describe()}: {_host_down(first)}", file=sys.stderr)

    def exit_code(self, name: str) -> int | None:
        """The child's exit code, None while it runs."""
        return self.procs[name].poll()

    def log(self, name: str) -> Path:
        return self.specs[name].log

    def log_tail(self, name: str, lines: int | None = None) -> list[str]:
        """The last `lines` (default: tail_lines) lines of the child's log."""
        log = self.log(name)
        return log.read_text(errors="replace").splitlines()[-(lines or self.tail_lines) :] if log.exists() else []

    def _report_failures(self, failed: dict[str, int]) -> str:
        """Name the cause with the end of its log, then the others that ended with it; return the cause.

        Children ended since the last poll are seen together: one killed by a signal is the cause of the
        others' exits (an orchestrator whose inference server was killed exits within a second)."""
        cause = next((name for name, code in failed.items() if code < 0), next(iter(failed)))
        print(f"rl: {cause} {_why_ended(failed[cause])}; last lines of {self.log(cause)}:", file=sys.stderr)
        for line in self.log_tail(cause):
            print(f"  | {line}", file=sys.stderr)
        for name, code in failed.items():
            if name != cause:
                print(f"rl: {name} {_why_ended(code)} too; log {self.log(name)}", file=sys.stderr)
        sys.stderr.flush()
        return cause

    def _show_new_metrics(self) -> None:
        """Print one concise line per new metrics.jsonl record."""
        if not self.paths.metrics.exists():
            return
        with open(self.paths.metrics) as f:
            f.seek(self.metrics_offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.metrics_offset += len(complete.encode())
        for line in complete.splitlines():
            record = json.loads(line)
            keys = ("reward", "loss", "policy_step", "staleness_max", "step_time_s")
            call = record.get("call")  # rl serve-api's service: a line per request, its kind and times
            if call:
                keys = (f"call_s/{call}", f"trainer_s/{call}")
            shown = " ".join(f"{k.split('/')[0]}={record[k]:.4g}" for k in keys
                             if isinstance(record.get(k), (int, float)))
            shown = f"{call} {shown}" if call else shown
            print(f"rl: step {record['step']} {record['process']:<12} {shown} [{self._progress(record)}]", flush=True)

    def _progress(self, record: dict) -> str:
        """Elapsed since this launch, and the time left to max_steps at the pace of this launch's trainer steps."""
        if record.get("process") == "trainer":
            self.shown = [*self.shown[-PACE_WINDOW:], record]  # all the pace needs
        elapsed = time.monotonic() - self.started
        if self.max_steps is None:
            return f"{duration(elapsed)} elapsed"
        return progress(elapsed, time_left_s(self.shown, self.max_steps))

    def _remember_descendants(self) -> None:
        for name, proc in self.procs.items():
            known = self.descendants.setdefault(name, {})
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    known.setdefault(child.pid, child)
            except psutil.Error:
                pass  # the child itself is gone; what it left behind is still in `known`

    def _alive_descendants(self) -> list[psutil.Process]:
        # psutil.Process.is_running() also checks the creation time, so a reused pid is not mistaken.
        return [p for known in self.descendants.values() for p in known.values() if p.is_running()]

    def stop_all(self) -> None:
        """SIGTERM every child's process group and every descendant ever seen, SIGKILL what is left after
        the grace period."""
        self._remember_descendants()
        for p in self.procs.values():
            _signal_group(p.pid, signal.SIGTERM)
        for p in self._alive_descendants():
            _signal_process(p, signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        psutil.wait_procs(self._alive_descendants(), timeout=max(deadline - time.monotonic(), 0.1))
        for p in self.procs.values():
            _signal_group(p.pid, signal.SIGKILL)
        for p in self._alive_descendants():
            _signal_process(p, signal.SIGKILL)
        for p in self.procs.values():
            p.wait()


def _host_down(host: Host) -> str:
    if host.state == "failed":
        return f"failed: {host.reason}"
    return f"went silent {time.time() - host.time:.0f}s ago (no heartbeat in hosts/{host.name}.json)"


def _why_ended(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == 0:  # only an inference server's exit is a failure with code 0
        return "exited while the run still needed it"
    return f"exited with code {code}"


def _signal_process(process: psutil.Process, sig: int) -> None:
    try:
        process.send_signal(sig)
    except psutil.Error:
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
