"""Sparse steps (`transfer.sparse`, over gloo or NCCL): only what changed since the step every server serves.

Each receiver announces the checksum of the full weights it serves and holds the bytes of (`announce_base`, before
it joins); the trainer sends changes only when every receiver announced the step it sent last (`common_base`),
else every tensor whole, so a server that missed a step, restarted or rolled back is brought up to date by the
next step. In a sparse step each bucket is preceded by its tensors' counts: WHOLE for a tensor sent whole (its
changes would not be smaller), else the number of elements that changed, sent as their flat indices and their new
values. The receiver applies them to a copy of its base's bytes and hashes the result, so the trainer's checksum
proves the whole step, not only the changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rl.weights import TransferError
from rl.weights.group import Deadline


NO_BASE = "-"
WHOLE = -1
INDEX_DTYPE = torch.int32
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # elements compared bit for bit
SAMPLE_STRIDE = 101  # every 101st element: a sample that does not line up with a tensor's rows


def announce_base(store: dist.Store, step: int, rank: int, base: str | None) -> None:
    """A receiver's announcement of the checksum of the full weights it serves and can apply changes to."""
    store.set(f"step_{step}/base/{rank}", base or NO_BASE)


def common_base(store: dist.Store, step: int, receivers: int, base: str | None, deadline: Deadline) -> str | None:
    """`base` (the step the trainer sent last) if every receiver of step `step` announced it, else None: the step
    then goes whole."""
    if base is None:
        return None
    keys = [f"step_{step}/base/{rank}" for rank in range(1, receivers + 1)]
    try:
        store.wait(keys, deadline.delta(f"the receivers of step {step} said what they serve"))
        served = [value.decode() for value in store.multi_get(keys)]
    except TransferError:
        raise
    except Exception as e:  # the wait timed out, or the store went away
        raise TransferError(f"the receivers of step {step} did not all say what they serve within "
                            f"{deadline.seconds:g} s: {e}") from None
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

