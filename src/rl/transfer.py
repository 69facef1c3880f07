"""Weights over the wire: the collective transport shared by the trainer (which sends) and the inference servers
(which receive), beside the filesystem transport (weights/step_k/, rl/trainer/weights.py).

With `weight_transport = "gloo"` a step's weights travel trainer -> every server with no file in between:

1. the trainer, after its optimizer step, offers the step: `transfer/offer_<k>.json` names the step and where its
   TCP store listens (rank 0 keeps one store for the whole run);
2. the orchestrator takes the offer (rl/orchestrator/main.py): it writes `transfer/take_<k>.json` with the number of
   receivers (one per server it asks) and posts each server `/update_weights {"step": k, "transfer": {...}}` naming
   the store and the server's rank in the step's group;
3. trainer rank 0 and the servers join the step's gloo group: the one they formed at an earlier step if every member
   still holds it at the same rank, else one formed for this step by all (`GroupKeeper`; its keys are under
   `step_<k>/` in the store, so a server restarted since the last step makes everyone form anew). Rank 0 broadcasts
   the step's header (every tensor's name, dtype and shape), the tensors' bytes in that order (small ones together, in
   buckets of up to `BUCKET_BYTES`: `bucket_plan`), then `weights_checksum`
   (`TensorDigest`: the same xxh3-128 of names, dtypes, shapes and bytes that the files' tally takes);
4. each server receives into a sealed memfd laid out as one safetensors file (`rl.inference.staging`), refuses the
   step if the bytes it got do not hash to the trainer's checksum, and only then loads it with the same verified
   reload, rollback and tensor-parallel sharding as a step read from files.

With `weight_transport = "nccl"` (GPU hosts) the same protocol runs over NCCL between GPUs: the trainer broadcasts
each gathered tensor from its rank 0's GPU, and on each server its first worker (`rl_receive_weights` in
rl/inference/worker.py, the one process of a server that holds a GPU of its own and an NCCL library) receives it into
GPU memory and copies it into the memfd, which the server then takes over as if it had received it itself: from
there on, the checks, the reload on every tensor-parallel worker, the verification and the rollback are the ones of
gloo and of files. Both sides hash the bytes on the host (the same checksum as files), so `weights_checksum` means
the same whatever the transport.

Every wait has a deadline: the trainer's wait for the take (`offer_timeout_s`), the group's forming and every
broadcast (`timeout_s`; NCCL's wait blocks with that deadline, and a group that failed is aborted, so no kernel of it
is left waiting on a GPU). A group is kept only while every member of the step holds it, and dropped by whoever's
transfer failed, so no stale member can hang a later step. Transports are looked up by name in `TRANSPORTS`, a
registry in the manner of vLLM's weight-transfer engine factory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from rl.atomic import atomic_write_text
from rl.manifest import CorruptFileError, read_regular

logger = logging.getLogger(__name__)

TRANSPORTS = {
    "filesystem": "every step's weights as files in weights/step_k/, which servers read and verify",
    "gloo": "every step's weights broadcast from trainer rank 0 to every server over TCP (gloo), verified as files",
    "nccl": "every step's weights broadcast from trainer rank 0's GPU to each server's first worker's GPU (NCCL), "
            "verified as files",
    "sparse_gloo": "as gloo, but only the elements that changed since the step every server serves",
    "sparse_nccl": "as nccl, but only the elements that changed since the step every server serves",
}
NCCL_CLEANUP_ONLY = "2"  # TORCH_NCCL_ASYNC_ERROR_HANDLING: a failed collective aborts its group, not the process
DIGEST_BYTES = 16
MAX_HEADER_BYTES = 64 * 2**20
BUCKET_BYTES = 32 * 2**20
"""Tensors smaller than this share broadcasts of up to this size: each broadcast costs a fixed time (a wait, and over
NCCL a kernel launch), which a LoRA adapter's hundreds of small tensors would otherwise pay one by one. The sender holds
one bucket beyond the tensor it gathers."""


HOST_CHUNK_BYTES = 64 * 2**20  # a GPU tensor's bytes come to the host to be hashed in chunks of this size


class TransferError(RuntimeError):
    """A collective transfer failed or timed out; the message names the step and what it waited for."""


class TensorDigest:
    """`weights_checksum`: per tensor, xxh3-128 of its name, dtype, shape and bytes; then xxh3-128 of those, by name.
    Independent of the order the tensors pass in, so the same weights have the same checksum whether they were read
    from files (however sharded: the files' tally) or received over the wire (the trainer's and the server's)."""

    def __init__(self):
        self._tensors: dict[str, bytes] = {}
        self._pinned: list[torch.Tensor] = []  # the two host buffers a GPU tensor's bytes pass through (`_hash_gpu`)

    def update(self, name: str, tensor: torch.Tensor) -> None:
        self.update_bytes(name, tensor.dtype, tuple(tensor.shape), tensor_bytes(tensor.detach()))

    def update_bytes(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], data: torch.Tensor) -> None:
        """A tensor given as its dtype, shape and raw bytes (a flat uint8 tensor, on the host or a GPU)."""
        one = xxhash.xxh3_128(f"{name}\0{dtype}\0{tuple(shape)}\0".encode())
        if data.is_cuda and len(data):
            self._hash_gpu(one, data)
        else:
            one.update(data.numpy())
        self._tensors[name] = one.digest()

    def _hash_gpu(self, one, data: torch.Tensor) -> None:
        """Hash a GPU tensor's bytes on the host, in chunks copied through two pinned buffers: the next chunk's copy
        goes on while this one is hashed. (A pageable copy of the whole tensor moved ~3 GB/s on an H200's host.)"""
        if not self._pinned:
            self._pinned = [torch.empty(HOST_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        starts = range(0, len(data), HOST_CHUNK_BYTES)
        copied = [torch.cuda.Event(), torch.cuda.Event()]
        with torch.cuda.device(data.device):
            def copy(index: int) -> None:
                part = data[starts[index]:starts[index] + HOST_CHUNK_BYTES]
                self._pinned[index % 2][:len(part)].copy_(part, non_blocking=True)
                copied[index % 2].record()

            copy(0)
            for index, start in enumerate(starts):
                if index + 1 < len(starts):  # into the other buffer, hashed already
                    copy(index + 1)
                copied[index % 2].synchronize()
                one.update(self._pinned[index % 2][:min(HOST_CHUNK_BYTES, len(data) - start)].numpy())

    def digest(self) -> bytes:
        whole = xxhash.xxh3_128()
        for name in sorted(self._tensors):
            whole.update(name.encode() + b"\0" + self._tensors[name])
        return whole.digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


@dataclass(frozen=True)
class Offer:
    """What the trainer offers for a step: where its store listens, and the step's size."""

    step: int
    host: str
    port: int
    tensor_bytes: int


@dataclass(frozen=True)
class GroupSpec:
    """A server's place in a step's group, as the orchestrator posts it to /update_weights."""

    host: str
    port: int
    rank: int
    world_size: int
    timeout_s: float


def transfer_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "transfer"


def offer_path(output_dir: Path, step: int) -> Path:
    return transfer_dir(output_dir) / f"offer_{step}.json"


def take_path(output_dir: Path, step: int) -> Path:
    return transfer_dir(output_dir) / f"take_{step}.json"


def write_offer(output_dir: Path, offer: Offer) -> None:
    atomic_write_text(offer_path(output_dir, offer.step), json.dumps(asdict(offer)))


MAX_OFFER_BYTES = 4096  # an offer is ~100 bytes
HOST_PATTERN = r"[A-Za-z0-9._:\[\]-]{1,255}"  # a host name, IPv4 or IPv6 address, as a server takes it to connect to


def read_offer(output_dir: Path, step: int, host: str | None = None) -> Offer | None:
    """The trainer's offer of `step`, None if there is none. It is read only as the trainer writes it: a regular file
    (not a link, a FIFO or a device: nothing can stall the reader), of a few bytes, whose fields have their types and
    ranges, name the step of the file's name and (if given) the trainer's `host`; anything else is a TransferError
    naming the file and the problem."""
    path = offer_path(output_dir, step)
    try:
        raw = read_regular(path.parent, path.name, MAX_OFFER_BYTES)
    except CorruptFileError as e:
        if not os.path.lexists(path):
            return None  # none, or taken away (a resumed trainer clears the old ones)
        raise TransferError(f"{path} is not an offer the trainer wrote: {e}") from None
    try:
        fields = json.loads(raw)
    except ValueError as e:
        raise TransferError(f"{path} is not an offer the trainer wrote: {e}") from None
    problem = offer_problem(fields, step)
    if problem is None and host is not None and fields["host"] != host:
        problem = f"it names host {fields['host']!r}, but the trainer's store is at transfer.host {host!r}"
    if problem:
        raise TransferError(f"{path} is not an offer the trainer wrote: {problem}")
    return Offer(**fields)


def offer_problem(fields, step: int) -> str | None:
    """What is wrong with an offer's fields, read from the file of `step`; None if nothing."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not isinstance(fields, dict) or set(fields) != {f.name for f in dataclasses.fields(Offer)}:
        return f"its fields are not {[f.name for f in dataclasses.fields(Offer)]}"
    if not whole(fields["step"]) or fields["step"] != step:
        return f"it offers step {fields['step']!r} in the file of step {step}"
    if not whole(fields["port"]) or not 1 <= fields["port"] <= 65535:
        return f"port {fields['port']!r} is not a port from 1 to 65535"
    if not whole(fields["tensor_bytes"]) or fields["tensor_bytes"] < 0:
        return f"tensor_bytes {fields['tensor_bytes']!r} is not a size"
    if not isinstance(fields["host"], str) or not re.fullmatch(HOST_PATTERN, fields["host"]):
        return f"host {fields['host']!r} is not a host name or address"
    return None


TRANSFER_FILE = re.compile(r"(offer|take)_([0-9]+)\.json")  # ASCII digits: str.isdigit takes '²', which int refuses


def offered_steps(output_dir: Path) -> list[int]:
    matches = (TRANSFER_FILE.fullmatch(path.name) for path in transfer_dir(output_dir).glob("offer_*.json"))
    return sorted(int(match[2]) for match in matches if match)


def write_take(output_dir: Path, step: int, receivers: int) -> None:
    atomic_write_text(take_path(output_dir, step), json.dumps({"step": step, "receivers": receivers}))


def wait_for_take(output_dir: Path, step: int, timeout_s: float) -> int:
    """The number of receivers the orchestrator asked to take step `step`; TransferError after `timeout_s`."""
    path = take_path(output_dir, step)
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TransferError(f"waited {timeout_s:.0f} s for the orchestrator to take the weights of step {step} "
                                f"({path} never appeared): is the orchestrator running?")
        time.sleep(0.005)  # a stat per 5 ms: the take is on the critical path of every step
    return int(json.loads(path.read_text())["receivers"])


def clear_transfers(output_dir: Path, from_step: int = 0) -> None:
    """Remove the offers and takes of steps >= `from_step` (a resumed run offers them again, on another store)."""
    for path in transfer_dir(output_dir).glob("*.json"):
        match = TRANSFER_FILE.fullmatch(path.name)
        if match and int(match[2]) >= from_step:
            path.unlink(missing_ok=True)


@dataclass
class StepGroup:
    """A transfer group: trainer rank 0 and the servers' receivers, with where its tensors live (the CPU for gloo, each
    member's current GPU for NCCL), how long any broadcast may take, and its `name` (the trainer's run token and the
    step that formed it)."""

    process_group: dist.ProcessGroup
    device: torch.device
    timeout: timedelta
    name: str

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

    def join(self, store: dist.Store, step: int, rank: int, world_size: int, timeout_s: float,
             backend: str = "gloo") -> StepGroup:
        """Step `step`'s group: the kept one where every member holds it, else a new one; TransferError if the members
        did not all report, or the group did not form, within `timeout_s`, or if another step's transfer is still
        using this keeper. Every join is followed by `done`."""
        if not self.busy.acquire(blocking=False):
            raise TransferError(f"step {step} cannot be transferred while another step's transfer is in progress")
        try:
            return self._join(store, step, rank, world_size, timeout_s, backend)
        except BaseException:
            self.busy.release()
            raise

    def _join(self, store: dist.Store, step: int, rank: int, world_size: int, timeout_s: float,
              backend: str) -> StepGroup:
        held = self.group.report() if self.group is not None else NOTHING_HELD
        try:
            reports = exchange_reports(store, step, rank, world_size, held, timeout_s)
        except TransferError:
            self.drop()
            raise
        group = self.group
        if group is not None and group.world_size == world_size and group.nccl == (backend == "nccl") \
                and all(r == group.report(i) for i, r in enumerate(reports)):
            return group
        self.drop()
        name = f"{run_token(store, timeout_s)}:{step}"
        self.group = open_group(store, step, rank, world_size, timeout_s, backend, name)
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


def exchange_reports(store: dist.Store, step: int, rank: int, world_size: int, held: str,
                     timeout_s: float) -> list[str]:
    """Every member's report of what it holds, by rank, once all have written theirs."""
    keys = [f"step_{step}/holds/{r}" for r in range(world_size)]
    try:
        store.set(keys[rank], held)
        store.wait(keys, timedelta(seconds=timeout_s))
        return [value.decode() for value in store.multi_get(keys)]
    except Exception as e:  # the wait timed out, or the store went away
        raise TransferError(f"the members of step {step}'s transfer did not all report within {timeout_s:.0f} s "
                            f"(rank {rank} of {world_size}): {e}") from None


def start_store(port: int, timeout_s: float) -> dist.TCPStore:
    """The trainer's transfer store (rank 0, one for the run), holding a token of this run: groups it forms are
    named by it, so that no server mistakes a group of an earlier run (before a resume) for a current one."""
    store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    store.set(RUN_TOKEN_KEY, os.urandom(8).hex())
    return store


def run_token(store: dist.Store, timeout_s: float) -> str:
    try:
        store.wait([RUN_TOKEN_KEY], timedelta(seconds=timeout_s))
        return store.get(RUN_TOKEN_KEY).decode()
    except Exception as e:
        raise TransferError(f"the trainer's transfer store holds no run token: {e}") from None


def open_group(store: dist.Store, step: int, rank: int, world_size: int, timeout_s: float, backend: str,
               name: str) -> StepGroup:
    """The step's own group over `store` (gloo, or NCCL between GPUs: each member on its current CUDA device), whose
    members all joined within `timeout_s`."""
    prefixed, timeout = dist.PrefixStore(f"step_{step}/group", store), timedelta(seconds=timeout_s)
    try:
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            return StepGroup(_nccl_group(prefixed, step, rank, world_size, timeout), device, timeout, name)
        return StepGroup(dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), torch.device("cpu"), timeout, name)
    except Exception as e:  # the store's wait timed out, or the store went away
        raise TransferError(f"the transfer group of step {step} did not form within {timeout_s:.0f} s "
                            f"(rank {rank} of {world_size}): {e}") from None


def _nccl_group(store: dist.Store, step: int, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    """An NCCL group whose failure (a member died, a deadline passed) aborts the group and raises, leaving the process
    (a vLLM worker, the trainer) running: NCCL's default tears the process down. The setting is read as the group is
    made."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = NCCL_CLEANUP_ONLY
    try:
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
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


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise TransferError(f"cannot reach the trainer's transfer store at {host}:{port} within {timeout_s:.0f} s: "
                            f"{e}") from None


@dataclass
class InFlight:
    """A broadcast started and not yet waited on; it holds its tensor, which must not be touched until `wait`."""

    work: dist.Work
    tensor: torch.Tensor
    group: StepGroup
    what: str

    def wait(self) -> None:
        """Until the broadcast is done; TransferError at the group's deadline, or if it failed. NCCL's wait would only
        order the GPU's streams; with a deadline it blocks this thread until the broadcast is done, or raises at the
        deadline (gloo's own timeout bounds it the same way)."""
        try:
            self.work.wait(self.group.timeout)
        except Exception as e:
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


def send_header(group: StepGroup, step: int, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                adapter_config: str | None, bucket_bytes: int, base: str | None = None) -> None:
    """The step's tensors (name, dtype, shape) in the order they follow, a LoRA adapter's adapter_config.json, how
    the tensors are grouped into broadcasts (`bucket_plan`), and the `weights_checksum` of the step the changes are
    against (`base`; None: every tensor whole)."""
    raw = json.dumps({"step": step, "tensors": [[n, str(d).removeprefix("torch."), list(s)] for n, d, s in tensors],
                      "adapter_config": adapter_config, "bucket_bytes": bucket_bytes, "base": base})
    data = torch.frombuffer(bytearray(raw.encode()), dtype=torch.uint8).to(group.device)
    broadcast(group, torch.tensor([len(data)], dtype=torch.int64, device=group.device), f"step {step}'s header length")
    broadcast(group, data, f"step {step}'s header")


TensorMeta = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape


@dataclass(frozen=True)
class Header:
    """A step as the trainer announces it: its tensors in the order they follow, its adapter config (None: full
    weights), the size of its broadcasts (`bucket_plan`), and the checksum of the step it sends changes against
    (None: every tensor whole)."""

    tensors: list[TensorMeta]
    adapter_config: str | None
    bucket_bytes: int
    base: str | None = None


def receive_header(group: StepGroup, step: int) -> Header:
    """The step's header; TransferError if the trainer sends another step or nonsense."""
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    broadcast(group, length, f"step {step}'s header length")
    if not 0 < length.item() <= MAX_HEADER_BYTES:
        raise TransferError(f"step {step}'s header claims {length.item()} bytes")
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    broadcast(group, data, f"step {step}'s header")
    try:
        header = json.loads(bytes(data.cpu().numpy()))
        tensors = [(str(n), getattr(torch, d), tuple(int(x) for x in s)) for n, d, s in header["tensors"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TransferError(f"step {step}'s header is malformed: {e!r}") from None
    if header.get("step") != step:
        raise TransferError(f"asked to receive step {step}, but the trainer sends step {header.get('step')}")
    if any(not isinstance(d, torch.dtype) for _, d, _ in tensors):
        raise TransferError(f"step {step}'s header names a dtype torch does not have")
    adapter_config, bucket_bytes = header.get("adapter_config"), header.get("bucket_bytes")
    if adapter_config is not None and not isinstance(adapter_config, str):
        raise TransferError(f"step {step}'s header holds an adapter config that is not a string")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise TransferError(f"step {step}'s header gives no bucket size (bucket_bytes {bucket_bytes!r})")
    base = header.get("base")
    if base is not None and not isinstance(base, str):
        raise TransferError(f"step {step}'s header names a base that is not a checksum: {base!r}")
    return Header(tensors, adapter_config, bucket_bytes, base)


def bucket_plan(sizes: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """The step's broadcasts, as [first, stop) ranges of its tensors (sizes in bytes, in order): consecutive tensors
    together up to `bucket_bytes`, a bigger tensor alone. Sender and receivers compute it from the header alike; the
    receivers' safetensors layout keeps consecutive tensors contiguous, so a bucket arrives straight into its place."""
    plan, first, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > first and total + size > bucket_bytes:
            plan.append((first, i))
            first, total = i, 0
        total += size
    if sizes:
        plan.append((first, len(sizes)))
    return plan


def bucket_name(names: list[str], step: int) -> str:
    """What a broadcast carries, for its error message."""
    what = names[0] if len(names) == 1 else f"{len(names)} tensors ({names[0]} to {names[-1]})"
    return f"{what} of step {step}"


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (what travels)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def pack_digest(digest: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)


def safetensors_layout(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, list[tuple[int, int]]]:
    """The safetensors head (length prefix and header, padded to 8 bytes) of one file holding `tensors` in order,
    and each tensor's [begin, end) in the file. Tensors of one dtype stay aligned; a server receives into it."""
    from rl.safetensors_io import NAMES

    header, offset, spans = {}, 0, []
    for name, dtype, shape in tensors:
        size = dtype.itemsize * _numel(shape)
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        spans.append((offset, offset + size))
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, [(len(head) + begin, len(head) + end) for begin, end in spans]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


# Sparse steps (`sparse_gloo`, `sparse_nccl`): only what changed since the step every server serves.
#
# Each receiver announces the checksum of the full weights it serves and holds the bytes of (`announce_base`, before
# it joins); the trainer sends changes only when every receiver announced the step it sent last (`common_base`),
# else every tensor whole, so a server that missed a step, restarted or rolled back is brought up to date by the
# next step. In a sparse step each bucket is preceded by its tensors' counts: WHOLE for a tensor sent whole (its
# changes would not be smaller), else the number of elements that changed, sent as their flat indices and their new
# values. The receiver applies them to a copy of its base's bytes and hashes the result, so the trainer's checksum
# proves the whole step, not only the changes.

NO_BASE = "-"
WHOLE = -1
INDEX_DTYPE = torch.int32
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # elements compared bit for bit
SAMPLE_STRIDE = 101  # every 101st element: a sample that does not line up with a tensor's rows


def announce_base(store: dist.Store, step: int, rank: int, base: str | None) -> None:
    """A receiver's announcement of the checksum of the full weights it serves and can apply changes to."""
    store.set(f"step_{step}/base/{rank}", base or NO_BASE)


def common_base(store: dist.Store, step: int, receivers: int, base: str | None, timeout_s: float) -> str | None:
    """`base` (the step the trainer sent last) if every receiver of step `step` announced it, else None: the step
    then goes whole."""
    if base is None:
        return None
    keys = [f"step_{step}/base/{rank}" for rank in range(1, receivers + 1)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        served = [value.decode() for value in store.multi_get(keys)]
    except Exception as e:  # the wait timed out, or the store went away
        raise TransferError(f"the receivers of step {step} did not all say what they serve within "
                            f"{timeout_s:.0f} s: {e}") from None
    return base if all(one == base for one in served) else None


def encode_changes(now: torch.Tensor, before: torch.Tensor, itemsize: int) -> tuple[int, torch.Tensor]:
    """What a sparse step sends of a tensor whose bytes (flat uint8, on the host) went from `before` to `now`: the
    number of elements that changed and their flat indices (int32) followed by their new values; or WHOLE and the
    bytes as they are, where that is no larger. A tensor that a sample shows well past that point (every tensor of
    an fp32 step on a CPU host) goes whole without the full comparison."""
    words_now, words_before = now.view(WORDS[itemsize]), before.view(WORDS[itemsize])
    numel, whole_from = len(words_now), len(now) // (INDEX_DTYPE.itemsize + itemsize)  # changes no smaller than whole
    if numel > torch.iinfo(INDEX_DTYPE).max:
        return WHOLE, now
    if numel >= SAMPLE_STRIDE * 100:
        sampled = (words_now[::SAMPLE_STRIDE] != words_before[::SAMPLE_STRIDE]).sum().item()
        if sampled * SAMPLE_STRIDE > 2 * whole_from:
            return WHOLE, now
    changed = (words_now != words_before).nonzero().view(-1)
    if len(changed) >= whole_from:
        return WHOLE, now
    values = words_now[changed]
    return len(changed), torch.cat([changed.to(INDEX_DTYPE).view(torch.uint8), values.view(torch.uint8)])


def encoded_bytes(count: int, size: int, itemsize: int) -> int:
    """How many bytes a tensor of `size` bytes takes in a sparse step's bucket, by its count."""
    return size if count == WHOLE else count * (INDEX_DTYPE.itemsize + itemsize)


def apply_changes(place: torch.Tensor, count: int, payload: torch.Tensor, itemsize: int) -> None:
    """Apply what `encode_changes` sent to `place`, the tensor's bytes as the base step has them (flat uint8);
    ValueError if an index lies outside the tensor."""
    if count == WHOLE:
        place.copy_(payload)
        return
    split = count * INDEX_DTYPE.itemsize
    indices = payload[:split].clone().view(INDEX_DTYPE).long()  # cloned: a bucket's parts need not be aligned
    values = payload[split:].clone().view(WORDS[itemsize])
    numel = place.numel() // itemsize
    if count and not (0 <= int(indices.min()) and int(indices.max()) < numel):
        raise ValueError(f"a change names element {int(indices.min())}..{int(indices.max())} of a tensor of "
                         f"{numel} elements")
    aligned = place.storage_offset() % itemsize == 0
    target = place.view(WORDS[itemsize]) if aligned else place.clone().view(WORDS[itemsize])
    target[indices] = values
    if not aligned:
        place.copy_(target.view(torch.uint8))
