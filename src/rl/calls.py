"""Calls from `rl serve-api`'s service to the trainer, through the run directory (as batches travel in `rl`):

    <output_dir>/calls/call_<n>/          call.json (the operation and its settings), tensors.safetensors, STABLE
    <output_dir>/calls/call_<n>/result/   result.json (rank 0's), rank_<r>.safetensors (each rank's outputs), STABLE

Calls are numbered 0, 1, 2 ... in the order the trainer runs them; every rank reads every call. The service writes a
call and waits for its result; the trainer waits for the next call. A result's `error` names why the call failed
(the trainer carries on with the next one)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from rl.atomic import atomic_write_text, temp_path
from rl.protocol import RunPaths, is_stable, mark_stable, publish_dir


def call_dir(paths: RunPaths, n: int) -> Path:
    return paths.root / "calls" / f"call_{n:06d}"


def calls_so_far(paths: RunPaths) -> int:
    """How many calls were written: the next call's number."""
    numbers = [int(p.name.removeprefix("call_")) for p in (paths.root / "calls").glob("call_*") if is_stable(p)]
    return max(numbers, default=-1) + 1


def write_call(paths: RunPaths, n: int, call: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
    final = call_dir(paths, n)
    tmp = temp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "call.json").write_text(json.dumps(call))
    save_file({k: v.contiguous() for k, v in (tensors or {}).items()}, str(tmp / "tensors.safetensors"))
    publish_dir(tmp, final)


def read_call(paths: RunPaths, n: int) -> tuple[dict, dict[str, torch.Tensor]]:
    where = call_dir(paths, n)
    return json.loads((where / "call.json").read_text()), load_file(str(where / "tensors.safetensors"))


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str, check: Callable[[], None] | None = None,
               poll_s: float = 0.02) -> None:
    """Poll `ready` until it holds; TimeoutError naming `what` after `timeout_s`; `check` may raise to stop early.
    Polls every millisecond at first, slowing to `poll_s` over the first second: a call answered in tens of
    milliseconds is seen at once, an idle wait costs a stat every `poll_s`."""
    start = time.monotonic()
    while not ready():
        if check is not None:
            check()
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what} and it never came")
        time.sleep(min(poll_s, 0.001 + waited / 50))


def write_rank_result(paths: RunPaths, n: int, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    result = call_dir(paths, n) / "result"
    result.mkdir(exist_ok=True)
    target = result / f"rank_{rank}.safetensors"
    tmp = temp_path(target)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(target)


def finish_result(paths: RunPaths, n: int, result: dict) -> None:
    """Rank 0, after every rank wrote its part: the result is complete."""
    where = call_dir(paths, n) / "result"
    where.mkdir(exist_ok=True)
    atomic_write_text(where / "result.json", json.dumps(result))
    mark_stable(where)


def result_ready(paths: RunPaths, n: int) -> bool:
    return is_stable(call_dir(paths, n) / "result")


def read_result(paths: RunPaths, n: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """Rank 0's result and every rank's tensors, merged (their names are distinct)."""
    where = call_dir(paths, n) / "result"
    tensors: dict[str, torch.Tensor] = {}
    for part in sorted(where.glob("rank_*.safetensors")):
        tensors |= load_file(str(part))
    return json.loads((where / "result.json").read_text()), tensors
