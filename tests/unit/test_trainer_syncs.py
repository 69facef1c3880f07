"""A training step crosses from the device to the host a fixed, small number of times, never once per
micro-batch: on a GPU every `.item()`, `.tolist()`, `float(t)`, `int(t)` or `if t:` waits for the queued
kernels, so one per micro-batch stalls the pipeline. Counted on CPU with the real step of the tiny model."""

from __future__ import annotations

import math
import random
import sys
from collections import Counter

import pytest
import torch

from rl.config import ModelConfig
from rl.samples import Sample
from rl.trainer.attention import PACKED_SDPA
from rl.trainer.config import TrainerConfig
from rl.trainer.loss_config import LossConfig, MaskRatio, TruncateRatio
from rl.trainer.model import load_policy, load_reference
from rl.trainer.optim import build_optimizer, build_scheduler
from rl.trainer.step import train_step

SYNC_METHODS = ("item", "tolist", "__float__", "__int__", "__bool__")
SEQ_LEN = 32
SAMPLE_LEN = 20  # two samples do not fit a SEQ_LEN row, so packing makes one micro-batch per sample
# all_reduces of the step totals, the micro-batch count and the metric sums; the sums to the host; the grad norm
SYNCS_PER_STEP = 5
# transformers reads its mask inputs back once per forward (packed-sequence detection from the position ids,
# sdpa's is_causal shortcut for an all-ones padding mask): in its code, reached through trainer/model.py, not
# counted here.
OUTSIDE_THE_STEP = ("/transformers/masking_utils.py:",)


class SyncCounter:
    """Counts calls of the host-syncing Tensor methods, keyed by method and call site."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def wrap(self, name: str, original):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            self.calls[f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}"] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in SYNC_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self.wrap(name, getattr(torch.Tensor, name)))

    def step_calls(self) -> Counter[str]:
        return Counter({site: n for site, n in self.calls.items() if not any(p in site for p in OUTSIDE_THE_STEP)})


def make_samples(count: int, rng: random.Random) -> list[Sample]:
    """`count` samples of SAMPLE_LEN tokens: a 5-token prompt, then a completion that is trained on."""
    samples = []
    for _ in range(count):
        ids = [rng.randrange(10, 90) for _ in range(SAMPLE_LEN)]
        mask = [0] * 5 + [1] * (SAMPLE_LEN - 5)
        logprobs = [-rng.uniform(0.5, 5.0) * m for m in mask]
        samples.append(Sample(ids, mask, logprobs, rng.uniform(-1, 1), 0.0, 0))
    return samples


@pytest.mark.parametrize(
    "packing, loss",
    [
        (True, LossConfig(beta=0.1, mismatch=MaskRatio(max_log_ratio=2.0))),  # reference model, masked tokens
        (False, LossConfig(mismatch=TruncateRatio(cap=2.0))),  # padded micro-batches of one sample
    ],
)
def test_host_syncs_per_step_do_not_grow_with_micro_batches(tiny_model, world, monkeypatch, packing, loss):
    config = TrainerConfig(
        model=ModelConfig(name=str(tiny_model)), seq_len=SEQ_LEN, micro_batch_size=1, packing=packing, loss=loss
    )
    torch.manual_seed(0)
    policy = load_policy(config, world)
    assert policy.config._attn_implementation == PACKED_SDPA  # packed rows attended one sample at a time
    reference = load_reference(config, world, policy)
    optimizer = build_optimizer(policy, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.max_steps)
    rng = random.Random(0)

    def syncs_of_a_step(micro_batches: int) -> SyncCounter:
        counter = SyncCounter()
        with monkeypatch.context() as patch:
            counter.install(patch)
            stats = train_step(policy, reference, optimizer, scheduler, make_samples(micro_batches, rng), config,
                               world, pad_id=0)
        assert stats["micro_batches"] == micro_batches
        assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0  # a real step ran, with gradients
        return counter

    syncs_of_a_step(2)  # lazy initialisation (FSDP, optimizer state) happens once, in the first step
    few, many = syncs_of_a_step(2), syncs_of_a_step(6)
    assert few.step_calls() == many.step_calls(), (
        f"host syncs grow with the micro-batches: 2 give {dict(few.step_calls())}, 6 give {dict(many.step_calls())}"
    )
    # AdamW reads each parameter's step counter with .item(): a host tensor on GPUs too, so no device sync
    device_syncs = {site: n for site, n in few.step_calls().items() if "/torch/optim/" not in site}
    assert sum(device_syncs.values()) <= SYNCS_PER_STEP, f"host syncs in one step: {device_syncs}"
