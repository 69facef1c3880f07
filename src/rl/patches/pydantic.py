"""rl's change to pydantic, in the processes that run environments (applied with verifiers' patches:
`apply_orchestrator_patches`). rl/patches/__init__.py lists it."""

from __future__ import annotations

import functools

from rl.patches.targets import patch_target


def cache_default_factory_inspection() -> None:
    """pydantic (2.14) inspects a field's `default_factory` signature on every `model_construct`; for a
    builtin factory (`list`) `inspect` copies `sys.modules` (thousands of modules once verifiers is imported),
    and verifiers constructs several such models per turn: the orchestrator's largest CPU cost. The answer
    depends only on the factory, so it is cached (pydantic/pydantic#13376 fixed the same for private
    attributes only)."""
    from pydantic._internal import _fields as pydantic_fields

    inspect_factory = patch_target(pydantic_fields, "takes_validated_data_argument", "pydantic")
    if hasattr(inspect_factory, "cache_info"):
        return
    cached = functools.lru_cache(maxsize=4096)(inspect_factory)

    @functools.wraps(inspect_factory)
    def takes_validated_data_argument(default_factory) -> bool:
        try:
            return cached(default_factory)
        except TypeError:  # an unhashable callable
            return inspect_factory(default_factory)

    takes_validated_data_argument.cache_info = cached.cache_info
    pydantic_fields.takes_validated_data_argument = takes_validated_data_argument
