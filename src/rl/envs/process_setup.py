"""What a process that runs or sends episodes sets up first: rl's patches to verifiers, renderers and pydantic
(rl/patches/), with rl's own classes handed to them; the GC tuned once environments serve; and, in an env-server
worker, its whole start (`set_up_worker`)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator

from rl.envs.chat_calls import route_in_process, shared_session
from rl.envs.chat_replies import build_client
from rl.envs.engine_client import EngineClient
from rl.envs.watch import beating
from rl.envs.groups import RL_CLIENT_CONFIGS
from rl.envs.policy_versions import POLICY_VERSION_STREAM, POLICY_VERSIONS
from rl.patches import (
    apply_orchestrator_patches, bound_eval_client, check_internals, send_traces_once, serve_rl_client_configs,
    stamp_policy_versions,
)
from rl.process import set_up_process


def apply_patches() -> None:
    """What rl changes in verifiers, renderers and pydantic (rl/patches/) in a process that runs or sends
    episodes: applied first by the main() of the orchestrator, of `eval` and by every env-server worker, once every
    internal name of verifiers', renderers' and pydantic's that rl reads is found there (rl/patches/internals.py)."""
    check_internals("episodes")
    apply_orchestrator_patches(EngineClient, route_in_process)
    bound_eval_client(build_client)
    serve_rl_client_configs(RL_CLIENT_CONFIGS)
    stamp_policy_versions(POLICY_VERSIONS.node_versions, POLICY_VERSION_STREAM)


YOUNG_GC_THRESHOLD = 10_000
"""Net container allocations between young-generation collections (CPython's default: 700). A rollout
allocates thousands of short-lived objects: at 700 the young collections took a tenth of the orchestrator's
CPU, at 10,000 next to none (benchmarks/RESULTS.md). Garbage in cycles waits one collection
longer: a few MB at most."""


def tune_gc_for_serving() -> None:
    """Once environments serve: keep the objects that live for the whole run (modules, environments, their
    tasks: hundreds of thousands) out of the cyclic GC (a full collection over them stalled every rollout for
    a good part of a second), and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


def set_up_worker() -> None:
    """Run by serve_env in the broker and in every worker it spawns (as its `log_setup`): rl's log format, and
    rl's patches to verifiers, renderers and pydantic, before the worker loads the environment."""
    from rl.metrics import PER_REQUEST_LOGGERS, setup_logging

    set_up_process()
    setup_logging(f"env-server[{os.getpid()}]", quiet=PER_REQUEST_LOGGERS)
    logging.getLogger("verifiers.v1.serve").setLevel(logging.INFO)  # the pool's and each worker's up and down
    apply_patches()
    send_traces_once()


@contextlib.asynccontextmanager
async def worker_holds() -> AsyncIterator[None]:
    """What a worker holds while it serves: the chat calls' shared HTTP session (rl/envs/chat_calls.py: one
    kept-alive session for the worker's model calls, not one per call), and its heartbeat (rl/envs/watch.py)."""
    async with shared_session(), beating():
        yield
