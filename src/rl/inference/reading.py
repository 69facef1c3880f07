"""What a worker reads: a published step's weight files as the server staged them (`MappedStep`: the server's
checked bytes, mapped; headers for a shape check, then tensors that view those bytes for the reload, the fingerprint
and the checksum), and an adapter step's two files from the server's private copy (`read_adapter`), checked again
against the manifest as they are read.

A model directory's files (the base model: the user's own, under no manifest) are read with safetensors
(`checkpoint_tensors`, `checkpoint_shapes`). Tied embeddings: vLLM's Qwen3 loader does not skip `lm_head.weight`,
and its in-place reload leaves the tied LM head's packed kernel stale when the files lack that tensor.
`with_tied_head` yields `lm_head.weight` = `model.embed_tokens.weight` for a tied model whose files lack it, so a
tied checkpoint reloads correctly either way; the verification would catch it if it did not.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from rl.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rl.listed_files import read_listed
from rl.manifest import CorruptFileError, Entry
from rl.safetensors_io import EMBEDDINGS, MAX_HEADER_BYTES, TIED_HEAD, parse_header, tensors_of, tied_head_source

MAX_ADAPTER_CONFIG_BYTES = 2**20  # PEFT's adapter_config.json is ~1 KB


@dataclass
class ReadCount:
    """Bytes read from a step's weight files (each file is read once)."""

    data_bytes: int = 0
    files: list[str] = field(default_factory=list)


class MappedStep:
    """A step's weight files as the server staged them (`rl.inference.staging`), mapped in this worker: tensors are
    views of the server's checked bytes (nothing is read from the step directory here)."""

    def __init__(self, staged: dict):
        self.data = dict(map_staged(staged))  # file -> its bytes, mapped

    @property
    def bytes(self) -> int:
        return sum(len(data) for data in self.data.values())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor, from the headers; a name in two files is corrupt."""
        shapes: dict[str, tuple[int, ...]] = {}
        for file, data in self.data.items():
            with memoryview(data) as view:
                header, _ = parse_header(view[: min(len(data), 8 + MAX_HEADER_BYTES)], file, len(data))
            for name, info in header.items():
                if name in shapes:
                    raise CorruptFileError(f"{file}: tensor {name!r} is also in another file of the step")
                shapes[name] = tuple(info["shape"])
        return shapes

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, as a view of the mapped bytes."""
        for file, data in self.data.items():
            yield from tensors_of(data, file)


def read_adapter(directory: Path, manifest: dict[str, Entry], count: ReadCount
                 ) -> tuple[list[tuple[str, torch.Tensor]], object]:
    """An adapter step's tensors (views of `adapter_model.safetensors` as read) and its parsed `adapter_config.json`,
    each file read once and checked against the manifest as it is read; CorruptFileError if either is missing,
    fails its check or does not parse."""
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if name not in manifest:
            raise CorruptFileError(f"{directory} is an adapter step but lists no {name}")
    config_entry = manifest[ADAPTER_CONFIG]
    if config_entry.checked and config_entry.bytes > MAX_ADAPTER_CONFIG_BYTES:
        raise CorruptFileError(f"{directory / ADAPTER_CONFIG} holds {config_entry.bytes} bytes, "
                               f"over {MAX_ADAPTER_CONFIG_BYTES}")
    config_bytes = read_listed(directory, ADAPTER_CONFIG, config_entry)
    try:
        config = json.loads(config_bytes.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptFileError(f"{directory / ADAPTER_CONFIG} is not JSON: {e}") from None
    data = read_listed(directory, ADAPTER_WEIGHTS, manifest[ADAPTER_WEIGHTS])
    count.data_bytes += len(data)
    count.files.append(ADAPTER_WEIGHTS)
    return list(tensors_of(data, str(directory / ADAPTER_WEIGHTS))), config


def checkpoint_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def model_dir_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the *.safetensors files of a model directory (the base model: the user's own files,
    under no STABLE marker), by name within each file."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(handle.keys()):
                yield name, handle.get_tensor(name)


def with_tied_head(tensors: Iterator[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors`, plus the tied LM head (= the input embedding) if the files lack it."""
    names, embeddings = set(), {}
    for name, tensor in tensors:
        names.add(name)
        if name in EMBEDDINGS:
            embeddings[name] = tensor
        yield name, tensor
    source = tied_head_source(names)
    if tied and source is not None:
        yield TIED_HEAD, embeddings[source]


def checkpoint_tensors(path: str | Path, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the *.safetensors files in `path`, plus the tied LM head if it is missing."""
    return with_tied_head(model_dir_tensors(path), tied)


def with_tied_shape(shapes: dict[str, tuple[int, ...]], tied: bool) -> dict[str, tuple[int, ...]]:
    source = tied_head_source(shapes)
    if tied and source is not None:
        shapes[TIED_HEAD] = shapes[source]
    return shapes


def checkpoint_shapes(path: str | Path, tied: bool) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in `path`, from the files' headers alone (no tensor is read)."""
    shapes = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return with_tied_shape(shapes, tied)


def map_staged(staged: dict) -> Iterator[tuple[str, mmap.mmap]]:
    """In a worker: each staged file of `StagedStep.rpc()`, mapped copy-on-write (writable views for torch, pages
    shared with the server and every other worker until written, which nothing does)."""
    pid = staged["pid"]
    for name, (fd, size) in sorted(staged["files"].items()):
        if size == 0:
            raise CorruptFileError(f"{name} is empty: not a safetensors file")
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield name, mmap.mmap(own, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(own)
