"""Reading a published step's weight files once: every file's bytes, checked against the STABLE manifest as
they are read, before anything is loaded; then the headers for a shape check, and tensors that view those
bytes (no second copy, no second read) for the reload, the fingerprint and the checksum.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl.manifest import CorruptFileError, Entry, read_listed
from rl.safetensors_io import MAX_HEADER_BYTES, parse_header, tensors_of


@dataclass
class ReadCount:
    """Bytes read from a step's weight files (each file is read once)."""

    data_bytes: int = 0
    files: list[str] = field(default_factory=list)


def weight_files(manifest: dict[str, Entry]) -> list[str]:
    """The listed safetensors files, the only ones loaded."""
    names = sorted(name for name in manifest if name.endswith(".safetensors"))
    if not names:
        raise CorruptFileError("the step lists no *.safetensors file")
    return names


@dataclass
class ReadStep:
    """A step's weight files, each read once and checked against the manifest, held in memory until reloaded."""

    directory: Path
    data: dict[str, bytearray]  # file -> its bytes

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor, from the headers; a name in two files is corrupt."""
        shapes: dict[str, tuple[int, ...]] = {}
        for file, data in self.data.items():
            header, _ = parse_header(memoryview(data)[: min(len(data), 8 + MAX_HEADER_BYTES)], str(self.directory / file))
            for name, info in header.items():
                if name in shapes:
                    raise CorruptFileError(f"{self.directory / file}: tensor {name!r} is also in another file of the step")
                shapes[name] = tuple(info["shape"])
        return shapes

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, as a view of the bytes read."""
        for file, data in self.data.items():
            yield from tensors_of(data, str(self.directory / file))


def read_step(directory: Path, manifest: dict[str, Entry], count: ReadCount) -> ReadStep:
    """Read every listed weight file of a step once, checking each against the manifest, before any of it is used:
    vLLM's in-place reload cannot be stopped halfway (a failed reload leaves layers without weights), so a
    corrupt file must be found before it starts."""
    data = {}
    for file in weight_files(manifest):
        data[file] = read_listed(directory, file, manifest[file])
        count.data_bytes += len(data[file])
        count.files.append(file)
    return ReadStep(directory, data)
