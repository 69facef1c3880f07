"""LR schedules and gradient clipping of the trainer's optimizer."""

import pytest
import torch

from rl.trainer.config import OptimConfig
from rl.trainer.optim import build_optimizer, build_scheduler, clip_gradients, lr_factor


def lrs(config: OptimConfig, max_steps: int) -> list[float]:
    model = torch.nn.Linear(2, 1)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, max_steps)
    out = []
    for _ in range(max_steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_constant_and_warmup():
    assert lrs(OptimConfig(lr=1.0), 3) == [1.0, 1.0, 1.0]
    # warmup 4: (k + 1) / 4 for k = 0..3, then the peak
    assert lrs(OptimConfig(lr=2.0, warmup_steps=4), 6) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0])


def test_linear_decay_after_warmup():
    # warmup 2 then decay over the remaining 4 steps to the floor 0.2: p = 0, 1/4, 1/2, 3/4
    # 0.2 + 0.8 * (1 - p) = 1.0, 0.8, 0.6, 0.4
    config = OptimConfig(lr=1.0, warmup_steps=2, schedule="linear", min_lr_ratio=0.2)
    assert lrs(config, 6) == pytest.approx([0.5, 1.0, 1.0, 0.8, 0.6, 0.4])


def test_cosine_decay():
    # p = 0, 1/4, 1/2, 3/4: (1 + cos(pi p)) / 2 = 1, 0.853553, 0.5, 0.146447
    assert lrs(OptimConfig(lr=1.0, schedule="cosine"), 4) == pytest.approx([1.0, 0.853553, 0.5, 0.146447], abs=1e-6)
    assert lr_factor(10, OptimConfig(schedule="cosine", min_lr_ratio=0.1), 4) == pytest.approx(0.1)  # past the end


def test_scheduler_state_round_trips():
    config = OptimConfig(lr=1.0, schedule="linear")
    model = torch.nn.Linear(2, 1)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config, 4)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    restored = build_scheduler(build_optimizer(torch.nn.Linear(2, 1), config), config, 4)
    restored.load_state_dict(scheduler.state_dict())
    restored.step()
    assert restored.get_last_lr() == pytest.approx([0.25])  # step 3 of 4: 1 - 3/4


def test_max_grad_norm_clips_the_global_norm():
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, 4.0]])  # norm 5
    assert clip_gradients(model, max_norm=1.0) == pytest.approx(5.0)
    assert model.weight.grad.tolist() == [pytest.approx([0.6, 0.8])]


def test_the_optimizer_is_fused_and_steps_as_adamw_does():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    config = OptimConfig(lr=1e-2, weight_decay=0.1)
    optimizer = build_optimizer(model, config)
    assert optimizer.defaults["fused"] is True
    plain = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        for m in (model, reference):
            m.zero_grad()
            m(torch.ones(2, 4)).square().sum().backward()
        optimizer.step()
        plain.step()
    for fused, looped in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(fused, looped)
