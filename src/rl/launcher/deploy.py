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
from rl.protocol import RunPaths, atomic_write_text

TEMPLATES = Path(__file__).parent / "templates"
PER_HOST = {"slurm", "k8s", "dry_run", "roles", "host_name", "node_rank", "node_addr", "rdzv_endpoint", "inference_urls",
            "trainer_nodes"}
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


def _template(name: str) -> jinja2.Template:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    return environment.get_template(name)


# --------------------------------------------------------------------------------------------------
# SLURM
# --------------------------------------------------------------------------------------------------


def render_slurm(config: RLConfig, paths: RunPaths, config_file: Path) -> str:
    slurm = config.slurm
    layout = (f"{slurm.inference_nodes} inference (the first also runs the orchestrator)"
              + (f", {slurm.trainer_nodes} trainer" if slurm.trainer_nodes else ", the trainer beside the first"))
    return _template("rl.sbatch.j2").render(
        slurm=slurm, layout=layout, nodes=slurm.inference_nodes + slurm.trainer_nodes,
        output_dir=shlex.quote(str(paths.root)), config_file=shlex.quote(str(config_file)),
        python=shlex.quote(sys.executable), inference_port=config.inference.port,
        inference_replicas=slurm.gpus_per_node or config.inference_replicas,  # servers per inference node
    )


def slurm_job(config: RLConfig, paths: RunPaths) -> Path:
    """Write <output_dir>/slurm/rl.toml and rl.sbatch; the script's path."""
    directory = paths.slurm
    config_file = directory / "rl.toml"
    atomic_write_text(config_file, as_given(config, str(paths.root)))
    script = directory / "rl.sbatch"
    atomic_write_text(script, render_slurm(config, paths, config_file))
    return script


def submit(script: Path) -> str:
    """sbatch the script; the job id."""
    if shutil.which("sbatch") is None:
        raise ConfigError(f"sbatch is not on PATH: submit {script} from a SLURM login node, or pass --slurm.submit false")
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


def render_k8s(config: RLConfig, paths: RunPaths, token: str | None = None) -> str:
    k8s = config.k8s
    name, port = k8s.name, config.inference.port
    run_dir = f"{k8s.mount_path}/{paths.root.name}"
    replicas = k8s.inference_gpus or config.inference_replicas  # servers per inference pod
    urls = [f"http://{name}-inference-{i}.{name}-inference:{port + r}" for i in range(k8s.inference_pods)
            for r in range(replicas)]
    rl = f"{k8s.rl} @ /etc/rl/rl.toml --output-dir {shlex.quote(run_dir)} --host-name \"$(hostname)\""
    gpus = f" --trainer-gpus {k8s.trainer_gpus}" if k8s.trainer_gpus else ""
    jobs = [
        {"role": "inference", "pods": k8s.inference_pods, "indexed": True, "gpus": k8s.inference_gpus,
         "command": f"{rl} --roles '[\"inference\"]' --inference.host 0.0.0.0"},
        {"role": "orchestrator", "pods": 1, "indexed": False, "gpus": None,
         "command": f"{rl} --roles '[\"orchestrator\"]' --inference-urls '{json.dumps(urls)}' "
                    f"--trainer-nodes {k8s.trainer_pods}{gpus}"},
        {"role": "trainer", "pods": k8s.trainer_pods, "indexed": True, "gpus": k8s.trainer_gpus,
         "command": f"{rl} --roles '[\"trainer\"]' --trainer-nodes {k8s.trainer_pods} "
                    f"--node-rank \"$JOB_COMPLETION_INDEX\" --rdzv-endpoint {name}-trainer-0.{name}-trainer:{k8s.rdzv_port}"},
    ]

    def labels(role: str | None = None) -> str:
        found = {"app.kubernetes.io/name": "rl", "rl/run": name} | ({"rl/role": role} if role else {})
        return json.dumps(found)

    return _template("rl.k8s.yaml.j2").render(
        k8s=k8s, name=name, labels=labels, jobs=jobs, inference_port=port,
        token=token or config.inference.admin_token or secrets.token_hex(16),
        config_toml=as_given(config, None).rstrip("\n"), claim=k8s.existing_claim or f"{name}-run",
        mount=k8s.mount_path,
    )
