"""Trainer checkpoints: model (with LoRA: the adapter alone) and optimizer with torch.distributed.checkpoint
(sharded, every rank writes its part), plus step, LR scheduler and RNG state (CPU and, with CUDA, every
device's; JSON per rank), under checkpoints/step_k/trainer/, keeping the last `keep`.

Trust boundary: a checkpoint is data, never code. Its files are checked against their STABLE marker, but
whoever can rewrite a file of the run directory can rewrite the marker too, so the two places where
torch.distributed.checkpoint unpickles are made safe: the `.metadata` file is unpickled with only the
classes checkpoint metadata is made of (`MetadataUnpickler`), and non-tensor values (the optimizer's
hyperparameters) with `torch.load(weights_only=True)` (`SafeLoadPlanner`). The rank JSON files are JSON.
"""

from __future__ import annotations

import enum
import io
import json
import pickle
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint._traverse import set_element

from rl.config import CkptConfig
from rl.protocol import STABLE, RunPaths, atomic_write_text, is_stable, mark_stable, verify_stable
from rl.trainer.optim import state_on_device
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
        with state_on_device(optimizer):  # an offloaded state is saved from where it computes
            model_state, optim_state, _ = checkpoint_state(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target))
        meta = {"step": step, "rng": rng_state(), "scheduler": scheduler.state_dict()}
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
        with state_on_device(optimizer):  # and loaded there, then offloaded again
            model_state, optim_state, options = checkpoint_state(model, optimizer)
            state = {"model": model_state, "optim": optim_state}
            reader = SafeFileSystemReader(str(target))
            reader.read_metadata()  # refused here with its reason; inside dcp.load it reads as "metadata not found"
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
            )
        meta = json.loads((target / f"rank_{self.world.rank}.json").read_text())
        if meta["step"] != step:
            raise ValueError(f"trainer checkpoint {target} holds step {meta['step']}, not {step}")
        scheduler.load_state_dict(meta["scheduler"])
        set_rng_state(meta["rng"])
        self.world.barrier()

    def prune(self) -> None:
        """Delete trainer checkpoints older than the newest `keep` complete ones (both parts written)."""
        self.paths.prune_checkpoint_parts("trainer", self.config.keep)


def rng_state() -> dict:
    """The CPU generator's state and, with CUDA, the state of this rank's device (the one it computes on; asking
    every visible device would open a CUDA context on each, from every rank): a resumed run draws what the
    uninterrupted one would. Lists of bytes, for the rank's JSON file."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()` (the CUDA state onto this rank's device). A checkpoint written before CUDA states were
    saved, or on a host without CUDA, restores the CPU generator alone."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def checkpoint_state(model, optimizer) -> tuple[dict, dict, StateDictOptions]:
    """What a checkpoint holds: the model's state and the optimizer's. With LoRA only the trained parameters (A
    and B) and their optimizer state: the frozen base model is its own files, and being absent it is not
    required on load. (torch's `ignore_frozen_params` keeps a tied head, which it does not see as frozen.)"""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = len(trained) < len(list(model.parameters()))
    options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if frozen:
        model_state = {name: value for name, value in model_state.items() if name in trained}
    return model_state, optim_state, options


def metadata_enum_member(cls: object, name: object) -> enum.Enum:
    """What a pickle's `getattr(cls, name)` may build here: a member of one of the metadata's enums, by name. Python
    3.11.0-3.11.4 (Debian 12's 3.11.2 among them) pickle an enum member so (later ones by value: its class called)."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ == dcp_metadata.__name__
            and isinstance(name, str) and name in cls.__members__):
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not part of a checkpoint's metadata; refusing it")


class MetadataUnpickler(pickle.Unpickler):
    """Builds only what a checkpoint's metadata is made of: torch.distributed.checkpoint's metadata types,
    its storage info, tensor sizes, dtypes and layouts, and paths."""

    ALLOWED = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return metadata_enum_member
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata; refusing to load it")


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as metadata_file:
            metadata = MetadataUnpickler(metadata_file).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"{self.path}: .metadata holds {type(metadata).__name__}, not Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
