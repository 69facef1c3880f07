"""rl's changes to verifiers' env-server pool (`verifiers.v1.serve.pool`), made by rl's env server
(rl/env_server.py) on its broker. rl/patches/__init__.py lists them."""

from __future__ import annotations

import multiprocessing

from rl.patches import PatchTargetMissing, installed_version, patch_target


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
    child (`rl.inference.forked`, as for vLLM's forked processes): the broker's TCP port is closed, and the child
    ends with the broker (the death pipe verifiers gives a worker cannot tell it: a forked worker holds the pipe's
    other end too). Apply to the pool before it runs."""
    from rl.inference import forked  # rl's own code, not a patch: what a forked process undoes of its parent's

    if not isinstance(getattr(env_pool, "_mpctx", None), multiprocessing.context.BaseContext):
        raise PatchTargetMissing(f"verifiers' EnvServerPool no longer starts its workers from `_mpctx` in verifiers "
                                 f"{installed_version('verifiers')}: update rl/patches/env_pool.py")
    env_pool._mpctx = multiprocessing.get_context("fork")
    forked.register_fork_hooks(after_in_child=forked.cut_from_parent)
