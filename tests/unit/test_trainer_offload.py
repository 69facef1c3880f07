"""Optimizer state offload (`optim.offload`): a step with AdamW's moments kept in host memory equals a step
without, and between steps every moment is in its host buffer (on GPUs: on the CPU, pinned), during the step in
a copy on the device. On a CPU host the device is the CPU too, so there the check is the optimizer's own
bookkeeping: each state tensor's storage is its host buffer between steps and another allocation in the step."""

import random

import pytest
import torch
from torch.distributed.tensor import DTensor

from rl.config import CkptConfig, ModelConfig
from rl.host_memory import ALIGN_BYTES, HostArena
from rl.protocol import RunPaths
from rl.trainer.checkpoint import Checkpointer
from rl.trainer.config import OptimConfig, TrainerConfig
from rl.trainer.model import load_policy
from rl.trainer.optim import HostStateAdamW, build_optimizer, build_scheduler
from rl.trainer.step import train_step
from tests.unit.test_bad_input import one_rank_world  # noqa: F401 (a fixture)
from tests.unit.test_trainer_syncs import make_samples

STEPS = 3


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The local shards of every exp_avg and exp_avg_sq, in parameter order."""
    return [local(state[key]) for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]


def assert_in_host_buffers(optimizer: HostStateAdamW, device: torch.device) -> None:
    assert not optimizer.on_device
    held = {id(c.tensor): c for c in optimizer.offloaded}
    state = [local(s[k]) if not isinstance(s[k], DTensor) else s[k]._local_tensor
             for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert state and len(held) == len(state), "a moment is not in host memory"
    for tensor in state:
        copy = held[id(tensor)]
        assert tensor.device.type == "cpu" and tensor.data_ptr() == copy.host.data_ptr()
        assert copy.device == device and copy.host.is_pinned() == (device.type == "cuda")
        assert copy.host.untyped_storage().data_ptr() == optimizer.arena.buffer.untyped_storage().data_ptr()
    # one allocation of exactly the state's bytes (each tensor aligned), not one rounded up per tensor
    exact = sum(-(-t.numel() * t.element_size() // ALIGN_BYTES) * ALIGN_BYTES for t in state)
    assert optimizer.arena.buffer.untyped_storage().nbytes() == exact
    assert optimizer.arena.pinned == (device.type == "cuda")


def train(config: TrainerConfig, world, spy=None) -> tuple[list[torch.Tensor], torch.nn.Module, torch.optim.Optimizer]:
    """STEPS steps from the same seed and samples; `spy(optimizer)` after each. Returns the parameters' copies,
    the model and the optimizer."""
    torch.manual_seed(0)
    policy = load_policy(config, world)
    optimizer = build_optimizer(policy, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.max_steps)
    rng = random.Random(0)
    for _ in range(STEPS):
        train_step(policy, None, optimizer, scheduler, make_samples(3, rng), config, world, pad_id=0)
        if spy:
            spy(optimizer)
    return [local(p).detach().clone() for p in policy.parameters()], policy, optimizer


def config_for(model, offload: bool) -> TrainerConfig:
    return TrainerConfig(model=ModelConfig(name=str(model)), seq_len=32, micro_batch_size=1, dtype="float32",
                         optim=OptimConfig(lr=1e-3, offload=offload))


def run_offloaded_and_plain(tiny_model, world, monkeypatch):
    in_step = []

    def record_where_the_step_computes(optimizer, closure=None):
        buffers = {c.data_ptr() for c in optimizer.arena.tensors} if optimizer.arena else set()
        in_step.append(optimizer.on_device and not any(m.data_ptr() in buffers for m in moments(optimizer)))
        return plain_step(optimizer, closure)

    plain_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", record_where_the_step_computes)
    offloaded, model, optimizer = train(config_for(tiny_model, True), world,
                                        spy=lambda o: assert_in_host_buffers(o, world.device))
    monkeypatch.setattr(torch.optim.AdamW, "step", plain_step)
    plain, _, _ = train(config_for(tiny_model, False), world)
    assert isinstance(optimizer, HostStateAdamW)
    # the first step creates the state on the device; every later one fetches it from the host buffers
    assert in_step[1:] == [True] * (STEPS - 1)
    return offloaded, plain, model, optimizer


def test_offloaded_steps_equal_plain_steps_and_the_state_waits_in_host_buffers(tiny_model, one_rank_world,  # noqa: F811
                                                                               monkeypatch, tmp_path):
    offloaded, plain, model, optimizer = run_offloaded_and_plain(tiny_model, one_rank_world, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(offloaded, plain, strict=True))
    before = [m.clone() for m in moments(optimizer)]
    checkpointer = Checkpointer(RunPaths(tmp_path / "run"), CkptConfig(), one_rank_world)
    checkpointer.save(1, model, optimizer, build_scheduler(optimizer, OptimConfig(), 10))
    assert_in_host_buffers(optimizer, one_rank_world.device)
    for m in moments(optimizer):
        m.zero_()
    checkpointer.load(1, model, optimizer, build_scheduler(optimizer, OptimConfig(), 10))
    assert_in_host_buffers(optimizer, one_rank_world.device)
    assert all(torch.equal(a, b) for a, b in zip(moments(optimizer), before, strict=True))


def test_an_arena_is_pinned_once_at_its_exact_size_and_unpinned_when_closed(monkeypatch):
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, pointer, size, flags):
            calls.append(("register", pointer, size))
            return 0

        def cudaHostUnregister(self, pointer):
            calls.append(("unregister", pointer))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    arena = HostArena([(torch.Size([3, 5]), torch.float32), (torch.Size([7]), torch.bfloat16)], pin=True)
    assert [t.shape for t in arena.tensors] == [(3, 5), (7,)] and arena.buffer.numel() == 64 + 64
    assert [t.data_ptr() - arena.buffer.data_ptr() for t in arena.tensors] == [0, 64]
    assert calls == [("register", arena.buffer.data_ptr(), 128)] and arena.pinned
    arena.close()
    assert calls[-1] == ("unregister", arena.buffer.data_ptr()) and not arena.pinned


@pytest.mark.gpu
def test_on_cuda_offloaded_state_is_pinned_host_memory_between_steps_and_steps_match(tiny_model, one_rank_world,  # noqa: F811
                                                                                     monkeypatch):
    assert one_rank_world.device.type == "cuda"
    rounded_before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    offloaded, plain, _, _ = run_offloaded_and_plain(tiny_model, one_rank_world, monkeypatch)
    # registered where it was allocated, not taken from torch's caching host allocator (which rounds up)
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] == rounded_before
    for a, b in zip(offloaded, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
