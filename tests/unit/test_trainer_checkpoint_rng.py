"""Trainer checkpoints restore the CUDA generators as well as the CPU one (a resumed GPU run draws what the
uninterrupted one would), and a checkpoint written before CUDA states were saved still loads. CUDA is faked:
torch.cuda's availability and RNG functions are monkeypatched and their calls recorded."""

import json
import sys

import torch

from rl.config import CkptConfig
from rl.protocol import RunPaths, mark_stable
from rl.trainer.checkpoint import Checkpointer
from tests.unit.test_bad_input import one_rank_world, small_training_state  # noqa: F401 (a fixture)

MODULE = Checkpointer.__module__


class FakeCuda:
    """Two devices whose generator states are byte tensors; set_rng_state_all records what it is given."""

    def __init__(self, monkeypatch):
        self.states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
        self.restored: list[list[torch.Tensor]] = []
        # CUDA is reported to rl.trainer.checkpoint alone: torch.distributed.checkpoint's writer would use streams
        monkeypatch.setattr(torch.cuda, "is_available", lambda: sys._getframe(1).f_globals["__name__"] == MODULE)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: self.restored.append(list(states)))


def test_cuda_rng_states_are_saved_and_restored(tmp_path, one_rank_world, monkeypatch):  # noqa: F811
    cuda = FakeCuda(monkeypatch)
    checkpointer = Checkpointer(RunPaths(tmp_path / "run"), CkptConfig(), one_rank_world)
    model, optimizer, scheduler = small_training_state()
    saved = cuda.states
    checkpointer.save(2, model, optimizer, scheduler)
    cuda.states = [torch.zeros(16, dtype=torch.uint8)] * 2  # the generators move on after the save
    torch.manual_seed(123)
    checkpointer.load(2, model, optimizer, scheduler)
    assert len(cuda.restored) == 1
    assert [s.tolist() for s in cuda.restored[0]] == [s.tolist() for s in saved]
    assert all(s.dtype == torch.uint8 for s in cuda.restored[0])


def test_a_checkpoint_without_cuda_rng_states_loads(tmp_path, one_rank_world, monkeypatch):  # noqa: F811
    """A checkpoint written before CUDA states were saved: its rank file holds the CPU state alone."""
    checkpointer = Checkpointer(RunPaths(tmp_path / "run"), CkptConfig(), one_rank_world)
    model, optimizer, scheduler = small_training_state()
    checkpointer.save(2, model, optimizer, scheduler)
    expected = torch.rand(3)  # what the generator draws after the save
    rank_file = checkpointer.directory(2) / "rank_0.json"
    meta = json.loads(rank_file.read_text())
    meta["rng"] = {"torch": meta["rng"]["torch"]}  # the old format
    rank_file.write_text(json.dumps(meta))
    mark_stable(checkpointer.directory(2), step=2)
    cuda = FakeCuda(monkeypatch)  # a CUDA host now: nothing to restore there, and no error
    checkpointer.load(2, model, optimizer, scheduler)
    assert cuda.restored == []
    assert torch.equal(torch.rand(3), expected)  # the CPU generator is restored
