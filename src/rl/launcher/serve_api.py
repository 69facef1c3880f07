"""`rl serve-api`: `rl` with the Tinker service in the orchestrator's place and the trainer taking its calls.

    TINKER_API_KEY=tml-... uv run rl serve-api --trainer @ train.toml --inference @ infer.toml --api.port 8100

The same device flags, logs and `--dry-run` as `rl`; the client drives the steps, so there is no batch, environment
or max_steps to give."""

from __future__ import annotations

import sys
from pathlib import Path

from rl.config import API_KEY_VAR, ConfigError
from rl.service.config import API_KEY_VAR as TINKER_KEY_VAR, ServiceConfig

TRAINER_MODULE = "rl.trainer.service"
TRAINER_RESTARTS = 3  # a trainer that dies is started again; the call it died in fails, and the client goes on from a
# saved state (create_training_client_from_state), as from a crash of the hosted service


def service_config(config) -> ServiceConfig:
    """What the service reads of the resolved run (`config`: an RLConfig with `api` set)."""
    o = config.orchestrator
    service = ServiceConfig(api=config.api, model=o.model.name, output_dir=o.output_dir.absolute(), seq_len=o.seq_len)
    service.client = o.client.model_copy()  # assigned, not validated from a dump, which masks the admin token
    return service


def resolve_api(config) -> None:
    """The trainer waits for calls as long as the service may stay idle; it trains one model, LoRA or not as
    create_model asks, published merged (servers without LoRA)."""
    if config.trainer.lora is not None:
        raise ConfigError("trainer.lora is set, but under rl serve-api each client's create_model chooses LoRA and its "
                          "rank: unset trainer.lora")
    config.trainer.batch_timeout_s = config.api.idle_timeout_s


def service_command(configs: Path) -> list[str]:
    return [sys.executable, "-m", "rl.service.main", "@", str(configs / "service.toml")]


SERVICE_SECRETS = (TINKER_KEY_VAR, API_KEY_VAR)
"""The service checks clients' TINKER_API_KEY and sends the servers' key."""
