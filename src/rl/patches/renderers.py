"""rl's changes to renderers (verifiers' token-level renderers), in the processes that run environments, applied
with the others by `apply_orchestrator_patches`. rl/patches/__init__.py lists them."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading

from rl.patches.targets import patch_target

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# renderers
# --------------------------------------------------------------------------------------------------


RENDERS_REMEMBERED = 256  # per renderer: more than the distinct prompts of the groups in flight at once


class NotRemembered(Exception):
    """Raised inside a renderer slot's work tried on the event loop: the work is not a remembered render."""


_on_loop = threading.local()  # `.active` while a slot's work is tried on the event loop thread


def remember_renders() -> None:
    """verifiers' training client renders each rollout's prompt (chat template, then tokenizer) on a renderer from
    its pool; the rollouts of a group share their prompt, so a group of n rendered it n times (~0.4-0.6 ms each for
    a short prompt). Each renderer built for the pool (`renderers.create_renderer`) keeps its last
    RENDERS_REMEMBERED renders, keyed by everything `render` takes, and hands out a copy: callers own what they
    get. A render is a pure function of its arguments for one renderer. It is kept pickled: unpickling is the
    copy (7 us for a short prompt's render against deepcopy's 67 us)."""
    import json
    import pickle
    from collections import OrderedDict

    import renderers

    create = patch_target(renderers, "create_renderer", "renderers")
    if getattr(create, "remembers_renders", False):
        return

    def remembering(render):
        memory: OrderedDict[str, bytes] = OrderedDict()  # verifiers renders only under the renderer's slot lock

        @functools.wraps(render)
        def remembered_render(messages, **kwargs):
            try:
                key = json.dumps([messages, kwargs], sort_keys=True)
            except TypeError:  # not plain JSON (images): rendered each time
                key = None
            pickled = memory.get(key)
            if pickled is not None:
                memory.move_to_end(key)
                return pickle.loads(pickled)
            if getattr(_on_loop, "active", False):
                raise NotRemembered
            rendered = render(messages, **kwargs)
            if key is not None:
                with contextlib.suppress(pickle.PicklingError, TypeError, AttributeError):  # unpicklable: not kept
                    memory[key] = pickle.dumps(rendered)
                    if len(memory) > RENDERS_REMEMBERED:
                        memory.popitem(last=False)
            return rendered

        remembered_render.remembers_renders = True
        return remembered_render

    def never_on_loop(work):
        @functools.wraps(work)
        def off_loop_only(*args, **kwargs):
            if getattr(_on_loop, "active", False):
                raise NotRemembered
            return work(*args, **kwargs)

        return off_loop_only

    @functools.wraps(create)
    def create_renderer(tokenizer, *args, **kwargs):
        renderer = create(tokenizer, *args, **kwargs)
        renderer.render = remembering(renderer.render)
        renderer.bridge_to_next_turn = never_on_loop(renderer.bridge_to_next_turn)
        remember_short_encodes(tokenizer)
        return renderer

    create_renderer.remembers_renders = True
    renderers.create_renderer = create_renderer


def remembered_on_loop() -> None:
    """verifiers runs a renderer slot's work (a render, a multi-turn bridge) in a thread under the slot's lock, so
    tokenizing a long prompt never blocks the event loop. A remembered render is a dictionary lookup and a copy:
    the hop to a thread and back cost more than the render (with `remember_signatures`, 2.67 -> 2.44 ms of
    orchestrator CPU per rollout: docs/architecture.md, Patches of other libraries). Where the slot's lock is
    free, its work is tried on the loop first, holding the lock; a render not remembered, or any other work of the
    renderer (`bridge_to_next_turn`), stops at once (`NotRemembered`) and goes to the thread as before. A
    renderer not built through `create_renderer` (so not remembering) is always sent to the thread."""
    from verifiers.v1.clients import train as verifiers_train

    slot = patch_target(verifiers_train, "RendererSlot", "verifiers")
    run_in_thread = patch_target(slot, "run", "verifiers")
    if getattr(run_in_thread, "remembered_on_loop", False):
        return

    @functools.wraps(run_in_thread)
    async def run(self, fn):
        if getattr(self.renderer.render, "remembers_renders", False) and self.lock.acquire(blocking=False):
            _on_loop.active = True
            try:
                return fn()
            except NotRemembered:
                pass
            finally:
                _on_loop.active = False
                self.lock.release()
        return await run_in_thread(self, fn)

    run.remembered_on_loop = True
    slot.run = run

SHORT_TEXT = 64  # characters: markers and headers, not prompts


def remember_short_encodes(tokenizer) -> None:
    """Parsing each response, renderers encode the assistant header and reasoning markers again (the prompt's and the
    completion's: ~0.2 ms per rollout, py-spy). The tokenizer of a renderer built for the training client remembers
    its encodes of short strings, keyed by the text and the call's arguments, and hands out copies. An encode is a
    pure function of those for one tokenizer."""
    encode = tokenizer.encode
    if getattr(encode, "remembers_short_encodes", False):
        return
    memory: dict[tuple, list[int]] = {}

    @functools.wraps(encode)
    def remembered_encode(text, *args, **kwargs):
        if not isinstance(text, str) or len(text) > SHORT_TEXT or args:
            return encode(text, *args, **kwargs)
        try:
            key = (text, tuple(sorted(kwargs.items())))
            ids = memory.get(key)
        except TypeError:  # an argument that cannot be a key
            return encode(text, **kwargs)
        if ids is None:
            ids = memory[key] = encode(text, **kwargs)
        return list(ids)

    remembered_encode.remembers_short_encodes = True
    tokenizer.encode = remembered_encode

def decode_engine_replies_with_msgspec() -> None:
    """renderers parses each `/inference/v1/generate` reply (`renderers.client.parse_generate_response`) with the
    json module: two dicts per sampled token, ~2.8x msgspec's time (a 4,096-token reply 8.1 against 2.9 ms on this
    CPU; benchmarks/RESULTS.md), on the orchestrator's one event loop, for every turn of every rollout.
    That module's `json` decodes with msgspec instead; a reply that is not strict JSON (`NaN`, `-Infinity`, which
    Python's json writes and reads) is decoded by the json module as before. The same values either way."""
    from renderers import client as renderers_client

    module_json = patch_target(renderers_client, "json", "renderers")
    if isinstance(module_json, StrictJsonFirst):
        return
    patch_target(renderers_client, "parse_generate_response", "renderers")
    renderers_client.json = StrictJsonFirst(module_json)


class StrictJsonFirst:
    """The json module, whose `loads` tries msgspec first (strict JSON only) and falls back to json's own."""

    def __init__(self, json_module) -> None:
        import msgspec

        self._json, self._decode, self._refused = json_module, msgspec.json.decode, msgspec.DecodeError

    def __getattr__(self, name: str):
        return getattr(self._json, name)

    def loads(self, text, **kwargs):
        if kwargs:
            return self._json.loads(text, **kwargs)
        try:
            return self._decode(text)
        except self._refused:
            return self._json.loads(text)
