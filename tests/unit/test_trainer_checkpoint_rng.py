"""Trainer checkpoints restore the CUDA generator of the rank's device as well as the CPU one (a resumed GPU run
draws what the uninterrupted one would), and a checkpoint written before CUDA states were saved still loads. CUDA
is faked: torch.cuda's availability and RNG functions are monkeypatched and their calls recorded; the functions
for every device fail, since they would open a CUDA context on each visible device from every rank."""

import json
import sys

import pytest
import torch

from rl.config import CkptConfig
from rl.protocol import RunPaths, mark_stable
from rl.trainer.checkpoint import Checkpointer
from tests.unit.test_bad_input import one_rank_world, small_training_state  # noqa: F401 (a fixture)

MODULE = Checkpointer.__module__


class FakeCuda:
    """The rank's device, whose generator state is a byte tensor; set_rng_state records what it is given."""

    def __init__(self, monkeypatch):
        self.state = torch.arange(16, dtype=torch.uint8)
        self.restored: list[torch.Tensor] = []
        # CUDA is reported to rl.trainer.checkpoint alone: torch.distributed.checkpoint's writer would use streams
        monkeypatch.setattr(torch.cuda, "is_available", lambda: sys._getframe(1).f_globals["__name__"] == MODULE)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.state.clone())
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": self.restored.append(state))
        for every_device in ("get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, every_device, lambda *a: pytest.fail("a CUDA context on every device"))


def test_cuda_rng_states_are_saved_and_restored(tmp_path, one_rank_world, monkeypatch):  # noqa: F811
    cuda = FakeCuda(monkeypatch)
    checkpointer = Checkpointer(RunPaths(tmp_path / "run"), CkptConfig(), one_rank_world)
    model, optimizer, scheduler = small_training_state()
    saved = cuda.state
    checkpointer.save(2, model, optimizer, scheduler)
    cuda.state = torch.zeros(16, dtype=torch.uint8)  # the generator moves on after the save
    torch.manual_seed(123)
    checkpointer.load(2, model, optimizer, scheduler)
    assert len(cuda.restored) == 1
    assert cuda.restored[0].tolist() == saved.tolist() and cuda.restored[0].dtype == torch.uint8


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
