"""`rl`: resolve the three configs, start inference, orchestrator and trainer, and supervise them.

    uv run rl --trainer @ train.toml --orchestrator @ orch.toml --inference @ infer.toml --max-steps 5
    uv run rl report <run-dir>    # <run-dir>/report.html: plots per step, progress, summary, configs
    uv run rl serve-api --trainer @ train.toml --inference @ infer.toml   # the Tinker API (docs/tinker.md)
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

from pydantic import BaseModel, ValidationError

from rl.config import (
    ConfigError, format_validation_error, parse_config, to_toml, warn_secrets_on_command_line, write_config,
)
from rl.config_help import config_help
from rl.config_secrets import args_without_secrets
from rl.checks import check_environments, check_lora_targets, check_model, check_output_dir, check_same_tokenizer
from rl.config import API_KEY_VAR
from rl.envs.config import ENV_SERVER_SECRET_VAR
from rl.inference.config import cpu_server_env
from rl.launcher.config import RLConfig
from rl.launcher.resolve import check_hosts, resolve
from rl.launcher.devices import (
    DevicePlan, check_gpu_ids, child_visible_devices, cpu_plan, cuda_unavailable, gpu_flags_without_gpus,
    ONE_NODE, nvidia_gpus_present, one_role_gpus, split_gpus, trainer_launcher, with_teacher,
)
from rl.launcher.placement import HostPlan, given_host, plan
from rl.launcher.resume import choose_checkpoint, discard_after
from rl.launcher.run_report import main as report_main
from rl.launcher.replay import main as replay_main
from rl.launcher.serve_api import (
    SERVICE_SECRETS, TRAINER_MODULE, TRAINER_RESTARTS, service_command, service_config,
)
from rl.launcher.deploy import describe, render_k8s, render_slurm, slurm_job, submit
from rl.launcher.hosts import HostBoard
from rl.launcher.supervisor import ChildSpec, Supervisor, is_secret
from rl.weights.config import CollectiveTransfer
from rl.trainer.config import check_device, cuda_device_count
from rl.protocol import RunPaths
from rl.process import set_up_process


def gpus_hidden_on_purpose() -> bool:
    """CUDA_VISIBLE_DEVICES set to '' (or -1): this host's GPUs are not for this run."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def this_host(config: RLConfig, available: int) -> HostPlan:
    """What this host starts: its entry of the run's plan (`--placement`), or what its own flags say."""
    check_hosts(config)
    if config.placement is None:
        return given_host(config, plan_devices(config, available))
    host = plan(config, config.placement)[config.placement.index]
    if config.uses_gpu_flags and config.placement.trainer_hosts > 0:
        raise ConfigError("--placement gives each host its GPUs (placement.inference_gpus, placement.trainer_gpus); "
                          "--trainer-gpus/--inference-gpus/--*-gpu-ids split them only where the trainer shares a host")
    planned = host.devices.trainer_gpus + [g for replica in host.devices.inference_gpus for g in replica]
    check_gpu_ids(planned, f"the GPUs placed on host {host.name!r}", available)
    return host


def plan_devices(config: RLConfig, available: int) -> DevicePlan:
    """`available`: the GPUs torch sees. None on a host whose driver shows NVIDIA GPUs is refused (a CPU torch
    there would train on the CPU) unless they are hidden on purpose or the run is only rendered for a cluster."""
    if available == 0:
        if config.uses_gpu_flags:
            raise gpu_flags_without_gpus()
        deploying = config.slurm is not None or config.k8s is not None
        if not deploying and not gpus_hidden_on_purpose() and (evidence := nvidia_gpus_present()):
            raise cuda_unavailable(evidence)
        return cpu_plan(config.trainer_processes, config.inference_replicas)
    if "orchestrator" in config.roles and "trainer" not in config.roles and config.trainer_gpus is None:
        raise ConfigError("the trainer runs on other hosts: give its GPUs per node with --trainer-gpus N "
                          "(the orchestrator writes one batch file per trainer rank)")
    tp = config.inference.tensor_parallel_size
    if "trainer" not in config.roles or "inference" not in config.roles:
        return one_role_gpus(
            available, "trainer" in config.roles, "inference" in config.roles,
            config.trainer_gpus, config.inference_gpus, config.trainer_gpu_ids, config.inference_gpu_ids, tp,
        )
    def split(gpus: int) -> DevicePlan:
        return split_gpus(
            gpus, config.trainer_gpus, config.inference_gpus, config.trainer_gpu_ids, config.inference_gpu_ids, tp
        )

    return split(available) if config.teacher is None else with_teacher(available, config.teacher.gpus, split)


def plan_resume(config: RLConfig, paths: RunPaths) -> None:
    """Point trainer and orchestrator at the checkpoint to continue from (nothing is changed on disk yet)."""
    step = choose_checkpoint(paths, config.resume_step)
    if step >= config.trainer.max_steps:
        raise ConfigError(f"checkpoint step {step} is already at --max-steps {config.trainer.max_steps}; raise it")
    config.trainer.resume_step = step
    config.orchestrator.resume_step = step


def cpu_trainer_env(plan: DevicePlan) -> dict[str, str]:
    """On a CPU host the trainer shares its cores with vLLM: its OpenMP workers sleep between parallel
    regions instead of spinning on cores vLLM's generation needs (small models' steps are faster; big ones
    leave little time to spin: benchmarks/RESULTS.md). A policy the user exported wins."""
    if plan.trainer_gpus or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}




def gpu_child_env(role: str) -> dict[str, str]:
    """Set for a child on GPUs unless the launcher's environment sets it. GPU ids in nvidia-smi's numbering
    (CUDA's default orders by speed). The trainer's allocator grows segments in place instead of caching
    blocks of every size (less fragmentation with packed rows of varying length). vLLM spawns its engine
    process instead of forking the server's, which may have initialised CUDA (vLLM then spawns anyway)."""
    wanted = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if role == "trainer" and "PYTORCH_ALLOC_CONF" not in os.environ:  # torch's newer name for the same setting
        wanted["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if role == "inference":
        wanted["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return {name: value for name, value in wanted.items() if name not in os.environ}


def host_dirs(host: HostPlan, paths: RunPaths) -> tuple[Path, Path]:
    """Where this host's resolved configs and logs go: configs/ and logs/, or a folder per host when the run
    spans several (each host derives its own values, and two hosts must not write one log)."""
    if not host.spans_hosts:
        return paths.configs.absolute(), paths.logs.absolute()
    return (paths.configs / host.name).absolute(), (paths.logs / host.name).absolute()


def torchrun_args(host: HostPlan, paths: RunPaths) -> list[str]:
    """One node: standalone (`ONE_NODE`). Several: c10d rendezvous hosted by trainer node 0 (said outright: torchrun
    guesses it from hostnames, which fails where a host's name does not resolve to the endpoint's address), one id
    per run directory."""
    args = trainer_launcher(host.devices.trainer_processes, bool(host.devices.trainer_gpus))
    if host.trainer_nodes == 1:
        return args + ONE_NODE
    run_id = "rl-" + hashlib.sha1(str(paths.root.absolute()).encode()).hexdigest()[:12]
    args += [f"--nnodes={host.trainer_nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={host.rdzv_endpoint}",
             f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={str(host.node_rank == 0).lower()}"]
    return args + ([f"--local-addr={host.node_addr}"] if host.node_addr else [])


# A child forked from the launcher (rl/launcher/forked.py) starts with what the launcher imported for its checks
# (verifiers, the environments' packages), but also with all it holds: its configs with the secrets it read or made,
# and its first environment block (/proc/<pid>/environ), whatever the child's own environment. So the processes that
# run environments' code are forked only where that holds nothing they may not have: env servers never (the launcher
# always holds the run's admin token); the orchestrator unless the launcher holds the transfer secret or a variable
# of ORCHESTRATOR_SECRETS' kind that it does not pass on.
ORCHESTRATOR_SECRETS = (API_KEY_VAR, ENV_SERVER_SECRET_VAR, "WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
"""The launcher's secrets the orchestrator needs: its servers' key, remote env servers' secret, W&B's and the hub's
keys; not the transfer secret or the admin token (its config file holds what it uses of those)."""
ENV_SERVER_RESTARTS = 5  # an environment's server that dies is started again this often: the orchestrator runs its lost
# episodes again (rl/envs/client.py); past that, its exit stops the run

def holds_more_than(config: RLConfig, secrets: tuple[str, ...]) -> bool:
    """Whether this launcher holds a secret beyond `secrets` (and the admin token): the transfer secret, or a
    secret variable of its environment."""
    transfer = isinstance(config.trainer.transfer, CollectiveTransfer) and config.trainer.transfer.secret is not None
    return transfer or any(is_secret(name) and name not in secrets for name in os.environ)


def child_specs(config: RLConfig, host: HostPlan, paths: RunPaths) -> list[ChildSpec]:
    """Plan GPU ids are indices into the launcher's visible GPUs; children get them as its CUDA_VISIBLE_DEVICES
    names them."""
    python = sys.executable
    plan = host.devices
    configs, logs = host_dirs(host, paths)
    parent_gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    tp, cores = config.inference.tensor_parallel_size, sorted(os.sched_getaffinity(0))
    specs = []
    if host.runs("inference"):
        for r, gpus in enumerate(plan.inference_gpus):
            name = "inference" if plan.replicas == 1 else f"inference-{r}"
            cmd = [python, "-m", "rl.inference.main", "@", str(configs / "inference.toml")]
            cmd += ["--port", str(config.inference.port + r)]
            visible, env = (
                (child_visible_devices(gpus, parent_gpus), gpu_child_env("inference")) if gpus
                else (None, cpu_server_env(r, tp, cores))
            )
            specs.append(ChildSpec(name, cmd, visible, logs / f"{name}.log", env))
        if config.teacher_server is not None:  # frozen: nothing ever sends it weights
            cmd = [python, "-m", "rl.inference.main", "@", str(configs / "teacher.toml")]
            gpus = list(plan.teacher_gpus)
            visible, env = (
                (child_visible_devices(gpus, parent_gpus), gpu_child_env("inference")) if gpus
                else (None, cpu_server_env(plan.replicas, tp, cores))
            )
            specs.append(ChildSpec("teacher", cmd, visible, logs / "teacher.log", env))
    if host.runs("orchestrator") and config.api is not None:  # rl serve-api: the service in its place
        specs.append(ChildSpec("service", service_command(configs), [], logs / "service.log",
                               keep_secrets=SERVICE_SECRETS))
    elif host.runs("orchestrator"):
        # verifiers' clients read the servers' API key from the variable they are given the name of; the processes
        # that run environments' code get no other secret of the launcher's but what they need (ORCHESTRATOR_SECRETS)
        key = {API_KEY_VAR: config.inference.api_key} if config.inference.api_key else {}
        for name in config.env_servers:  # no GPU; started before the orchestrator, which waits for each to answer
            cmd = [python, "-m", "rl.envs.server", "@", str(configs / f"{name}.toml")]
            specs.append(ChildSpec(name, cmd, [], logs / f"{name}.log", secret_env=key, keep_secrets=(API_KEY_VAR,),
                                   restarts=ENV_SERVER_RESTARTS))
        cmd = [python, "-m", "rl.orchestrator.main", "@", str(configs / "orchestrator.toml")]
        fork = not holds_more_than(config, ORCHESTRATOR_SECRETS)
        specs.append(ChildSpec("orchestrator", cmd, [], logs / "orchestrator.log", secret_env=key,  # no GPU
                               keep_secrets=ORCHESTRATOR_SECRETS, preload=("rl.orchestrator.main",) if fork else ()))
    if host.runs("trainer"):
        module = "rl.trainer.main" if config.api is None else TRAINER_MODULE
        cmd = torchrun_args(host, paths) + ["-m", module, "@", str(configs / "trainer.toml")]
        gpus = plan.trainer_gpus
        visible, env = (child_visible_devices(gpus, parent_gpus), gpu_child_env("trainer")) if gpus else (None, {})
        restarts = 0 if config.api is None else TRAINER_RESTARTS  # rl serve-api: its client loads a saved state
        specs.append(ChildSpec("trainer", cmd, visible, logs / "trainer.log", env | cpu_trainer_env(plan),
                               restarts=restarts))
    return specs


def print_dry_run(config: RLConfig, host: HostPlan, specs: list[ChildSpec]) -> None:
    print("# ---- placement ----")
    print(*describe([host], config.env_servers), sep="\n")
    for name in host.roles:
        print(f"# ---- {name} config ----")
        print(to_toml(getattr(config, name), mask_secrets=True))
    if host.runs("inference") and config.teacher_server is not None:
        print("# ---- teacher config ----")
        print(to_toml(config.teacher_server, mask_secrets=True))
    print("# ---- chosen by device ----")
    for field, why in config.device_choices.items():
        section, *path = field.split(".")
        if host.runs(section):
            value = getattr(config, section)
            for name in path:
                value = getattr(value, name)
            print(f"{field} = {choice_text(value)} ({why})")
    print("# ---- commands ----")
    for spec in specs:
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in spec.extra_env.items())  # '0|1' is no pipe
        print(f"{spec.name}: {prefix}{shlex.join(args_without_secrets(spec.cmd))}  > {spec.log}")


def choice_text(value) -> str:
    """A chosen value as TOML writes it: `true`, `bfloat16`, a section inline (`{ type = "mask", ... }`), a list of
    them (`[{ ... }, { ... }]`)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(choice_text(item) for item in value) + "]"
    if isinstance(value, BaseModel):
        fields = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.model_dump(mode="json").items())
        return f"{{ {fields} }}"
    return str(value)


def load(argv: list[str]) -> tuple[RLConfig, HostPlan]:
    config = parse_config(RLConfig, argv)
    host = this_host(config, cuda_device_count())
    try:
        return resolve(config, host), host
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def deploy(config: RLConfig, host: HostPlan, given: RLConfig, paths: RunPaths) -> None:
    """`--k8s`: print the manifests. `--slurm`: check as for a start here (the nodes share this filesystem),
    write the job and submit it; with --dry-run print the job and write nothing. `config` is resolved for
    this host, `given` as the user gave it (what every host of the job starts from)."""
    if config.slurm and config.k8s:
        raise ConfigError("--slurm and --k8s are two ways to run; choose one")
    if config.k8s:
        print(render_k8s(given, paths), end="")
        return
    check_start(config, host, paths, config.resume or config.resume_step is not None, devices_here=False)
    if config.dry_run:
        print(render_slurm(given, paths, paths.slurm / "rl.toml", paths.slurm / "placement.toml"), end="")
        return
    paths.make_private()
    script = slurm_job(given, paths)
    if not config.slurm.submit:
        exported = " with RL_INFERENCE__API_KEY exported" if given.inference.api_key else ""
        print(f"rl: wrote {script}; submit it{exported} with: sbatch {script}")
        return
    print(f"rl: submitted SLURM job {submit(script, given)} ({script}); its log: {paths.slurm}/<job id>.log, "
          f"each host's in {paths.logs}/<host>/")


def check_start(config: RLConfig, host: HostPlan, paths: RunPaths, resuming: bool, devices_here: bool = True) -> None:
    """The checks before anything starts, for the processes this host runs (`devices_here`: and on its
    devices; not where a SLURM job is submitted from). The host running the orchestrator (one per run) owns
    the run directory: it checks it and, on resume, trims it."""
    if devices_here and host.runs("trainer"):
        check_device(config.trainer)
    if host.runs("orchestrator"):
        check_output_dir(paths, resuming)
    if resuming:
        plan_resume(config, paths)
    for name in {getattr(config, role).model.name for role in host.roles}:
        check_model(name)
    if host.runs("orchestrator") and config.api is None:
        check_environments(config.orchestrator)
    if config.teacher is not None and host.runs("orchestrator"):
        check_same_tokenizer(config.orchestrator.model.name, config.teacher.model)
    if host.runs("trainer"):
        check_lora_targets(config.trainer)


def main(argv: list[str] | None = None) -> None:
    set_up_process()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:  # a subcommand: no config flag is a bare word
        return report_main(argv[1:])
    if argv[:1] == ["replay"]:
        return replay_main(argv[1:])
    if argv[:1] == ["serve-api"]:
        argv = ["--api", *argv[1:]]
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(config_help(RLConfig))
        return
    try:
        config, host = load(argv)
        warn_secrets_on_command_line(config, argv, "rl")
        paths = RunPaths(config.trainer.output_dir.absolute())
        if config.slurm or config.k8s:
            return deploy(config, host, parse_config(RLConfig, argv), paths)
        resuming = config.resume or config.resume_step is not None
        check_start(config, host, paths, resuming)
        specs = child_specs(config, host, paths)
    except ConfigError as e:
        print(f"rl: error: {e}", file=sys.stderr)
        sys.exit(2)
    if config.dry_run:
        print_dry_run(config, host, specs)
        return
    paths.make_private()
    if resuming and host.runs("orchestrator"):
        removed = discard_after(paths, config.trainer.resume_step)
        print(f"rl: resuming from step {config.trainer.resume_step}; discarded {', '.join(removed) or 'nothing'}")
    configs, _ = host_dirs(host, paths)
    for name in host.roles:
        write_config(getattr(config, name), configs / f"{name}.toml")
    if host.runs("inference") and config.teacher_server is not None:
        write_config(config.teacher_server, configs / "teacher.toml")
    if host.runs("orchestrator") and config.api is not None:
        write_config(service_config(config), configs / "service.toml")
    elif host.runs("orchestrator"):
        for name, server in config.env_servers.items():
            write_config(server, configs / f"{name}.toml")
    write_config(config, configs / "rl.toml", mask_secrets=True)  # a record: nothing reads it back
    board = HostBoard(paths, host.name, host.roles, host.node_rank, host.trainer_nodes, config.host_timeout_s)
    supervisor = Supervisor(paths, config.log_tail_lines, config.shutdown_timeout_s, config.trainer.max_steps)
    sys.exit(supervisor.run(specs, board))


if __name__ == "__main__":
    main()
