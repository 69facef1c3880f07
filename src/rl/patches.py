"""Every change rl makes to another library's code at run time, in one place. Nothing else in rl assigns into
another library's modules. Each patch says what it replaces, why, and who applies it; what each was measured to
save is in docs/architecture.md ("Patches of other libraries"):

- pydantic: its inspection of default factories is cached (`cache_default_factory_inspection`);
- verifiers: its training client sends requests through our `EngineClient` (`use_engine_client`);
- renderers: each renderer it builds for verifiers' training client remembers its recent renders
  (`remember_renders`): a group's rollouts render the same prompt; its tokenizer remembers encodes of short strings
  (`remember_short_encodes`); verifiers' renderer slots hand out a remembered render on the event loop instead of
  through a thread (`remembered_on_loop`);
- verifiers: its subprocess runtime makes each rollout's working directory at its first use, not at every start
  (`lazy_runtime_workdirs`); harness classes are remembered by id (`remember_harness_classes`); the
  signatures of the hooks and scoring functions it calls, by function (`remember_signatures`); a task's content
  hash, per data object (`remember_task_hashes`); renderers decodes
  engine replies with msgspec (`decode_engine_replies_with_msgspec`); each interception server offers rl's
  in-process chat harness its model routes, called without HTTP (`interception_in_process`);
  all applied by the orchestrator's rollouts module when it is imported (`apply_orchestrator_patches`, which
  it hands the client class: this module imports nothing of rl's);
- verifiers: its eval client reads chat replies through an httpx client that bounds their size and the time to
  read them (`bound_eval_client`), applied by `eval/replies.py` when it is imported;
- vLLM: its shared-memory queues sleep between polls instead of spinning (`vllm_shm_polling`), a vLLM
  general plugin that vLLM runs in each of its processes, active only where `RL_VLLM_SHM_POLL_S` is set
  (the inference server sets it on CPU hosts);
- vLLM: its CPU platform starts the engine core and workers by fork, as vLLM does where no accelerator is
  initialised, not by spawn, and each forked worker takes the OpenMP threads and cores vLLM chose for it
  (`vllm_cpu_fork`), applied by the inference server on CPU hosts (`rl.inference.server.cpu_start_method`);
- vLLM: its generate route answers through the inference gate's response class, which adds token strings and
  writes the response once (`render_generate_responses`), applied by the gate when vLLM builds it.

The imports of the patched libraries stay inside the functions: vLLM loads this module in every process
it starts, where neither pydantic's internals nor verifiers are needed. A patch whose target is gone (the
library changed) raises `PatchTargetMissing` when it is applied, at start-up: it never silently stops applying.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import threading
import time
import types

logger = logging.getLogger(__name__)


class PatchTargetMissing(RuntimeError):
    """A library no longer has what rl patches: pin the version rl was measured with, or update the patch."""


def patch_target(module, name: str, library: str):
    """`module.name`, or PatchTargetMissing naming it and the installed version of `library`."""
    from importlib.metadata import version

    target = getattr(module, name, None)
    if target is None:
        raise PatchTargetMissing(
            f"{module.__name__}.{name} is gone in {library} {version(library)}: rl/patches.py replaces it; install "
            f"the {library} version in uv.lock or update the patch"
        )
    return target


# --------------------------------------------------------------------------------------------------
# pydantic
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# verifiers
# --------------------------------------------------------------------------------------------------


def use_engine_client(client_class: type) -> None:
    """verifiers' training client builds an OpenAI SDK client for vLLM's generate route; it builds
    `client_class` (rl's `EngineClient`, orchestrator/engine_client.py: the members it uses, over aiohttp, at a
    fraction of the SDK's CPU per request) instead."""
    import verifiers.v1.clients.train as verifiers_train

    patch_target(verifiers_train, "build_async_openai", "verifiers")
    verifiers_train.build_async_openai = client_class


def bound_eval_client(build_client) -> None:
    """verifiers' eval client (chat completions at any OpenAI-compatible server: what `eval` samples through with
    `client.api = "chat"`) reads every reply whole, however large and however long it takes; it builds its httpx
    client with `build_client` instead (rl's `eval/replies.py`: where the config carries them, a size bound and a
    deadline enforced as each reply's bytes arrive; verifiers' own client otherwise)."""
    import verifiers.v1.clients.eval as verifiers_eval

    patch_target(verifiers_eval, "build_async_httpx", "verifiers")
    verifiers_eval.build_async_httpx = build_client


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


WORKDIR_USES = ("run", "open_process", "run_background", "_read", "write")  # every use of a runtime's workdir


def lazy_runtime_workdirs() -> None:
    """verifiers' subprocess runtime, the one rollouts get on the orchestrator's host, makes a working directory for
    every rollout as it starts (a mkdir on the event loop) and removes it as it ends (an rmtree in a thread), though
    a harness that runs no program (rl's in-process chat) never uses it: py-spy put ~15% of the orchestrator's CPU
    in them (benchmarks/orchestrator_throughput.py). The directory is now made at its first use (a program run or
    started, a file written or read) and removed only where it was made. Same path, same contents for any harness
    that uses it; none for one that does not."""
    from verifiers.v1.runtimes import subprocess as runtimes

    runtime = runtimes.SubprocessRuntime
    start = patch_target(runtime, "start", "verifiers")
    if getattr(start, "lazy_workdir", False):
        return

    async def start_lazily(self) -> None:
        self.workdir = runtimes.CACHE_DIR / "runtimes" / "subprocess" / self.name
        self.info.id = str(self.workdir)

    def made_first(use):
        @functools.wraps(use)
        async def using_workdir(self, *args, **kwargs):
            self.workdir.mkdir(parents=True, exist_ok=True)
            return await use(self, *args, **kwargs)

        return using_workdir

    @contextlib.contextmanager
    def unmade_passed_over(self):
        """While `self`'s directory was never made, it has none: `teardown`/`cleanup` remove nothing, the rest runs."""
        workdir = self.workdir
        if workdir is not None and not workdir.exists():
            self.workdir = None
        try:
            yield
        finally:
            self.workdir = workdir

    def removed_where_made(end):
        @functools.wraps(end)
        def ending(self):
            with unmade_passed_over(self):
                return end(self)

        return ending

    def removed_where_made_async(end):
        @functools.wraps(end)
        async def ending(self):
            with unmade_passed_over(self):
                return await end(self)

        return ending

    for name in WORKDIR_USES:
        setattr(runtime, name, made_first(patch_target(runtime, name, "verifiers")))
    runtime.teardown = removed_where_made_async(patch_target(runtime, "teardown", "verifiers"))
    runtime.cleanup = removed_where_made(patch_target(runtime, "cleanup", "verifiers"))
    start_lazily.lazy_workdir = True
    runtime.start = start_lazily


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


def remember_harness_classes() -> None:
    """verifiers looks up a seat's harness class by id for every agent of every episode (an importlib spec search
    first: ~0.1 ms per rollout, py-spy). A class found is remembered by id; a lookup that fails is tried again."""
    from verifiers.v1.utils import loaders

    find = patch_target(loaders, "harness_class", "verifiers")
    if hasattr(find, "cache_info"):
        return
    loaders.harness_class = functools.cache(find)


def remember_task_hashes() -> None:
    """verifiers' `Task.hash`, the sha256 of the task data's JSON recorded on every trace, is computed again on every
    read (a model_dump and a json.dumps of the data): twice per rollout, 4-5% of the orchestrator's CPU in an rl run
    of the quickstart (py-spy). Task data are frozen values (`Task.with_data` makes a copy), so a task remembers its
    hash for the data object it was computed from, and computes it again for any other."""
    from verifiers.v1 import task as task_module

    task_class = patch_target(task_module, "Task", "verifiers")
    content_hash = task_class.__dict__.get("hash")
    if not isinstance(content_hash, property):
        raise PatchTargetMissing("verifiers.v1.task.Task.hash is no longer a property: rl/patches.py replaces it")
    if getattr(content_hash.fget, "remembered", False):
        return
    compute = content_hash.fget

    def remembered_hash(task):
        data, digest = task.__dict__.get("_rl_content_hash", (None, None))
        if digest is None or data is not task.data:
            digest = compute(task)
            task.__dict__["_rl_content_hash"] = (task.data, digest)
        return digest

    remembered_hash.remembered = True
    task_class.hash = property(remembered_hash, doc=content_hash.__doc__)


def remember_signatures() -> None:
    """verifiers calls each task hook and scoring function (`setup`, rewards, metrics, ...) through
    `utils.decorators.invoke`, which reads the function's signature (`inspect.signature`) on every call to pick
    the arguments it takes: several per rollout, ~5% of the orchestrator's CPU (py-spy). The module's `inspect`
    remembers signatures (`RememberingInspect`); `invoke` is unchanged, and any other use of `inspect` there goes
    to `inspect` itself."""
    from verifiers.v1.utils import decorators

    if isinstance(patch_target(decorators, "inspect", "verifiers"), RememberingInspect):
        return
    patch_target(decorators, "invoke", "verifiers")
    decorators.inspect = RememberingInspect()


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


def decode_engine_replies_with_msgspec() -> None:
    """renderers parses each `/inference/v1/generate` reply (`renderers.client.parse_generate_response`) with the
    json module: two dicts per sampled token, ~2.8x msgspec's time (a 4,096-token reply 8.1 against 2.9 ms on this
    CPU; docs/architecture.md, Measurements), on the orchestrator's one event loop, for every turn of every rollout.
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


def interception_in_process() -> None:
    """verifiers' interception server is an aiohttp server on localhost, and rl's in-process chat harness reaches it
    over HTTP from the same event loop: a client request and a server request per model call, ~0.7 ms of CPU
    (py-spy and a bare aiohttp round trip, docs/architecture.md, Measurements) of the few ms a rollout costs. Each
    server, once started, offers in_process_chat its model routes (`route_in_process`): the harness's calls go to
    the route's handler directly, with the harness's headers and body in a request that carries what the handler
    reads (`LocalRequest`), in a task of its own as aiohttp serves each request (a concluded rollout's session
    cancels its handlers' tasks, never the caller's). Same handler, same checks, same trace; a harness that
    speaks HTTP (any other) is served over HTTP as before."""
    from verifiers.v1.interception import server as interception

    server_class = patch_target(interception, "InterceptionServer", "verifiers")
    start = patch_target(server_class, "start", "verifiers")
    if getattr(start, "routes_in_process", False):
        return
    patch_target(server_class, "_handler_for", "verifiers")
    dialects = patch_target(interception, "DIALECTS", "verifiers")
    max_body = patch_target(interception, "MAX_REQUEST_BODY", "verifiers")

    async def start_routing_in_process(self) -> None:
        from in_process_chat import route_in_process

        await start(self)
        for dialect in dialects:
            for route in dialect.routes:
                url = f"{self.base_url}{route}"
                route_in_process(url, local_route(self._handler_for(dialect), route, max_body))
                self.stack.callback(route_in_process, url, None)

    start_routing_in_process.routes_in_process = True
    server_class.start = start_routing_in_process


def local_route(handler, path: str, max_body: int):
    """An aiohttp route handler called in process: (headers, body) -> (status, body), as HTTP would have answered.
    Requests with streamed replies are not served here (in_process_chat asks for none)."""
    from multidict import CIMultiDict, CIMultiDictProxy

    async def call(headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        if len(body) > max_body:  # aiohttp's client_max_size, which the server sets
            return 413, f"request body of {len(body)} bytes exceeds {max_body}".encode()
        request = LocalRequest(path, CIMultiDictProxy(CIMultiDict(headers)), body)
        del body  # the request holds it until the handler has parsed it
        served = asyncio.ensure_future(handler(request))
        try:
            await asyncio.wait([served])
        except asyncio.CancelledError:  # the caller is gone, as a client that disconnects
            served.cancel()
            raise
        if served.cancelled():
            return 503, f"{path}: the handler was cancelled (its rollout concluded)".encode()
        if served.exception() is not None:
            logger.error("in-process request to %s failed", path, exc_info=served.exception())
            return 500, f"{path}: {served.exception()!r}".encode()
        response = served.result()
        if not isinstance(getattr(response, "body", None), (bytes, bytearray)):
            return 500, f"{path}: the handler answered with a stream, which is served over HTTP only".encode()
        return response.status, bytes(response.body)

    return call


class LocalRequest(dict):
    """What verifiers' interception handler reads of an `aiohttp.web.Request`: its path, headers (case-insensitive)
    and body, and a mapping for per-request state."""

    def __init__(self, path: str, headers, body: bytes) -> None:
        super().__init__()
        self.path, self.headers, self.content_length = path, headers, len(body)
        self._read_bytes: bytes | None = body  # aiohttp's cache of the body, which the handler drops once parsed

    async def read(self) -> bytes:
        return self._read_bytes if self._read_bytes is not None else b""  # once dropped, as a drained stream


def apply_orchestrator_patches(client_class: type) -> None:
    cache_default_factory_inspection()
    use_engine_client(client_class)
    remember_renders()
    remembered_on_loop()
    lazy_runtime_workdirs()
    remember_harness_classes()
    remember_signatures()
    remember_task_hashes()
    decode_engine_replies_with_msgspec()
    interception_in_process()


# --------------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------------

POLL_ENV = "RL_VLLM_SHM_POLL_S"
CPU_POLL_S = 0.0005
"""Latency added per wait at most, small beside a decode step; shorter and longer intervals measured alike."""


def poll_interval() -> float | None:
    """Seconds per poll that `POLL_ENV` asks for; None where it is unset or empty (vLLM keeps spinning)."""
    value = os.environ.get(POLL_ENV, "")
    if not value:
        return None
    try:
        poll_s = float(value)
    except ValueError:
        poll_s = -1.0
    if not 0 <= poll_s <= 1:
        raise ValueError(f"{POLL_ENV}={value!r}: give seconds from 0 to 1, or leave it empty to keep vLLM's spinning")
    return poll_s


def render_generate_responses(response_class: type) -> None:
    """vLLM's `/inference/v1/generate` route answers through `response_class` (`rl.inference.gate.GenerateResponse`)
    instead of starlette's JSONResponse; the route reads the name from its module at every call. The route wrote
    its dict with the json module, and rl's gate parsed that body again to add the token strings verifiers' client
    needs, then wrote it again; `response_class` adds them on the dict and writes it once."""
    from starlette.responses import JSONResponse
    from vllm.entrypoints.scale_out.token_in_token_out import api_router

    current = patch_target(api_router, "JSONResponse", "vllm")
    if current is not response_class and current is not JSONResponse:
        raise PatchTargetMissing(f"vLLM's generate route answers through {current!r}, not starlette's JSONResponse: "
                                 "rl/patches.py would replace another class than it was written for")
    api_router.JSONResponse = response_class


def vllm_shm_polling() -> None:
    """A vLLM general plugin (pyproject.toml's `vllm.general_plugins` entry point), called by vLLM in each of
    its processes, maybe more than once. vLLM's engine core and worker pass each step through shared-memory
    queues: a reader spins on `sched_yield` for 1 s after each message, a writer whenever the queue is full.
    On a CPU host the engine core spun through most of a core while the worker computed, CPU taken from the
    model itself, the orchestrator and the trainer. With `POLL_ENV` set each poll sleeps that long instead;
    idle waits (1 s without a message) block on a socket as before. The variable, inherited by vLLM's
    processes, is the switch, so other vLLM runs in this environment are untouched."""
    poll_s = poll_interval()
    if poll_s is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if not hasattr(shm_broadcast, "sched_yield"):
        logger.warning("vllm's shm_broadcast has no sched_yield: %s has no effect", POLL_ENV)
        return
    shm_broadcast.sched_yield = functools.partial(time.sleep, poll_s)


START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def vllm_cpu_fork() -> None:
    """vLLM's CLI sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` where nothing is set, and its CPU platform sets it again as
    it checks the config (in the API process, and in the engine core), so on CPU its engine core and every worker
    import vLLM, torch and transformers anew, one after the other. Spawn is vLLM's safe choice for accelerators (CUDA
    cannot be used in a process forked after it started); a CPU host has none, and fork is vLLM's library default.
    This keeps the platform's other settings and puts fork back after them; forked processes inherit the patched
    class, so the engine core forks its workers too.

    A forked process must not keep what a spawned one never had, nor outlive its parent (`rl.inference.forked`). Above
    all it must get the cores and threads vLLM chose for it: vLLM's CPU executor binds each worker through the
    environment only (it preloads torch's OpenMP with LD_PRELOAD and sets GOMP_CPU_AFFINITY or OMP_PLACES, and
    OMP_NUM_THREADS, around the worker's start), which the loader and OpenMP read when a process starts. A forked
    worker would keep its parent's OpenMP, a thread per core of the host bound to none, spinning against the engine
    core and the API server: fewer tokens/s (benchmarks/RESULTS.md). Apply this before vLLM parses its arguments, and
    only where the user set no start method."""
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    check = patch_target(platform, "check_and_update_config", "vllm")
    if getattr(check, "rl_forks", False):
        return

    def check_and_fork(vllm_config) -> None:
        check(vllm_config)
        os.environ[START_METHOD_ENV] = "fork"

    check_and_fork.rl_forks = True
    platform.check_and_update_config = staticmethod(check_and_fork)
    from rl.inference import forked  # rl's own code, not a patch: what a forked process undoes of its parent's

    os.register_at_fork(before=forked.remember_forking_parent, after_in_child=forked.child)
