"""Which directory a files update names: the step's own `step_<k>` strictly inside the weights dir, with a STABLE
marker and no link leading out (each refusal an HTTPException with its status), opened once with no component a
link, and its marker and manifest read from one read of the marker."""

import os
from pathlib import Path

from fastapi import HTTPException

from rl.adapter import ADAPTER_CONFIG
from rl.listed_files import check_listed
from rl.manifest import STABLE, Entry, OpenDir, read_manifest, read_marker


def resolve_step_dir(weights_dir: str | None, path: str, step: int) -> str:
    """The real path of the step's own `step_<step>` directory, strictly inside the weights dir, with a
    STABLE marker and no file that leads outside the weights dir."""
    if weights_dir is None:
        raise HTTPException(403, "this server was started without a weights dir: updates are off")
    try:
        return _resolve_in(Path(os.path.realpath(weights_dir)), path, step)
    except OSError as e:  # e.g. the weights dir and the path together past the OS's path limit
        raise HTTPException(400, f"{path[:200]!a} cannot be resolved: {e.strerror}") from None


def _resolve_in(root: Path, path: str, step: int) -> str:
    target = Path(os.path.realpath(root / path))
    if target == root or not target.is_relative_to(root):
        raise HTTPException(403, f"{path!r} resolves to {target}, outside the weights dir {root}")
    if not target.is_dir():
        raise HTTPException(404, f"no step directory at {target}")
    if target.name != f"step_{step}":
        raise HTTPException(400, f"{path!r} is {target.name}: step {step} loads only from step_{step}")
    if not (target / STABLE).exists():
        raise HTTPException(409, f"{target} has no {STABLE} marker yet: it may be half written")
    for entry in target.rglob("*"):  # the reads refuse any link (422); one leading out is named as such
        if entry.is_symlink() and not Path(os.path.realpath(entry)).is_relative_to(root):
            raise HTTPException(403, f"{entry} links to {os.path.realpath(entry)}, outside the weights dir {root}")
    return str(target)


def open_step_dir(weights_dir: str, target: str) -> OpenDir:
    """The step directory `target` (a real path inside the weights dir), opened once, no component a link."""
    root = Path(os.path.realpath(weights_dir))
    return OpenDir.beneath(root, Path(target).relative_to(root))


def is_adapter_step(manifest: dict[str, Entry] | None) -> bool:
    """Whether a step's files are a LoRA adapter (rl.adapter's layout) rather than full weights."""
    return manifest is not None and ADAPTER_CONFIG in manifest


def published_step(directory: OpenDir | Path) -> tuple[bytes, dict[str, Entry]]:
    """The step's marker bytes (what identifies its files) and manifest, both from one read of the marker: the
    directory holds exactly its listed files, and every one but the weight files (which the worker checks as it
    reads them, once) is checked here."""
    marker = read_marker(directory)
    manifest = read_manifest(directory, marker)
    for name, entry in manifest.items():
        if not name.endswith(".safetensors"):
            check_listed(directory, name, entry)
    return marker, manifest
