"""Resolving the launcher's config (rl/launcher/config.py): `resolve()` is the one place where every cross-process
value is derived, from the shared fields and this host's plan; `check_hosts()` what a multi-host run needs of each
host's command line."""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel

from rl.config import SECRET_MASK, ConfigError, is_hybrid, is_moe, secret_fields, to_toml
from rl.weights.config import CollectiveTransfer
from rl.launcher.config import ROLES, RLConfig
from rl.envs.placement import place_env_servers
from rl.launcher.serve_api import resolve_api
from rl.launcher.teacher import check_distillation, place_teacher
from rl.adapter import next_vllm_rank
from rl.inference.config import LOOPBACK_HOSTS, InferenceConfig, LoraServingConfig
from rl.inference.config import resolve_device_defaults as resolve_inference_device
from rl.launcher.wire import give_transfer_secret, place_transfer_store
from rl.launcher.placement import HostPlan, given_base_urls
from rl.orchestrator.config import OrchestratorConfig, check_rescore_temperature
from rl.trainer.config import TrainerConfig, vllm_auto_dtype
from rl.trainer.loss_config import needs_rescored
from rl.trainer.config import resolve_device_defaults as resolve_trainer_device


def _fill(value: Any, target: BaseModel, field: str, flag: str, where: str) -> None:
    """Set target.field to the shared value unless the sub-config set a different one explicitly (a secret's value
    is not repeated in the error: it lands in logs)."""
    if field in target.model_fields_set and getattr(target, field) != value:
        def shown(v: Any) -> str:
            return SECRET_MASK if v is not None and field in secret_fields(type(target)) else repr(v)

        raise ConfigError(
            f"--{flag} = {shown(value)} contradicts {where}.{field} = {shown(getattr(target, field))}; set it in one "
            "place"
        )
    setattr(target, field, value)


def _fill_section(shared: BaseModel, parent: BaseModel, flag: str, where: str) -> None:
    target = getattr(parent, flag)
    if type(target) is not type(shared):  # another variant of a union (transfer.type): the shared one, if not set
        if target.model_fields_set:
            raise ConfigError(f"--{flag} ({type(shared).__name__}) contradicts {where} = {target!r}; "
                              "set it in one place")
        setattr(parent, flag, type(shared)())
        target = getattr(parent, flag)
    for field in shared.model_fields_set:
        _fill(getattr(shared, field), target, field, f"{flag}.{field.replace('_', '-')}", where)


def _require_equal(name: str, values: dict[str, Any]) -> None:
    """A section is compared with its secrets, and shown without them (its repr)."""
    def compared(v: Any) -> str:
        return to_toml(v) if isinstance(v, BaseModel) else str(v)

    if len({compared(v) for v in values.values()}) > 1:
        listed = ", ".join(f"{where} = {v!r}" for where, v in values.items())
        raise ConfigError(f"{name} differs between processes ({listed}); set it once with --{name.replace('_', '-')}")


def resolve(config: RLConfig, host: HostPlan) -> RLConfig:
    """Fill every process config from the shared fields and this host's plan; return a new config."""
    config = config.model_copy(deep=True)
    t, o, i = config.trainer, config.orchestrator, config.inference
    sections = {"trainer": t, "orchestrator": o, "inference": i}
    if config.model.name is not None:
        for where, sub in sections.items():
            _fill(config.model.name, sub.model, "name", "model.name", f"{where}.model")
    if config.model.renderer is not None:
        _fill(config.model.renderer, o.model, "renderer", "model.renderer", "orchestrator.model")
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
    for flag, where in (("wandb", ("trainer", "orchestrator")), ("ckpt", ("trainer", "orchestrator")),
                        ("transfer", ROLES)):
        shared = getattr(config, flag)
        if shared is not None:
            for name in where:
                _fill_section(shared, sections[name], flag, f"{name}.{flag}")

    _require_equal("model.name", {w: s.model.name for w, s in sections.items()})
    _require_equal("output_dir", {"trainer": t.output_dir, "orchestrator": o.output_dir})
    _require_equal("max_steps", {"trainer": t.max_steps, "orchestrator": o.max_steps})
    _require_equal("transfer", {w: s.transfer for w, s in sections.items()})

    # Derived cross-process values.
    if isinstance(t.transfer, CollectiveTransfer):  # the fields only a collective has
        place_transfer_store(sections, host)
        give_transfer_secret(t, i, o, host)
    if host.inference_bind is not None:
        _fill(host.inference_bind, i, "host", "placement (servers other hosts reach)", "inference")
    check_admin_token(i, host)
    i.weights_dir = (t.output_dir / "weights").absolute()
    if i.admin_token is None:
        i.admin_token = secrets.token_hex(16)
    replicas = host.devices.replicas
    if i.port + replicas - 1 > 65535:
        raise ConfigError(
            f"inference.port = {i.port} with {replicas} replicas needs ports up to {i.port + replicas - 1}, "
            "past 65535; choose a lower port"
        )
    if host.inference_urls:  # only the orchestrator's host has them
        _fill(list(host.inference_urls), o.client, "base_urls",
              "the servers rl starts (inference.port + replica) or places", "orchestrator.client")
    _fill(i.admin_token, o.client, "admin_token", "inference.admin-token", "orchestrator.client")
    world_size = host.devices.trainer_processes * host.trainer_nodes
    _fill(world_size, o, "trainer_world_size", "trainer-processes / --trainer-gpus x --trainer-nodes", "orchestrator")
    if o.sampling.temperature <= 0:
        raise ConfigError("orchestrator.sampling.temperature must be > 0 for training: greedy rollouts have no "
                          "sampling distribution to take a policy gradient of")
    _fill(o.sampling.temperature, t, "temperature", "orchestrator.sampling.temperature", "trainer")
    resolve_rescore(t, o)
    if config.api is not None:
        resolve_api(config)
    resolve_lora(t, i, o)
    if t.keep_weights < o.async_level + 2:
        raise ConfigError(
            f"trainer.keep_weights = {t.keep_weights} would delete weights inference may still serve or roll back "
            f"to with async_level = {o.async_level}; set it to at least {o.async_level + 2}"
        )
    config._teacher_server = place_teacher(config, host)
    check_distillation(t, o)
    derived = resolve_concurrency(o, i) | resolve_router_replay(t, i)
    config._device_choices = resolve_devices(t, i, host.devices.device) | derived
    check_cpu_lora(t, host.devices.device)
    config._env_servers = place_env_servers(o.output_dir.absolute(), {"env": o.env, "eval": o.eval.env},
                                            o.client.base_urls, [o.model.name])
    o.transfer.resolve_device(host.devices.device, "orchestrator")  # as trainer and inference resolved it
    return config


def resolve_rescore(t: TrainerConfig, o: OrchestratorConfig) -> None:
    """A trainer's mask against = "rescored" needs the orchestrator to re-score stale samples, and only it does."""
    _fill(needs_rescored(t.loss.mismatch), o, "rescore", "trainer.loss.mismatch (a mask against = 'rescored')",
          "orchestrator")
    if o.rescore:
        try:
            check_rescore_temperature(o.sampling)
        except ValueError as e:
            raise ConfigError(f"orchestrator.{e}") from None


def check_cpu_lora(t: TrainerConfig, device: str) -> None:
    """vLLM 0.32 on CPU cannot serve LoRA adapters of two kinds of model: a mixture of experts (its MoE LoRA kernels
    need Triton) and a hybrid with linear attention (its CPU Gated DeltaNet layer takes no adapter). Refused on CPU,
    where merged weights serve."""
    if device != "cpu" or t.lora is None or t.lora.publish_merged:
        return
    why = ("its MoE LoRA kernels need Triton" if is_moe(t.model.name) else
           "its CPU linear-attention layers take no adapter" if is_hybrid(t.model.name) else None)
    if why:
        raise ConfigError(f"trainer.lora on {t.model.name!r}: vLLM 0.32 on CPU cannot serve its adapters ({why}); set "
                          "trainer.lora.publish_merged = true (merged weights each step) or train without LoRA")


def resolve_lora(t: TrainerConfig, i: InferenceConfig, o: OrchestratorConfig) -> None:
    """A LoRA trainer publishing adapters needs servers that load them (LoRA on, a max rank that holds the
    trainer's, one slot) and an orchestrator that names the adapter; merged weights or full training need
    neither."""
    serves_adapters = t.lora is not None and not t.lora.publish_merged
    if not serves_adapters:
        if i.lora is not None:
            raise ConfigError("inference.lora is set but the trainer publishes full weights (trainer.lora is unset or "
                              "publish_merged): unset inference.lora, or set trainer.lora")
        return
    if i.lora is None:
        i.lora = LoraServingConfig(max_rank=next_vllm_rank(t.lora.rank))
    elif i.lora.max_rank < t.lora.rank:
        raise ConfigError(f"trainer.lora.rank = {t.lora.rank} is above inference.lora.max_rank = {i.lora.max_rank}: "
                          f"the servers would refuse every adapter; set max_rank to {next_vllm_rank(t.lora.rank)} "
                          "or leave it unset")
    if i.lora.name == i.model.name:
        raise ConfigError(f"inference.lora.name = {i.lora.name!r} is the model's name; vLLM refuses an adapter named "
                          "like the model it serves: choose another")
    _fill(i.lora.name, o, "adapter", "inference.lora.name", "orchestrator")


def resolve_router_replay(t: TrainerConfig, i: InferenceConfig) -> dict[str, str]:
    """Router replay is one setting, the trainer's (trainer.loss.router_replay): inference records each token's
    experts where the trainer replays them. Recording without replay is allowed (the trainer then only compares its
    router with the record); replay without a record is refused here, not at the trainer's first step."""
    if i.router_replay is None:
        i.router_replay = t.loss.router_replay
        return {"inference.router_replay": "as trainer.loss.router_replay"}
    if t.loss.router_replay and not i.router_replay:
        raise ConfigError("trainer.loss.router_replay routes every token as inference recorded it, and "
                          "inference.router_replay = false records nothing: unset inference.router_replay (it "
                          "follows the trainer's), or set trainer.loss.router_replay = false")
    return {}


def resolve_concurrency(o: OrchestratorConfig, i: InferenceConfig) -> dict[str, str]:
    """The adaptive in-flight cap reads vLLM's statistics from the servers' /metrics: on for the servers rl
    starts, unless the user turned them off. Returns {"inference.log_stats": why} where it set them."""
    if not o.concurrency.adaptive:
        return {}
    if i.log_stats is False:
        raise ConfigError("orchestrator.concurrency.adaptive reads the servers' KV-cache usage and preemptions, "
                          "which inference.log_stats = false turns off: set log_stats true (or unset), or turn "
                          "adaptive off")
    if i.log_stats is None:
        i.log_stats = True
        return {"inference.log_stats": "on: orchestrator.concurrency.adaptive reads them"}
    return {}


def resolve_devices(t: TrainerConfig, i: InferenceConfig, device: str) -> dict[str, str]:
    """The device-dependent values of both processes (each process's own rule), the trainer publishing in the
    dtype inference serves. Returns {"section.field": why}."""
    inference = resolve_inference_device(i, device)
    if i.dtype == "auto":
        served, why = vllm_auto_dtype(i.model.name)
        why = f"what vLLM's --dtype auto serves: {why}"
    else:
        served, why = i.dtype, "as inference.dtype"
    if t.publish_dtype == "auto":
        t.publish_dtype = served
    elif t.publish_dtype != served:
        raise ConfigError(
            f"trainer.publish_dtype = {t.publish_dtype!r} but inference.dtype = {i.dtype!r} serves {served!r}: "
            "inference would reload weights of another dtype than it serves; set one to match the other"
        )
    else:
        why = "set by you"
    trainer = resolve_trainer_device(t, device) | {"publish_dtype": why}
    return {f"trainer.{k}": v for k, v in trainer.items()} | {f"inference.{k}": v for k, v in inference.items()}


PER_HOST_FLAGS = ("roles", "trainer_nodes", "node_rank", "rdzv_endpoint", "node_addr")


def check_hosts(config: RLConfig) -> None:
    """What a run over several hosts needs from each host's command line (its flags, or its placement)."""
    if config.placement is not None:
        given = [f"--{name.replace('_', '-')}" for name in PER_HOST_FLAGS if name in config.model_fields_set]
        if given:
            raise ConfigError(f"--placement places this host; {', '.join(given)} would place it again: remove them")
        if config.placement.index is None or not config.placement.hosts:
            raise ConfigError("--placement needs this host's --placement.index and every host's --placement.hosts")
        return
    if len(set(config.roles)) != len(config.roles):
        raise ConfigError(f"--roles {config.roles} lists a process twice")
    if "orchestrator" in config.roles and "inference" not in config.roles and not given_base_urls(config):
        raise ConfigError("this host runs the orchestrator but no inference: give the servers with "
                          "--orchestrator.client.base-urls "
                          "'[\"http://host:8000\", ...]'")
    if config.trainer_nodes > 1 and "trainer" in config.roles and config.rdzv_endpoint is None:
        raise ConfigError(f"--trainer-nodes {config.trainer_nodes} needs --rdzv-endpoint host:port (on trainer node 0, "
                          "the same on every trainer host)")
    if config.node_rank >= config.trainer_nodes:
        raise ConfigError(f"--node-rank {config.node_rank} is not below --trainer-nodes {config.trainer_nodes}")


def check_admin_token(i: InferenceConfig, host: HostPlan) -> None:
    routable = i.host not in LOOPBACK_HOSTS
    if i.admin_token is None and (routable or host.spans_hosts):
        why = (f"inference.host = {i.host!r} lets other hosts reach the admin routes"
               if routable else "every host of the run must send and expect the same admin token")
        raise ConfigError(f"{why}: set inference.admin_token, the same on every host "
                          "(e.g. export RL_INFERENCE__ADMIN_TOKEN=$(openssl rand -hex 16))")
