"""Writing a file so that readers see the old file or the whole new one, never part of it: it is written under
a temporary name in the same directory (`.<name>.tmp<pid>`, which readers and STABLE manifests skip) and
renamed into place."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def atomic_write(path: Path, write: Callable[[Path], None], private: bool = False) -> None:
    """`write(tmp)` writes the content; then it replaces `path`. `private`: readable by the owner only (the
    file exists with mode 0600 before any content is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    if private:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    write(tmp)
    tmp.replace(path)


def atomic_write_text(path: Path, text: str, private: bool = False) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text), private)
