"""`env-server`: one `[[env]]` served over ZMQ by verifiers' env-server pool (`verifiers.v1.serve.serve_env`).

A broker binds `address` and dispatches each request it is sent (rl's orchestrator sends a group's episodes as one:
the task's data, the model endpoint and each episode's sampling, rl/envs/groups.py; verifiers' clients one episode)
to the least busy of `workers` processes, which it forks once it has imported everything and checked the environment.
Each worker loads the environment once as rl's orchestrator does (its harness and runtime defaults:
rl/envs/loading.py), with rl's patches applied (rl/patches/), and runs its episodes itself: their model
calls go from the worker straight to inference. The client owns the taskset and samples it; a worker never loads
the environment's data.

    uv run env-server --env.id reverse-text [--workers 2] [--address tcp://127.0.0.1:5000]
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from rl.config import ConfigError, run_cli
from rl.envs.config import EnvServerConfig
from rl.envs.seal import seal_server
from rl.envs.worker import set_up_worker

WORKER_WATCH_S = 0.5
WORKER_DIED = 3  # the exit code when a worker died
logger = logging.getLogger("env-server")



def serve(config: EnvServerConfig) -> None:
    """verifiers' pool, always (one worker too: the broker then answers health checks while the worker is busy),
    every worker started at once; the first worker to die takes the server down with it, so that `rl` restarts it
    and the orchestrator runs the lost episodes again (verifiers' pool does not replace a dead worker)."""
    from verifiers.v1.serve import env_config_data

    from rl.envs.loading import EnvLoadError, resolved_env_config

    try:  # checked here, so that a wrong table fails the start with rl's message rather than in every worker
        env_config, seats = resolved_env_config(config.env)
    except EnvLoadError as e:
        raise ConfigError(str(e)) from None
    # Every worker's first episode loads its model's tokenizer: transformers' import (with torch's, ~8 s of a core on
    # a 2-core CPU host) is paid here once, before the workers fork, not by each worker as its first episode waits.
    from transformers import AutoTokenizer  # noqa: F401
    if config.address.startswith("ipc://"):  # the socket's directory, as rl names one in the run directory
        Path(config.address.removeprefix("ipc://")).parent.mkdir(parents=True, exist_ok=True)
    logger.info(f"environment {config.env.label!r} at {config.address}, {config.workers} workers; "
                + "; ".join(f"seat {seat!r}: {how}" for seat, how in seats.items()))
    signal.signal(signal.SIGTERM, _stop)  # asyncio.run's clean-up then stops the workers
    server_kwargs = {"config_data": env_config_data(env_config), "max_concurrent": config.max_concurrent}
    pool, authenticator = open_pool(config, server_kwargs)
    threading.Thread(target=exit_when_a_worker_dies, args=(pool,), name="worker watch", daemon=True).start()
    try:
        asyncio.run(pool.run())
    except KeyboardInterrupt:
        pass
    finally:
        if authenticator is not None:
            authenticator.stop()


def open_pool(config: EnvServerConfig, server_kwargs: dict):
    """verifiers' pool bound at the config's address; with a secret, a tcp:// address sealed (rl/envs/seal.py): the
    pool is bound first at a private socket, which is closed once the sealed address is bound, before any peer."""
    from verifiers.v1.serve import EnvServerPool

    from rl.patches import fork_pool_workers

    if config.secret is None or not config.address.startswith("tcp://"):
        pool = EnvServerPool(server_kwargs, config.workers, config.address, set_up_worker, elastic=False)
        fork_pool_workers(pool)
        return pool, None
    with tempfile.TemporaryDirectory(prefix="rl-env-server-") as private:
        unsealed = f"ipc://{private}/unsealed.sock"
        pool = EnvServerPool(server_kwargs, config.workers, unsealed, set_up_worker, elastic=False)
        authenticator, pool.address = seal_server(pool.frontend, unsealed, config.address, config.secret)
    fork_pool_workers(pool)
    logger.info(f"{pool.address} is sealed: only clients that hold the run's secret are admitted")
    return pool, authenticator


def _stop(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def exit_when_a_worker_dies(pool) -> None:
    """Also keeps the count of live workers in the pool's health reply, which the orchestrator logs."""
    from rl.patches import answer_health_with, pool_workers

    live = None
    while True:
        time.sleep(WORKER_WATCH_S)
        workers = pool_workers(pool)
        for index, process in workers:
            if process.exitcode is not None:
                logger.error(f"worker {index} (pid {process.pid}) died (exit code {process.exitcode}); "
                             "this env server stops with it, to be restarted and its episodes run again")
                os._exit(WORKER_DIED)
        if len(workers) != live:
            live = len(workers)
            answer_health_with({"workers": live})


def main() -> None:
    config = run_cli(EnvServerConfig)
    set_up_worker()
    try:
        serve(config)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
