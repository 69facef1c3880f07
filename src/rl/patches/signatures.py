"""`inspect` with its `signature` remembered per function: what `remember_signatures` (rl/patches/verifiers.py) gives
verifiers' `utils.decorators` in place of the module."""

from __future__ import annotations

import inspect
import types

SIGNATURES_REMEMBERED = 4096  # functions; more than any environment's hooks and scoring functions


class RememberingInspect:
    """`inspect`, with `signature` remembered per function; a bound method's per function, as it does not depend on
    the instance. Past SIGNATURES_REMEMBERED functions (callables made per call) it starts again."""

    def __init__(self) -> None:
        self._inspect = inspect
        self._memory: dict[tuple, object] = {}

    def __getattr__(self, name: str):
        return getattr(self._inspect, name)

    def signature(self, fn):
        bound = isinstance(fn, types.MethodType)
        key = (fn.__func__ if bound else fn, bound)
        try:
            signature = self._memory.get(key)
        except TypeError:  # an unhashable callable
            return self._inspect.signature(fn)
        if signature is None:
            if len(self._memory) >= SIGNATURES_REMEMBERED:
                self._memory.clear()
            signature = self._memory[key] = self._inspect.signature(fn)
        return signature
