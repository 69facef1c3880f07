"""A step's files as the server checked them: what is checked is what is loaded.

The server opens a step directory once (`OpenDir`: no component may be a symlink) and takes every read through
that one handle: the STABLE marker, the manifest, the small files and then each weight file, copied once into a
sealed memfd (`stage_weights`), where its size, CRC-32 and safetensors header (every tensor inside the file, none
overlapping) are checked. The step's `weights_checksum` is taken here as well, once per server, from the bytes in
hand (a step over the wire: as it arrives), while generation goes on; the workers only fingerprint what they load.
The workers, every tensor-parallel rank of the server, map those memfds read-only through
`/proc/<server pid>/fd/<fd>` (`map_staged`, rl/inference/reading.py): no worker opens the user's directory, nothing
can change the bytes after the check (the memfd is sealed against writes), and they are in memory once per server
however many workers map them. A step's memory is given back off the event loop (`release`). An adapter step is
copied the same way into a private directory the server owns (`stage_adapter`), from which the workers read it and
vLLM's `add_lora` loads it: vLLM never opens the user's path.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from zlib_ng import zlib_ng

from rl.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rl.inference import hooks
from rl.inference.reading import map_staged
from rl.listed_files import copy_listed, read_listed
from rl.manifest import CorruptFileError, Entry, OpenDir
from rl.safetensors_io import read_file_header, tensors_of
from rl.weights import StepRefused, TransferError
from rl.weights.digest import DIGEST_BYTES, SEAL_BYTES, TensorDigest
from rl.weights.group import Deadline, GroupKeeper, InFlight, StepGroup, broadcast, connect_store, start_broadcast
from rl.weights.header import Header, bucket_name, bucket_plan, checksum_seal, receive_header, safetensors_layout
from rl.weights.offers import GroupSpec
from rl.weights.sparse import WHOLE, announce_base, apply_changes, encoded_bytes

if TYPE_CHECKING:
    from rl.inference.layout import ServedLayout

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def weight_files(manifest: dict[str, Entry]) -> list[str]:
    """The listed safetensors files, the only ones loaded."""
    names = sorted(name for name in manifest if name.endswith(".safetensors"))
    if not names:
        raise CorruptFileError("the step lists no *.safetensors file")
    return names


@dataclass
class StagedStep:
    """A step's weight files, each in a sealed memfd of this process, and the `weights_checksum` of their tensors
    (`rl.weights.digest.TensorDigest`), taken as they were checked; `rpc()` is what a worker needs to map them."""

    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (memfd, bytes)
    checksum: str | None = None

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files.values())

    def rpc(self) -> dict:
        return {"pid": os.getpid(), "files": {name: list(entry) for name, entry in self.files.items()},
                "checksum": self.checksum}

    def close(self) -> None:
        for fd, _ in self.files.values():
            os.close(fd)
        self.files.clear()

    def dup(self) -> StagedStep:
        """The same step through descriptors of its own, open until closed whatever happens to this one."""
        return StagedStep({name: (os.dup(fd), size) for name, (fd, size) in self.files.items()}, self.checksum)


async def release(staged: StagedStep) -> None:
    """Close a step's memfds in a thread: the last close frees the step's pages (~50 ms per 400 MB here), which on
    the event loop would hold up every request the server answers meanwhile."""
    await asyncio.to_thread(staged.close)


def stage_weights(step: OpenDir, manifest: dict[str, Entry]) -> StagedStep:
    """Copy every listed weight file of `step` once, through its handle, into a sealed memfd, checked there (size,
    CRC-32, then the safetensors header against the file's length), and hash its tensors for the step's checksum
    while they are in hand. CorruptFileError names the first problem; nothing is kept then."""
    staged, digest = StagedStep(), TensorDigest()
    try:
        for name in weight_files(manifest):
            staged.files[name] = _stage_file(step, name, manifest[name], digest)
    except BaseException:
        staged.close()
        raise
    staged.checksum = digest.hexdigest()
    return staged


def _stage_file(step: OpenDir, name: str, entry: Entry, digest: TensorDigest) -> tuple[int, int]:
    fd = os.memfd_create(f"rl-{name}"[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        data = copy_listed(step, name, entry, fd)  # checked in the memfd, where the workers will map it
        size = len(data)
        try:
            # every tensor inside the file's bytes, none over another; checked from the fd, before any view of the
            # mapping exists (a refusal raised inside `tensors_of` would leave one exported, and the close would fail)
            read_file_header(fd, str(step / name))
            _hash_tensors(data, str(step / name), digest)
        finally:
            if isinstance(data, mmap.mmap):
                data.close()  # no writable mapping may be left for the seal
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # no writable mapping is left: from here the bytes are fixed
        return fd, size
    except BaseException:
        os.close(fd)
        raise


def _hash_tensors(data, where: str, digest: TensorDigest) -> None:
    """Add a checked file's tensors to the step's digest (their views of `data` are gone when this returns)."""
    for name, tensor in tensors_of(data, where):
        digest.update(name, tensor)


WIRE_FILE = "model.safetensors"  # the one file a step received over the wire is staged as


@dataclass
class Received:
    """A step as it arrived over the wire: its bytes staged, with the checksum they hash to (the trainer's), and with
    an adapter its adapter_config.json."""

    staged: StagedStep
    adapter_config: str | None

    @property
    def checksum(self) -> str:
        return self.staged.checksum


def receive_weights(spec: GroupSpec, step: int, key: bytes, backend: str = "gloo", keeper: GroupKeeper | None = None,
                    base: dict | None = None, layout: ServedLayout | None = None, forming=None) -> Received:
    """Receive step `step` from the trainer's group (rl/weights/) into one sealed memfd laid out as a safetensors
    file, within one deadline (`spec.timeout_s`) for all of it. Refused (StepRefused) before anything is allocated
    for it: a header not sealed with the run's `key`, malformed, or not of the served `layout`; after its bytes
    arrived: a checksum not sealed with the key. CorruptFileError if the bytes hash to anything but the trainer's
    checksum (nothing is kept then); TransferError if the transfer fails or runs out of time. `keeper`: the
    receiver's group, kept for the next step (unset: a group for this step alone); a refused step drops it.
    `backend` "nccl": each tensor arrives in this process's current GPU, and is copied from there into the memfd.
    Each tensor is hashed as it lands (`hooks.received_digest`: a test may alter it on the way). `base`
    (sparse transports): the full weights this server serves, as `StagedStep.rpc()` names them, which the trainer
    may send changes against (rl/weights/sparse.py). `forming`: the context a new group forms in (`GroupKeeper.join`).
    """
    deadline = Deadline(spec.timeout_s, step)
    digest = hooks.received_digest()
    kept, keeper = keeper is not None, keeper or GroupKeeper()
    store = connect_store(spec.host, spec.port, deadline)
    announce_base(store, step, spec.rank, base["checksum"] if base else None)
    group = keeper.join(store, step, spec.rank, spec.world_size, deadline, backend, forming)
    fd, failed = None, True
    try:
        header = receive_header(group, step, key)
        if layout is not None and (problem := layout.problem(header)):
            raise StepRefused(f"step {step} {problem}")
        hooks.hold_in_thread("during_receive")
        head, spans = safetensors_layout(header.tensors)
        size = spans[-1][1] if spans else len(head)
        fd = os.memfd_create(f"rl-step-{step}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as data:
            data[: len(head)] = head
            altered = None  # or why the changes sent cannot apply
            if header.base is None:
                _receive_into(group, data, header, spans, step, digest)
            else:  # changes against the weights this server serves
                with _map_base(base, header.base, head, size, step) as served:
                    altered = _receive_changes(group, data, served, header, spans, step, digest)
        sent = torch.empty(DIGEST_BYTES + SEAL_BYTES, dtype=torch.uint8, device=group.device)
        broadcast(group, sent, f"step {step}'s checksum")
        sent = bytes(sent.cpu().numpy())
        if altered is not None or sent[:DIGEST_BYTES] != digest.digest():
            failed = False  # the group served: what arrived was altered on the way
            raise CorruptFileError(altered or f"step {step} arrived altered: its bytes hash to {digest.hexdigest()}, "
                                              f"the trainer sent {sent[:DIGEST_BYTES].hex()}")
        if sent != checksum_seal(key, header.seal, digest.digest()):
            raise StepRefused(f"step {step}'s checksum is not sealed with this run's transfer secret: the sender is "
                              "not this run's trainer", status=403)
        failed = False
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)  # the mapping is closed: from here the bytes are fixed
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    finally:
        keeper.done(failed, keep=kept)
    return Received(StagedStep({WIRE_FILE: (fd, size)}, digest.hexdigest()), header.adapter_config)


def _receive_into(group: StepGroup, data: mmap.mmap, header: Header, spans: list, step: int,
                  digest: TensorDigest) -> None:
    """Each bucket of tensors broadcast into its place in `data`, each tensor hashed once its bucket arrived. Over gloo
    a bucket arrives straight into its place, while the one before it is hashed; over NCCL into the GPU, then it is
    copied there, one bucket at a time (the GPU is vLLM's but for one arriving bucket)."""
    landing = None
    for first, stop in bucket_plan([end - begin for begin, end in spans], header.bucket_bytes):
        begin, end = spans[first][0], spans[stop - 1][1]
        place = torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=begin) if end > begin else (
            torch.empty(0, dtype=torch.uint8))
        arriving = torch.empty(end - begin, dtype=torch.uint8, device=group.device) if group.nccl else place
        what = bucket_name([name for name, _, _ in header.tensors[first:stop]], step)
        if group.nccl:
            _land(start_broadcast(group, arriving, what), place, header.tensors[first:stop], spans[first:stop],
                  digest)
        else:
            in_flight = start_broadcast(group, arriving, what)
            if landing is not None:
                _land(*landing, digest)
            landing = (in_flight, place, header.tensors[first:stop], spans[first:stop])
        del place, arriving  # no view of the mapping may outlive it
    if landing is not None:
        _land(*landing, digest)


def _map_base(base: dict | None, checksum: str, head: bytes, size: int, step: int) -> mmap.mmap:
    """The bytes of `base` (what this server serves), mapped copy-on-write (never written); TransferError unless they
    are the step the trainer sends changes against, laid out as this step is."""
    if base is None or base["checksum"] != checksum:
        held = "no full weights it received" if base is None else f"weights with checksum {base['checksum']}"
        raise TransferError(f"step {step} comes as changes against the weights with checksum {checksum}, but this "
                            f"server holds {held}")
    (_, own_size), = base["files"].values()
    if own_size != size:
        raise TransferError(f"step {step}'s tensors take {size} bytes, the weights it changes {own_size}")
    mapped = map_staged(base)  # as a worker maps a staged step
    _, served = next(mapped)
    mapped.close()  # closes the descriptor; the mapping stays
    if served[: len(head)] != head:
        served.close()
        raise TransferError(f"step {step}'s tensors are not those of the weights it changes (names, dtypes, shapes)")
    return served


def _receive_changes(group: StepGroup, data: mmap.mmap, served: mmap.mmap, header: Header, spans: list, step: int,
                     digest: TensorDigest) -> str | None:
    """A sparse step: per bucket, its tensors' counts, then their changes (or whole bytes), applied to the served
    bytes; each tensor then hashed whole, so the trainer's checksum proves the whole step. A bucket is applied while
    the next one arrives. Changes that cannot be applied are named in the second value, once the whole step has
    arrived (leaving mid-step would hold up the other receivers)."""
    altered, landing = [], None
    for first, stop in bucket_plan([end - begin for begin, end in spans], header.bucket_bytes):
        tensors, places = header.tensors[first:stop], spans[first:stop]
        what = bucket_name([name for name, _, _ in tensors], step)
        counts = torch.empty(stop - first, dtype=torch.int64, device=group.device)
        broadcast(group, counts, f"the counts of {what}")  # sent after the last bucket's changes: those arrived
        counts = counts.cpu().tolist()
        lengths = []
        for (name, dtype, _), (begin, end), count in zip(tensors, places, counts, strict=True):
            if not WHOLE <= count <= (end - begin) // max(dtype.itemsize, 1):
                raise TransferError(f"step {step} claims {count} changed elements of {name}")
            lengths.append(encoded_bytes(count, end - begin, dtype.itemsize))
        payload = torch.empty(sum(lengths), dtype=torch.uint8, device=group.device)
        in_flight = start_broadcast(group, payload, what) if len(payload) else None
        if landing is not None:
            _apply(*landing, data, served, digest, altered, step)
        landing = (in_flight, payload, tensors, places, counts, lengths)
        del payload
    if landing is not None:
        _apply(*landing, data, served, digest, altered, step)
    return altered[0] if altered else None


def _apply(in_flight: InFlight | None, payload: torch.Tensor, tensors: list, places: list, counts: list,
           lengths: list, data: mmap.mmap, served: mmap.mmap, digest: TensorDigest, altered: list, step: int
           ) -> None:
    """Wait for a sparse bucket's changes, apply each tensor's to its served bytes in `data` (a whole one is put in
    place as it is), and hash it."""
    if in_flight is not None:
        in_flight.wait()
    payload, offset = payload.cpu(), 0
    for (name, dtype, shape), (begin, end), count, length in zip(tensors, places, counts, lengths, strict=True):
        place = torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=begin) if end > begin else (
            torch.empty(0, dtype=torch.uint8))
        if count != WHOLE and end > begin:
            place.copy_(torch.frombuffer(served, dtype=torch.uint8, count=end - begin, offset=begin))
        try:
            apply_changes(place, count, payload[offset: offset + length], dtype.itemsize)
        except ValueError as e:
            altered.append(f"{name} of step {step} arrived altered: {e}")
        digest.update_bytes(name, dtype, shape, place)
        offset += length
        del place  # no view of a mapping may outlive it


def _land(in_flight: InFlight, place: torch.Tensor, tensors: list, spans: list, digest: TensorDigest) -> None:
    """Wait for a bucket to arrive, put it in its `place` (over NCCL: from the GPU), and hash each of its tensors."""
    in_flight.wait()
    if in_flight.tensor is not place:
        place.copy_(in_flight.tensor)
    begin = spans[0][0]
    for (name, dtype, shape), (tensor_begin, tensor_end) in zip(tensors, spans, strict=True):
        part = place[tensor_begin - begin: tensor_end - begin]
        digest.update_bytes(name, dtype, shape, part)
        del part


def take_over(received: dict) -> Received:
    """In the server: the step a worker received (`rl_receive_weights`'s report: its pid and memfd), opened through
    /proc as this process's own descriptor of the same sealed memfd (the worker may then close its own)."""
    fd = os.open(f"/proc/{received['pid']}/fd/{received['fd']}", os.O_RDONLY | os.O_CLOEXEC)
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
        os.close(fd)
        raise CorruptFileError(f"the memfd worker {received['pid']} received into is not sealed")
    return Received(StagedStep({WIRE_FILE: (fd, received["size"])}, received["checksum"]), received["adapter_config"])


class PrivateCopies:
    """Directories of this server alone (0700, under one temporary root removed at exit), one per adapter step,
    holding the adapter's files as the server read and checked them."""

    def __init__(self):
        self.root: Path | None = None

    def stage_adapter(self, step: OpenDir, manifest: dict[str, Entry]) -> str:
        """Copy an adapter step's two files, each read once through the step's handle and checked, into a new
        private directory, which it returns (the step's manifest describes it)."""
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            if name not in manifest:
                raise CorruptFileError(f"{step} is an adapter step but lists no {name}")
        copy = Path(self._new_copy(step.path.name))
        try:
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                data = read_listed(step, name, manifest[name])
                fd = os.open(copy / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
        except BaseException:
            self.remove(str(copy))
            raise
        return str(copy)

    def write_adapter(self, received: Received, step: int) -> tuple[str, dict[str, Entry]]:
        """An adapter step that arrived over the wire, written as its two files into a new private directory (its
        path), and their manifest (size and CRC-32 of what was written), which the workers check as they read it."""
        if received.adapter_config is None:
            raise CorruptFileError(f"step {step} arrived without an adapter config: it holds full weights")
        copy = self._new_copy(f"step_{step}")
        fd, size = received.staged.files[WIRE_FILE]
        manifest = {}
        try:
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as weights:
                for name, data in ((ADAPTER_WEIGHTS, weights), (ADAPTER_CONFIG, received.adapter_config.encode())):
                    manifest[name] = Entry(len(data), zlib_ng.crc32(data))
                    out = os.open(Path(copy) / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    with os.fdopen(out, "wb") as file:
                        file.write(data)
        except BaseException:
            self.remove(copy)
            raise
        return copy, manifest

    def _new_copy(self, label: str) -> str:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="rl-adapters-"))
        return tempfile.mkdtemp(prefix=f"{label}-", dir=self.root)

    def remove(self, copy: str | None) -> None:
        """Remove one private copy (never a path outside the root)."""
        if copy and self.root is not None and Path(copy).parent == self.root:
            shutil.rmtree(copy, ignore_errors=True)

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
