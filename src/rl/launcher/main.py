"""`rl`: resolve the three configs, start inference, orchestrator and trainer, and supervise them.

    uv run rl --trainer @ train.toml --orchestrator @ orch.toml --inference @ infer.toml --max-steps 5
"""

from __future__ import annotations

import os
import shlex
import sys

from pydantic import ValidationError

from rl.config import ConfigError, format_validation_error, parse_config, config_help, to_toml, write_config
from rl.launcher.checks import check_environments, check_model, check_output_dir
from rl.launcher.config import RLConfig, resolve
from rl.launcher.devices import DevicePlan, cpu_plan, split_gpus
from rl.launcher.resume import choose_checkpoint, discard_after
from rl.launcher.supervisor import ChildSpec, Supervisor
from rl.protocol import RunPaths


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_devices(config: RLConfig, available: int) -> DevicePlan:
    if available == 0:
        if config.uses_gpu_flags:
            raise ConfigError(
                "no GPU is visible, so --trainer-gpus/--inference-gpus/--*-gpu-ids cannot be used; on a CPU host "
                "set --trainer-processes N (gloo ranks) and --inference-replicas M instead"
            )
        return cpu_plan(config.trainer_processes, config.inference_replicas)
    return split_gpus(
        available,
        config.trainer_gpus,
        config.inference_gpus,
        config.trainer_gpu_ids,
        config.inference_gpu_ids,
        config.inference.tensor_parallel_size,
    )


def plan_resume(config: RLConfig, paths: RunPaths) -> None:
    """Point trainer and orchestrator at the checkpoint to continue from (nothing is changed on disk yet)."""
    step = choose_checkpoint(paths, config.resume_step)
    if step >= config.trainer.max_steps:
        raise ConfigError(f"checkpoint step {step} is already at --max-steps {config.trainer.max_steps}; raise it")
    config.trainer.resume_step = step
    config.orchestrator.resume_step = step


def cpu_trainer_env(plan: DevicePlan) -> dict[str, str]:
    """On a CPU host the trainer shares its cores with vLLM: its OpenMP workers sleep between parallel
    regions instead of spinning on cores vLLM's generation needs. Tiny model, rl side of
    benchmarks/trl_side_by_side.py: step 2.4-2.6 s against 3.0-4.5 s spinning; at 100M no gain beyond
    this machine's noise (big ops leave little time to spin). A policy the user exported wins."""
    if plan.trainer_gpus or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def child_specs(config: RLConfig, plan: DevicePlan, paths: RunPaths) -> list[ChildSpec]:
    python = sys.executable
    configs = paths.configs.absolute()
    specs = []
    for r, gpus in enumerate(plan.inference_gpus):
        name = "inference" if plan.replicas == 1 else f"inference-{r}"
        cmd = [python, "-m", "rl.inference.main", "@", str(configs / "inference.toml")]
        cmd += ["--port", str(config.inference.port + r)]
        specs.append(ChildSpec(name, cmd, gpus if gpus else None, paths.logs / f"{name}.log"))
    specs.append(
        ChildSpec(
            "orchestrator",
            [python, "-m", "rl.orchestrator.main", "@", str(configs / "orchestrator.toml")],
            [],  # the orchestrator needs no GPU
            paths.logs / "orchestrator.log",
        )
    )
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={plan.trainer_processes}"]
    specs.append(
        ChildSpec(
            "trainer",
            torchrun + ["-m", "rl.trainer.main", "@", str(configs / "trainer.toml")],
            plan.trainer_gpus or None,
            paths.logs / "trainer.log",
            cpu_trainer_env(plan),
        )
    )
    return specs


def print_dry_run(config: RLConfig, specs: list[ChildSpec]) -> None:
    for name in ("inference", "orchestrator", "trainer"):
        print(f"# ---- {name} config ----")
        print(to_toml(getattr(config, name), mask_secrets=True))
    print("# ---- commands ----")
    for spec in specs:
        prefix = "".join(f"{k}={v} " for k, v in spec.extra_env.items())
        print(f"{spec.name}: {prefix}{shlex.join(spec.cmd)}  > {spec.log}")


def load(argv: list[str]) -> tuple[RLConfig, DevicePlan]:
    config = parse_config(RLConfig, argv)
    plan = plan_devices(config, visible_gpus())
    try:
        return resolve(config, plan), plan
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(config_help(RLConfig))
        return
    try:
        config, plan = load(argv)
        paths = RunPaths(config.trainer.output_dir.absolute())
        resuming = config.resume or config.resume_step is not None
        check_output_dir(paths, resuming)
        if resuming:
            plan_resume(config, paths)
        for name in {config.trainer.model.name, config.orchestrator.model.name, config.inference.model.name}:
            check_model(name)
        check_environments(config.orchestrator)
        specs = child_specs(config, plan, paths)
    except ConfigError as e:
        print(f"rl: error: {e}", file=sys.stderr)
        sys.exit(2)
    if config.dry_run:
        print_dry_run(config, specs)
        return
    if resuming:
        removed = discard_after(paths, config.trainer.resume_step)
        print(f"rl: resuming from step {config.trainer.resume_step}; discarded {', '.join(removed) or 'nothing'}")
    for name in ("inference", "orchestrator", "trainer"):
        write_config(getattr(config, name), paths.configs / f"{name}.toml")
    write_config(config, paths.configs / "rl.toml")
    supervisor = Supervisor(paths, config.log_tail_lines, config.shutdown_timeout_s)
    sys.exit(supervisor.run(specs))


if __name__ == "__main__":
    main()
