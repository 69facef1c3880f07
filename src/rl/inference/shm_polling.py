"""A vLLM general plugin: vLLM's shared-memory queues sleep between polls instead of spinning.

vLLM's engine core and worker processes pass each step through shared-memory queues: a reader spins on
`sched_yield` for 1 s after each message it reads, a writer whenever the queue is full. On a CPU host the engine
core spun at 0.6-0.8 of a core while the worker computed, CPU taken from the model itself, the
orchestrator and the trainer (benchmarks/orchestrator_throughput.py). With `POLL_ENV` set, each poll
sleeps that many seconds instead; idle waits (1 s without a message) block on a socket as before.

vLLM loads `vllm.general_plugins` entry points in each of its processes, including the engine core and
worker it spawns (see pyproject.toml); the environment variable, inherited by those processes, is the
switch, so other vLLM runs in this environment are untouched. `serve()` sets it on CPU hosts.
"""

from __future__ import annotations

import functools
import logging
import os
import time

logger = logging.getLogger(__name__)

POLL_ENV = "RL_VLLM_SHM_POLL_S"
CPU_POLL_S = 0.0005
"""Latency added per wait at most; a decode step of the tiny model takes ~15 ms. 0.1, 0.2, 0.5 and 1 ms
measured alike within the machine's noise. Ending vLLM's busy period at once instead (every wait on the
socket) stalled generation: 190-1,100 tokens/s with every process idle, against ~3,800."""


def poll_interval() -> float | None:
    """Seconds per poll that `POLL_ENV` asks for; None where it is unset or empty (vLLM keeps spinning)."""
    value = os.environ.get(POLL_ENV, "")
    if not value:
        return None
    try:
        poll_s = float(value)
    except ValueError:
        poll_s = -1.0
    if not 0 <= poll_s <= 1:
        raise ValueError(f"{POLL_ENV}={value!r}: give seconds from 0 to 1, or leave it empty to keep vLLM's spinning")
    return poll_s


def register() -> None:
    """Called by vLLM in each of its processes (it may be called more than once in one)."""
    poll_s = poll_interval()
    if poll_s is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not hasattr(shm_broadcast, "sched_yield"):
        logger.warning("vllm's shm_broadcast has no sched_yield: %s has no effect", POLL_ENV)
        return
    shm_broadcast.sched_yield = functools.partial(time.sleep, poll_s)
