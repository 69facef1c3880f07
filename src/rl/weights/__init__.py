"""Weights in motion: the collective transport shared by the trainer (which sends) and the inference servers
(which receive), beside the filesystem transport (weights/step_k/, rl/trainer/weights.py).

The package: `digest` (the checksum), `offers` (the files through which trainer and orchestrator agree on a step),
`group` (the store, the step's group, broadcasts with deadlines), `header` (what a step announces, bucket plan and
layout), `sparse` (the codec of a step sent as its changes).

Each way weights travel is one engine per side, registered by name (`SENDERS.register_engine(name, module,
class)`, `RECEIVERS` likewise, in the manner of vLLM's weight-transfer engine factory): the trainer's sender
(`Sender`: one `publish` per step) and a server's receiver (`Receiver`: one `receive` per step), imported only when a
config names them (`transfer.engine`: filesystem, gloo, nccl, sparse_gloo, sparse_nccl). Nothing else asks which
way a run uses.

With `transfer.backend = "gloo"` a step's weights travel trainer -> every server with no file in between:

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

With `transfer.backend = "nccl"` (GPU hosts) the same protocol runs over NCCL between GPUs: the trainer broadcasts
each gathered tensor from its rank 0's GPU, and on each server its first worker (`rl_receive_weights` in
rl/inference/worker.py, the one process of a server that holds a GPU of its own and an NCCL library) receives it into
GPU memory and copies it into the memfd, which the server then takes over as if it had received it itself: from
there on, the checks, the reload on every tensor-parallel worker, the verification and the rollback are the ones of
gloo and of files. Both sides hash the bytes on the host (the same checksum as files), so `weights_checksum` means
the same whatever the transport.

Every wait has a deadline: the trainer's wait for the take (`offer_timeout_s`), and one for the whole step on both
ends (`timeout_s`: the store, the group's forming, every broadcast; NCCL's wait blocks with that deadline, and a group
that failed is aborted, so no kernel of it is left waiting on a GPU). A group is kept only while every member of the
step holds it, and dropped by whoever's transfer failed, so no stale member can hang a later step. Every step is
sealed with the run's secret (`digest.seal`), and a server checks its header before it allocates anything for it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod


class TransferError(RuntimeError):
    """A collective transfer failed or timed out; the message names the step and what it waited for."""


class StepRefused(TransferError):
    """A step this server will not take, for what its header or checksum says (unsealed, malformed, not of the
    served model, not newer); `status` is the HTTP status the refusal answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Sender(ABC):
    """The trainer's end of a transport; collective: every rank calls each method, in the same order."""

    @classmethod
    @abstractmethod
    def create(cls, config, publisher, world, first_step: int) -> Sender:
        """The sender of a trainer's run (`config`: its TrainerConfig; `publisher`: its writer of step files)."""

    def check(self, model) -> None:
        """Refuse, before any step is trained, what this transport cannot do for `model` (nothing, by default)."""

    @abstractmethod
    def publish(self, step: int, model) -> dict:
        """Make step `step`'s weights reach inference; the step's metrics (rank 0's; `adapter_checksum` where an
        adapter went, as inference will report it)."""

    def close(self) -> None:
        """Release what the sender holds (stores, groups, buffers)."""


class Receiver(ABC):
    """A server's end of a transport: each step received while generation goes on, into memory of the server's own,
    and checked against the trainer's sealed checksum; the server then loads what it returns (nothing is loaded
    here)."""

    @classmethod
    @abstractmethod
    def create(cls, engine, key: bytes, adapters: bool, hold_generation, served) -> Receiver:
        """The receiver of one server. `engine`: vLLM's engine client (its workers answer `collective_rpc`); `key`:
        the run's transfer key; `adapters`: whether the server serves LoRA adapters (what a step must be);
        `hold_generation`: an async context manager factory inside which the server generates nothing; `served`: a
        call that gives the full weights served (the server's staged step, a handle of the caller's own, to release)
        where they came over the wire and verified, else None (what a step sent as changes applies to)."""

    @abstractmethod
    async def receive(self, spec, step: int):
        """Step `step`, received through the group `spec` names (an `offers.GroupSpec`) and checked (the server's
        `Received`): StepRefused for a step this server will not take, CorruptFileError for one that arrived altered,
        TransferError for one that did not arrive."""


class Engines:
    """One side's engines by name, each "module", "Class", imported when a config names it (vLLM's
    `WeightTransferEngineFactory`). A name registered with no module has no engine on this side."""

    def __init__(self, side: str):
        self.side = side
        self.registry: dict[str, tuple[str, str] | None] = {}

    def register_engine(self, name: str, module: str | None, class_name: str | None) -> None:
        if name in self.registry:
            raise ValueError(f"the {self.side} engine {name!r} is registered already")
        self.registry[name] = None if module is None else (module, class_name)

    def load(self, name: str) -> type | None:
        """The engine class registered as `name` (None: registered without one); ValueError for another name."""
        if name not in self.registry:
            raise ValueError(f"no {self.side} engine {name!r} is registered (there are {sorted(self.registry)})")
        where = self.registry[name]
        return None if where is None else getattr(importlib.import_module(where[0]), where[1])


SENDERS = Engines("sender")
RECEIVERS = Engines("receiver")

SENDERS.register_engine("filesystem", "rl.trainer.weights", "FilesSender")
SENDERS.register_engine("gloo", "rl.trainer.transfer", "GlooSender")
SENDERS.register_engine("nccl", "rl.trainer.transfer", "NcclSender")
SENDERS.register_engine("sparse_gloo", "rl.trainer.transfer", "SparseGlooSender")
SENDERS.register_engine("sparse_nccl", "rl.trainer.transfer", "SparseNcclSender")
RECEIVERS.register_engine("filesystem", None, None)  # servers read its steps as files (`/update_weights {"path"}`)
RECEIVERS.register_engine("gloo", "rl.inference.wire", "GlooReceiver")
RECEIVERS.register_engine("nccl", "rl.inference.wire", "NcclReceiver")
RECEIVERS.register_engine("sparse_gloo", "rl.inference.wire", "SparseGlooReceiver")
RECEIVERS.register_engine("sparse_nccl", "rl.inference.wire", "SparseNcclReceiver")
