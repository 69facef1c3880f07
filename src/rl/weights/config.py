"""The `[transfer]` section every process shares: how each step's weights reach inference (rl/weights/)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from rl.config import ConfigError, Section


class TransferConfig(Section):
    """How each step's weights reach inference (rl/weights/); `rl` fills trainer, orchestrator and inference
    from one `--transfer.*` so the three agree."""

    transport: Annotated[
        Literal["filesystem", "collective", "sparse", "gloo", "nccl", "sparse_gloo", "sparse_nccl"],
        Field(description="filesystem: weights/step_k/ files every step; gloo (CPU hosts) or nccl (GPUs): a broadcast "
                          "from the trainer to every server each step, files only at checkpoints (resume needs them); "
                          "sparse_gloo / sparse_nccl: the same, sending only the elements that changed since the step "
                          "every server serves (needs one host copy of the served weights on trainer rank 0); "
                          "collective / sparse: nccl / sparse_nccl on CUDA hosts, gloo / sparse_gloo on CPU hosts"),
    ] = "filesystem"
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
        str | None, Field(min_length=16, description="the run's secret: every step over the wire is sealed with a key "
                                                     "derived from it, and servers load only sealed steps; rl makes "
                                                     "one per run (for processes started by hand, set the same "
                                                     "one in each one's environment)")
    ] = None
    offer_timeout_s: Annotated[
        float, Field(gt=0, description="longest the trainer waits for the orchestrator to take an offered step")
    ] = 1800.0

    @property
    def collective(self) -> bool:
        return self.transport != "filesystem"

    @property
    def way(self) -> str:
        """The registered transport its steps travel by (rl/weights/): filesystem, gloo or nccl."""
        return self.backend if self.collective else "filesystem"

    @property
    def backend(self) -> str:
        """The collective's backend: nccl or gloo."""
        return transport_backend(self.transport)

    def key(self) -> bytes:
        """The key that seals each step over the wire (rl/weights/digest.py); ConfigError without a secret."""
        from rl.weights.digest import transfer_key

        if self.secret is None:
            raise ConfigError(f"transfer.transport = {self.transport!r} seals every step with transfer.secret, which "
                              "is not set: rl makes one per run; for a trainer and servers started by hand, give "
                              "each the same one in its environment (RL_TRAINER__TRANSFER__SECRET, "
                              "RL_INFERENCE__TRANSFER__SECRET; e.g. $(openssl rand -hex 32))")
        return transfer_key(self.secret)

    @property
    def sparse(self) -> bool:
        """Whether a step sends only what changed since the step every server serves."""
        return transport_sparse(self.transport)

    def resolve_device(self, device: str, process: str) -> str:
        """Fill a transport left to the device (`collective`, `sparse`: NCCL's on CUDA hosts, gloo's elsewhere), then
        refuse one the device cannot run; returns why the transport is what it is, for `rl --dry-run`."""
        if self.transport not in DEVICE_TRANSPORTS:
            self.check_device(device, process)
            return "set by you"
        chosen = DEVICE_TRANSPORTS[self.transport]["nccl" if device == "cuda" else "gloo"]
        why, self.transport = f"{self.transport}: {device.upper()}", chosen
        return why

    def check_device(self, device: str, process: str) -> None:
        """NCCL moves tensors between GPUs only."""
        if self.backend == "nccl" and device != "cuda":
            raise ConfigError(f"transfer.transport = {self.transport!r} needs CUDA GPUs, but the {process} runs on "
                              f"{device}: use {self.transport.replace('nccl', 'gloo')!r} on CPU hosts")


DEVICE_TRANSPORTS = {"collective": {"nccl": "nccl", "gloo": "gloo"},
                     "sparse": {"nccl": "sparse_nccl", "gloo": "sparse_gloo"}}


def transport_backend(transport: str) -> str:
    """The collective backend a transport broadcasts over (`filesystem`: none, reported as gloo)."""
    return "nccl" if transport.endswith("nccl") else "gloo"


def transport_sparse(transport: str) -> bool:
    """Whether a transport sends a step as its changes where it can."""
    return transport.startswith("sparse")
