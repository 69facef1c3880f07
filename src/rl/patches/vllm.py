"""rl's changes to vLLM: in each of its processes (a general plugin) or in the inference server's.
rl/patches/__init__.py lists them."""

from __future__ import annotations

import functools
import logging
import os
import time

from rl.patches.targets import PatchTargetMissing, patch_target

logger = logging.getLogger(__name__)

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
                                 "rl/patches/ would replace another class than it was written for")
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

    patch_target(shm_broadcast, "sched_yield", "vllm")
    shm_broadcast.sched_yield = functools.partial(time.sleep, poll_s)


START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def vllm_cpu_fork(child_set_up) -> None:
    """vLLM's CLI sets `VLLM_WORKER_MULTIPROC_METHOD=spawn` where nothing is set, and its CPU platform sets it again as
    it checks the config (in the API process, and in the engine core), so on CPU its engine core and every worker
    import vLLM, torch and transformers anew, one after the other. Spawn is vLLM's safe choice for accelerators (CUDA
    cannot be used in a process forked after it started); a CPU host has none, and fork is vLLM's library default.
    This keeps the platform's other settings and puts fork back after them; forked processes inherit the patched
    class, so the engine core forks its workers too.

    A forked process must not keep what a spawned one never had, nor outlive its parent: `child_set_up` runs first in
    each (the inference server gives `rl.inference.cpu_fork.child`; this module imports nothing of a process). Above
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
    from rl.process import register_fork_hooks  # rl's own code, not a patch: the hooks around each fork

    register_fork_hooks(after_in_child=child_set_up)


def vllm_cpu_moe_reload() -> None:
    """vLLM 0.32's in-place reload skips its CPU MoE kernel's set-up for a layer it has set up before (it treats the
    reload as an update of weights already in place): the reloaded experts stay in checkpoint layout, which the kernel
    reads as its packed layout (wrong logits; with a padded intermediate size the reload fails on a shape). This
    packs (and pads) a reloaded layer's experts as a first load does, before vLLM copies them into the served
    buffers. Applied on CPU hosts for an MoE (`vllm_cpu_moe`); the served fingerprint reads the experts back from the
    kernel's buffers, so a reload without it is refused."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    set_up = patch_target(UnquantizedFusedMoEMethod, "_setup_kernel", "vllm")
    if getattr(set_up, "rl_packs_reloads", False):
        return

    def set_up_and_pack(self, layer, w13, w2):
        reloading = self.moe_kernel is not None
        set_up(self, layer, w13, w2)
        if reloading and self.unquantized_backend == UnquantizedMoeBackend.CPU:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    set_up_and_pack.rl_packs_reloads = True
    UnquantizedFusedMoEMethod._setup_kernel = set_up_and_pack


MOE_ENV = "RL_VLLM_CPU_MOE"  # "reload": an MoE served on CPU; "record": its routed experts recorded too


def vllm_cpu_moe() -> None:
    """A vLLM general plugin (pyproject.toml's `vllm.general_plugins` entry point), called by vLLM in each of its
    processes, forked or spawned: where the inference server set `MOE_ENV` (an MoE on a CPU host), its reloads pack
    the experts again (`vllm_cpu_moe_reload`) and, with "record", its CPU runner records each token's experts
    (`capture_routed_experts_on_cpu`). Other vLLM runs in this environment are untouched."""
    mode = os.environ.get(MOE_ENV, "")
    if mode not in ("reload", "record"):
        return
    vllm_cpu_moe_reload()
    if mode == "record":
        from rl.patches.routed_experts import capture_routed_experts_on_cpu

        capture_routed_experts_on_cpu()
