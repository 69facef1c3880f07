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
from pathlib import Path

import zmq

from rl.config import ConfigError, run_cli
from rl.envs.config import EnvServerConfig
from rl.envs.seal import seal_server
from rl.envs.trust import ClientPolicy
from rl.envs.watch import BEATS_VAR, watch_workers
from rl.envs.process_setup import set_up_worker
from rl.envs.worker_server import WorkerServer
from rl.patches import serve_env_with

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
    policy = ClientPolicy.of(config.client_env_vars, config.model_endpoints, config.renderer_models)
    serve_env_with(WorkerServer)  # in the broker: its forked workers inherit it
    server_kwargs = {"config_data": env_config_data(env_config), "max_concurrent": config.max_concurrent,
                     "client_policy": policy}  # handed to each worker's WorkerServer
    with tempfile.TemporaryDirectory(prefix="rl-env-beats-") as beats:
        os.environ[BEATS_VAR] = beats  # the workers forked from here beat there (rl/envs/watch.py)
        pool, authenticator = open_pool(config, server_kwargs)
        threading.Thread(target=watch_workers, args=(pool, Path(beats), config.worker_stall_s), name="worker watch",
                         daemon=True).start()
        try:
            asyncio.run(pool.run())
        except KeyboardInterrupt:
            pass
        finally:
            if authenticator is not None:
                authenticator.stop()


def open_pool(config: EnvServerConfig, server_kwargs: dict):
    """verifiers' pool at the config's address. The pool is bound first at a private socket, closed once the address
    is bound: a listener takes its socket's options as they are when it is bound, so the size bound (and, with a
    secret, a tcp:// address's seal: rl/envs/seal.py) is set between the two, before any peer can connect."""
    from verifiers.v1.serve import EnvServerPool

    from rl.patches import fork_pool_workers

    with tempfile.TemporaryDirectory(prefix="rl-env-server-") as private:
        placeholder = f"ipc://{private}/unbound.sock"
        pool = EnvServerPool(server_kwargs, config.workers, placeholder, set_up_worker, elastic=False)
        pool.frontend.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        sealed = config.secret is not None and config.address.startswith("tcp://")
        authenticator = seal_server(pool.frontend, config.secret) if sealed else None
        pool.frontend.bind(config.address)
        pool.address = pool.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        pool.frontend.unbind(placeholder)
    fork_pool_workers(pool)
    if sealed:
        logger.info(f"{pool.address} is sealed: only clients that hold the run's secret are admitted")
    return pool, authenticator


def _stop(*_) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main() -> None:
    config = run_cli(EnvServerConfig)
    set_up_worker()
    try:
        serve(config)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
