"""Where an `rl` launch's time goes: a short run as the integration tests launch it, each phase's end in seconds.

Runs `rl` with the tests' command line (tests/integration/launched.py's `rl_command`: reverse-text, batch 32, 2
trainer ranks, `--steps` steps, a TP=2 server by default as test_run.py) and prints, in seconds from the launch:
when each process logged its first line (its imports done), the server listening, the orchestrator's first batch,
the trainer's first and last step, and the launcher's exit. Log stamps are whole seconds; the launcher's lines and
its exit are timed as they arrive. Then the CPU seconds each kind of process used (its process tree sampled every
0.3 s: a process's last sample counts), and their sum: on a host of few cores a launch's start is CPU-bound.

    uv run --no-sync python benchmarks/launch_phases.py --model /tmp/tiny
    uv run --no-sync python benchmarks/launch_phases.py --model /tmp/tiny --tp 1 --steps 3

Run it from another checkout (`git worktree add /tmp/old <commit>`, then `PYTHONPATH=/tmp/old/src` and this file's
copy from here) to compare two commits on the same machine.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
STAMP = re.compile(r"(?:^|\s)(\d\d):(\d\d):(\d\d)(?:[,.]\d+)?\s")
PHASES = [  # (phase, log, the first line that ends it; None: the log's first stamped line)
    ("inference imported", "inference.log", None),
    ("inference serving", "inference.log", re.compile(r"Starting vLLM server on")),
    ("trainer imported", "trainer.log", None),
    ("orchestrator imported", "orchestrator.log", None),
    ("orchestrator step 0", "orchestrator.log", re.compile(r"orchestrator INFO step 0 \|")),
    ("trainer step 0", "trainer.log", re.compile(r"trainer INFO step 0 \|")),
]


ROLES = [  # (kind of process, what its command line holds); the first that matches names it
    ("launcher", "rl.launcher.main"), ("inference", "rl.inference.main"), ("inference", "VLLM::"),
    ("orchestrator", "rl.orchestrator.main"), ("env servers", "rl.envs.server"), ("trainer ranks", "rl.trainer.main"),
    ("torchrun", "torch.distributed.run"),
]


def role(cmdline: str) -> str:
    return next((name for name, part in ROLES if part in cmdline), "other")


def sample_cpu(root: psutil.Process, seen: dict[int, tuple[str, float]], stop: threading.Event) -> None:
    """Every process under `root` (and root): its role and CPU seconds at the last sample, by pid."""
    while not stop.wait(0.3):
        try:
            processes = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for process in processes:
            try:
                cpu = process.cpu_times()
                kind = role(" ".join(process.cmdline()))  # a zombie's command line is empty: keep what it was
                if kind == "other" and process.pid in seen:
                    kind = seen[process.pid][0]
                seen[process.pid] = (kind, cpu.user + cpu.system)
            except psutil.Error:
                pass


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the tiny model's directory")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tp", type=int, default=2, help="the server's tensor-parallel size")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep it (default: a temporary one)")
    return parser.parse_args()


def first_stamp(log: Path, pattern: re.Pattern | None, launched: datetime.datetime) -> float | None:
    """Seconds from `launched` to the first stamped line of `log` matching `pattern` (any, if None)."""
    if not log.is_file():
        return None
    for line in log.read_text(errors="replace").splitlines():
        stamp = STAMP.search(line)
        if stamp and (pattern is None or pattern.search(line)):
            at = launched.replace(hour=int(stamp[1]), minute=int(stamp[2]), second=int(stamp[3]), microsecond=0)
            return (at - launched).total_seconds()
    return None


def launch_command(args: argparse.Namespace, out: Path) -> list[str]:
    """The integration tests' `rl` command line, at this benchmark's steps and tensor-parallel size."""
    sys.path.insert(0, str(ROOT))
    from tests.integration.launched import rl_command

    return rl_command(Path(args.model), out, args.steps, "--inference.tensor-parallel-size", str(args.tp))


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / "run"
        cmd = launch_command(args, out)
        launched, start = datetime.datetime.now(), time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        arrivals: list[tuple[float, str]] = []
        reader = threading.Thread(
            target=lambda: arrivals.extend((time.monotonic() - start, line) for line in proc.stdout))
        reader.start()
        seen: dict[int, tuple[str, float]] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=sample_cpu, args=(psutil.Process(proc.pid), seen, stop))
        sampler.start()
        code = proc.wait(timeout=1800)
        stop.set()
        sampler.join()
        reader.join(timeout=10)
        ended = time.monotonic() - start
        if code != 0:
            sys.exit(f"rl exited {code}:\n" + "".join(line for _, line in arrivals[-40:]))
        rows = [(phase, first_stamp(out / "logs" / log, pattern, launched)) for phase, log, pattern in PHASES]
        steps = [at for at, line in arrivals if re.match(r"rl: step \d+ trainer", line)]
        rows += [("launcher: first step line", steps[0]), ("launcher: last step line", steps[-1]),
                 ("rl exited", ended)]
    for phase, at in rows:
        print(f"{phase:28} {'-' if at is None else f'{at:6.1f}'}")
    if len(steps) > 1:
        print(f"per step after the first: {(steps[-1] - steps[0]) / (len(steps) - 1):.1f} s")
    cpu = Counter()
    for name, seconds in seen.values():
        cpu[name] += seconds
    print("CPU seconds: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu.most_common())
          + f"; all {sum(cpu.values()):.1f}")


if __name__ == "__main__":
    main()
