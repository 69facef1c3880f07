"""STABLE markers: the exact manifest of a published directory, and the only way its files are read.

A writer fills a directory, then writes `STABLE`, listing every file beneath it with its size and CRC-32
(`mark_stable`). A reader trusts a directory only through its marker (`read_manifest`):

- the marker is parsed with bounded size and depth; anything malformed is a `CorruptFileError`;
- the directory holds exactly the listed files: an unlisted file (but a writer's temporary `.name.tmpN`), a
  symlink or a special file anywhere beneath it makes the directory corrupt; nothing unlisted is ever read;
- a listed file is opened relative to the directory, component by component, without following a symlink
  and without blocking on a FIFO or device (`open_regular`), and is refused unless it is a regular file;
- a file's bytes are checked against the recorded size and CRC-32 as they are read, once (`read_listed`,
  rl/listed_files.py), so a caller that then uses the bytes (a batch, a weight shard) reads the file once.

A marker that is empty or exactly `{}` was made by hand: it vouches for completeness only. Its directory's
files are then whatever regular files it holds (the same no-symlink, no-special-file rules), unchecked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from zlib_ng import zlib_ng

from rl.atomic import atomic_write_text

STABLE = "STABLE"
MAX_MARKER_BYTES = 8 * 2**20  # a marker lists ~100 bytes per file
MAX_NAME_BYTES = 255  # one path component (NAME_MAX)
MAX_LISTED = 100_000


class CorruptFileError(ValueError):
    """A STABLE directory, its marker or one of its files is not what the marker recorded."""


@dataclass(frozen=True)
class Entry:
    """A file of a manifest: its recorded size and CRC-32 (None for a hand-made marker: unchecked)."""

    bytes: int | None
    crc32: int | None

    @property
    def checked(self) -> bool:
        return self.bytes is not None


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------


def is_temp(path: Path) -> bool:
    return path.name.startswith(".") and ".tmp" in path.name


def file_crc32(path: Path) -> int:
    """CRC-32 of a file, the value `zlib.crc32` gives, computed by zlib-ng (SIMD: several times zlib's speed)
    over the mapped file (benchmarks/RESULTS.md)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return 0  # an empty file cannot be mapped
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return zlib_ng.crc32(data)


def mark_stable(directory: Path, written: dict[str, Entry] | None = None, **info) -> None:
    """Write `directory/STABLE`, recording every file beneath it (size and CRC-32) and `info`. `written`: the size
    and CRC-32 of files whose writers took them as they wrote (not read again here; a size that disagrees with the
    file on disk is an error)."""
    written = written or {}
    files = {}
    for p in sorted(directory.rglob("*")):
        if not p.is_file() or p.name == STABLE or is_temp(p):
            continue
        name, size = p.relative_to(directory).as_posix(), p.stat().st_size
        known = written.get(name)
        if known is not None and known.bytes != size:
            raise CorruptFileError(f"{p} has {size} bytes, its writer wrote {known.bytes}")
        files[name] = {"bytes": size, "crc32": known.crc32 if known else file_crc32(p)}
    atomic_write_text(directory / STABLE, json.dumps({"time": time.time(), **info, "files": files}) + "\n")


# ---------------------------------------------------------------------------------------------------
# Opening files without following links or blocking
# ---------------------------------------------------------------------------------------------------


def name_parts(directory: Where, name: object) -> tuple[str, ...]:
    """The components of a listed name, refused unless it is a plain relative path inside `directory`."""
    if not isinstance(name, str) or not name:
        raise CorruptFileError(f"{directory / STABLE} lists {name!r}, which is not a file name")
    try:
        encoded = [part.encode() for part in name.split("/")]
    except UnicodeEncodeError:
        raise CorruptFileError(f"{directory / STABLE} lists {name!r}, which is not valid UTF-8") from None
    parts = PurePosixPath(name).parts
    if name.startswith("/") or "\0" in name or any(p in ("", ".", "..") for p in name.split("/")):
        raise CorruptFileError(f"{directory / STABLE} lists {name!r}, which is outside {directory}")
    if any(len(p) > MAX_NAME_BYTES for p in encoded):
        raise CorruptFileError(f"{directory / STABLE} lists {name[:80]!r}..., a name over {MAX_NAME_BYTES} bytes")
    return parts


class OpenDir:
    """A directory opened once, refusing a symlink at every component: every file beneath it is then opened
    relative to this handle (openat), so a directory renamed, swapped or replaced by a link after it was opened is
    never read. Readers take one handle from the check of a STABLE marker to the last read of its files."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    @classmethod
    def beneath(cls, root: Path, relative: Path | str) -> OpenDir:
        """Open `root/relative`, each component of `relative` without following a symlink (`root` itself is
        opened as given). CorruptFileError if a component is a symlink, missing or not a directory."""
        path = root / relative
        with _dir_fd(root) as root_fd:
            return cls(_descend(root_fd, Path(relative).parts, path), path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __truediv__(self, name: str) -> Path:  # for messages: the path the handle was opened at
        return self.path / name

    def __str__(self) -> str:
        return str(self.path)


Where = Path | OpenDir  # a directory by path (opened at each use) or by an open handle


@contextlib.contextmanager
def _dir_fd(directory: Where):
    """A descriptor of `directory`: the handle's own, or one opened for the duration."""
    if isinstance(directory, OpenDir):
        yield directory.fd
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise CorruptFileError(f"{directory} cannot be opened: {e.strerror}") from None
    try:
        yield fd
    finally:
        os.close(fd)


def open_regular(directory: Where, name: str):
    """Open `directory/name` for reading (a binary file object): each directory component without following
    a symlink, the file itself non-blocking (a FIFO or device cannot stall the reader) and only if it is a
    regular file. Raises CorruptFileError naming the problem."""
    parts = name_parts(directory, name)
    path = directory / name
    with _dir_fd(directory) as root_fd:
        fd = _descend(root_fd, parts[:-1], path)
        try:
            file_fd = _open_at(fd, parts[-1], os.O_NONBLOCK, path)
        finally:
            os.close(fd)
    mode = os.fstat(file_fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(file_fd)
        raise CorruptFileError(f"{path} is not a regular file")
    fcntl.fcntl(file_fd, fcntl.F_SETFL, fcntl.fcntl(file_fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(file_fd, "rb")


def _descend(root_fd: int, parts: tuple[str, ...], path: Path) -> int:
    """A new descriptor of the directory `parts` beneath `root_fd`, each component opened without following a
    symlink (a duplicate of `root_fd` for no parts); the caller closes it."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            child = _open_at(fd, part, os.O_DIRECTORY, path)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_at(dir_fd: int, part: str, flags: int, path: Path) -> int:
    try:
        return os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CorruptFileError(f"{path}: {part!r} is a symlink or not a directory") from None
        if e.errno == errno.ENOENT:
            if part == STABLE:
                raise CorruptFileError(f"{path} is missing: the directory is not marked stable") from None
            raise CorruptFileError(f"{path} is listed in its {STABLE} marker but missing") from None
        raise CorruptFileError(f"{path} cannot be opened: {e.strerror}") from None


def read_regular(directory: Where, name: str, limit: int | None = None) -> bytes:
    """All bytes of a regular file (see `open_regular`); refused if it holds more than `limit`."""
    with open_regular(directory, name) as f:
        data = f.read(None if limit is None else limit + 1)
    if limit is not None and len(data) > limit:
        raise CorruptFileError(f"{directory / name} holds more than {limit} bytes")
    return data


# ---------------------------------------------------------------------------------------------------
# Reading a manifest
# ---------------------------------------------------------------------------------------------------


def read_marker(directory: Where) -> bytes:
    """The STABLE marker's bytes (bounded; opened as any listed file is)."""
    return read_regular(directory, STABLE, MAX_MARKER_BYTES)


def stable_info(directory: Where, data: bytes | None = None) -> dict:
    """The STABLE marker's contents ({} for an empty marker), from `data` if the caller read it already;
    CorruptFileError if it is not a JSON object of bounded size and depth."""
    marker = directory / STABLE
    data = read_marker(directory) if data is None else data
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise CorruptFileError(f"{marker} is not UTF-8: {e}") from None
    if not text.strip():
        return {}
    try:
        info = json.loads(text)
    except RecursionError:
        raise CorruptFileError(f"{marker} is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, or an integer past Python's digit limit
        raise CorruptFileError(f"{marker} is not valid JSON: {e}") from None
    if not isinstance(info, dict):
        raise CorruptFileError(f"{marker} holds {type(info).__name__}, not a JSON object")
    return info


def recorded_files(directory: Where, data: bytes | None = None) -> dict[str, Entry] | None:
    """The marker's file list, checked for shape: name -> Entry. None for a hand-made marker (empty or `{}`)."""
    marker = directory / STABLE
    info = stable_info(directory, data)
    if not info:
        return None
    files = info.get("files")
    if not isinstance(files, dict):
        raise CorruptFileError(f"{marker}: `files` is {type(files).__name__}, not an object")
    if len(files) > MAX_LISTED:
        raise CorruptFileError(f"{marker} lists {len(files)} files, more than {MAX_LISTED}")
    entries = {}
    for name, entry in files.items():
        name_parts(directory, name)
        if name == STABLE:
            raise CorruptFileError(f"{marker} lists itself")
        if not isinstance(entry, dict):
            raise CorruptFileError(f"{marker}: entry {name!r} is not an object")
        for key in ("bytes", "crc32"):
            value = entry.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
                raise CorruptFileError(f"{marker}: entry {name!r} lacks a non-negative integer `{key}`")
        entries[name] = Entry(entry["bytes"], entry["crc32"])
    return entries


def present_files(directory: Where) -> dict[str, os.stat_result]:
    """Every file beneath `directory` (but the marker), by relative name, from lstat through directory descriptors:
    no link is followed. CorruptFileError for a symlink or special file anywhere beneath it."""
    found: dict[str, os.stat_result] = {}
    with _dir_fd(directory) as root_fd:
        pending = [(os.dup(root_fd), "")]
        try:
            while pending:
                fd, prefix = pending.pop()
                try:
                    _list_into(directory, fd, prefix, found, pending)
                finally:
                    os.close(fd)
        finally:
            for fd, _ in pending:
                os.close(fd)
    return found


def _list_into(directory: Where, fd: int, prefix: str, found: dict, pending: list) -> None:
    try:
        entries = list(os.scandir(fd))
    except OSError as e:
        raise CorruptFileError(f"{directory / prefix} cannot be listed: {e.strerror}") from None
    for entry in entries:
        name = prefix + entry.name
        info = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode):
            pending.append((_open_at(fd, entry.name, os.O_DIRECTORY, directory / name), name + "/"))
        elif not stat.S_ISREG(info.st_mode):
            kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
            raise CorruptFileError(f"{directory / name} is {kind}: a published directory holds regular files only")
        elif name != STABLE and not is_temp(Path(name)):  # a writer's temporary file: never read
            found[name] = info
        if len(found) > MAX_LISTED:
            raise CorruptFileError(f"{directory} holds more than {MAX_LISTED} files")


def read_manifest(directory: Where, marker: bytes | None = None) -> dict[str, Entry]:
    """The files of a STABLE directory, name -> Entry: exactly the listed ones, each present as a regular file
    of the recorded size (no file's bytes are read). A hand-made marker gives the regular files present, unchecked.
    `marker`: the marker's bytes, if the caller read them already."""
    recorded = recorded_files(directory, marker)
    present = present_files(directory)
    if recorded is None:
        return {name: Entry(None, None) for name in sorted(present)}
    unlisted = sorted(present.keys() - recorded.keys())
    if unlisted:
        raise CorruptFileError(f"{directory / unlisted[0]} is not listed in {directory / STABLE}")
    for name, entry in recorded.items():
        if name not in present:
            raise CorruptFileError(
                f"{directory / name} is listed in {directory / STABLE} but missing (or not a plain file)"
            )
        if present[name].st_size != entry.bytes:
            raise size_mismatch(directory / name, present[name].st_size, entry)
    return recorded


def size_mismatch(path: Path, size: int, entry: Entry) -> CorruptFileError:
    return CorruptFileError(f"{path} has {size} bytes, {entry.bytes} were written: truncated or changed")
