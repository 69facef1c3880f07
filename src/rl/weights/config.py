"""The `[transfer]` section every process shares: how each step's weights reach inference (rl/weights/).

A union on `type`: `filesystem` (the default: weights/step_k/ files every step) or `collective` (a broadcast from the
trainer to every server, with its `backend` and whether it is `sparse`). Each names one registered engine per side,
its `engine` (rl/weights/__init__.py), once its `way` (the backend) is resolved: `backend = "auto"` becomes NCCL's on
CUDA hosts and gloo's elsewhere.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BeforeValidator, Field

from rl.config import ConfigError, Secret, Section

logger = logging.getLogger(__name__)


class FilesTransfer(Section):
    """Every step's weights as files in weights/step_k/, which each server reads (rl/trainer/weights.py)."""

    # Not dumped: a table without a type reads as files anyway, and a process's default section is dumped under
    # what was given (pydantic-settings' partial update), where its type must not outvote a given backend.
    type: Annotated[
        Literal["filesystem"], Field(exclude=True, description="steps as files the servers read")
    ] = "filesystem"
    sparse: ClassVar[bool] = False  # every file holds a whole tensor

    @property
    def way(self) -> str:
        return "filesystem"

    @property
    def engine(self) -> str:
        """The registered engines its steps travel by (rl/weights/__init__.py)."""
        return "filesystem"

    def key(self) -> None:
        """Files need no seal: they are written on the run's own disk."""
        return None

    def resolve_device(self, device: str, process: str) -> str:
        return "set by you"


class CollectiveTransfer(Section):
    """Each step broadcast from trainer rank 0 to every server over the run's `backend`, files only at checkpoints
    (resume needs them); the servers join the trainer's store at `host`:`port`."""

    type: Annotated[Literal["collective"], Field(description="steps broadcast to every server")] = "collective"
    backend: Annotated[
        Literal["auto", "gloo", "nccl"],
        Field(description="gloo (CPU hosts) or nccl (GPUs: trainer GPU to each server's first worker's GPU); auto: "
                          "nccl on CUDA hosts, gloo elsewhere"),
    ] = "auto"
    sparse: Annotated[
        bool, Field(description="send only the elements that changed since the step every server serves (keeps one "
                                "host copy of the served weights on trainer rank 0; LoRA adapters go whole)")
    ] = False
    host: Annotated[
        str, Field(min_length=1, description="address the servers reach the trainer's rank 0 at (its TCP store)")
    ] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535, description="the store's port on the trainer (0: any free port)")] = 0
    timeout_s: Annotated[
        float, Field(gt=0, description="deadline for a whole step over the wire: reaching the store, the group "
                                       "forming, every byte and the checksum (raise it where a step's bytes take "
                                       "longer over the link)")
    ] = 60.0
    secret: Annotated[
        Secret | None, Field(min_length=16, description="the run's secret: every step over the wire is sealed with a "
                                                        "key derived from it, and servers load only sealed steps; rl "
                                                        "makes one per run (for processes started by hand, set the "
                                                        "same one in each one's environment)")
    ] = None
    offer_timeout_s: Annotated[
        float, Field(gt=0, description="longest the trainer waits for the orchestrator to take an offered step")
    ] = 1800.0

    @property
    def way(self) -> str:
        """The backend its steps travel over, once resolved."""
        if self.backend == "auto":
            raise ConfigError("transfer.backend = 'auto' is resolved on the process's device (trainer and inference "
                              "do so at start); name 'gloo' or 'nccl' where no device is known")
        return self.backend

    @property
    def engine(self) -> str:
        """The registered engines its steps travel by (rl/weights/__init__.py): the way, and sparse_ before it where
        steps go as their changes."""
        return f"sparse_{self.way}" if self.sparse else self.way

    def key(self) -> bytes:
        """The key that seals each step over the wire (rl/weights/digest.py); ConfigError without a secret."""
        from rl.weights.digest import transfer_key

        if self.secret is None:
            raise ConfigError("transfer.type = 'collective' seals every step with transfer.secret, which is not set: "
                              "rl makes one per run; for a trainer and servers started by hand, give each the same "
                              "one in its environment (RL_TRAINER__TRANSFER__SECRET, RL_INFERENCE__TRANSFER__SECRET; "
                              "e.g. $(openssl rand -hex 32))")
        return transfer_key(self.secret)

    def resolve_device(self, device: str, process: str) -> str:
        """Fill `backend = "auto"` (NCCL's on CUDA hosts, gloo's elsewhere), then refuse a backend the device cannot
        run; returns why the backend is what it is, for `rl --dry-run`."""
        why = "set by you"
        if self.backend == "auto":
            self.backend, why = ("nccl" if device == "cuda" else "gloo"), f"auto: {device.upper()}"
        if self.backend == "nccl" and device != "cuda":  # NCCL moves tensors between GPUs only
            raise ConfigError(f"transfer.backend = 'nccl' needs CUDA GPUs, but the {process} runs on {device}: use "
                              "'gloo' on CPU hosts")
        return why


# The one-string spellings before the union, each with what it now reads as.
OLD_TRANSPORTS = {
    "filesystem": {"type": "filesystem"},
    "collective": {"type": "collective"},
    "sparse": {"type": "collective", "sparse": True},
    "gloo": {"type": "collective", "backend": "gloo"},
    "nccl": {"type": "collective", "backend": "nccl"},
    "sparse_gloo": {"type": "collective", "backend": "gloo", "sparse": True},
    "sparse_nccl": {"type": "collective", "backend": "nccl", "sparse": True},
}
CHOOSES_COLLECTIVE = ("backend", "sparse")  # given without a type, these name a collective


def _typed(data: Any) -> Any:
    """A `[transfer]` table as the union reads it: `transport = "..."` (the old spelling) rewritten, with a warning
    that names the new one; with no `type`, collective if a backend or `sparse` is named, else files."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    if "transport" in data:
        old = data.pop("transport")
        if old not in OLD_TRANSPORTS:
            raise ValueError(f"transfer.transport = {old!r} is none of {sorted(OLD_TRANSPORTS)} (the old spelling of "
                             "transfer.type / backend / sparse)")
        new = OLD_TRANSPORTS[old]
        logger.warning(f"transfer.transport = {json.dumps(old)} is the old spelling of "
                       + ", ".join(f"transfer.{k} = {json.dumps(v)}" for k, v in new.items()) + "; it still works")
        data = {**new, **data}
    if "type" not in data:
        data["type"] = "collective" if any(name in data for name in CHOOSES_COLLECTIVE) else "filesystem"
    if data["type"] == "filesystem":
        data.pop("secret", None)  # a host's exported secret, meant for runs over the wire; files need none
        wire_only = sorted(set(data) - {"type"})
        if wire_only and wire_only[0] in CollectiveTransfer.model_fields:
            raise ValueError(f"transfer.{wire_only[0]} is a setting of transfer.type = \"collective\" (weights over "
                             "the wire), and this transfer is \"filesystem\": set transfer.type, or drop it")
    return data


TransferConfig = Annotated[
    Union[FilesTransfer, CollectiveTransfer],
    Field(discriminator="type", description="how each step's weights reach inference"),
    BeforeValidator(_typed),
]
