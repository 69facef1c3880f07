"""The trainer for real under torchrun (gloo on CPU) on the tiny model, with fake batches written through
rl.protocol: FSDP over two ranks trains like one rank, and resuming from a checkpoint is bit-exact."""

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl.protocol import RunPaths, read_metrics, write_batch
from rl.samples import Sample
from rl.trainer.flops import matmul_params, train_flops
from tests.conftest import ROOT
from tests.integration.launched import free_port

pytestmark = pytest.mark.integration


def fake_samples(step: int, n: int = 8) -> list[Sample]:
    rng = random.Random(step)
    samples = []
    for _ in range(n):
        prompt, completion = rng.randint(3, 10), rng.randint(3, 20)
        mask = [0] * prompt + [1] * completion
        logprobs = [0.0] * prompt + [-rng.uniform(2.0, 6.0) for _ in range(completion)]
        ids = [rng.randint(4, 90) for _ in mask]
        samples.append(Sample(ids, mask, logprobs, rng.uniform(-1, 1), rng.random(), step))
    return samples


def write_batches(out: Path, steps: range, ranks: int) -> None:
    for step in steps:
        samples = fake_samples(step)
        # uneven on purpose: rank 0 holds 6 samples, rank 1 holds 2 (fewer micro-batches, empty ones added)
        per_rank = [samples] if ranks == 1 else [samples[:6], samples[6:]]
        write_batch(RunPaths(out), step, per_rank)


def run_trainer(model: Path, out: Path, ranks: int, max_steps: int, *extra: str, on_cuda: bool = False
                ) -> subprocess.CompletedProcess:
    """The trainer under torchrun; on the CPU (float32, gloo) unless `on_cuda`, also on a GPU host: these tests
    compare ranks and resumes at 1e-5 or bit for bit, which only float32 on the CPU holds. On the CPU as `rl`
    starts it there: torchrun's flags to rl.trainer.ranks, the ranks forked."""
    launcher = "torch.distributed.run" if on_cuda else "rl.trainer.ranks"
    cmd = [
        sys.executable, "-m", launcher, "--nproc-per-node", str(ranks),
        "--master-port", str(free_port()), "-m", "rl.trainer.main", "--model.name", str(model),
        "--output-dir", str(out), "--max-steps", str(max_steps),
        "--seq-len", "48", "--optim.lr", "1e-3", "--batch-timeout-s", "60", *extra,
    ]
    env = os.environ if on_cuda else os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def train(model: Path, out: Path, ranks: int, max_steps: int, *extra: str, on_cuda: bool = False) -> None:
    proc = run_trainer(model, out, ranks, max_steps, *extra, on_cuda=on_cuda)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(RunPaths(out)) if m["process"] == "trainer"}


def weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(RunPaths(out).weights(step) / "model.safetensors"))


def test_two_ranks_train_like_one(tiny_model, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    write_batches(one, range(1), ranks=1)
    write_batches(two, range(1), ranks=2)
    train(tiny_model, one, 1, 1)
    forked = run_trainer(tiny_model, two, 2, 1)
    assert forked.returncode == 0, forked.stdout[-3000:] + forked.stderr[-3000:]
    # torchrun's one OpenMP thread per rank holds in ranks forked after OpenMP read the environment
    assert re.findall(r"rank \d/2 on cpu \(gloo, (\d+) torch threads\)", forked.stdout + forked.stderr) == ["1", "1"]
    assert losses(one)[0] == pytest.approx(losses(two)[0], rel=1e-5, abs=1e-7)
    base = load_file(str(next(tiny_model.glob("*.safetensors"))))
    w1, w2 = weights(one, 1), weights(two, 1)
    for name, t in w1.items():
        assert torch.allclose(t, w2[name], atol=1e-6, rtol=0), name
    moved = max((w1[n] - base[n]).abs().max().item() for n in base)
    assert moved > 1e-4, "the step did not move the weights: the comparison above proves nothing"
    # model FLOPs counted on the sharded model (tied head once, no embedding lookup) as on the unsharded one
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    expected = train_flops(matmul_params(model), model.config.num_hidden_layers, model.config.hidden_size,
                           [len(s.input_ids) for s in fake_samples(0)])
    for out in (one, two):
        assert next(m["flops"] for m in read_metrics(RunPaths(out)) if m["process"] == "trainer") == expected


@pytest.mark.parametrize("ranks", [1, 2])  # one rank keeps the model as one FSDP group (trainer/model.py)
def test_resume_from_checkpoint_is_bit_exact(tiny_model, tmp_path, ranks):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # seq_len 48 with 8 samples of up to 30 tokens: several micro-batches per step, so gradients accumulate
    schedule = ("--optim.schedule", "cosine", "--optim.warmup-steps", "1", "--ckpt.interval", "2")
    write_batches(straight, range(4), ranks=ranks)
    train(tiny_model, straight, ranks, 4, *schedule)
    write_batches(resumed, range(2, 4), ranks=ranks)
    shutil.copytree(RunPaths(straight).checkpoint(2), RunPaths(resumed).checkpoint(2))
    # the resumed run writes its weights in the background: they must equal the ones written at once
    train(tiny_model, resumed, ranks, 4, *schedule, "--resume-step", "2", "--publish-in-background")
    expected, got = losses(straight), losses(resumed)
    assert sorted(got) == [2, 3]
    assert [got[2], got[3]] == [expected[2], expected[3]]
    lrs = {m["step"]: m["lr"] for m in read_metrics(RunPaths(resumed)) if m["process"] == "trainer"}
    assert lrs[2] == next(m["lr"] for m in read_metrics(RunPaths(straight)) if m["step"] == 2)
    for name, t in weights(straight, 4).items():
        assert torch.equal(t, weights(resumed, 4)[name]), name


def test_a_step_is_logged_before_its_checkpoint(tiny_model, tmp_path):
    """A resume from checkpoint k never runs step k - 1 again, so its metrics record must be written before the
    checkpoint is: here the record cannot be written (metrics.jsonl is a directory), and no checkpoint may follow."""
    write_batches(tmp_path, range(2), ranks=1)
    RunPaths(tmp_path).metrics.mkdir()
    proc = run_trainer(tiny_model, tmp_path, 1, 2, "--ckpt.interval", "1")
    assert proc.returncode != 0 and "IsADirectoryError" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert RunPaths(tmp_path).checkpoint_steps("trainer") == []


@pytest.mark.gpu
def test_bf16_mixed_precision_with_activation_checkpointing(tiny_model, tmp_path):
    out = tmp_path / "bf16"
    write_batches(out, range(2), ranks=1)
    train(tiny_model, out, 1, 2, "--dtype", "bfloat16", "--activation-checkpointing", on_cuda=True)
    assert all(0 < abs(loss) < 10 for loss in losses(out).values()), losses(out)
    final, base = weights(out, 2), load_file(str(next(tiny_model.glob("*.safetensors"))))
    assert all(t.dtype == torch.bfloat16 for t in final.values())  # published as vLLM's auto dtype serves it
    assert any(not torch.equal(final[n], base[n]) for n in base)


@pytest.mark.gpu
def test_two_cuda_ranks_train_like_one_in_bf16_with_activation_checkpointing(tiny_model, tmp_path):
    """NCCL FSDP2 over 2 GPUs equals 1 GPU within bf16: the fp32 master weights differ only by the reduction's order
    (~1e-6 relative), so a published bf16 weight differs by at most one rounding step (2^-8 relative) where the two
    masters straddle a rounding boundary, which few elements do."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    bf16 = ("--dtype", "bfloat16", "--activation-checkpointing")
    one, two = tmp_path / "one", tmp_path / "two"
    write_batches(one, range(2), ranks=1)
    write_batches(two, range(2), ranks=2)
    train(tiny_model, one, 1, 2, *bf16, on_cuda=True)
    train(tiny_model, two, 2, 2, *bf16, on_cuda=True)
    for step, loss in losses(one).items():
        assert losses(two)[step] == pytest.approx(loss, rel=2e-2, abs=1e-3), step
    base = load_file(str(next(tiny_model.glob("*.safetensors"))))
    w1, w2 = weights(one, 2), weights(two, 2)
    differing = 0
    for name, t in w1.items():
        a, b = t.float(), w2[name].float()
        assert torch.allclose(a, b, rtol=2**-7, atol=1e-6), name  # one bf16 step, with margin
        differing += (a != b).sum().item()
    assert differing <= 0.01 * sum(t.numel() for t in w1.values()), differing
    assert any(not torch.equal(w1[n], base[n].to(w1[n].dtype)) for n in base), "the steps did not move the weights"


def test_a_tokenizer_without_pad_token_pads_and_fills_with_eos(tiny_model, tmp_path):
    """Llama-3 and others have no pad token: with ranks holding unequal micro-batch counts (6 and 2 samples),
    padded rows and the empty micro-batches are filled with eos, masked, so the step equals the one with a pad
    token. Padding at 2 samples per micro-batch: rows are padded, and rank 1 runs 2 empty micro-batches."""
    from transformers import AutoTokenizer

    no_pad = tmp_path / "no_pad_model"
    shutil.copytree(tiny_model, no_pad)
    tokenizer = AutoTokenizer.from_pretrained(no_pad)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(no_pad)
    assert AutoTokenizer.from_pretrained(no_pad).pad_token_id is None
    padding = ("--packing", "false", "--micro-batch-size", "2")
    runs = {"pad": (tiny_model, padding), "no_pad": (no_pad, padding), "no_pad_packed": (no_pad, ())}
    for name, (model, extra) in runs.items():
        write_batches(tmp_path / name, range(1), ranks=2)
        train(model, tmp_path / name, 2, 1, *extra)
    assert losses(tmp_path / "no_pad")[0] == losses(tmp_path / "pad")[0]
    for name, t in weights(tmp_path / "pad", 1).items():
        assert torch.equal(t, weights(tmp_path / "no_pad", 1)[name]), name
    assert losses(tmp_path / "no_pad_packed")[0] == pytest.approx(losses(tmp_path / "pad")[0], rel=1e-5)
