"""Reading a published step's weight files once: every file's bytes, checked against the STABLE manifest as
they are read, before anything is loaded; then the headers for a shape check, and tensors that view those
bytes (no second copy, no second read) for the reload, the fingerprint and the checksum.

The safetensors format: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data; offsets
count from the end of the header.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl.manifest import CorruptFileError, Entry, read_listed

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


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


def parse_header(raw: bytes | bytearray | memoryview, where: str) -> tuple[dict, int]:
    """The header's tensor entries and the offset at which the data starts; CorruptFileError if malformed."""
    if len(raw) < 8:
        raise CorruptFileError(f"{where} is not a safetensors file: {len(raw)} bytes")
    (size,) = struct.unpack("<Q", bytes(raw[:8]))
    if size > MAX_HEADER_BYTES or 8 + size > len(raw):
        raise CorruptFileError(f"{where}: a safetensors header of {size} bytes does not fit the file")
    try:
        header = json.loads(bytes(raw[8 : 8 + size]))
    except (ValueError, RecursionError) as e:
        raise CorruptFileError(f"{where}: its safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{where}: its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(name, info, where)
    return header, 8 + size


def _check_entry(name: str, info, where: str) -> None:
    ok = (
        isinstance(info, dict) and info.get("dtype") in DTYPES
        and isinstance(info.get("shape"), list) and all(type(d) is int and d >= 0 for d in info["shape"])
        and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
        and all(type(o) is int for o in info["data_offsets"])
    )
    if not ok:
        raise CorruptFileError(f"{where}: tensor {name!r} has a malformed header entry")
    begin, end = info["data_offsets"]
    if not 0 <= begin <= end or end - begin != math.prod(info["shape"]) * DTYPES[info["dtype"]].itemsize:
        raise CorruptFileError(f"{where}: tensor {name!r} has data offsets that do not match its shape")


def tensors_of(data: bytearray, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file held in `data`, as views of it (in file order)."""
    header, start = parse_header(memoryview(data)[: min(len(data), 8 + MAX_HEADER_BYTES)], where)
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = (start + offset for offset in info["data_offsets"])
        if end > len(data):
            raise CorruptFileError(f"{where}: tensor {name!r} ends past the end of the file")
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        if end == begin:
            yield name, torch.empty(shape, dtype=dtype)
        elif begin % dtype.itemsize:  # unaligned for its dtype: copied (writers align, so this is rare)
            yield name, torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).reshape(shape)
        else:
            yield name, torch.frombuffer(data, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=begin).reshape(shape)


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
