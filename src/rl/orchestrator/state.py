"""The orchestrator's resume state: checkpoints/step_k/orchestrator/state.json holds the step, the
policy step, each environment's sampler position after batch k - 1 was written, and (continuous dispatch) the
groups drawn but not yet in a batch then, as [environment, task] pairs: a resume runs them first."""

from __future__ import annotations

import json

from rl.envs.config import EpochSampling
from rl.orchestrator.sampler import Sampler, restored_sampler
from rl.protocol import STABLE, RunPaths, atomic_write_text, is_stable, mark_stable, verify_stable


def save_state(paths: RunPaths, step: int, policy_step: int, samplers: list[Sampler], keep: int,
               pending: list[tuple[int, int]] = ()) -> None:
    """Write the state a resume at `step` needs, then drop orchestrator states beyond the last `keep`."""
    state = {"step": step, "policy_step": policy_step, "samplers": [s.state_dict() for s in samplers],
             "pending": [list(group) for group in pending]}
    directory = paths.checkpoint(step) / "orchestrator"
    atomic_write_text(directory / "state.json", json.dumps(state, indent=1) + "\n")
    mark_stable(directory, step=step)
    paths.prune_checkpoint_parts("orchestrator", keep)


def load_state(paths: RunPaths, step: int) -> dict:
    directory = paths.checkpoint(step) / "orchestrator"
    if not is_stable(directory):
        raise ValueError(f"resume_step={step}: no complete orchestrator state at {directory} (missing {STABLE})")
    verify_stable(directory)
    state = json.loads((directory / "state.json").read_text())
    if state["step"] != step:
        raise ValueError(f"resume_step={step}: {directory}/state.json is for step {state['step']}")
    return state


def restore_samplers(state: dict, samplers: list[Sampler], configs: list | None = None) -> list[Sampler]:
    """Samplers positioned as saved; the environments must have the same task counts, seeds and sampler types
    (`configs`, each [[env]]'s sampler; default: epoch samplers)."""
    saved = state["samplers"]
    if len(saved) != len(samplers):
        raise ValueError(f"the saved state has {len(saved)} environment samplers, the config {len(samplers)}")
    restored = []
    configs = configs or [EpochSampling()] * len(samplers)
    for i, (was, now, config) in enumerate(zip(saved, samplers, configs)):
        if (was["num_tasks"], was["seed"]) != (now.num_tasks, now.seed):
            raise ValueError(
                f"env {i}: saved sampler had {was['num_tasks']} tasks with seed {was['seed']}, the config gives "
                f"{now.num_tasks} tasks with seed {now.seed}; resume with the same [[env]] args and seed"
            )
        restored.append(restored_sampler(config, was))
    return restored


def pending_groups(state: dict, samplers: list[Sampler]) -> list[tuple[int, int]]:
    """The saved groups not yet trained, as (environment, task); each must name a task the config has."""
    pending = []
    for entry in state.get("pending", []):
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(x) is int for x in entry)
                and 0 <= entry[0] < len(samplers) and 0 <= entry[1] < samplers[entry[0]].num_tasks):
            raise ValueError(f"the saved state's pending group {entry!r} names no task of the configured environments")
        pending.append((entry[0], entry[1]))
    return pending
