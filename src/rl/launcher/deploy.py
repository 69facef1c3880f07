"""A run over several hosts, as a SLURM job (`rl --slurm`) or Kubernetes manifests (`rl --k8s`).

Either way every host starts `rl` from one config file, the run's config as the user gave it (files,
environment and flags merged; nothing derived, no secret), adding only what differs per host: its
`--roles`, its name, its trainer node rank, where the inference servers and the rendezvous are. The hosts
find each other through the shared run directory (`launcher/hosts.py`); the admin token, the API key and the
transfer secret reach each one through its environment (`HOST_SECRETS`), never through a file of the run directory.

A value reaches a render only where it cannot change the render's structure: the Kubernetes manifests are built
as data and dumped by PyYAML; the SLURM script shell-quotes each value, keeps them out of comment lines, and
refuses what an #SBATCH line cannot hold (control characters first of all: a newline would start a command).
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jinja2
import tomli_w
import yaml

from rl.config import ConfigError, without_secrets
from rl.launcher.config import CONTROL_CHARACTERS, K8sConfig, RLConfig
from rl.launcher.placement import HostPlan, PlacementConfig, plan
from rl.protocol import RunPaths, atomic_write_text
from rl.weights.config import CollectiveTransfer

TEMPLATES = Path(__file__).parent / "templates"
PER_HOST = {"slurm", "k8s", "dry_run", "roles", "host_name", "node_rank", "node_addr", "rdzv_endpoint",
            "trainer_nodes", "placement"}
SBATCH_TIMEOUT_S = 60
# The secrets every host needs: (section.field, the environment variable that carries it to a host, the k8s
# Secret (<name>-<suffix>) and key that hold it).
HOST_SECRETS = (("inference.admin_token", "RL_INFERENCE__ADMIN_TOKEN", "admin-token", "token"),
                ("inference.api_key", "RL_INFERENCE__API_KEY", "api-key", "key"),
                ("transfer.secret", "RL_TRANSFER__SECRET", "transfer-secret", "secret"))
# Which of them each role's pods get: the orchestrator runs environments' code and needs no transfer secret.
ROLE_SECRETS = {"inference": {var for _, var, _, _ in HOST_SECRETS}, "trainer": {var for _, var, _, _ in HOST_SECRETS},
                "orchestrator": {"RL_INFERENCE__ADMIN_TOKEN", "RL_INFERENCE__API_KEY"}}


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


def describe(hosts: list[HostPlan], env_servers: dict | None = None) -> list[str]:
    """One line per host: what it runs, on what (the env servers `rl` starts go beside the orchestrator)."""
    lines = []
    for host in hosts:
        devices, parts = host.devices, []
        if host.runs("inference"):  # each server's GPUs: its TP group
            groups = " ".join(f"[{','.join(map(str, g))}]" for g in devices.inference_gpus if g)
            parts.append(f"inference ({devices.replicas} server{'s' * (devices.replicas > 1)}"
                         + (f" on GPUs {groups})" if groups else ")"))
        if host.runs("orchestrator"):
            parts.append(f"orchestrator (to {len(host.inference_urls)} servers)")
            parts += [f"{name} ({server.workers} worker{'s' * (server.workers > 1)})"
                      for name, server in (env_servers or {}).items()]
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
                           orchestrator_host=slurm.orchestrator_node,
                           inference_gpus=slurm.gpus_per_node, trainer_gpus=slurm.gpus_per_node,
                           rdzv_port=slurm.rdzv_port)


def check_sbatch_path(path: Path) -> None:
    """The run directory goes into `#SBATCH --output`, which sbatch reads with its own rules: a newline ends the
    line, a backslash escapes (even inside quotes) and % starts a file name pattern (%j)."""
    text = str(path)
    if CONTROL_CHARACTERS.search(text) or "\\" in text or "%" in text:
        raise ConfigError(f"output_dir = {text!r}: a run directory rendered into a SLURM job may hold no control "
                          "character, backslash or %; choose another --output-dir")


def render_slurm(config: RLConfig, paths: RunPaths, config_file: Path, placement_file: Path) -> str:
    check_sbatch_path(paths.root)
    topology = slurm_topology(config)
    hosts = plan(config, topology.model_copy(update={"hosts": [f"node {i}" for i in range(topology.size)]}))
    layout = describe(hosts, config.env_servers)
    return _template("rl.sbatch.j2").render(
        unset=[" ".join(sorted(not_needed(host.roles))) for host in hosts],
        slurm=config.slurm, layout=layout, nodes=topology.size, output_dir=shlex.quote(str(paths.root)),
        config_file=shlex.quote(str(config_file)), placement_file=shlex.quote(str(placement_file)),
        python=shlex.quote(sys.executable), api_key=config.inference.api_key is not None,
        collective=over_the_wire(config), **node_claim(config.slurm),
    )


def not_needed(roles) -> set[str]:
    """The run's secrets (their variables) that a host running `roles` does not need."""
    return {var for _, var, _, _ in HOST_SECRETS} - set().union(*(ROLE_SECRETS[role] for role in roles))


def node_claim(slurm) -> dict:
    """A GPU job takes its nodes whole, all their memory too, unless the user said otherwise."""
    gpus = slurm.gpus_per_node is not None
    return {"exclusive": gpus if slurm.exclusive is None else slurm.exclusive,
            "mem": slurm.mem if slurm.mem is not None else "0" if gpus else None}


def slurm_job(config: RLConfig, paths: RunPaths) -> Path:
    """Write <output_dir>/slurm/rl.toml (the run), placement.toml (its topology) and rl.sbatch; the script's path."""
    directory = paths.slurm
    config_file, placement_file = directory / "rl.toml", directory / "placement.toml"
    script = render_slurm(config, paths, config_file, placement_file)  # refuses what it cannot render first
    atomic_write_text(config_file, as_given(config, str(paths.root)))
    atomic_write_text(placement_file, placement_toml(slurm_topology(config)))
    atomic_write_text(directory / "rl.sbatch", script)
    return directory / "rl.sbatch"


def host_secrets(config: RLConfig) -> dict[str, str]:
    """The secrets set for this run, by the environment variable that carries each to a host."""
    found = {var: getattr(getattr(config, section) or SimpleNamespace(), field, None)
             for section, field, var in ((*where.split("."), var) for where, var, _, _ in HOST_SECRETS)}
    return {var: value for var, value in found.items() if value is not None}


def over_the_wire(config: RLConfig) -> bool:
    return any(isinstance(transfer, CollectiveTransfer) for transfer in (config.transfer, config.trainer.transfer))


def submit(script: Path, config: RLConfig) -> str:
    """sbatch the script, the run's secrets in its environment (sbatch passes it on to the job); the job id."""
    if shutil.which("sbatch") is None:
        raise ConfigError(f"sbatch is not on PATH: submit {script} from a SLURM login node, "
                          "or pass --slurm.submit false")
    try:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                              timeout=SBATCH_TIMEOUT_S, env=os.environ | host_secrets(config))
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


K8S_HEADER = """\
# An rl run on Kubernetes, rendered by `rl --k8s`.
# One Job per role (inference and trainer Indexed: one pod per replica or node; a failed role fails the run,
# resume it with --resume), a volume every pod shares for the run directory, a RAM-backed /dev/shm for NCCL in
# the inference and trainer pods, the run's config as given and its topology in a ConfigMap, the admin token (and
# the API key, when set) as Secrets, headless Services that give each pod a DNS name (<pod hostname>.<service>).
#   kubectl apply -n {namespace} -f <this file>
# Each pod starts its entry of the plan (--placement.index):
"""


class ManifestDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, written for people: no anchors, lists indented under their key, multi-line strings
    (the ConfigMap's files) as literal blocks where a block holds them exactly (PyYAML quotes them otherwise)."""

    def ignore_aliases(self, data) -> bool:
        return True

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


ManifestDumper.add_representer(
    str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, "|" if "\n" in text else None)
)


def render_k8s(config: RLConfig, paths: RunPaths, token: str | None = None) -> str:
    """The manifests: data dumped by PyYAML, so no value can add a key or a document."""
    k8s = config.k8s
    secret_values = host_secrets(config) | {"RL_INFERENCE__ADMIN_TOKEN": token or config.inference.admin_token
                                            or secrets.token_hex(16)}
    if over_the_wire(config):  # one per run, as the admin token
        secret_values.setdefault("RL_TRANSFER__SECRET", secrets.token_hex(32))
    pod_secrets = [(var, f"{k8s.name}-{suffix}", key) for _, var, suffix, key in HOST_SECRETS if var in secret_values]
    documents = [k8s_secret(k8s, name, key, secret_values[var]) for var, name, key in pod_secrets]
    documents.append(k8s_config_map(config))
    if not k8s.existing_claim:
        documents.append(k8s_volume_claim(k8s))
    documents += [k8s_service(k8s, role, port) for role, port in (("inference", config.inference.port),
                                                                   ("trainer", k8s.rdzv_port))]
    documents += [k8s_job(k8s, role, pods, gpus, command, [s for s in pod_secrets if s[0] in ROLE_SECRETS[role]])
                  for role, pods, gpus, command in k8s_roles(config, paths)]
    layout = "".join(f"#   {line}\n" for line in describe(plan(config, k8s_topology(config)), config.env_servers))
    return (K8S_HEADER.format(namespace=k8s.namespace) + layout
            + yaml.dump_all(documents, Dumper=ManifestDumper, sort_keys=False, width=float("inf")))


def k8s_roles(config: RLConfig, paths: RunPaths) -> list[tuple[str, int, int | None, str]]:
    """(role, pods, GPUs per pod, shell command) per Job. An Indexed Job's pods are hosts <first> +
    JOB_COMPLETION_INDEX of the plan."""
    k8s = config.k8s
    run_dir = f"{k8s.mount_path}/{paths.root.name}"
    rl = f"{k8s.rl} @ /etc/rl/rl.toml @ /etc/rl/placement.toml --output-dir {shlex.quote(run_dir)} --placement.index"
    first_trainer = k8s.inference_pods + 1
    return [("inference", k8s.inference_pods, k8s.inference_gpus, f'{rl} "$JOB_COMPLETION_INDEX"'),
            ("orchestrator", 1, None, f"{rl} {k8s.inference_pods}"),
            ("trainer", k8s.trainer_pods, k8s.trainer_gpus, f'{rl} "$(({first_trainer} + JOB_COMPLETION_INDEX))"')]


def k8s_metadata(k8s: K8sConfig, name: str, role: str | None = None) -> dict:
    return {"name": name, "namespace": k8s.namespace, "labels": k8s_labels(k8s, role)}


def k8s_labels(k8s: K8sConfig, role: str | None = None) -> dict:
    return {"app.kubernetes.io/name": "rl", "rl/run": k8s.name} | ({"rl/role": role} if role else {})


def k8s_secret(k8s: K8sConfig, name: str, key: str, value: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": k8s_metadata(k8s, name), "type": "Opaque",
            "stringData": {key: value}}


def k8s_config_map(config: RLConfig) -> dict:
    """The run's config as given (no secret) and its topology, mounted at /etc/rl in every pod."""
    data = {"rl.toml": as_given(config, None), "placement.toml": placement_toml(k8s_topology(config))}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": k8s_metadata(config.k8s, f"{config.k8s.name}-config"),
            "data": data}


def k8s_volume_claim(k8s: K8sConfig) -> dict:
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": k8s.storage_size}}}
    if k8s.storage_class:
        spec["storageClassName"] = k8s.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": k8s_metadata(k8s, f"{k8s.name}-run"),
            "spec": spec}


def k8s_service(k8s: K8sConfig, role: str, port: int) -> dict:
    """Headless: each pod of the role's Job gets a DNS name, <pod hostname>.<name>-<role>."""
    spec = {"clusterIP": "None", "selector": k8s_labels(k8s, role),
            "ports": [{"name": "http" if role == "inference" else "rendezvous", "port": port}]}
    return {"apiVersion": "v1", "kind": "Service", "metadata": k8s_metadata(k8s, f"{k8s.name}-{role}", role),
            "spec": spec}


def k8s_job(k8s: K8sConfig, role: str, pods: int, gpus: int | None, command: str,
            pod_secrets: list[tuple[str, str, str]]) -> dict:
    """One Job per role; the inference and trainer Jobs are Indexed (a pod per index, named in their Service)."""
    env = [{"name": var, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}} for var, name, key in pod_secrets]
    container = {
        "name": role, "image": k8s.image, "command": ["/bin/sh", "-c"], "args": [f"exec {command}"],
        "env": env + [{"name": key, "value": value} for key, value in k8s.env.items()],
        "volumeMounts": [{"name": "run", "mountPath": k8s.mount_path},
                         {"name": "config", "mountPath": "/etc/rl", "readOnly": True}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    volumes = [{"name": "run", "persistentVolumeClaim": {"claimName": k8s.existing_claim or f"{k8s.name}-run"}},
               {"name": "config", "configMap": {"name": f"{k8s.name}-config"}}]
    if role in ("inference", "trainer"):  # NCCL and vLLM's workers share memory in /dev/shm: a container's 64 MB
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})  # fails NCCL; give it RAM
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    indexed = role != "orchestrator"
    pod = {"restartPolicy": "Never", **({"subdomain": f"{k8s.name}-{role}"} if indexed else {}),
           "containers": [container], "volumes": volumes}
    spec = {"completions": pods, "parallelism": pods, **({"completionMode": "Indexed"} if indexed else {}),
            "backoffLimit": 0, "template": {"metadata": {"labels": k8s_labels(k8s, role)}, "spec": pod}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": k8s_metadata(k8s, f"{k8s.name}-{role}", role),
            "spec": spec}
