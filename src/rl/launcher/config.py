"""The launcher's config: the three process configs plus the shared fields that fill them.

`resolve()` is the one place where every cross-process value is derived."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, Field
from pydantic_settings import SettingsConfigDict

from rl.config import CkptConfig, ConfigError, Section, Settings, WandbConfig
from rl.inference.config import InferenceConfig
from rl.launcher.devices import DevicePlan
from rl.orchestrator.config import OrchestratorConfig
from rl.trainer.config import TrainerConfig


class SharedModelConfig(Section):
    name: Annotated[str | None, Field(description="model for all three processes")] = None


class RLConfig(Settings):
    model_config = SettingsConfigDict(env_prefix="RL_")
    file_sections: ClassVar[tuple[str, ...]] = ("trainer", "orchestrator", "inference")

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)

    # Shared fields: each fills the matching field of every process that has one.
    model: SharedModelConfig = SharedModelConfig()
    output_dir: Annotated[Path | None, Field(description="run directory of all three processes")] = None
    max_steps: Annotated[int | None, Field(ge=1, description="number of optimizer steps")] = None
    async_level: Annotated[int | None, Field(ge=0, description="max policy staleness (0 = on-policy)")] = None
    seq_len: Annotated[int | None, Field(ge=16, description="longest sample; also vLLM's max model length")] = None
    wandb: Annotated[WandbConfig | None, Field(description="W&B settings of trainer and orchestrator")] = None
    ckpt: Annotated[CkptConfig | None, Field(description="checkpoint settings of trainer and orchestrator")] = None

    # Devices
    trainer_gpus: Annotated[int | None, Field(ge=1, description="GPUs for the trainer (one process each)")] = None
    inference_gpus: Annotated[int | None, Field(ge=1, description="GPUs for inference (a replica per TP group)")] = None
    trainer_gpu_ids: Annotated[list[int] | None, Field(description="explicit trainer GPU ids")] = None
    inference_gpu_ids: Annotated[list[int] | None, Field(description="explicit inference GPU ids")] = None
    # One process by default: it uses every core, and on 2 cores two gloo ranks of one thread each train
    # 0.4x as fast at 100M (benchmarks/trainer_throughput.py).
    trainer_processes: Annotated[
        int, Field(ge=1, description="CPU hosts only: trainer processes (gloo); GPU hosts use one per GPU")
    ] = 1
    inference_replicas: Annotated[int, Field(ge=1, description="CPU hosts only: vLLM servers to start")] = 1

    # Resume
    resume: Annotated[bool, Field(description="continue the run in output_dir from its latest complete checkpoint")] = False
    resume_step: Annotated[int | None, Field(ge=1, description="continue from this checkpoint step instead")] = None

    # Launcher behaviour
    dry_run: Annotated[bool, Field(description="print resolved configs and commands, start nothing")] = False
    log_tail_lines: Annotated[int, Field(ge=1, description="lines of a failed process's log to print")] = 40
    shutdown_timeout_s: Annotated[float, Field(gt=0, description="grace period before SIGKILL on shutdown")] = 10.0

    @property
    def uses_gpu_flags(self) -> bool:
        return any(
            v is not None for v in (self.trainer_gpus, self.inference_gpus, self.trainer_gpu_ids, self.inference_gpu_ids)
        )


def _fill(value: Any, target: BaseModel, field: str, flag: str, where: str) -> None:
    """Set target.field to the shared value unless the sub-config set a different one explicitly."""
    if field in target.model_fields_set and getattr(target, field) != value:
        raise ConfigError(
            f"--{flag} = {value!r} contradicts {where}.{field} = {getattr(target, field)!r}; set it in one place"
        )
    setattr(target, field, value)


def _fill_section(shared: BaseModel, target: BaseModel, flag: str, where: str) -> None:
    for field in shared.model_fields_set:
        _fill(getattr(shared, field), target, field, f"{flag}.{field.replace('_', '-')}", where)


def _require_equal(name: str, values: dict[str, Any]) -> None:
    if len({str(v) for v in values.values()}) > 1:
        listed = ", ".join(f"{where} = {v!r}" for where, v in values.items())
        raise ConfigError(f"{name} differs between processes ({listed}); set it once with --{name.replace('_', '-')}")


def resolve(config: RLConfig, plan: DevicePlan) -> RLConfig:
    """Fill every process config from the shared fields and the device plan; return a new config."""
    config = config.model_copy(deep=True)
    t, o, i = config.trainer, config.orchestrator, config.inference
    sections = {"trainer": t, "orchestrator": o, "inference": i}
    if config.model.name is not None:
        for where, sub in sections.items():
            _fill(config.model.name, sub.model, "name", "model.name", f"{where}.model")
    for flag, field, where in (
        ("output-dir", "output_dir", ("trainer", "orchestrator")),
        ("max-steps", "max_steps", ("trainer", "orchestrator")),
        ("async-level", "async_level", ("orchestrator",)),
        ("seq-len", "seq_len", ("trainer", "orchestrator")),
    ):
        value = getattr(config, field)
        if value is not None:
            for name in where:
                _fill(value, sections[name], field, flag, name)
    if config.seq_len is not None:
        _fill(config.seq_len, i, "max_model_len", "seq-len", "inference")
    for flag in ("wandb", "ckpt"):
        shared = getattr(config, flag)
        if shared is not None:
            for name in ("trainer", "orchestrator"):
                _fill_section(shared, getattr(sections[name], flag), flag, f"{name}.{flag}")

    _require_equal("model.name", {w: s.model.name for w, s in sections.items()})
    _require_equal("output_dir", {"trainer": t.output_dir, "orchestrator": o.output_dir})
    _require_equal("max_steps", {"trainer": t.max_steps, "orchestrator": o.max_steps})

    # Derived cross-process values.
    i.weights_dir = (t.output_dir / "weights").absolute()
    if i.admin_token is None:
        i.admin_token = secrets.token_hex(16)
    if i.port + plan.replicas - 1 > 65535:
        raise ConfigError(
            f"inference.port = {i.port} with {plan.replicas} replicas needs ports up to {i.port + plan.replicas - 1}, "
            "past 65535; choose a lower port"
        )
    urls = [f"http://{_client_host(i.host)}:{i.port + r}" for r in range(plan.replicas)]
    _fill(urls, o.client, "base_urls", "inference.port (one server per replica)", "orchestrator.client")
    _fill(i.admin_token, o.client, "admin_token", "inference.admin-token", "orchestrator.client")
    _fill(plan.trainer_processes, o, "trainer_world_size", "trainer-processes / --trainer-gpus", "orchestrator")
    if o.sampling.temperature <= 0:
        raise ConfigError("orchestrator.sampling.temperature must be > 0 for training: greedy rollouts have no "
                          "sampling distribution to take a policy gradient of")
    _fill(o.sampling.temperature, t, "temperature", "orchestrator.sampling.temperature", "trainer")
    if t.keep_weights < o.async_level + 2:
        raise ConfigError(
            f"trainer.keep_weights = {t.keep_weights} would delete weights inference may still serve or roll back "
            f"to with async_level = {o.async_level}; set it to at least {o.async_level + 2}"
        )
    return config


def _client_host(bind_host: str) -> str:
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "") else bind_host
