"""Test hooks: points where a test drives the server deterministically (a race between a check and a read, a reload
that fails on purpose), instead of by timing. Off unless the server's environment names a hook directory
(`RL_TEST_HOOK_DIR`, which only tests set); a hook is armed by a file of that directory, read by this process
alone (so every tensor-parallel worker sees the same choice, passed to it as an argument).

- `fail_reload_at` holding an int k: the next reload fails at its k-th tensor (the file is consumed);
- `corrupt_reload` holding `<tensor name> <row> <tensor-parallel rank>`: in the next reload, that worker adds 1 to
  that row of the tensor after its fingerprint was taken, as a fault in the load would (consumed);
- `after_check` present: the next update, once it has checked the step's marker and manifest, creates
  `after_check.held` and waits (at most HOLD_TIMEOUT_S) until the test removes `after_check`;
- `after_stage` present: the same, once the update has read the step's files (before anything is loaded);
- `during_receive` present: the same, in a step arriving over the wire, once its header arrived (the trainer is then
  mid-send);
- `corrupt_receive` holding a tensor name: the next step over the wire gets that tensor's first byte flipped on
  arrival, as a fault on the way would (consumed, by the process that receives it: `received_digest`);
- `receive_in_worker` present: the next step over gloo is received by the server's first worker, as one over NCCL is
  (consumed): the CPU's proof of that path.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import torch

from rl.weights.digest import TensorDigest

HOOK_DIR_ENV = "RL_TEST_HOOK_DIR"
HOLD_TIMEOUT_S = 60.0


def _hook(name: str) -> Path | None:
    root = os.environ.get(HOOK_DIR_ENV)
    return Path(root) / name if root else None


def take(name: str) -> str | None:
    """The armed hook's text, disarming it; None when it is not armed. Of the processes (servers) that race for one
    hook, exactly one takes it: the hook is renamed away first, which only one rename can do."""
    path = _hook(name)
    if path is None:
        return None
    taken = path.with_name(f"{name}.taken-{os.getpid()}-{threading.get_ident()}")
    try:
        path.rename(taken)
    except FileNotFoundError:
        return None
    value = taken.read_text().strip()
    taken.unlink()
    return value


def reload_faults() -> dict:
    """The faults armed for the next reload, as the workers take them (`rl_load_weights(faults=...)`)."""
    faults = {}
    if (fail_at := take("fail_reload_at")) is not None:
        faults["fail_at"] = int(fail_at)
    if (corrupt := take("corrupt_reload")) is not None:
        name, row, rank = corrupt.split()
        faults["corrupt"] = [name, int(row), int(rank)]
    return faults


def received_digest() -> TensorDigest:
    """What a step over the wire is hashed with as each tensor lands: with `corrupt_receive` armed, one that first
    alters the named tensor (`AlteredOnArrival`)."""
    name = take("corrupt_receive")
    return TensorDigest() if name is None else AlteredOnArrival(name)


class AlteredOnArrival(TensorDigest):
    """A receiver's digest that flips the first byte of tensor `name` where it landed, then hashes it, as a fault on
    the way would."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def update_bytes(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], data: torch.Tensor) -> None:
        if name == self.name and len(data):
            data[0] ^= 1
        super().update_bytes(name, dtype, shape, data)


async def hold(name: str) -> None:
    """Wait while the hook `name` is armed (see the module docstring); a test that never releases it is a
    TimeoutError after HOLD_TIMEOUT_S."""
    while _holding(name):
        await asyncio.sleep(0.02)


def hold_in_thread(name: str) -> None:
    """`hold` for code running in a worker thread."""
    while _holding(name):
        time.sleep(0.02)


_HOLD_DEADLINES: dict[str, float] = {}  # hook name -> when the hold in progress gives up


def _holding(name: str, deadlines: dict[str, float] = _HOLD_DEADLINES) -> bool:
    """Whether the hook is (still) armed; marks it held the first time, and raises once it was held too long."""
    path = _hook(name)
    if path is None or not path.exists():
        deadlines.pop(name, None)
        return False
    if name not in deadlines:
        path.with_name(name + ".held").touch()
        deadlines[name] = time.monotonic() + HOLD_TIMEOUT_S
    if time.monotonic() > deadlines[name]:
        deadlines.pop(name)
        raise TimeoutError(f"test hook {path} was not released within {HOLD_TIMEOUT_S} s")
    return True
