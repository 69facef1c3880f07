"""Reading the files a STABLE marker lists (rl/manifest.py): each opened as `open_regular` does, its bytes checked
against the recorded size and CRC-32 as they are read, once, so a caller that then uses them (a batch, a weight
shard) reads the file once."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from zlib_ng import zlib_ng

from rl.manifest import STABLE, CorruptFileError, Entry, Where, open_regular, read_manifest, size_mismatch

READ_CHUNK = 64 * 2**20


def crc_mismatch(path: Path) -> CorruptFileError:
    return CorruptFileError(f"{path} fails its CRC-32 check: changed after it was written")


def listed_size(f, path: Path, entry: Entry) -> int:
    """The size of the open listed file `f`, which must be the recorded one where the entry is checked."""
    size = os.fstat(f.fileno()).st_size
    if entry.checked and size != entry.bytes:
        raise size_mismatch(path, size, entry)
    return size


def read_listed(directory: Where, name: str, entry: Entry, chunk: int = READ_CHUNK) -> bytearray:
    """The bytes of a listed file, read once: checked against the recorded size and CRC-32 as they are read."""
    path = directory / name
    with open_regular(directory, name) as f:
        size = listed_size(f, path, entry)
        data = bytearray(size)
        with memoryview(data) as view:
            done, crc = 0, 0
            while done < size:
                n = f.readinto(view[done : done + chunk])
                if not n:
                    raise CorruptFileError(f"{path} ended after {done} of {size} bytes: truncated while read")
                crc = zlib_ng.crc32(view[done : done + n], crc)
                done += n
    if entry.checked and crc != entry.crc32:
        raise crc_mismatch(path)
    return data


def copy_listed(directory: Where, name: str, entry: Entry, into: int) -> mmap.mmap | bytes:
    """A listed file's bytes, copied once by the kernel into the file open at `into` (a memfd: sendfile, so no page
    passes through this process on the way), then checked where they landed against the recorded size and CRC-32.
    Returns a private mapping of them (writable views for torch, pages shared until written, which nothing does; the
    caller closes it), or b"" for an empty file."""
    path = directory / name
    with open_regular(directory, name) as f:
        size = listed_size(f, path, entry)
        os.ftruncate(into, size)
        os.lseek(into, 0, os.SEEK_SET)  # sendfile writes at `into`'s offset
        done = 0
        while done < size:
            sent = os.sendfile(into, f.fileno(), done, size - done)
            if not sent:
                raise CorruptFileError(f"{path} ended after {done} of {size} bytes: truncated while read")
            done += sent
    data = mmap.mmap(into, size, access=mmap.ACCESS_COPY) if size else b""
    if entry.checked and zlib_ng.crc32(data) != entry.crc32:
        if size:
            data.close()
        raise crc_mismatch(path)
    return data


def check_listed(directory: Where, name: str, entry: Entry) -> None:
    """Check one listed file's size and CRC-32 (mapped, not copied), opened as `open_regular` does."""
    if not entry.checked:
        return
    with open_regular(directory, name) as f:
        crc = 0
        if listed_size(f, directory / name, entry):
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                crc = zlib_ng.crc32(data)
    if crc != entry.crc32:
        raise crc_mismatch(directory / name)


def verify_stable(directory: Path, names: list[str] | None = None) -> dict[str, Entry]:
    """Check a STABLE directory: it holds exactly its listed files, and each of them (or only `names`) has its
    recorded size and CRC-32. Returns the manifest. Raises CorruptFileError naming the first problem."""
    manifest = read_manifest(directory)
    for name in names if names is not None else list(manifest):
        if name not in manifest:
            raise CorruptFileError(f"{directory / name} is not listed in {directory / STABLE}")
        check_listed(directory, name, manifest[name])
    return manifest
