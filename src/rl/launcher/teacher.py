"""The teacher `rl` serves for on-policy distillation (its section, `TeacherServerConfig`, is in rl/launcher/config.py):
where it goes (after inference's servers, on the last GPUs of a GPU host) and the pairing of a teacher with the loss's
distillation term."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.config import ConfigError
from rl.inference.config import InferenceConfig
from rl.orchestrator.config import OrchestratorConfig, TeacherConfig
from rl.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from rl.launcher.config import RLConfig
    from rl.launcher.placement import HostPlan


def place_teacher(config: RLConfig, host: HostPlan) -> InferenceConfig | None:
    """The teacher rl serves on this host: inference's config for the teacher's model, at the port after the
    inference servers', named in the orchestrator's teacher section."""
    if config.teacher is None:
        return None
    i, o = config.inference, config.orchestrator
    if o.teacher is not None:
        raise ConfigError(f"--teacher.model has rl serve the teacher, and orchestrator.teacher.base_url = "
                          f"{o.teacher.base_url!r} names one served elsewhere: set one")
    if host.spans_hosts:
        raise ConfigError("rl serves a teacher on a single host only (yet): on several hosts, serve it yourself "
                          "(`uv run inference --model.name M --port P`) and set orchestrator.teacher.base_url")
    port = config.teacher.port or i.port + host.devices.replicas
    if port in range(i.port, i.port + host.devices.replicas) or port > 65535:
        raise ConfigError(f"teacher.port = {port} is taken by an inference server or past 65535: choose another")
    server = i.model_copy(deep=True, update={"port": port, "lora": None})
    if host.devices.teacher_gpus:  # its own GPUs, one tensor-parallel group over them
        server.tensor_parallel_size = len(host.devices.teacher_gpus)
    server.model = server.model.model_copy(update={"name": config.teacher.model})
    o.teacher = TeacherConfig(base_url=f"http://127.0.0.1:{port}", model=config.teacher.model,
                              top_k=config.teacher.top_k)
    return server


def check_distillation(t: TrainerConfig, o: OrchestratorConfig) -> None:
    """A teacher and the loss's distillation terms come together, and its top-k with the dense term."""
    for name, weight in (("distill", t.loss.distill), ("distill_top_k", t.loss.distill_top_k)):
        if weight > 0 and o.teacher is None:
            raise ConfigError(f"trainer.loss.{name} = {weight} needs a teacher: --teacher.model M (rl serves it) or "
                              "orchestrator.teacher.base_url (one served elsewhere)")
    if o.teacher is not None and t.loss.distill == 0 and t.loss.distill_top_k == 0:
        raise ConfigError("a teacher scores every sample but trainer.loss.distill = 0 and trainer.loss.distill_top_k "
                          "= 0 would ignore it: set trainer.loss.distill (e.g. 1.0)")
    top_k = 0 if o.teacher is None else o.teacher.top_k
    if t.loss.distill_top_k > 0 and top_k == 0:
        raise ConfigError(f"trainer.loss.distill_top_k = {t.loss.distill_top_k} needs the teacher's top-k: set "
                          "--teacher.top-k K (or orchestrator.teacher.top_k), e.g. 8")
    if top_k > 0 and t.loss.distill_top_k == 0:
        raise ConfigError(f"the teacher ships its top {top_k} tokens but trainer.loss.distill_top_k = 0 would ignore "
                          "them: set trainer.loss.distill_top_k (e.g. 1.0)")
