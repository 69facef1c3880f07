"""A step's header (what the trainer announces before the bytes: every tensor's name, dtype and shape, an adapter's
config, the bucket size, the base of a sparse step), how tensors are grouped into broadcasts, and the safetensors
layout a receiver receives into."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from rl.safetensors_io import DTYPES
from rl.weights import StepRefused
from rl.weights.digest import SEAL_BYTES, seal, seal_matches
from rl.weights.group import StepGroup, broadcast

RESERVED_NAME = "__metadata__"  # a safetensors header's own entry
WIRE_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES.values()}  # what a step's files can hold

MAX_HEADER_BYTES = 64 * 2**20
BUCKET_BYTES = 32 * 2**20
"""Tensors smaller than this share broadcasts of up to this size: each broadcast costs a fixed time (a wait, and over
NCCL a kernel launch), which a LoRA adapter's hundreds of small tensors would otherwise pay one by one. The sender holds
one bucket beyond the tensor it gathers."""


def send_header(group: StepGroup, step: int, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                adapter_config: str | None, bucket_bytes: int, key: bytes, base: str | None = None) -> bytes:
    """The step's tensors (name, dtype, shape) in the order they follow, a LoRA adapter's adapter_config.json, how
    the tensors are grouped into broadcasts (`bucket_plan`), and the `weights_checksum` of the step the changes are
    against (`base`; None: every tensor whole); sealed with the run's key. Returns the seal, which the step's
    checksum is sealed with (`seal_checksum`)."""
    raw = json.dumps({"step": step, "tensors": [[n, str(d).removeprefix("torch."), list(s)] for n, d, s in tensors],
                      "adapter_config": adapter_config, "bucket_bytes": bucket_bytes, "base": base}).encode()
    header_seal = seal(key, "header", raw)
    data = torch.frombuffer(bytearray(raw + header_seal), dtype=torch.uint8).to(group.device)
    broadcast(group, torch.tensor([len(data)], dtype=torch.int64, device=group.device), f"step {step}'s header length")
    broadcast(group, data, f"step {step}'s header")
    return header_seal


def checksum_seal(key: bytes, header_seal: bytes, digest: bytes) -> bytes:
    """What the trainer sends after a step's bytes: their checksum, and its seal bound to the step's header."""
    return digest + seal(key, "checksum", header_seal + digest)


TensorMeta = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape


@dataclass(frozen=True)
class Header:
    """A step as the trainer announces it: its tensors in the order they follow, its adapter config (None: full
    weights), the size of its broadcasts (`bucket_plan`), the checksum of the step it sends changes against
    (None: every tensor whole), and its seal."""

    tensors: list[TensorMeta]
    adapter_config: str | None
    bucket_bytes: int
    base: str | None = None
    seal: bytes = b""

    @property
    def bytes(self) -> int:
        return sum(dtype.itemsize * _numel(shape) for _, dtype, shape in self.tensors)


def receive_header(group: StepGroup, step: int, key: bytes) -> Header:
    """The step's header, refused (StepRefused) unless it is sealed with the run's key and well formed: dtypes a
    step's files can hold, dimensions >= 0, each name once and none reserved. Nothing of the step is allocated yet:
    only the header itself, up to MAX_HEADER_BYTES."""
    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    broadcast(group, length, f"step {step}'s header length")
    if not SEAL_BYTES < length.item() <= MAX_HEADER_BYTES:
        raise StepRefused(f"step {step}'s header claims {length.item()} bytes")
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    broadcast(group, data, f"step {step}'s header")
    raw = bytes(data.cpu().numpy())
    raw, header_seal = raw[:-SEAL_BYTES], raw[-SEAL_BYTES:]
    if not seal_matches(key, "header", raw, header_seal):
        raise StepRefused(f"step {step}'s header is not sealed with this run's transfer secret: the sender is not "
                          "this run's trainer", status=403)
    try:
        header = json.loads(raw)
        tensors = [(n, WIRE_DTYPES.get(d, d), tuple(s)) for n, d, s in header["tensors"]]
    except (ValueError, KeyError, TypeError) as e:
        raise StepRefused(f"step {step}'s header is malformed: {e!r}") from None
    if header.get("step") != step:
        raise StepRefused(f"asked to receive step {step}, but the trainer sends step {header.get('step')}")
    if problem := _tensors_problem(tensors):
        raise StepRefused(f"step {step}'s header {problem}")
    adapter_config, bucket_bytes = header.get("adapter_config"), header.get("bucket_bytes")
    if adapter_config is not None and not isinstance(adapter_config, str):
        raise StepRefused(f"step {step}'s header holds an adapter config that is not a string")
    if type(bucket_bytes) is not int or bucket_bytes < 0:
        raise StepRefused(f"step {step}'s header gives no bucket size (bucket_bytes {bucket_bytes!r})")
    base = header.get("base")
    if base is not None and not isinstance(base, str):
        raise StepRefused(f"step {step}'s header names a base that is not a checksum: {base!r}")
    return Header(tensors, adapter_config, bucket_bytes, base, header_seal)


def _tensors_problem(tensors: list[TensorMeta]) -> str | None:
    """What makes a header's tensors unfit to be laid out as one safetensors file; None if nothing."""
    seen = set()
    for name, dtype, shape in tensors:
        if not isinstance(name, str) or not name or name == RESERVED_NAME:
            return f"names a tensor {name!r}, which no weight file can hold"
        if name in seen:
            return f"names tensor {name!r} twice"
        seen.add(name)
        if not isinstance(dtype, torch.dtype):
            return f"gives tensor {name!r} dtype {dtype!r}, which no weight file holds (one of {sorted(WIRE_DTYPES)})"
        if any(type(dim) is not int or dim < 0 for dim in shape):
            return f"gives tensor {name!r} the shape {list(shape)}"
    return None


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

