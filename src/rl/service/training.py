"""The service's side of the calls to the trainer (rl/calls.py): numbered, one at a time, each awaited under a
deadline; and each model's requests run in the order of their seq_id, as the Tinker SDK numbers them."""

from __future__ import annotations

import asyncio
import contextvars

import torch

from rl.calls import read_result, result_ready, wait_until, write_call
from rl.protocol import RunPaths


TIMES: contextvars.ContextVar[dict] = contextvars.ContextVar("times")
"""The timings of the request this task serves: `trainer_s`, the trainer's own time on its calls."""


class CallFailed(ValueError):
    """The trainer refused or failed a call; `category` as Tinker's futures report it (user, server)."""

    def __init__(self, message: str, category: str = "server", model_lost: bool = False):
        super().__init__(message)
        self.category, self.model_lost = category, model_lost


class TrainerCalls:
    def __init__(self, paths: RunPaths, timeout_s: float):
        self.paths, self.timeout_s = paths, timeout_s
        self.next = 0
        self.lock = asyncio.Lock()

    async def call(self, op: str, tensors: dict[str, torch.Tensor] | None = None, **settings) -> tuple[dict, dict]:
        """The trainer's result and its tensors; CallFailed with its error."""
        async with self.lock:
            n, self.next = self.next, self.next + 1
            await asyncio.to_thread(write_call, self.paths, n, {"op": op, **settings}, tensors)
            what = f"the trainer's result of call {n} ({op})"
            try:
                await asyncio.to_thread(wait_until, lambda: result_ready(self.paths, n), self.timeout_s, what)
            except TimeoutError as e:
                raise CallFailed(f"{e}: is the trainer alive? (logs/trainer.log)") from None
            result, outputs = await asyncio.to_thread(read_result, self.paths, n)
        if (times := TIMES.get(None)) is not None:
            times["trainer_s"] = times.get("trainer_s", 0.0) + result.get("time_s", 0.0)
            times["step"] = result.get("step", times.get("step"))
        if "error" in result:
            raise CallFailed(result["error"], result.get("category", "server"), result.get("model_lost", False))
        return result, outputs

    async def stop(self) -> None:
        async with self.lock:
            await asyncio.to_thread(write_call, self.paths, self.next, {"op": "stop"})


class InOrder:
    """Runs a model's requests in seq_id order (the SDK sends a call's chunks at once, the first one last): a request
    waits for the ones before it, each at most `timeout_s`."""

    def __init__(self, timeout_s: float, first: int = 1):
        self.next, self.timeout_s = first, timeout_s
        self.turn = asyncio.Condition()

    async def run(self, seq_id: int, work):
        async with self.turn:
            try:
                await asyncio.wait_for(self.turn.wait_for(lambda: self.next >= seq_id), self.timeout_s)
            except TimeoutError:
                raise CallFailed(f"request {seq_id} waited {self.timeout_s:.0f}s for request {self.next} of its "
                                 "model, which never came", "user") from None
            if seq_id < self.next:
                raise CallFailed(f"request seq_id {seq_id} came after request {self.next - 1}: seq_ids must "
                                 "rise", "user")
        try:
            return await work()
        finally:
            async with self.turn:
                self.next = seq_id + 1
                self.turn.notify_all()
