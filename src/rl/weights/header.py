"""A step's header (what the trainer announces before the bytes: every tensor's name, dtype and shape, an adapter's
config, the bucket size, the base of a sparse step), how tensors are grouped into broadcasts, and the safetensors
layout a receiver receives into."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from rl.weights import TransferError
from rl.weights.group import StepGroup, broadcast

MAX_HEADER_BYTES = 64 * 2**20
BUCKET_BYTES = 32 * 2**20
"""Tensors smaller than this share broadcasts of up to this size: each broadcast costs a fixed time (a wait, and over
NCCL a kernel launch), which a LoRA adapter's hundreds of small tensors would otherwise pay one by one. The sender holds
one bucket beyond the tensor it gathers."""


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

