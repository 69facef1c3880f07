"""Host buffers pinned at their exact size.

torch's pinned allocations (`pin_memory=True`) come from its caching host allocator, which rounds each one up to a
power of two and keeps it: an optimizer's offloaded state at 7B+ could take up to twice its size in page-locked host
memory. Memory registered with CUDA (`cudaHostRegister`) instead is pinned as it was allocated, byte for byte, and
copies to and from it are as asynchronous as to a pinned allocation."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

ALIGN_BYTES = 64  # each tensor of an arena starts at a multiple of this (every dtype's alignment, a cache line)


def pin_exactly(buffer: torch.Tensor) -> bool:
    """Register a contiguous CPU tensor's bytes with CUDA; False (with a warning) where CUDA refuses."""
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0))
    if code != 0:
        logger.warning("could not pin %d bytes of host memory (CUDA error %d): copies through it are pageable",
                       buffer.numel() * buffer.element_size(), code)
    return code == 0


def unpin(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class HostArena:
    """One host allocation carved into tensors of the given shapes and dtypes, in order, each aligned; with `pin`,
    registered with CUDA as a whole (one registration: pages shared by two tensors cannot be registered twice)."""

    def __init__(self, layout: list[tuple[torch.Size, torch.dtype]], pin: bool):
        offsets, end = [], 0
        for shape, dtype in layout:
            offsets.append(end)
            end += -(-shape.numel() * dtype.itemsize // ALIGN_BYTES) * ALIGN_BYTES
        self.buffer = torch.empty(end, dtype=torch.uint8)
        self.layout = layout
        self.pinned = pin and end > 0 and pin_exactly(self.buffer)
        self.tensors = [self.buffer[offset: offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                        for offset, (shape, dtype) in zip(offsets, layout, strict=True)]

    def close(self) -> None:
        if self.pinned:
            unpin(self.buffer)
            self.pinned = False
