"""`env-server`: one `[[env]]` served over ZMQ by verifiers' env-server pool (`verifiers.v1.serve.serve_env`).

A broker binds `address` and dispatches each request it is sent (rl's orchestrator sends a group's episodes as one:
the task's data, the model endpoint and each episode's sampling, rl/episode_groups.py; verifiers' clients one episode)
to the least busy of `workers` processes, which it forks once it has imported everything and checked the environment.
Each worker loads the environment once as rl's orchestrator does (its harness and runtime defaults:
rl/orchestrator/environment.py), with rl's patches applied (rl/patches/), and runs its episodes itself: their model
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
from typing import Annotated

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from rl.config import ConfigError, Settings, run_cli
from rl.env_config import EnvConfig
from rl.env_seal import beyond_loopback, seal_server

MAX_DEFAULT_WORKERS = 8
WORKER_WATCH_S = 0.5
WORKER_DIED = 3  # the exit code when a worker died
logger = logging.getLogger("env-server")


def default_workers() -> int:
    """A quarter of this host's cores, 1 to 8: the orchestrator, inference's API processes and the trainer share
    the host, and an episode of a chat environment is mostly waiting on inference."""
    return max(1, min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 1) // 4))


class EnvServerConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_ENV_SERVER__")

    env: Annotated[EnvConfig, Field(description="the environment served, as an [[env]] table of the orchestrator")]
    workers: Annotated[
        int, Field(ge=1, default_factory=default_workers, description="worker processes, all started at once; "
                                                                       "default: a quarter of the host's cores, 1-8")
    ]
    address: Annotated[
        str, Field(min_length=1, description="ZMQ endpoint the broker binds: ipc://<path>, or tcp://<host>:<port> "
                                             "(port 0: any free one, logged)")
    ] = "tcp://127.0.0.1:5000"
    max_concurrent: Annotated[
        int | None, Field(ge=1, description="episodes in flight per worker; unset: no bound")
    ] = None
    secret: Annotated[
        str | None, Field(min_length=16, description="the run's secret: a tcp:// address is sealed with it (ZMQ "
                                                     "CURVE), admitting only clients that hold it; required beyond "
                                                     "loopback (RL_ENV_SERVER__SECRET)")
    ] = None

    @model_validator(mode="after")
    def _sealed_beyond_loopback(self) -> "EnvServerConfig":
        if beyond_loopback(self.address) and self.secret is None:
            raise ValueError(f"address {self.address} reaches beyond this host, and a request runs an episode (code, "
                             "for a sandboxed environment): set secret (or RL_ENV_SERVER__SECRET) to the run's secret, "
                             "which the orchestrator's [[env]] table then needs too")
        return self


def started_for(spec: EnvConfig, address: str) -> EnvServerConfig:
    """The env server started for an `[[env]]` table without an address (by `rl`, or by an orchestrator started by
    hand): the table's environment, its workers, at `address` (local: no secret)."""
    env = spec.model_copy(update={"address": None, "workers": None, "secret": None})
    return EnvServerConfig(env=env, workers=spec.workers or default_workers(), address=address)


def set_up_worker() -> None:
    """Run by serve_env in the broker and in every worker it spawns (as its `log_setup`): rl's log format, and
    rl's patches to verifiers, renderers and pydantic, before the worker loads the environment."""
    from in_process_chat import shared_session

    from rl.episode_groups import ROUTE, serve_group
    from rl.metrics import PER_REQUEST_LOGGERS, setup_logging
    from rl.orchestrator.rollouts import apply_patches, tune_gc_for_serving
    from rl.patches import send_traces_once, serve_episodes_holding, serve_group_runs
    from rl.teardown import set_up_process

    set_up_process()
    setup_logging(f"env-server[{os.getpid()}]", quiet=PER_REQUEST_LOGGERS)
    logging.getLogger("verifiers.v1.serve").setLevel(logging.INFO)  # the pool's and each worker's up and down
    apply_patches()
    serve_episodes_holding(shared_session, tune_gc_for_serving)
    send_traces_once()
    serve_group_runs(ROUTE, serve_group)


def serve(config: EnvServerConfig) -> None:
    """verifiers' pool, always (one worker too: the broker then answers health checks while the worker is busy),
    every worker started at once; the first worker to die takes the server down with it, so that `rl` restarts it
    and the orchestrator runs the lost episodes again (verifiers' pool does not replace a dead worker)."""
    from verifiers.v1.serve import env_config_data

    from rl.orchestrator.environment import EnvLoadError, resolved_env_config

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
    """verifiers' pool bound at the config's address; with a secret, a tcp:// address sealed (rl/env_seal.py): the
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
    from rl.patches import answer_health_with

    live = None
    while True:
        time.sleep(WORKER_WATCH_S)
        for worker in list(pool.workers):
            process = worker["process"]
            if process.exitcode is not None:
                logger.error(f"worker {worker['index']} (pid {process.pid}) died (exit code {process.exitcode}); "
                             "this env server stops with it, to be restarted and its episodes run again")
                os._exit(WORKER_DIED)
        if len(pool.workers) != live:
            live = len(pool.workers)
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
