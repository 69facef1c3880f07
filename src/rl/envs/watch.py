"""An env server's watch over its workers: one that died, or one whose event loop has not run for
`worker_stall_s` (stopped, or blocked by an environment's code), takes the server down with it, named in the log, so
that `rl` restarts it and the orchestrator runs the lost episodes again (rl/envs/client.py). verifiers' broker answers
health itself, so without this a hung worker held its episodes, and the run, silently and for good.

Each worker's event loop touches a file of its own (`<beats>/<pid>`) every `BEAT_S` (`beating`, entered by every
worker as it starts to serve); the watch, a thread of the broker, reads their times. The directory is made by the
broker before it forks its workers and named to them in `BEATS_VAR`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

BEATS_VAR = "RL_ENV_SERVER_BEATS"
BEAT_S = 1.0
FIRST_BEAT_S = 300.0  # a worker loads its environment before its loop first beats: as long as a server has to answer
WATCH_S = 0.5
WORKER_DIED = 3  # the env server's exit code when a worker died or hung
logger = logging.getLogger("env-server")


@contextlib.asynccontextmanager
async def beating() -> AsyncIterator[None]:
    """In a worker, while it serves: its event loop touches its beat file every BEAT_S (none outside an env server)."""
    directory = os.environ.get(BEATS_VAR)
    if not directory:
        yield
        return
    beat = Path(directory) / str(os.getpid())

    async def touch() -> None:
        while True:
            beat.touch()
            await asyncio.sleep(BEAT_S)

    task = asyncio.create_task(touch())
    try:
        yield
    finally:
        task.cancel()


def stalled_for(beats: Path, pid: int, started: float, now: float) -> tuple[float, bool]:
    """Seconds since the worker's loop last beat (since `started`, the watch's start, where it has not yet), and
    whether it has beaten at all."""
    try:
        last = (beats / str(pid)).stat().st_mtime
    except FileNotFoundError:
        return now - started, False  # still loading its environment
    return now - max(last, started), True


def watch_workers(pool, beats: Path, stall_s: float) -> None:
    """Exit the server (WORKER_DIED) when a worker dies or its loop stalls past `stall_s`; keep the count of live
    workers in the pool's health reply, which the orchestrator logs."""
    from rl.patches import answer_health_with, pool_workers

    live, started = None, time.time()
    while True:
        time.sleep(WATCH_S)
        workers, now = pool_workers(pool), time.time()
        for index, process in workers:
            if process.exitcode is not None:
                logger.error(f"worker {index} (pid {process.pid}) died (exit code {process.exitcode}); "
                             "this env server stops with it, to be restarted and its episodes run again")
                os._exit(WORKER_DIED)
            stalled, beaten = stalled_for(beats, process.pid, started, now)
            if stalled > (stall_s if beaten else max(stall_s, FIRST_BEAT_S)):
                what = "its event loop has not run" if beaten else "it has not started serving"
                logger.error(f"worker {index} (pid {process.pid}) hung: {what} for {stalled:.0f} s "
                             f"(worker_stall_s = {stall_s:g}); this env server stops with it, to be restarted and its "
                             "episodes run again")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)  # a stopped process takes no SIGTERM until it runs again
                os._exit(WORKER_DIED)
        if len(workers) != live:
            live = len(workers)
            answer_health_with({"workers": live})
