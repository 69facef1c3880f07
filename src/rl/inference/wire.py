"""A server's end of the collective transports (rl/weights/): one receiver per registered engine, which takes a
step over the wire into a sealed memfd checked against the trainer's sealed checksum, the same for all from there
on. `PolicyWeights` holds the one its config names and loads what it returns.

gloo's receiver takes a step in this process (the server's API process), NCCL's in the server's first worker; the
sparse engines' give the receive the full weights served, which a step sent as its changes applies to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from abc import abstractmethod
from dataclasses import asdict

from rl.inference import hooks
from rl.inference.layout import ServedLayout
from rl.inference.staging import Received, StagedStep, receive_weights, release, take_over
from rl.manifest import CorruptFileError
from rl.weights import Receiver, StepRefused, TransferError
from rl.weights.group import GroupKeeper
from rl.weights.offers import GroupSpec

logger = logging.getLogger(__name__)

RECEIVE_POLL_S = 0.02  # how often the server asks its first worker whether a step it receives has arrived
WORKER_ANSWER_S = 30  # beyond a step's deadline, how long its first worker may take to say how its receive went


class ServerReceiver(Receiver):
    """What every receiver of a server shares (the arguments: `Receiver.create`): the layout a step must have, asked
    of the first worker once, and the base a step's changes apply to (none: every step comes whole)."""

    def __init__(self, engine, key: bytes, adapters: bool, hold_generation=None, served=None):
        self.engine, self.key, self.adapters = engine, key, adapters
        self.hold_generation = hold_generation or _nothing_held
        self.served = served or _nothing_served
        self.layout: ServedLayout | None = None  # what a step must be, asked of the first worker once

    @classmethod
    def create(cls, engine, key: bytes, adapters: bool, hold_generation, served) -> ServerReceiver:
        return cls(engine, key, adapters, hold_generation, served)

    async def receive(self, spec: GroupSpec, step: int) -> Received:
        base = self._base()
        try:
            return await self._receive(spec, step, base)
        finally:
            if base is not None:
                await release(base)

    def _base(self) -> StagedStep | None:
        """What a step may come as changes against: nothing, every step comes whole (`ChangesReceived`)."""
        return None

    @abstractmethod
    async def _receive(self, spec: GroupSpec, step: int, base: StagedStep | None) -> Received:
        """Step `step`, received and checked; `base`: the full weights served, which a sparse step may change."""

    async def served_layout(self) -> ServedLayout:
        if self.layout is None:
            served = await self.first_worker("rl_served_layout")
            self.layout = ServedLayout.from_rpc(served | {"adapters": self.adapters})
        return self.layout

    async def first_worker(self, method: str, *args) -> dict:
        """`method`'s answer from the first tensor-parallel worker (the others answer None)."""
        return next(r for r in await self.engine.collective_rpc(method, args=args) if r is not None)


class FirstWorkerReceiver(ServerReceiver):
    """The first worker (the process of a server that holds a GPU and an NCCL library, `rl_receive_weights`)
    receives the step over `backend` while generation goes on; its sealed memfd is then taken over by this process.
    While the worker's group forms (the first step, or after a failure) this process holds generation for it."""

    backend = "nccl"

    async def _receive(self, spec: GroupSpec, step: int, base: StagedStep | None) -> Received:
        layout = await self.served_layout()
        await self.first_worker("rl_receive_weights", asdict(spec), step, self.backend, self.key, layout.rpc(),
                                base and base.rpc())
        limit_s = spec.timeout_s + WORKER_ANSWER_S  # the worker's receive keeps the step's deadline itself
        deadline = time.monotonic() + limit_s
        held = None  # generation, while the worker's group forms
        try:
            while (report := await self.first_worker("rl_received")).get("pending"):
                if time.monotonic() > deadline:
                    raise TransferError(f"the first worker was still receiving step {step} after {limit_s:.0f} s")
                if report["hold"] and held is None:
                    held = await self._hold_for_forming()
                elif held is not None and not report["hold"]:
                    await self._release_after_forming(held, step)
                    held = None
                await asyncio.sleep(RECEIVE_POLL_S)
            if report.get("kind") == "refused":
                raise StepRefused(report["error"], report["status"])
            if "error" in report:
                raise (CorruptFileError if report["kind"] == "corrupt" else TransferError)(report["error"])
            logger.info("step %d received over %s by the first worker (pid %d): %d bytes", step, self.backend,
                        report["pid"], report["size"])
            return await asyncio.to_thread(take_over, report)
        finally:
            if held is not None:
                await self._release_after_forming(held, step)
            await self.engine.collective_rpc("rl_release_received")

    async def _hold_for_forming(self) -> tuple[contextlib.AsyncExitStack, float]:
        """Generation held, and the worker told so; the hold and when it began."""
        held = contextlib.AsyncExitStack()
        await held.enter_async_context(self.hold_generation())
        await self.engine.collective_rpc("rl_generation_held")
        return held, time.perf_counter()

    @staticmethod
    async def _release_after_forming(held: tuple[contextlib.AsyncExitStack, float], step: int) -> None:
        await held[0].aclose()
        logger.info("step %d: generation held %.3f s while the transfer group formed", step,
                    time.perf_counter() - held[1])


class NcclReceiver(FirstWorkerReceiver):
    """nccl: every step whole, received by the first worker into its GPU."""


class GlooReceiver(ServerReceiver):
    """gloo: this process (the server's API process) receives the step while generation goes on, in a group it keeps
    from step to step. The test hook `receive_in_worker` takes NCCL's path over gloo instead: how a CPU host proves
    it."""

    def __init__(self, engine, key: bytes, adapters: bool, hold_generation=None, served=None):
        super().__init__(engine, key, adapters, hold_generation, served)
        self.group = GroupKeeper()  # this process's group with the trainer

    async def _receive(self, spec: GroupSpec, step: int, base: StagedStep | None) -> Received:
        if hooks.take("receive_in_worker") is not None:
            in_worker = FirstWorkerReceiver(self.engine, self.key, self.adapters, self.hold_generation)
            in_worker.backend, in_worker.layout = "gloo", self.layout
            return await in_worker._receive(spec, step, base)
        layout = await self.served_layout()
        return await in_daemon_thread(receive_weights, spec, step, self.key, "gloo", self.group,
                                      base and base.rpc(), layout)


class ChangesReceived(ServerReceiver):
    """Sparse (rl/weights/sparse.py): a step may come as its changes against the full weights served, when they came
    over the wire and verified (`served`: a handle of this receive's own, released once it is done)."""

    def _base(self) -> StagedStep | None:
        return self.served()


class SparseGlooReceiver(ChangesReceived, GlooReceiver):
    """sparse_gloo: gloo's receive, a step's changes applied to the weights served."""


class SparseNcclReceiver(ChangesReceived, NcclReceiver):
    """sparse_nccl: NCCL's receive in the first worker, a step's changes applied there to the weights served."""


@contextlib.asynccontextmanager
async def _nothing_held():
    yield


def _nothing_served() -> None:
    return None


async def in_daemon_thread(function, *args):
    """`function(*args)` in a daemon thread of its own, awaited: unlike asyncio.to_thread's pool, which the interpreter
    joins at exit, nothing it waits on (a silent peer) can keep a stopping server alive past its grace period."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            outcome = function(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, done, None, error)
        else:
            loop.call_soon_threadsafe(_settle, done, outcome, None)

    threading.Thread(target=run, name=function.__name__, daemon=True).start()
    return await done


def _settle(future: asyncio.Future, outcome, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outcome)
