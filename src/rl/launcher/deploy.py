"""A run over several hosts, as a SLURM job (`rl --slurm`) or Kubernetes manifests (`rl --k8s`).

Either way every host starts `rl` from one config file, the run's config as the user gave it (files,
environment and flags merged; nothing derived, no secret), adding only what differs per host: its
`--roles`, its name, its trainer node rank, where the inference servers and the rendezvous are. The hosts
find each other through the shared run directory (`launcher/hosts.py`); the admin token reaches each one
through its environment (`RL_INFERENCE__ADMIN_TOKEN`), never through a file of the run directory.
"""

from __future__ import annotations

import json
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import tomli_w

from rl.config import ConfigError, without_secrets
from rl.launcher.config import RLConfig
from rl.launcher.placement import HostPlan, PlacementConfig, plan
from rl.protocol import RunPaths, atomic_write_text

TEMPLATES = Path(__file__).parent / "templates"
PER_HOST = {"slurm", "k8s", "dry_run", "roles", "host_name", "node_rank", "node_addr", "rdzv_endpoint",
            "trainer_nodes", "placement"}
SBATCH_TIMEOUT_S = 60


def as_given(config: RLConfig, output_dir: str | None) -> str:
    """The config every host starts from, as TOML; `output_dir` replaces the run directory (None: leave it
    out, the hosts' command lines give it)."""
    data = config.model_dump(mode="json", exclude_unset=True, exclude_none=True, exclude=PER_HOST)
    for process in ("trainer", "orchestrator"):
        data.get(process, {}).pop("output_dir", None)  # one run directory, set once below
    data.pop("output_dir", None)
    if output_dir is not None:
        data["output_dir"] = output_dir
    return tomli_w.dumps(without_secrets(data, drop=True))


def placement_toml(topology: PlacementConfig) -> str:
    """The topology every host shares; each adds its own --placement.index (and SLURM the node names)."""
    return tomli_w.dumps({"placement": topology.model_dump(mode="json", exclude_defaults=True, exclude={"index"})})


def describe(hosts: list[HostPlan]) -> list[str]:
    """One line per host: what it runs, on what."""
    lines = []
    for host in hosts:
        devices, parts = host.devices, []
        if host.runs("inference"):  # each server's GPUs: its TP group
            groups = " ".join(f"[{','.join(map(str, g))}]" for g in devices.inference_gpus if g)
            parts.append(f"inference ({devices.replicas} server{'s' * (devices.replicas > 1)}"
                         + (f" on GPUs {groups})" if groups else ")"))
        if host.runs("orchestrator"):
            parts.append(f"orchestrator (to {len(host.inference_urls)} servers)")
        if host.runs("trainer"):
            on = (f"{len(devices.trainer_gpus)} GPUs" if devices.trainer_gpus
                  else f"{devices.trainer_processes} processes")
            parts.append(f"trainer node {host.node_rank} of {host.trainer_nodes} ({on})")
        lines.append(f"{host.name}: {', '.join(parts)}")
    return lines


def _template(name: str) -> jinja2.Template:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    return environment.get_template(name)


# --------------------------------------------------------------------------------------------------
# SLURM
# --------------------------------------------------------------------------------------------------


def slurm_topology(config: RLConfig) -> PlacementConfig:
    slurm = config.slurm
    return PlacementConfig(inference_hosts=slurm.inference_nodes, trainer_hosts=slurm.trainer_nodes,
                           inference_gpus=slurm.gpus_per_node, trainer_gpus=slurm.gpus_per_node,
                           rdzv_port=slurm.rdzv_port)


def render_slurm(config: RLConfig, paths: RunPaths, config_file: Path, placement_file: Path) -> str:
    topology = slurm_topology(config)
    layout = describe(plan(config, topology.model_copy(update={"hosts": [f"node {i}" for i in range(topology.size)]})))
    return _template("rl.sbatch.j2").render(
        slurm=config.slurm, layout=layout, nodes=topology.size, output_dir=shlex.quote(str(paths.root)),
        config_file=shlex.quote(str(config_file)), placement_file=shlex.quote(str(placement_file)),
        python=shlex.quote(sys.executable),
    )


def slurm_job(config: RLConfig, paths: RunPaths) -> Path:
    """Write <output_dir>/slurm/rl.toml (the run), placement.toml (its topology) and rl.sbatch; the script's path."""
    directory = paths.slurm
    config_file, placement_file = directory / "rl.toml", directory / "placement.toml"
    atomic_write_text(config_file, as_given(config, str(paths.root)))
    atomic_write_text(placement_file, placement_toml(slurm_topology(config)))
    script = directory / "rl.sbatch"
    atomic_write_text(script, render_slurm(config, paths, config_file, placement_file))
    return script


def submit(script: Path) -> str:
    """sbatch the script; the job id."""
    if shutil.which("sbatch") is None:
        raise ConfigError(f"sbatch is not on PATH: submit {script} from a SLURM login node, "
                          "or pass --slurm.submit false")
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                              timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"sbatch did not answer within {SBATCH_TIMEOUT_S}s; is slurmctld up?") from None
    if done.returncode != 0:
        raise ConfigError(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


# --------------------------------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------------------------------


def k8s_topology(config: RLConfig) -> PlacementConfig:
    """Pods reach each other by their headless services' DNS names: <job>-<index>.<job>."""
    k8s, name = config.k8s, config.k8s.name
    hosts = ([f"{name}-inference-{i}.{name}-inference" for i in range(k8s.inference_pods)] + [f"{name}-orchestrator"]
             + [f"{name}-trainer-{i}.{name}-trainer" for i in range(k8s.trainer_pods)])
    return PlacementConfig(hosts=hosts, inference_hosts=k8s.inference_pods, orchestrator_host=True,
                           trainer_hosts=k8s.trainer_pods, inference_gpus=k8s.inference_gpus,
                           trainer_gpus=k8s.trainer_gpus, rdzv_port=k8s.rdzv_port)


def render_k8s(config: RLConfig, paths: RunPaths, token: str | None = None) -> str:
    k8s = config.k8s
    name = k8s.name
    topology = k8s_topology(config)
    run_dir = f"{k8s.mount_path}/{paths.root.name}"
    rl = f"{k8s.rl} @ /etc/rl/rl.toml @ /etc/rl/placement.toml --output-dir {shlex.quote(run_dir)} --placement.index"
    first_trainer = k8s.inference_pods + 1
    jobs = [  # an Indexed Job's pods are hosts <first> + JOB_COMPLETION_INDEX of the plan
        {"role": "inference", "pods": k8s.inference_pods, "indexed": True, "gpus": k8s.inference_gpus,
         "command": f'{rl} "$JOB_COMPLETION_INDEX"'},
        {"role": "orchestrator", "pods": 1, "indexed": False, "gpus": None, "command": f"{rl} {k8s.inference_pods}"},
        {"role": "trainer", "pods": k8s.trainer_pods, "indexed": True, "gpus": k8s.trainer_gpus,
         "command": f'{rl} "$(({first_trainer} + JOB_COMPLETION_INDEX))"'},
    ]

    def labels(role: str | None = None) -> str:
        found = {"app.kubernetes.io/name": "rl", "rl/run": name} | ({"rl/role": role} if role else {})
        return json.dumps(found)

    return _template("rl.k8s.yaml.j2").render(
        k8s=k8s, name=name, labels=labels, jobs=jobs, inference_port=config.inference.port,
        token=token or config.inference.admin_token or secrets.token_hex(16),
        config_toml=as_given(config, None).rstrip("\n"), placement_toml=placement_toml(topology).rstrip("\n"),
        layout=describe(plan(config, topology)), claim=k8s.existing_claim or f"{name}-run", mount=k8s.mount_path,
    )
