"""The launcher's config: the three process configs plus the shared fields that fill them.

`resolve()` is the one place where every cross-process value is derived."""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, PrivateAttr
from pydantic_settings import SettingsConfigDict

from rl.config import CkptConfig, ConfigError, Section, Settings, WandbConfig, optional_section
from rl.weights.config import CollectiveTransfer, TransferConfig
from rl.env_server import EnvServerConfig
from rl.launcher.env_servers import place_env_servers
from rl.launcher.teacher import TeacherServerConfig, check_distillation, place_teacher
from rl.adapter import next_vllm_rank
from rl.inference.config import LOOPBACK_HOSTS, InferenceConfig, LoraServingConfig
from rl.inference.config import resolve_device_defaults as resolve_inference_device
from rl.launcher.wire import give_transfer_secret, place_transfer_store
from rl.launcher.placement import HostPlan, PlacementConfig, given_base_urls
from rl.orchestrator.config import OrchestratorConfig
from rl.trainer.config import TrainerConfig, vllm_auto_dtype
from rl.trainer.config import resolve_device_defaults as resolve_trainer_device


class SharedModelConfig(Section):
    name: Annotated[str | None, Field(description="model for all three processes")] = None
    renderer: Annotated[
        str | dict[str, Any] | None, Field(description="the orchestrator's model.renderer (see there)")
    ] = None


CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def one_line(value: str) -> str:
    """A value rendered into a line of text (a shell line, an #SBATCH line) must end nowhere but where the line
    ends: a newline would start a line of its own, run as a command."""
    if CONTROL_CHARACTERS.search(value):
        raise ValueError(f"{value!r} holds a control character, which would break the line it is rendered into")
    return value


def env_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError(f"{value!r} is not an environment variable name (letters, digits and _, not starting "
                         "with a digit)")
    return value


OneLine = Annotated[str, AfterValidator(one_line)]
EnvName = Annotated[str, AfterValidator(env_name)]
# Names SLURM takes for a partition (or a comma-separated list of them) and an account: nothing an #SBATCH line
# would read as a space, a quote or a comment.
SLURM_NAME = r"^[A-Za-z0-9._,-]+$"


class SlurmConfig(Section):
    """`rl --slurm`: one sbatch job, the nodes split between inference and the trainer."""

    inference_nodes: Annotated[
        int, Field(ge=1, description="nodes running inference; the first also runs the orchestrator")
    ] = 1
    trainer_nodes: Annotated[
        int,
        Field(ge=0, description="nodes running the trainer; 0: the trainer runs beside inference on the first node"),
    ] = 1
    gpus_per_node: Annotated[
        int | None, Field(ge=1, description="GPUs per node (--gpus-per-node); unset on CPU nodes")
    ] = None
    cpus_per_task: Annotated[int | None, Field(ge=1, description="CPUs per node's task (--cpus-per-task)")] = None
    exclusive: Annotated[
        bool | None,
        Field(description="whole nodes (--exclusive); default: on with GPUs, whose nodes run vLLM, the trainer's "
                          "ranks and the orchestrator, which one core per task (per-core allocation) starves"),
    ] = None
    mem: Annotated[
        str | None,
        Field(pattern=r"^[0-9]+[KMGT]?$", description="memory per node (--mem); default with GPUs: 0, all of it "
                                                      "(pinned optimizer buffers and vLLM's swap take host memory)"),
    ] = None
    partition: Annotated[str | None, Field(pattern=SLURM_NAME, description="SLURM partition")] = None
    account: Annotated[str | None, Field(pattern=SLURM_NAME, description="SLURM account")] = None
    time: Annotated[str, Field(pattern=r"^[0-9:-]+$", description="wall-clock limit of the job")] = "24:00:00"
    job_name: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+$", description="SLURM job name")] = "rl"
    rdzv_port: Annotated[
        int, Field(ge=1, le=65535, description="port of the trainer's rendezvous on its first node")
    ] = 29400
    sbatch: Annotated[list[OneLine], Field(description="more #SBATCH options, e.g. ['--qos=high']")] = []
    setup: Annotated[list[OneLine], Field(description="shell lines run before rl (module load, source env ...)")] = []
    submit: Annotated[
        bool, Field(description="submit with sbatch; false: only write <output_dir>/slurm/rl.sbatch")
    ] = True


class K8sConfig(Section):
    """`rl --k8s`: Kubernetes manifests (one Job per role, a shared volume, the token as a Secret) on stdout."""

    name: Annotated[
        str, Field(pattern=r"^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$", description="prefix of every resource")
    ] = "rl"
    namespace: Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$", description="namespace")] = "default"
    image: Annotated[str, Field(min_length=1, description="image with rl installed (see the Dockerfile)")] = "rl:latest"
    rl: Annotated[str, Field(min_length=1, description="the rl command in the image")] = "/app/.venv/bin/rl"
    inference_pods: Annotated[int, Field(ge=1, description="inference pods (an Indexed Job)")] = 1
    trainer_pods: Annotated[int, Field(ge=1, description="trainer pods, one torchrun node each (an Indexed Job)")] = 1
    inference_gpus: Annotated[
        int | None, Field(ge=1, description="GPUs per inference pod (a server per inference.tensor_parallel_size)")
    ] = None
    trainer_gpus: Annotated[int | None, Field(ge=1, description="GPUs per trainer pod")] = None
    storage_size: Annotated[str, Field(description="size of the run directory's volume")] = "100Gi"
    storage_class: Annotated[str | None, Field(description="its storage class (ReadWriteMany)")] = None
    existing_claim: Annotated[
        str | None, Field(description="use this PersistentVolumeClaim instead of making one")
    ] = None
    mount_path: Annotated[OneLine, Field(pattern=r"^/", description="where pods mount the volume")] = "/rl"
    rdzv_port: Annotated[int, Field(ge=1, le=65535, description="port of the trainer's rendezvous on pod 0")] = 29400
    env: Annotated[
        dict[EnvName, str], Field(description="more environment variables of every pod (names: letters, digits, _)")
    ] = {}


ROLES = ("inference", "orchestrator", "trainer")
Role = Literal["inference", "orchestrator", "trainer"]


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
    transfer: Annotated[
        TransferConfig | None,
        Field(description="how weights reach inference (`--transfer.backend gloo`), for all three processes"),
    ] = None
    teacher: Annotated[
        TeacherServerConfig | None, BeforeValidator(optional_section),
        Field(description="a teacher rl serves for on-policy distillation (`--teacher.model M`; one host; on "
                          "several, serve it yourself and set orchestrator.teacher.base_url)"),
    ] = None

    # Devices
    trainer_gpus: Annotated[int | None, Field(ge=1, description="GPUs for the trainer (one process each)")] = None
    inference_gpus: Annotated[int | None, Field(ge=1, description="GPUs for inference (a replica per TP group)")] = None
    trainer_gpu_ids: Annotated[list[int] | None, Field(description="explicit trainer GPU ids")] = None
    inference_gpu_ids: Annotated[list[int] | None, Field(description="explicit inference GPU ids")] = None
    # One process by default: it uses every core, where several gloo ranks of one thread each train much
    # slower (benchmarks/RESULTS.md).
    trainer_processes: Annotated[
        int, Field(ge=1, description="CPU hosts only: trainer processes (gloo); GPU hosts use one per GPU")
    ] = 1
    inference_replicas: Annotated[int, Field(ge=1, description="CPU hosts only: vLLM servers to start")] = 1

    # Several hosts (the run directory on a filesystem they share)
    roles: Annotated[
        list[Role], Field(min_length=1, description="the processes this host starts (default: all three)")
    ] = list(ROLES)
    host_name: Annotated[
        str | None,
        Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$",
              description="this host in <output_dir>/hosts/ (default: its hostname)"),
    ] = None
    host_timeout_s: Annotated[
        float,
        Field(gt=0, description="a host silent this long in <output_dir>/hosts/ is taken for dead and the run stops"),
    ] = 15.0
    trainer_nodes: Annotated[int, Field(ge=1, description="hosts the trainer spans (torchrun --nnodes)")] = 1
    node_rank: Annotated[int, Field(ge=0, description="this host's rank among the trainer's hosts")] = 0
    rdzv_endpoint: Annotated[
        str | None,
        Field(pattern=r"^[^:\s]+:\d+$", description="host:port of torchrun's c10d rendezvous, on trainer node 0 "
                                                       "(needed with trainer_nodes > 1)"),
    ] = None
    node_addr: Annotated[
        str | None, Field(min_length=1, description="this host's address the trainer's other nodes reach "
                                                    "(torchrun --local-addr; default: its hostname)")
    ] = None
    placement: Annotated[
        PlacementConfig | None, BeforeValidator(optional_section),
        Field(description="this host's place in a run over several hosts, from the topology every host shares "
                          "(what --slurm and --k8s write; replaces the per-host flags above)"),
    ] = None
    slurm: Annotated[
        SlurmConfig | None, BeforeValidator(optional_section),
        Field(description="render the run as one sbatch job and submit it (`--slurm`, `--slurm.trainer-nodes 2` ...)"),
    ] = None
    k8s: Annotated[
        K8sConfig | None, BeforeValidator(optional_section),
        Field(description="print the run as Kubernetes manifests (`--k8s`, `--k8s.image ...`)"),
    ] = None

    # Resume
    resume: Annotated[
        bool, Field(description="continue the run in output_dir from its latest complete checkpoint")
    ] = False
    resume_step: Annotated[int | None, Field(ge=1, description="continue from this checkpoint step instead")] = None

    # Launcher behaviour
    dry_run: Annotated[bool, Field(description="print resolved configs and commands, start nothing")] = False
    log_tail_lines: Annotated[int, Field(ge=1, description="lines of a failed process's log to print")] = 40
    shutdown_timeout_s: Annotated[float, Field(gt=0, description="grace period before SIGKILL on shutdown")] = 10.0

    # Filled by resolve(): {"trainer.dtype": "auto: CUDA", ...}, how each device-dependent value was chosen.
    _device_choices: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def device_choices(self) -> dict[str, str]:
        return self._device_choices

    # Filled by resolve(): the env servers rl starts beside the orchestrator, by process name.
    _env_servers: dict[str, EnvServerConfig] = PrivateAttr(default_factory=dict)

    @property
    def env_servers(self) -> dict[str, EnvServerConfig]:
        return self._env_servers

    # Filled by resolve(): the teacher's server config, where rl serves one.
    _teacher_server: InferenceConfig | None = PrivateAttr(default=None)

    @property
    def teacher_server(self) -> InferenceConfig | None:
        return self._teacher_server

    @property
    def uses_gpu_flags(self) -> bool:
        flags = (self.trainer_gpus, self.inference_gpus, self.trainer_gpu_ids, self.inference_gpu_ids)
        return any(v is not None for v in flags)


def _fill(value: Any, target: BaseModel, field: str, flag: str, where: str) -> None:
    """Set target.field to the shared value unless the sub-config set a different one explicitly."""
    if field in target.model_fields_set and getattr(target, field) != value:
        raise ConfigError(
            f"--{flag} = {value!r} contradicts {where}.{field} = {getattr(target, field)!r}; set it in one place"
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
    if len({str(v) for v in values.values()}) > 1:
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
    _require_equal("transfer", {w: s.transfer.model_dump() for w, s in sections.items()})

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
    resolve_lora(t, i, o)
    if t.keep_weights < o.async_level + 2:
        raise ConfigError(
            f"trainer.keep_weights = {t.keep_weights} would delete weights inference may still serve or roll back "
            f"to with async_level = {o.async_level}; set it to at least {o.async_level + 2}"
        )
    config._teacher_server = place_teacher(config, host)
    check_distillation(t, o)
    config._device_choices = resolve_devices(t, i, host.devices.device)
    config._env_servers = place_env_servers(o)
    o.transfer.resolve_device(host.devices.device, "orchestrator")  # as trainer and inference resolved it
    return config


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
