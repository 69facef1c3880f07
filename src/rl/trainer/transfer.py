"""The trainer's side of the collective transport (rl/weights/ says how a step travels).

Every rank takes part in each tensor's gather (FSDP's all-gather, tensor by tensor, as the files path gathers them);
rank 0 alone holds the run's store and the group with the servers (kept from step to step while every member holds
it: `GroupKeeper`) and broadcasts the tensors, in the served dtype, as they become whole: a big one at once, small
ones together once their bucket is full (`bucket_plan`). Each broadcast goes on while the next bucket is gathered,
packed and hashed, and is waited on before the next starts: rank 0 holds at most two buckets (or whole tensors)
beyond its shards, the others none. Over gloo the whole tensor is on rank 0's host; over NCCL it stays on rank 0's
GPU, which broadcasts it, and comes to the host only to be hashed.
A failed transfer (no server joined in time, one died mid-broadcast) is logged with its reason and the run goes on:
the servers keep the weights they verified last, and the next step's transfer brings every server that answers to
that step. Every rank learns how the step went, so all ranks agree on what was sent.

One registered engine per way (rl/weights/__init__.py): `GlooSender` and `NcclSender` send every step whole,
`SparseGlooSender` and `SparseNcclSender` its changes (`ChangesSent`, rl/weights/sparse.py); the backend decides only
where a gathered tensor lies (`_gather_whole`) and whether the sparse host copy is pinned (`_pin`).
"""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist

from rl.adapter import adapter_checksum
from rl.host_memory import pin_exactly, unpin
from rl.weights.config import CollectiveTransfer
from rl.trainer.lora import LoRALinear, adapter_tensors, full_tensor, merged_weight
from rl.trainer.config import TrainerConfig
from rl.trainer.weights import WeightPublisher, published_sources, weight_of
from rl.trainer.world import World
from rl.weights import SENDERS, Sender, TransferError
from rl.weights.digest import TensorDigest, tensor_bytes
from rl.weights.group import Deadline, GroupKeeper, InFlight, broadcast, start_broadcast, start_store
from rl.weights.header import BUCKET_BYTES, bucket_name, bucket_plan, checksum_seal, pack_digest, send_header
from rl.weights.offers import Offer, clear_transfers, wait_for_take, write_offer, write_sent
from rl.weights.sparse import WHOLE, common_base, encode_changes

logger = logging.getLogger(__name__)
HOST_COPY_SHARE = 0.8  # of the host's available memory, the most a sparse sender's copy of the weights may take


class CollectiveSender(Sender):
    """What every collective engine shares: each step's weights to the servers the orchestrator asked to take them,
    and as files only where a checkpoint needs them (a resume serves them). Collective: every rank calls `send` for
    every step. An engine names its `backend` and where a gathered tensor lies (`_gather_whole`); a step goes whole
    unless the engine encodes it otherwise (`ChangesSent`)."""

    backend: ClassVar[str]  # the step group's (rl/weights/group.py)
    how: ClassVar[str]  # the engine, as the log names it

    def __init__(self, config: CollectiveTransfer, output_dir, world: World, dtype: torch.dtype, first_step: int,
                 adapter_config: bytes | None = None):
        self.config, self.output_dir, self.world, self.dtype = config, output_dir, world, dtype
        self.adapter_config = adapter_config  # set: the trainer sends its LoRA adapter (PEFT names), not the weights
        self.store: dist.TCPStore | None = None
        self.groups = GroupKeeper()  # rank 0's group with the servers, kept from step to step while it serves
        self.staging: list[torch.Tensor] | None = None  # rank 0's two bucket buffers (`_packed`)
        self.key = config.key()  # seals every step: servers load nothing else
        self._check_world(world)
        self.files: WeightPublisher | None = None  # where checkpoint steps go as files too (`create`)
        self.files_due: Callable[[int], bool] = lambda step: False
        if world.is_main:
            clear_transfers(output_dir, first_step)  # a resumed run's old offers name a store that is gone
            self.store = start_store(config.host, config.port, config.timeout_s)
            logger.info(f"weights go over the wire ({self.how}): transfer store on "
                        f"{config.host}:{self.store.port}")

    @classmethod
    def create(cls, config: TrainerConfig, publisher: WeightPublisher, world: World, first_step: int
               ) -> CollectiveSender:
        sender = cls(config.transfer, config.output_dir, world, publisher.dtype, first_step, publisher.adapter_config)
        # a checkpoint's step goes as files too (a resume serves them); step 0 (the first adapter) never does
        sender.files, sender.files_due = publisher, lambda step: step > 0 and config.ckpt.due(step, config.max_steps)
        return sender

    def check(self, model: torch.nn.Module) -> None:
        self.check_host_memory(model)

    def publish(self, step: int, model: torch.nn.Module) -> dict:
        stats = self.send(step, model)
        if self.files is not None and self.files_due(step):
            self.files.publish(step, model)
        return stats

    def check_host_memory(self, model: torch.nn.Module, available: int | None = None) -> None:
        """Refuse, before training, a host copy of the served weights this host cannot hold: a whole step keeps
        none (`ChangesSent` does)."""

    def _check_world(self, world: World) -> None:
        """Refuse a trainer this engine cannot send from (any, by default)."""

    @abstractmethod
    def _gather_whole(self, source: torch.Tensor) -> torch.Tensor | None:
        """Collective: the whole of a sharded tensor in the served dtype on rank 0 (None elsewhere), where the
        engine's broadcast sends it from."""

    def _pin(self, host: torch.Tensor) -> bool:
        """Whether `host` (the sparse host copy) was registered with CUDA (not by default)."""
        return False

    # How a step is encoded: whole, unless an engine sends its changes (`ChangesSent`).

    def _keep_what_is_sent(self, names: list[str], sizes: list[int]) -> None:
        """Rank 0, before a step: keep what the next step is compared against (nothing, for whole steps)."""

    def _base(self, step: int, receivers: int, deadline: Deadline) -> str | None:
        """The checksum of the step the receivers hold that this one goes as changes against (None: whole)."""
        return None

    def _encoded(self, name: str, full: torch.Tensor, against_base: bool, device: torch.device,
                 digest: TensorDigest) -> tuple[int, torch.Tensor]:
        """A tensor's count and bytes in its bucket (hashed into `digest`): whole, on the device that broadcasts."""
        data = tensor_bytes(full.to(device))
        digest.update(name, full)
        return WHOLE, data

    def _sent(self, digest: TensorDigest, reached_all: bool) -> None:
        """After a step: what the next one may go against (nothing, for whole steps)."""

    def send(self, step: int, model: torch.nn.Module) -> dict:
        """Offer step `step`, wait for the orchestrator to take it, broadcast it. Returns the step's metrics:
        `weights_checksum` (rank 0, what every server must report it serves; `adapter_checksum` too for an adapter),
        `weights_sent`, `transfer_wait_s`, `transfer_s`."""
        return self.send_tensors(step, self._tensors(model))

    def send_tensors(self, step: int, tensors: list[tuple[str, torch.Tensor | LoRALinear]]) -> dict:
        """`send` of the given (name, source) pairs, in order."""
        meta = [(name, self.dtype, _shape(source)) for name, source in tensors]
        sizes = [self.dtype.itemsize * _numel(source) for _, source in tensors]
        config = None if self.adapter_config is None else self.adapter_config.decode()
        start = time.perf_counter()
        if self.world.is_main:
            write_offer(self.output_dir, Offer(step, self.config.host, self.store.port, sum(sizes)))
        receivers = wait_for_take(self.output_dir, step, self.config.offer_timeout_s)  # every rank: all agree
        waited = time.perf_counter() - start
        group, failure, base, header_seal = None, None, None, b""
        deadline = Deadline(self.config.timeout_s, step)  # one for the whole step, from the take on
        if self.world.is_main:
            self._keep_what_is_sent([name for name, _ in tensors], sizes)
        if self.world.is_main and receivers == 0:
            failure = "no server was up to take it"
        elif self.world.is_main:
            try:
                group = self.groups.join(self.store, step, 0, receivers + 1, deadline, self.backend)
                base = self._base(step, receivers, deadline)
                # the receivers read as the header says
                header_seal = send_header(group, step, meta, config, BUCKET_BYTES, self.key, base)
            except TransferError as e:
                failure = str(e)
        digest, in_flight, sent_bytes = TensorDigest(), [], 0
        for index, (first, stop) in enumerate(bucket_plan(sizes, BUCKET_BYTES)):
            bucket, counts = [], []  # every rank gathers every tensor; rank 0 sends each bucket while nothing failed
            for name, source in tensors[first:stop]:
                full = self._gather(source)
                if group is not None and failure is None:
                    count, data = self._encoded(name, full, base is not None, group.device, digest)
                    bucket.append(data)
                    counts.append(count)
                del full
            if bucket:  # gathered while the previous bucket was on its way; now that one must have arrived
                data = bucket[0] if len(bucket) == 1 else self._packed(bucket, index % 2, group.device)
                failure, in_flight = _waited(in_flight), []
                if failure is None:
                    try:
                        what = bucket_name([name for name, _ in tensors[first:stop]], step)
                        if base is not None:  # the receivers learn how much follows, and how to read it
                            counts = torch.tensor(counts, dtype=torch.int64, device=group.device)
                            in_flight.append(start_broadcast(group, counts, f"the counts of {what}"))
                        if len(data):  # a sparse bucket where nothing changed sends nothing more
                            in_flight.append(start_broadcast(group, data, what))
                        sent_bytes += len(data)
                    except TransferError as e:
                        failure = str(e)
                del data
            del bucket
        failure = failure or _waited(in_flight)
        del in_flight
        if group is not None and failure is None:
            try:
                sealed = checksum_seal(self.key, header_seal, digest.digest())
                broadcast(group, pack_digest(sealed, group.device), f"step {step}'s checksum")
            except TransferError as e:
                failure = str(e)
        if group is not None:
            self.groups.done(failed=failure is not None)
        self._sent(digest, reached_all=group is not None and failure is None)
        failed, = self.world.all_reduce([1.0 if failure is not None else 0.0], op="max")  # rank 0's verdict
        stats = {"weights_sent": failed == 0.0, "transfer_wait_s": waited,
                 "transfer_s": time.perf_counter() - start - waited}
        if self.world.is_main:  # what travelled: all of the step's bytes, or (sparse) its changes
            stats |= {"transfer_bytes": sent_bytes, "transfer_sparse": base is not None}
        if self.adapter_config is not None and self.world.is_main:  # as inference reports the adapter it serves
            stats["adapter_checksum"] = adapter_checksum((name, source) for name, source in tensors)
        if self.world.is_main:
            if failure is None:
                stats["weights_checksum"] = digest.hexdigest()
                # what the orchestrator holds each server's report to: an adapter is reported by its own checksum
                write_sent(self.output_dir, step, stats.get("adapter_checksum", digest.hexdigest()))
            else:
                logger.error(f"the weights of step {step} did not reach inference ({failure}); the servers keep "
                             "the weights they verified last, and the next step is offered as usual")
        return stats

    def _tensors(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor | LoRALinear]]:
        """(name sent, what it is gathered from): what the files path publishes (`published_sources`); with an
        adapter, its A and B matrices under PEFT's names, already whole (gathered here: they are small)."""
        if self.adapter_config is not None:
            return list(adapter_tensors(model, self.dtype).items())
        return published_sources(model)

    def _gather(self, source: torch.Tensor | LoRALinear) -> torch.Tensor | None:
        """Collective: the whole tensor in the served dtype on rank 0 (None elsewhere), where the engine's broadcast
        sends it from (`_gather_whole`)."""
        if isinstance(source, LoRALinear):
            full = merged_weight(source, self.dtype)
            return full if self.world.is_main else None
        if self.adapter_config is not None:  # adapter tensors: already whole on every rank
            return source
        return self._gather_whole(source)

    def _packed(self, bucket: list[torch.Tensor], slot: int, device: torch.device) -> torch.Tensor:
        """A bucket's tensors, one after the other, in staging buffer `slot` (of two, reused from bucket to bucket
        and step to step: one is on its way while the other fills; a fresh allocation each time cost page faults
        on the CPU)."""
        if self.staging is None or self.staging[0].device != device:
            self.staging = [torch.empty(BUCKET_BYTES, dtype=torch.uint8, device=device) for _ in range(2)]
        size = sum(len(data) for data in bucket)
        return torch.cat(bucket, out=self.staging[slot][:size])

    def close(self) -> None:
        self.groups.drop()
        self.staging = None
        self.store = None


def collective_sender(config: CollectiveTransfer, output_dir, world: World, dtype: torch.dtype, first_step: int,
                      adapter_config: bytes | None = None) -> CollectiveSender:
    """The sender of the engine `config` names (rl/weights/), outside a trainer's run (tests, benchmarks)."""
    return SENDERS.load(config.engine)(config, output_dir, world, dtype, first_step, adapter_config)


class GlooSender(CollectiveSender):
    """gloo: each tensor gathered to rank 0's host and broadcast from there."""

    backend = how = "gloo"

    def _gather_whole(self, source: torch.Tensor) -> torch.Tensor | None:
        return full_tensor(source, self.dtype, to_host=self.world.is_main)


class NcclSender(CollectiveSender):
    """NCCL: each tensor gathered on rank 0's GPU and broadcast from there (to the host only to be hashed)."""

    backend = how = "nccl"

    def _check_world(self, world: World) -> None:
        if not world.on_gpu:
            raise TransferError(f"transfer.backend = 'nccl' needs the trainer on CUDA GPUs; this one runs on "
                                f"{world.device.type}: use 'gloo'")

    def _gather_whole(self, source: torch.Tensor) -> torch.Tensor | None:
        full = full_tensor(source, self.dtype, on_device=True)
        return full if self.world.is_main else None

    def _pin(self, host: torch.Tensor) -> bool:
        return pin_exactly(host)


class ChangesSent(CollectiveSender):
    """Sparse (rl/weights/sparse.py): rank 0 keeps the bytes it sent last (one host copy of the served weights) and
    their checksum, the base it sends changes against once every server serves it. An adapter always goes whole: it
    is small."""

    def __init__(self, config: CollectiveTransfer, output_dir, world: World, dtype: torch.dtype, first_step: int,
                 adapter_config: bytes | None = None):
        self.changes = adapter_config is None  # else every step goes whole
        self.sent: dict[str, torch.Tensor] = {}  # views of one host buffer (`_keep_host_copy`)
        self.pinned: torch.Tensor | None = None  # that buffer, where it is registered with CUDA
        self.base: str | None = None
        super().__init__(config, output_dir, world, dtype, first_step, adapter_config)
        if not self.changes and world.is_main:
            logger.info("transfer.sparse: LoRA adapters go whole every step (each step changes most of them)")

    def check_host_memory(self, model: torch.nn.Module, available: int | None = None) -> None:
        """Refuse, before training, a host copy of the served weights (kept by rank 0) that this host's available
        memory (`available`, else psutil's) cannot hold beside the rest; TransferError names both sizes."""
        if not (self.changes and self.world.is_main):
            return
        import psutil

        needed = sum(self.dtype.itemsize * _numel(source) for _, source in self._tensors(model))
        available = psutil.virtual_memory().available if available is None else available
        if needed > HOST_COPY_SHARE * available:
            raise TransferError(
                f"transfer.sparse = true keeps a host copy of the served weights on trainer "
                f"rank 0 ({needed / 2**30:.1f} GiB), but this host has {available / 2**30:.1f} GiB available: use "
                "transfer.sparse = false, which sends every step whole")

    def _keep_what_is_sent(self, names: list[str], sizes: list[int]) -> None:
        if self.changes:
            self._keep_host_copy(names, sizes)

    def _base(self, step: int, receivers: int, deadline: Deadline) -> str | None:
        """Changes only if every server serves the step sent last."""
        return common_base(self.store, step, receivers, self.base, deadline) if self.changes else None

    def _encoded(self, name: str, full: torch.Tensor, against_base: bool, device: torch.device,
                 digest: TensorDigest) -> tuple[int, torch.Tensor]:
        """Compared where it is (over NCCL on the GPU), hashed from the host copy."""
        if not self.changes:
            return super()._encoded(name, full, against_base, device, digest)
        count, data = self._changes(name, tensor_bytes(full), against_base)
        digest.update_bytes(name, full.dtype, tuple(full.shape), self.sent[name])
        return count, data

    def _sent(self, digest: TensorDigest, reached_all: bool) -> None:
        """The next step's base: this one, if every server now holds it (else the next step goes whole)."""
        self.base = digest.hexdigest() if self.changes and reached_all else None

    def _keep_host_copy(self, names: list[str], sizes: list[int]) -> None:
        """Sparse, rank 0: one host buffer for the bytes of every tensor sent last (`sent`, views in send order),
        made at the first step. On a GPU it is pinned (registered with CUDA, at its exact size), so the bytes go up to
        be compared and come down to be hashed at the link's speed rather than a pageable copy's."""
        if [(name, len(self.sent.get(name, ()))) for name in names] == list(zip(names, sizes)):
            return
        self._drop_host_copy()
        host = torch.empty(sum(sizes), dtype=torch.uint8)
        if self._pin(host):
            self.pinned = host
        self.sent = dict(zip(names, host.split(sizes)))

    def _drop_host_copy(self) -> None:
        self.sent, self.base = {}, None
        if self.pinned is not None:
            unpin(self.pinned)
            self.pinned = None

    def _changes(self, name: str, data: torch.Tensor, against_base: bool) -> tuple[int, torch.Tensor]:
        """A sparse step's count and bytes for tensor `name` (its bytes `data`, on the host or rank 0's GPU): its
        changes since the step sent last where the step goes against that base and they are smaller (compared on
        `data`'s device), else WHOLE and `data`. Either way `data` is kept on the host as what was sent last."""
        sent = self.sent[name]
        count, encoded = WHOLE, data
        if against_base:  # the base goes up to the GPU (pinned: asynchronously, ordered before the compare)
            count, encoded = encode_changes(data, sent.to(data.device, non_blocking=True), self.dtype.itemsize)
        sent.copy_(data, non_blocking=True)  # after the base went up: the same stream
        if data.is_cuda:
            torch.cuda.current_stream(data.device).synchronize()  # down before it is hashed
        return count, encoded

    def close(self) -> None:
        super().close()
        self._drop_host_copy()


class SparseGlooSender(ChangesSent, GlooSender):
    """sparse_gloo: each step's changes (or the tensors whole) from rank 0's host."""

    how = "gloo, sparse"


class SparseNcclSender(ChangesSent, NcclSender):
    """sparse_nccl: each step's changes, found on rank 0's GPU, hashed through a pinned host copy."""

    how = "nccl, sparse"


def _waited(in_flight: list[InFlight]) -> str | None:
    """Wait for the broadcasts in flight; why one failed, or None."""
    try:
        for one in in_flight:
            one.wait()
    except TransferError as e:
        return str(e)
    return None


def _shape(source: torch.Tensor | LoRALinear) -> tuple[int, ...]:
    return tuple(weight_of(source).shape)


def _numel(source: torch.Tensor | LoRALinear) -> int:
    return torch.Size(_shape(source)).numel()
