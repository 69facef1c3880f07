"""Trainer checkpoints: model and optimizer with torch.distributed.checkpoint (sharded, every rank writes
its part), plus step, LR scheduler and RNG state (JSON per rank), under checkpoints/step_k/trainer/,
keeping the last `keep`."""

from __future__ import annotations

import json
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rl.config import CkptConfig
from rl.protocol import STABLE, RunPaths, atomic_write_text, is_stable, mark_stable, verify_stable
from rl.trainer.world import World


class Checkpointer:
    def __init__(self, paths: RunPaths, config: CkptConfig, world: World):
        self.paths = paths
        self.config = config
        self.world = world

    def directory(self, step: int):
        return self.paths.checkpoint(step) / "trainer"

    def save(self, step: int, model, optimizer, scheduler) -> None:
        """Collective: every rank writes its shards; rank 0 marks the step complete and prunes."""
        target = self.directory(step)
        if self.world.is_main and target.exists():
            shutil.rmtree(target)
        self.world.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))
        meta = {"step": step, "rng": {"torch": torch.get_rng_state().tolist()}, "scheduler": scheduler.state_dict()}
        atomic_write_text(target / f"rank_{self.world.rank}.json", json.dumps(meta))
        self.world.barrier()
        if self.world.is_main:
            mark_stable(target, step=step)
            self.prune()

    def load(self, step: int, model, optimizer, scheduler) -> None:
        target = self.directory(step)
        if not is_stable(target):
            raise FileNotFoundError(f"trainer checkpoint {target} is missing or incomplete (no {STABLE})")
        verify_stable(target)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(target))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        meta = json.loads((target / f"rank_{self.world.rank}.json").read_text())
        if meta["step"] != step:
            raise ValueError(f"trainer checkpoint {target} holds step {meta['step']}, not {step}")
        scheduler.load_state_dict(meta["scheduler"])
        torch.set_rng_state(torch.tensor(meta["rng"]["torch"], dtype=torch.uint8))
        self.world.barrier()

    def prune(self) -> None:
        """Delete trainer checkpoints older than the newest `keep` complete ones (both parts written)."""
        self.paths.prune_checkpoint_parts("trainer", self.config.keep)

