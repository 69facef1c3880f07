"""Every change rl makes to verifiers, and every read of its env-server pool's private structure, in one file (with
rl/envs/groups.py, which reads its env server's and client's private members, the only places rl touches verifiers'
internals; docs/architecture.md lists each with the verifiers version it was read from). Applied in the processes
that run or send episodes (`rl.envs.process_setup.apply_patches`) and in rl's env server (`rl.envs.server`).
rl/patches/__init__.py lists them."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
from collections.abc import Callable

from rl.patches.targets import PatchTargetMissing, installed_version, once, patch_target
from rl.patches.local_route import local_route
from rl.patches.pydantic import cache_default_factory_inspection
from rl.patches.signatures import RememberingInspect
from rl.patches.renderers import (
    decode_engine_replies_with_msgspec, remember_renders, remembered_on_loop,
)

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# verifiers
# --------------------------------------------------------------------------------------------------


def use_engine_client(client_class: type) -> None:
    """verifiers' training client builds an OpenAI SDK client for vLLM's generate route; it builds
    `client_class` (rl's `EngineClient`, envs/engine_client.py: the members it uses, over aiohttp, at a
    fraction of the SDK's CPU per request) instead."""
    import verifiers.v1.clients.train as verifiers_train

    patch_target(verifiers_train, "build_async_openai", "verifiers")
    verifiers_train.build_async_openai = client_class


@once
def bound_eval_client(build_client) -> None:
    """verifiers' eval client (chat completions at any OpenAI-compatible server: what `eval` samples through with
    `client.api = "chat"`) reads every reply whole, however large and however long it takes; it builds its httpx
    client with `build_client` instead (rl's `envs/chat_replies.py`: where the config carries them, a size bound and a
    deadline enforced as each reply's bytes arrive; verifiers' own client otherwise)."""
    import verifiers.v1.clients.eval as verifiers_eval

    patch_target(verifiers_eval, "build_async_httpx", "verifiers")
    verifiers_eval.build_async_httpx = build_client


@once
def serve_rl_client_configs(client_configs: tuple[type, ...]) -> None:
    """verifiers' env-server request (`RunRequest`) carries its client config as verifiers' own classes: rl's
    subclasses (`client_configs`: the training client's grouping of a group's identical requests, the eval client's
    bounds on each reply) would be dumped without their fields by the orchestrator and refused by a worker; and the
    episode a worker sends back records the config on each trace, which the orchestrator reads as verifiers' own
    (`WireAgentConfig`, extra fields refused). Both fields take verifiers' own classes first, then rl's (an instance
    keeps its class; a dict with rl's fields validates only as rl's, one without them as verifiers' own, so that a
    plain verifiers client's episode comes back with the config it sent, which that client can read), and the wire
    models are built over them again; applied on both ends, where `apply_patches` runs."""
    from typing import Optional, Union

    from pydantic.fields import FieldInfo
    from verifiers.v1 import episode, trace
    from verifiers.v1.configs import agent
    from verifiers.v1.configs.client import EvalClientConfig, TrainClientConfig
    from verifiers.v1.serve import types as serve_types

    client_config = Union[(EvalClientConfig, TrainClientConfig, *client_configs)]
    for model, annotation in ((patch_target(serve_types, "RunRequest", "verifiers"), client_config),
                              (patch_target(agent, "WireAgentConfig", "verifiers"), Optional[client_config])):
        if "client" not in model.model_fields:
            raise PatchTargetMissing(f"verifiers' {model.__name__} has no client field (verifiers "
                                     f"{installed_version('verifiers')}): update rl/patches/verifiers.py")
        default = model.model_fields["client"].default  # verifiers' field, its discriminator dropped with it
        model.model_fields["client"] = FieldInfo.from_annotated_attribute(annotation, default)
        model.model_rebuild(force=True)
    agent_info = patch_target(trace, "AgentInfo", "verifiers")[agent.WireAgentConfig]  # pydantic's cached class
    for wire_model in (agent_info, patch_target(trace, "WireTrace", "verifiers"),
                       patch_target(episode, "WireEpisode", "verifiers")):
        wire_model.model_rebuild(force=True)  # each built over the old schema of the one before


def serve_env_with(server_class: type) -> None:
    """verifiers' pool builds the server each worker runs by its module's name (`serve_env`:
    `EnvServer.run_server(...)`, which makes `cls(...)`): that name becomes `server_class`, a subclass of verifiers'
    (rl/envs/worker_server.py), with the server arguments the pool hands it. Applied by rl's env server in its
    broker, before its workers fork: they inherit it."""
    from verifiers.v1.serve import pool

    env_server = patch_target(pool, "EnvServer", "verifiers")
    if not issubclass(server_class, env_server):
        raise TypeError(f"{server_class.__name__} is not a subclass of verifiers' {env_server.__name__}")
    pool.EnvServer = server_class


@once
def send_traces_once() -> None:
    """verifiers' env server streams an episode's traces while it runs: a delta at every phase change and turn, each
    diffed against what was sent, encoded, sent through the broker and applied by the client. The orchestrator
    reads an episode only when it has ended, so each worker sends its traces once, at the end (the streamer's final
    flush, which diffs every live trace): the same bytes in one message, not one per phase. A cancelled episode
    sends none, as before (its run is answered with an error). Measured (benchmarks/RESULTS.md): 1.3 ms of the env
    server's CPU per single-turn rollout and 0.3 ms of the orchestrator's. Applied by every env-server worker."""
    from verifiers.v1.serve import delta

    streamer = patch_target(delta, "DeltaStreamer", "verifiers")
    patch_target(streamer, "watch", "verifiers")
    streamer.watch = lambda self, trace: None  # no flush per change; __aexit__'s final flush sends it all


# --------------------------------------------------------------------------------------------------
# verifiers' env-server pool, in rl's env server (rl/envs/server.py)
# --------------------------------------------------------------------------------------------------


def answer_health_with(fields: dict) -> None:
    """verifiers' env-server pool answers `health` itself, with a fixed reply (`pool._HEALTH`, read as it answers);
    rl's env server has the reply carry `fields` too (its live workers, which the orchestrator logs per step),
    set again by its worker watch whenever they change. verifiers' own client ignores fields it does not know."""
    import msgpack
    from verifiers.v1.serve import pool

    patch_target(pool, "_HEALTH", "verifiers")
    pool._HEALTH = msgpack.packb({"success": True, "error": None, **fields}, use_bin_type=True)


def fork_pool_workers(env_pool) -> None:
    """verifiers' pool spawns its workers: each imports verifiers, rl and the environment's package anew before it
    loads the environment, which the broker has already imported and checked (~18 s of a core per worker on a
    2-core CPU host, where the broker took ~12 s). Forked from the broker, a worker starts with all of it imported.

    The broker holds no accelerator, and a worker uses nothing of its parent's ZMQ context or event loop: it makes
    its own, as a spawned one does. What a forked process inherits and a spawned one never has is undone in the
    child (rl/process.py, as for vLLM's forked processes): the broker's TCP port is closed, and the child
    ends with the broker (the death pipe verifiers gives a worker cannot tell it: a forked worker holds the pipe's
    other end too). Apply to the pool before it runs."""
    from rl.process import cut_from_parent, register_fork_hooks  # rl's own code: what a forked child undoes

    if not isinstance(getattr(env_pool, "_mpctx", None), multiprocessing.context.BaseContext):
        raise PatchTargetMissing(f"verifiers' EnvServerPool no longer starts its workers from `_mpctx` in verifiers "
                                 f"{installed_version('verifiers')}: update rl/patches/verifiers.py")
    env_pool._mpctx = multiprocessing.get_context("fork")
    register_fork_hooks(after_in_child=cut_from_parent)


def pool_workers(env_pool) -> list[tuple[int, object]]:
    """Each worker of verifiers' pool as (its index, its process): the pool keeps them as dicts (`workers`)."""
    workers = patch_target(env_pool, "workers", "verifiers")
    return [(worker["index"], worker["process"]) for worker in list(workers)]


# --------------------------------------------------------------------------------------------------
# verifiers' runtimes, loaders and interception, in the processes that run episodes
# --------------------------------------------------------------------------------------------------


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
        raise PatchTargetMissing("verifiers.v1.task.Task.hash is no longer a property: rl/patches/ replaces it")
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




def interception_in_process(route_in_process: Callable[[str, object], None]) -> None:
    """verifiers' interception server is an aiohttp server on localhost, and rl's in-process chat harness reaches it
    over HTTP from the same event loop: a client request and a server request per model call, ~0.7 ms of CPU
    (py-spy and a bare aiohttp round trip, benchmarks/RESULTS.md) of the few ms a rollout costs. Each
    server, once started, offers its model routes in process (`route_in_process`, rl/envs/chat_calls.py's): the
    harness's calls go to the route's handler directly, with the harness's headers and body in a request that
    carries what the handler reads (`LocalRequest`), in a task of its own as aiohttp serves each request (a
    concluded rollout's session cancels its handlers' tasks, never the caller's). Same handler, same checks, same
    trace; a harness that speaks HTTP (any other) is served over HTTP as before."""
    from verifiers.v1.interception import server as interception

    server_class = patch_target(interception, "InterceptionServer", "verifiers")
    start = patch_target(server_class, "start", "verifiers")
    if getattr(start, "routes_in_process", False):
        return
    patch_target(server_class, "_handler_for", "verifiers")
    dialects = patch_target(interception, "DIALECTS", "verifiers")
    max_body = patch_target(interception, "MAX_REQUEST_BODY", "verifiers")

    async def start_routing_in_process(self) -> None:
        await start(self)
        for dialect in dialects:
            for route in dialect.routes:
                url = f"{self.base_url}{route}"
                route_in_process(url, local_route(self._handler_for(dialect), route, max_body))
                self.stack.callback(route_in_process, url, None)

    start_routing_in_process.routes_in_process = True
    server_class.start = start_routing_in_process


@once
def apply_orchestrator_patches(client_class: type, route_in_process: Callable[[str, object], None]) -> None:
    """verifiers in a process that runs episodes, with rl's engine client (`client_class`) and rl's way to offer a
    route in process (rl/envs/chat_calls.py)."""
    cache_default_factory_inspection()
    use_engine_client(client_class)
    remember_renders()
    remembered_on_loop()
    lazy_runtime_workdirs()
    remember_harness_classes()
    remember_signatures()
    remember_task_hashes()
    decode_engine_replies_with_msgspec()
    interception_in_process(route_in_process)


