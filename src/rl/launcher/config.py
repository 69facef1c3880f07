"""The launcher's config: the three process configs plus the shared fields that fill them (rl/launcher/resolve.py
derives every cross-process value from them)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PrivateAttr
from pydantic_settings import SettingsConfigDict

from rl.config import CkptConfig, Section, Settings, WandbConfig, optional_section
from rl.weights.config import TransferConfig
from rl.envs.config import EnvServerConfig
from rl.inference.config import InferenceConfig
from rl.launcher.placement import PlacementConfig
from rl.service.config import ApiConfig
from rl.orchestrator.config import OrchestratorConfig
from rl.trainer.config import TrainerConfig


class TeacherServerConfig(Section):
    """On-policy distillation's teacher, served by `rl` beside inference: a frozen vLLM server of `model` with
    inference's settings, never sent weights. It fills orchestrator.teacher."""

    model: Annotated[
        str, Field(min_length=1, description="the teacher model (Hugging Face id or local directory); it must "
                                             "tokenize as the student does")
    ]
    port: Annotated[
        int | None, Field(ge=1, le=65535, description="its port (default: the one after inference's servers)")
    ] = None
    gpus: Annotated[
        int, Field(ge=1, description="GPU hosts: its GPUs, the last ones visible (its tensor-parallel size); the "
                                     "trainer and inference split the others")
    ] = 1
    top_k: Annotated[
        int, Field(ge=0, le=20, description="orchestrator.teacher.top_k: the teacher's k likeliest tokens at every "
                                            "trained token, for trainer.loss.distill_top_k (at most vLLM's default "
                                            "max_logprobs, 20)")
    ] = 0


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
        int, Field(ge=1, description="nodes running inference; the first also runs the orchestrator, unless "
                                "orchestrator_node")
    ] = 1
    orchestrator_node: Annotated[
        bool, Field(description="the orchestrator and its environments on a node of their own, whose step holds no "
                                "transfer secret and no trainer or server process (environments run others' code); "
                                "off: beside the first inference node")
    ] = False
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

    api: Annotated[
        ApiConfig | None, BeforeValidator(optional_section),
        Field(description="`rl serve-api`: the Tinker API in the orchestrator's place (docs/tinker.md)"),
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
