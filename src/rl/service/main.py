"""The service of `rl serve-api`: the Tinker REST surface on http://<api.host>:<api.port>, over the trainer (calls in
the run directory) and rl's inference servers."""

from __future__ import annotations

import asyncio
import os
import sys

import uvicorn

from rl.config import run_cli
from rl.metrics import setup_logging
from rl.orchestrator.inference_pool import InferencePool
from rl.process import set_up_process
from rl.protocol import RunPaths
from rl.service.app import Service, build_app
from rl.service.config import API_KEY_VAR, ServiceConfig
from rl.service.sampler import Sampler, ServedPolicy
from rl.service.training import TrainerCalls


async def serve(config: ServiceConfig, logger) -> None:
    paths = RunPaths(config.output_dir)
    client = config.client
    pool = InferencePool(client.base_urls, client.admin_token, client.timeout_s, logger.info)
    await pool.wait_healthy(client.startup_timeout_s)
    trainer = TrainerCalls(paths, config.api.call_timeout_s)
    sampler = Sampler(client.base_urls, config.model, ServedPolicy(pool, paths, config.api.call_timeout_s, logger.info),
                      config.api.call_timeout_s)
    app = build_app(Service(config, trainer, sampler))
    server = uvicorn.Server(uvicorn.Config(app, host=config.api.host, port=config.api.port, log_level="warning"))
    logger.info(f"Tinker API on http://{config.api.host}:{config.api.port} for {config.model}; "
                f"{len(client.base_urls)} inference servers")
    try:
        await server.serve()
    finally:
        await trainer.stop()
        await sampler.close()
        await pool.close()


def main() -> None:
    set_up_process()
    config = run_cli(ServiceConfig)
    if not os.environ.get(API_KEY_VAR):
        print(f"error: set {API_KEY_VAR}: the service answers only requests that carry it (the Tinker SDK sends it; "
              "the SDK takes keys that start with 'tml-')", file=sys.stderr)
        sys.exit(2)
    asyncio.run(serve(config, setup_logging("service")))


if __name__ == "__main__":
    main()
