"""A step's transfer group: the trainer's store, the group its rank 0 and the servers form (kept from step to step
while every member holds it), and broadcasts with deadlines."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rl.weights import TransferError
from rl.weights.lingering import leave_behind

logger = logging.getLogger(__name__)


class Deadline:
    """One deadline for a whole step over the wire (`transfer.timeout_s`): reaching the store, the group forming,
    every broadcast and the checksum all take what is left of it, so no peer, however slowly it answers or sends,
    holds a step longer."""

    def __init__(self, seconds: float, step: int):
        self.seconds, self.step, self.end = seconds, step, time.monotonic() + seconds

    def left(self, what: str) -> float:
        """Seconds left; TransferError naming `what` the step was about to wait for once none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TransferError(f"step {self.step} ran out of its {self.seconds:g} s (transfer.timeout_s) before "
                                f"{what}")
        return left

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed (within the millisecond a timed wait is rounded down to)."""
        return time.monotonic() >= self.end - 0.01

    def delta(self, what: str) -> timedelta:
        return timedelta(seconds=self.left(what))

NCCL_CLEANUP_ONLY = "2"  # TORCH_NCCL_ASYNC_ERROR_HANDLING: a failed collective aborts its group, not the process


@dataclass
class StepGroup:
    """A transfer group: trainer rank 0 and the servers' receivers, with where its tensors live (the CPU for gloo, each
    member's current GPU for NCCL), how long any broadcast may take, and its `name` (the trainer's run token and the
    step that formed it)."""

    process_group: dist.ProcessGroup
    device: torch.device
    name: str
    deadline: Deadline  # the deadline of the step it serves now (a group serves one step at a time)

    @property
    def nccl(self) -> bool:
        return self.device.type == "cuda"

    @property
    def world_size(self) -> int:
        return self.process_group.size()

    def report(self, rank: int | None = None) -> str:
        """What a member holding this group reports at a step's start (`rank`: as the member of that rank would)."""
        rank = self.process_group.rank() if rank is None else rank
        return f"{self.name} {rank}/{self.world_size} {'nccl' if self.nccl else 'gloo'}"


NOTHING_HELD = "-"


RUN_TOKEN_KEY = "run_token"


class GroupKeeper:
    """The transfer group one sender or receiver keeps from step to step. Forming a group is a rendezvous of every
    member through the store (~30 ms for three gloo members on this 2-core host, against 0.4 ms for a broadcast on
    a kept one; NCCL also sets up a communicator and its GPU buffers), so a group is kept while it serves.

    It is kept only while every member of the step holds it at the same rank: at each step's start every member
    reports what it holds (`step_<k>/holds/<rank>` in the store) and reads every other's, so all reach the same
    verdict: all keep the group, or all drop what they hold and form the step's own. A server that restarted, a
    member whose last transfer failed, a trainer that resumed (a new run token) or another set of receivers thus makes
    everyone form anew, and no stale member can hang a step. Every wait has the step's deadline."""

    def __init__(self) -> None:
        self.group: StepGroup | None = None
        self.formed = 0  # groups formed, kept ones not counted (tests and logs read it)
        self.busy = threading.Lock()  # one step at a time: another's broadcasts would interleave with its own

    def join(self, store: dist.Store, step: int, rank: int, world_size: int, deadline: Deadline,
             backend: str = "gloo", forming: Callable[[Deadline], ContextManager] | None = None) -> StepGroup:
        """Step `step`'s group: the kept one where every member holds it, else a new one, formed inside `forming`
        (a server's first worker holds generation there); TransferError if the members did not all report, or the
        group did not form, by the step's `deadline`, or if another step's transfer is still using this keeper. Every
        join is followed by `done`."""
        if not self.busy.acquire(blocking=False):
            raise TransferError(f"step {step} cannot be transferred while another step's transfer is in progress")
        try:
            return self._join(store, step, rank, world_size, deadline, backend, forming or no_hold)
        except BaseException:
            self.busy.release()
            raise

    def _join(self, store: dist.Store, step: int, rank: int, world_size: int, deadline: Deadline,
              backend: str, forming: Callable[[Deadline], ContextManager]) -> StepGroup:
        held = self.group.report() if self.group is not None else NOTHING_HELD
        try:
            reports = exchange_reports(store, step, rank, world_size, held, deadline)
        except TransferError:
            self.drop()
            raise
        group = self.group
        if group is not None and group.world_size == world_size and group.nccl == (backend == "nccl") \
                and all(r == group.report(i) for i, r in enumerate(reports)):
            group.deadline = deadline
            return group
        self.drop()
        name = f"{run_token(store, deadline)}:{step}"
        with forming(deadline):
            self.group = open_group(store, step, rank, world_size, deadline, backend, name)
        self.formed += 1
        logger.info("formed the transfer group of step %d (rank %d of %d, %s)", step, rank, world_size, backend)
        return self.group

    def done(self, failed: bool, keep: bool = True) -> None:
        """After a step: a group whose transfer failed is dropped; one that served is kept unless `keep` is False."""
        try:
            if failed or not keep:
                self.drop()
        finally:
            self.busy.release()

    def drop(self) -> None:
        group, self.group = self.group, None
        release_group(group)


def no_hold(deadline: Deadline) -> ContextManager:
    return contextlib.nullcontext()


def exchange_reports(store: dist.Store, step: int, rank: int, world_size: int, held: str,
                     deadline: Deadline) -> list[str]:
    """Every member's report of what it holds, by rank, once all have written theirs."""
    keys = [f"step_{step}/holds/{r}" for r in range(world_size)]
    try:
        store.set(keys[rank], held)
        store.wait(keys, deadline.delta(f"the members of step {step}'s transfer reported"))
        return [value.decode() for value in store.multi_get(keys)]
    except TransferError:
        raise
    except Exception as e:  # the wait timed out, or the store went away
        raise TransferError(f"the members of step {step}'s transfer did not all report within {deadline.seconds:g} s "
                            f"(rank {rank} of {world_size}): {e}") from None


def start_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The trainer's transfer store (rank 0, one for the run), listening on `host` only (transfer.host, where the
    servers reach it), holding a token of this run: groups it forms are named by it, so that no server mistakes a
    group of an earlier run (before a resume) for a current one."""
    listener = _listen(host, port)
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.fileno())
    finally:
        listener.detach()  # the store owns the descriptor now
    store.set(RUN_TOKEN_KEY, os.urandom(8).hex())
    return store


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on `host`'s address; on every address where `host` is not one of this machine's (a name
    that only others resolve to it, as a Kubernetes Service's), with a warning."""
    for family, _, _, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(address[:2])
        except OSError as e:
            listener.close()
            if e.errno != errno.EADDRNOTAVAIL:
                raise TransferError(f"the transfer store cannot listen on {host}:{port}: {e}") from None
            continue
        listener.listen(128)
        return listener
    logger.warning("transfer.host %r is no address of this machine: the transfer store listens on every address "
                   "(what it serves is sealed with the run's secret all the same)", host)
    listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True) \
        if socket.has_dualstack_ipv6() else socket.create_server(("0.0.0.0", port))
    return listener


def run_token(store: dist.Store, deadline: Deadline) -> str:
    try:
        store.wait([RUN_TOKEN_KEY], deadline.delta("the store gave its run token"))
        return store.get(RUN_TOKEN_KEY).decode()
    except TransferError:
        raise
    except Exception as e:
        raise TransferError(f"the trainer's transfer store holds no run token: {e}") from None


def open_group(store: dist.Store, step: int, rank: int, world_size: int, deadline: Deadline, backend: str,
               name: str) -> StepGroup:
    """The step's own group over `store` (gloo, or NCCL between GPUs: each member on its current CUDA device), whose
    members all joined by the step's deadline. Its own timeout for any one collective is what was left of that
    deadline when it formed; each wait on it, in this step or a later one that keeps it, takes that step's deadline.

    It forms in a thread of its own, waited on until the deadline only: a member's address comes from the store,
    which any store client can write, and a member waiting for a peer that connected elsewhere (an old address) is
    held by gloo for about five times the timeout it was given. A group that forms after the step gave up on it is
    released by that thread; the thread itself ends by gloo's (or NCCL's) own timeout, and the process's exit does not
    wait for it (rl/weights/lingering.py)."""
    prefixed = dist.PrefixStore(f"step_{step}/group", store)
    timeout = deadline.delta(f"the transfer group of step {step} formed")
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    outcome: dict = {}
    settled = threading.Lock()  # the group goes either to the caller, or, once the caller gave up, to release

    def form() -> None:
        try:
            if backend == "nccl":
                torch.cuda.set_device(device)  # the current device is per thread
                group = StepGroup(_nccl_group(prefixed, rank, world_size, timeout, device), device, name, deadline)
            else:
                group = StepGroup(dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), device, name, deadline)
        except Exception as e:  # noqa: BLE001 - reported by the caller, if it still waits
            outcome["error"] = e
            return
        with settled:
            if outcome.setdefault("group", group) is not group:
                release_group(group)

    start = time.monotonic()
    thread = threading.Thread(target=form, name=f"forming the transfer group of step {step} (rank {rank})",
                              daemon=True)
    thread.start()
    thread.join(timeout.total_seconds())
    with settled:
        group = outcome.setdefault("group", None)
    if group is not None:
        return group
    if thread.is_alive():
        leave_behind(thread)
    where = f"the transfer group of step {step}"
    unconnected = ("not every member connected by the step's deadline: one failed, or connected to an address in the "
                   "store that is not this member's (any client of the store can write one)")
    if "error" not in outcome or deadline.expired:
        why = f": {outcome['error']}" if "error" in outcome else ""
        raise TransferError(f"{where} did not form within {deadline.seconds:g} s (rank {rank} of {world_size}): "
                            f"{unconnected}{why}")
    raise TransferError(f"{where} failed to form after {time.monotonic() - start:.2f} s of its {deadline.seconds:g} s "
                        f"(rank {rank} of {world_size}), connecting to the members' addresses in the store: "
                        f"{outcome['error']}")


def _nccl_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                device: torch.device) -> dist.ProcessGroup:
    """An NCCL group whose failure (a member died, a deadline passed) aborts the group and raises, leaving the process
    (a vLLM worker, the trainer) running: NCCL's default tears the process down. The setting is read as the group is
    made. Its communicator is set up here, with every member (NCCL's own default is at the first collective): a
    server forms its group with generation held, not while a step's first bytes arrive beside vLLM's work, and a
    member that never comes fails the forming, by the deadline, rather than the header's broadcast."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_CLEANUP_ONLY
    try:
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        try:
            group.eager_connect_single_device(device)
        except BaseException:
            with contextlib.suppress(Exception):  # what it set up so far goes; why it failed is raised
                group.abort()
            raise
        return group
    finally:
        if before is None:
            os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before


def release_group(group: StepGroup | None) -> None:
    """Release a group: an NCCL one holds a communicator and GPU buffers until aborted (abort, not shutdown: a member
    may be gone, and no collective is pending, as every broadcast was waited on); gloo's go with the object."""
    if group is None or not group.nccl:
        return
    try:
        group.process_group.abort()
    except Exception as e:  # noqa: BLE001 - releasing a group that already failed must not hide why it failed
        logger.warning("releasing a transfer group failed (its GPU buffers may stay allocated): %r", e)


def connect_store(host: str, port: int, deadline: Deadline) -> dist.Store:
    """A client of the trainer's store, by the step's deadline. A plain connection first tells a port where nothing
    listens (refused: the store is gone) or a host that does not answer from a store that is slow. The store
    client's handshake has no deadline of its own (a peer that accepts and never answers holds it for good), so it
    runs in a daemon thread of its own, left behind if it does not finish in time; the client's later waits are
    bounded by what is left of the deadline."""
    where = f"the trainer's transfer store at {host}:{port}"
    try:
        socket.create_connection((host, port), timeout=deadline.left(f"reaching {where}")).close()
    except ConnectionRefusedError:
        raise TransferError(f"cannot reach {where}: nothing listens at {host}:{port} (connection refused); the "
                            "trainer's store has stopped, or the offer names another") from None
    except TimeoutError:
        raise TransferError(f"cannot reach {where} within {deadline.seconds:g} s: it did not accept a connection"
                            ) from None
    except OSError as e:
        raise TransferError(f"cannot reach {where}: {e}") from None
    outcome: dict = {}

    def connect() -> None:
        try:
            outcome["store"] = dist.TCPStore(host, port, is_master=False, timeout=deadline.delta("reaching the store"))
        except Exception as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    thread = threading.Thread(target=connect, name=f"connect to {host}:{port}", daemon=True)
    thread.start()
    thread.join(deadline.left(f"reaching {where}"))
    if "store" in outcome:
        outcome["store"].set_timeout(deadline.delta("the store answered"))
        return outcome["store"]
    if thread.is_alive():
        leave_behind(thread)
    why = outcome.get("error", "it accepted the connection but never answered")
    raise TransferError(f"cannot reach {where} within {deadline.seconds:g} s: {why}")


@dataclass
class InFlight:
    """A broadcast started and not yet waited on; it holds its tensor, which must not be touched until `wait`."""

    work: dist.Work
    tensor: torch.Tensor
    group: StepGroup
    what: str

    def wait(self) -> None:
        """Until the broadcast is done; TransferError at the step's deadline, or if it failed. NCCL's wait would only
        order the GPU's streams; with a deadline it blocks this thread until the broadcast is done, or raises at the
        deadline (gloo's own timeout bounds it the same way)."""
        deadline = self.group.deadline
        try:
            self.work.wait(deadline.delta(f"the broadcast of {self.what}"))
        except TransferError:
            raise
        except Exception as e:
            if deadline.expired:
                raise TransferError(f"step {deadline.step} ran out of its {deadline.seconds:g} s (transfer.timeout_s) "
                                    f"during the broadcast of {self.what}") from None
            raise TransferError(f"the broadcast of {self.what} failed: {e}") from None


def start_broadcast(group: StepGroup, tensor: torch.Tensor, what: str) -> InFlight:
    """Start broadcasting `tensor` from rank 0 (in place on the others), so that the next one can be made ready
    meanwhile; TransferError names what was being sent."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    try:
        return InFlight(group.process_group.broadcast([tensor], options), tensor, group, what)
    except Exception as e:
        raise TransferError(f"the broadcast of {what} failed: {e}") from None


def broadcast(group: StepGroup, tensor: torch.Tensor, what: str) -> None:
    """Broadcast `tensor` from rank 0 (in place on the others); TransferError names what was being sent."""
    start_broadcast(group, tensor, what).wait()

