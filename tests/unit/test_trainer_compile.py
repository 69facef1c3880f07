"""What torch.compile does with packed rows of varying length. Per-block compile (`trainer.compile`): steps of the
compiled model equal eager steps (fp32, CPU), the blocks are compiled (dynamo's counters move) and rows of new
lengths recompile at most once (to dynamic shapes). `attn_implementation = "flex_attention"`, which transformers
compiles: five row lengths cost at most two recompiles, and logprobs equal sdpa's (on CPU without gradients: torch
has no flex attention backward there; training steps on CUDA)."""

import random

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from rl.config import ModelConfig
from rl.samples import Sample
from rl.trainer.config import OptimConfig, TrainerConfig
from rl.trainer.data import build_micro_batches
from rl.trainer.model import forward_logprobs, load_policy
from rl.trainer.optim import build_optimizer, build_scheduler
from rl.trainer.step import train_step
from tests.unit.test_bad_input import one_rank_world  # noqa: F401 (a fixture)

ROW_LENGTHS = (24, 31, 40, 47, 56)  # one packed row per step, each step a new length


def samples_of(length: int, rng: random.Random) -> list[Sample]:
    """Two samples packed into one row of `length` tokens; each has a 4-token prompt."""
    samples = []
    for n in (length // 2, length - length // 2):
        ids = [rng.randrange(10, 90) for _ in range(n)]
        mask = [0] * 4 + [1] * (n - 4)
        samples.append(Sample(ids, mask, [-rng.uniform(0.5, 3.0) * m for m in mask], rng.uniform(-1, 1), 0.0, 0))
    return samples


def config_for(model, **fields) -> TrainerConfig:
    return TrainerConfig(model=ModelConfig(name=str(model)), seq_len=64, dtype="float32",
                         optim=OptimConfig(lr=1e-3), **fields)


def run_steps(config: TrainerConfig, world, lengths=ROW_LENGTHS) -> tuple[list[torch.Tensor], list[dict], list]:
    """One step per row length from the same seed and samples; returns each step's logprobs (before its update),
    its stats and the parameters after the last step."""
    torch.manual_seed(0)
    policy = load_policy(config, world)
    optimizer = build_optimizer(policy, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, config.max_steps)
    rng, logprobs, steps = random.Random(0), [], []
    for length in lengths:
        samples = samples_of(length, rng)
        (row,) = build_micro_batches(samples, [1.0] * len(samples), config.row_tokens, 1, True, 0)
        row = row.to(world.device)
        # with autograd on, as in training: a no_grad forward would be one more graph to compile
        logprobs.append(forward_logprobs(policy, row, config.temperature)[0].detach())
        stats = train_step(policy, None, optimizer, scheduler, samples, config, world, pad_id=0)
        assert stats["micro_batches"] == 1 and stats["grad_norm"] > 0
        steps.append(stats | {"frames_compiled": counters["frames"]["ok"]})  # dynamo's count so far
    return logprobs, steps, [p.full_tensor().detach().clone() for p in policy.parameters()]


def assert_close_lists(got: list[torch.Tensor], expected: list[torch.Tensor], atol: float) -> None:
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_compiled_blocks_train_as_eager_ones_with_one_recompile(tiny_model, one_rank_world, fresh_dynamo):  # noqa: F811
    eager_logprobs, eager_steps, eager_params = run_steps(config_for(tiny_model), one_rank_world, ROW_LENGTHS[:3])
    assert not fresh_dynamo["stats"], "the eager run compiled something"
    logprobs, steps, params = run_steps(config_for(tiny_model, compile=True), one_rank_world, ROW_LENGTHS[:3])
    assert steps[0]["frames_compiled"] >= 1, "no block was compiled"
    # three lengths: the first compiles static shapes, the second recompiles to dynamic ones, the third reuses them
    assert recompiles(steps) <= 1, [s["frames_compiled"] for s in steps]
    assert_steps_match(logprobs, steps, params, eager_logprobs, eager_steps, eager_params)


def recompiles(steps: list[dict]) -> int:
    """Frames dynamo compiled after the first step: each new row length that did not reuse a graph."""
    return steps[-1]["frames_compiled"] - steps[0]["frames_compiled"]


def assert_steps_match(logprobs, steps, params, eager_logprobs, eager_steps, eager_params, fp32=1e-5) -> None:
    """fp32: logprobs (each step's, so after the updates before it) to `fp32` absolute, loss and gradient norm to
    `fp32` relative. The parameters only to lr / 10: Adam moves a parameter by ~lr wherever its gradient is tiny,
    whatever the gradient's last bits (seen: 2 of 16k elements 1.9e-5 apart after 3 steps at lr 1e-3)."""
    assert_close_lists(logprobs, eager_logprobs, atol=fp32)
    for got, expected in zip(steps, eager_steps, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], rel=fp32, abs=1e-7)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=fp32)
    assert_close_lists(params, eager_params, atol=1e-4)


@pytest.mark.gpu
def test_on_cuda_compiled_blocks_with_activation_checkpointing_train_as_eager_ones(tiny_model, one_rank_world,  # noqa: F811
                                                                                  fresh_dynamo):
    """As on CPU, with what a GPU run has besides: activation checkpointing around the compiled blocks. fp32 to 1e-4:
    inductor's fused CUDA kernels sum in another order than eager's (seen on an H100: one logprob of 31 1.29e-5
    apart, the rest within 1e-5)."""
    assert one_rank_world.device.type == "cuda"
    eager = run_steps(config_for(tiny_model, activation_checkpointing=True), one_rank_world, ROW_LENGTHS[:3])
    compiled = run_steps(config_for(tiny_model, activation_checkpointing=True, compile=True), one_rank_world,
                         ROW_LENGTHS[:3])
    assert compiled[1][0]["frames_compiled"] >= 1 and recompiles(compiled[1]) <= 1
    assert_steps_match(*compiled, *eager, fp32=1e-4)



def score_rows(config: TrainerConfig, world, lengths=ROW_LENGTHS) -> tuple[list[torch.Tensor], list[int]]:
    """Logprobs of one packed row per length (no gradient: flex attention has no backward on CPU) and dynamo's
    count of compiled frames after each."""
    torch.manual_seed(0)
    policy = load_policy(config, world)
    rng, logprobs, frames = random.Random(0), [], []
    for length in lengths:
        samples = samples_of(length, rng)
        (row,) = build_micro_batches(samples, [1.0] * len(samples), config.row_tokens, 1, True, 0)
        with torch.no_grad():
            logprobs.append(forward_logprobs(policy, row.to(world.device), config.temperature)[0])
        frames.append(counters["frames"]["ok"])
    return logprobs, frames


def test_flex_attention_scores_packed_rows_of_five_lengths_as_sdpa_with_two_compiles_at_most(
    tiny_model, one_rank_world, fresh_dynamo  # noqa: F811
):
    sdpa, _ = score_rows(config_for(tiny_model), one_rank_world)
    flex, frames = score_rows(config_for(tiny_model, attn_implementation="flex_attention"), one_rank_world)
    assert frames[0] >= 1, "flex attention compiled nothing: it ran unfused"
    assert frames[-1] - frames[0] <= 2, frames
    assert_close_lists(flex, sdpa, atol=1e-5)


@pytest.mark.gpu
def test_on_cuda_flex_attention_trains_on_packed_rows_of_five_lengths_as_sdpa_with_two_recompiles_at_most(
    tiny_model, one_rank_world, fresh_dynamo  # noqa: F811
):
    """Different kernels on both sides: fp32 agreement to 1e-4."""
    assert one_rank_world.device.type == "cuda"
    sdpa = run_steps(config_for(tiny_model), one_rank_world)
    flex = run_steps(config_for(tiny_model, attn_implementation="flex_attention"), one_rank_world)
    assert flex[1][0]["frames_compiled"] >= 1 and recompiles(flex[1]) <= 2, [s["frames_compiled"] for s in flex[1]]
    assert_steps_match(*flex, *sdpa, fp32=1e-4)
