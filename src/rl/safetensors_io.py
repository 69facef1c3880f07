"""The safetensors format, read and written without the safetensors library's file access: an 8-byte
little-endian header length N, N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {...}}`, then the data, offsets counting from the end of the header. Parsing bytes already read
(`tensors_of`) lets a reader check and use a file from one read; `write_file` writes one in a single pass that also
takes its CRC-32 (so nobody needs a second pass to record it); `read_rows` reads a tensor's rows alone with pread
(no mapping, so a rank loading its shard of a model keeps only that shard in memory).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator

import torch
from zlib_ng import zlib_ng

from rl.manifest import CorruptFileError

MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit
TIED_HEAD = "lm_head.weight"
# The input embedding a tied head is, by layout: a causal LM's, or a vision-language model's language model's.
EMBEDDINGS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def tied_head_source(names) -> str | None:
    """The embedding that stands for the tied LM head where `names` (a checkpoint's tensors) lack the head."""
    names = set(names)
    return None if TIED_HEAD in names else next((name for name in EMBEDDINGS if name in names), None)
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def parse_header(raw: bytes | bytearray | memoryview, where: str, file_bytes: int) -> tuple[dict, int]:
    """The header's tensor entries and the offset at which the data starts, for a file of `file_bytes` bytes whose
    first bytes are `raw`; CorruptFileError if the header is malformed, names a tensor twice, or places a tensor past
    the end of the file or over another tensor's bytes (a loader would stop halfway, or read garbage)."""
    if len(raw) < 8:
        raise CorruptFileError(f"{where} is not a safetensors file: {len(raw)} bytes")
    (size,) = struct.unpack("<Q", bytes(raw[:8]))
    if size > MAX_HEADER_BYTES or 8 + size > len(raw):
        raise CorruptFileError(f"{where}: a safetensors header of {size} bytes does not fit the file")
    try:
        header = json.loads(bytes(raw[8 : 8 + size]), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:
        raise CorruptFileError(f"{where}: its safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{where}: its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(name, info, where)
    _check_layout(header, where, file_bytes - 8 - size)
    return header, 8 + size


NAMES = {dtype: name for name, dtype in DTYPES.items()}
WRITE_CHUNK = 64 * 2**20  # bytes handed to write() and the CRC at a time


def write_file(path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[int, int]:
    """Write `tensors` (on the CPU) as a safetensors file at `path`, ordered as the safetensors library orders them
    (wider dtypes first, then by name: every tensor stays aligned for its dtype) with the header padded to 8 bytes;
    returns (bytes, CRC-32) of what was written, taken as it was written."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    crc, written = zlib_ng.crc32(head), len(head)
    with open(path, "wb") as out:
        out.write(head)
        for name in order:
            data = tensors[name].detach().contiguous().view(-1).view(torch.uint8).numpy()
            for start in range(0, len(data), WRITE_CHUNK):
                chunk = memoryview(data[start : start + WRITE_CHUNK])
                out.write(chunk)
                crc = zlib_ng.crc32(chunk, crc)
            written += len(data)
    return written, crc


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


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = next(key for key in keys if keys.count(key) > 1)
        raise ValueError(f"{twice!r} appears twice")
    return dict(pairs)


def _check_layout(header: dict, where: str, data_bytes: int) -> None:
    """Every tensor's bytes inside the file's data and no two tensors' bytes overlapping."""
    end_of_previous, previous = 0, None
    for name, info in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        begin, end = info["data_offsets"]
        if end > data_bytes:
            raise CorruptFileError(f"{where}: tensor {name!r} ends at byte {end} of the data, past its end "
                                   f"({data_bytes} bytes): the file is cut short or its header is wrong")
        if begin < end_of_previous:
            raise CorruptFileError(f"{where}: tensors {previous!r} and {name!r} overlap in the file")
        if end > begin:
            end_of_previous, previous = end, name


def tensors_of(data, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file held in `data`, as views of it (in file order)."""
    header, start = parse_header(memoryview(data)[: min(len(data), 8 + MAX_HEADER_BYTES)], where, len(data))
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = (start + offset for offset in info["data_offsets"])
        dtype, shape = DTYPES[info["dtype"]], info["shape"]
        if end == begin:
            yield name, torch.empty(shape, dtype=dtype)
        elif begin % dtype.itemsize:  # unaligned for its dtype: copied (writers align, so this is rare)
            yield name, torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).reshape(shape)
        else:
            count = (end - begin) // dtype.itemsize
            yield name, torch.frombuffer(data, dtype=dtype, count=count, offset=begin).reshape(shape)




def read_file_header(fd: int, where: str) -> tuple[dict, int]:
    """The header of the safetensors file open at `fd` (tensor entries) and the offset of its data."""
    head = os.pread(fd, 8, 0)
    size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    raw = head + os.pread(fd, min(size, MAX_HEADER_BYTES), 8)
    header, data_start = parse_header(raw, where, os.fstat(fd).st_size)
    return header, data_start


def read_rows(fd: int, header: dict, data_start: int, name: str, start: int, end: int) -> torch.Tensor:
    """Rows [start, end) of dim 0 of tensor `name` (a whole 0-d tensor), read with pread."""
    info = header[name]
    dtype, shape = DTYPES[info["dtype"]], info["shape"]
    row_bytes = math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize
    rows = end - start if shape else 1
    offset = data_start + info["data_offsets"][0] + start * row_bytes
    data = bytearray(rows * row_bytes)
    view, done = memoryview(data), 0
    while done < len(data):
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            raise CorruptFileError(f"{name}: the file ends inside its data")
        done += n
    tensor = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return tensor.reshape([rows, *shape[1:]] if shape else [])
