"""The trainer with LoRA for real under torchrun (gloo on CPU) on the tiny model: what it publishes each step
(a PEFT adapter under STABLE with its checksum, or merged weights), two ranks like one, and resume."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rl.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, DEFAULT_TARGETS, adapter_checksum, tensor_name
from rl.listed_files import verify_stable
from rl.manifest import STABLE
from rl.protocol import RunPaths, read_metrics
from rl.trainer.checkpoint import SafeFileSystemReader
from tests.integration.test_trainer import losses, train, weights, write_batches

pytestmark = pytest.mark.integration

LORA = ("--lora.rank", "4", "--lora.alpha", "8", "--optim.lr", "1e-2", "--loss.beta", "0.05")


def adapter(out, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(RunPaths(out).weights(step) / ADAPTER_WEIGHTS))


def trainer_metrics(out) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(RunPaths(out)) if m["process"] == "trainer"}


def test_lora_steps_publish_adapters_two_ranks_like_one_and_merged_weights_agree(tiny_model, tmp_path):
    one, two, merged = tmp_path / "one", tmp_path / "two", tmp_path / "merged"
    write_batches(one, range(2), ranks=1)
    write_batches(two, range(2), ranks=2)
    write_batches(merged, range(2), ranks=1)
    train(tiny_model, one, 1, 2, *LORA)
    train(tiny_model, two, 2, 2, *LORA)
    train(tiny_model, merged, 1, 2, *LORA, "--lora.publish-merged", "true")

    # each step of the adapter runs is a PEFT adapter under an exact STABLE manifest that records its checksum
    for step in range(3):
        directory = RunPaths(one).weights(step)
        assert sorted(verify_stable(directory)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        marker = json.loads((directory / STABLE).read_text())
        assert marker["adapter_checksum"] == adapter_checksum(adapter(one, step).items())
        if step:
            assert trainer_metrics(one)[step - 1]["adapter_checksum"] == marker["adapter_checksum"]
    config = json.loads((RunPaths(one).weights(1) / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == sorted(DEFAULT_TARGETS)
    a0, a2 = adapter(one, 0), adapter(one, 2)
    q_a = tensor_name("model.layers.0.self_attn.q_proj", "A")
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    assert a0[q_a].shape == (4, 128) and len(a0) == layers * 7 * 2  # 7 projections per layer, A and B each
    assert all(not t.any() for name, t in a0.items() if "lora_B" in name)  # step 0 is the base model
    assert all((a2[name] - a0[name]).abs().max() > 1e-5 for name in a0)  # A and B both moved by step 2

    # two ranks gather the adapter one rank has. Step 2 within 0.5% of one step's update (lr 1e-2): Adam divides
    # by sqrt(v), so the ~1e-7 differences of a gradient reduced in another order grow where gradients are tiny
    for step, atol in ((0, 0), (1, 1e-6), (2, 5e-5)):
        one_rank, two_ranks = adapter(one, step), adapter(two, step)
        for name, t in one_rank.items():
            torch.testing.assert_close(two_ranks[name], t, rtol=0, atol=atol, msg=f"step {step}: {name}")
    assert losses(one)[1] == pytest.approx(losses(two)[1], rel=1e-5, abs=1e-7)
    # the KL penalty's reference is the base model: zero while B = 0, then not
    metrics = trainer_metrics(one)
    assert metrics[0]["ref_kl"] == 0 and metrics[1]["ref_kl"] > 0

    # merged publishing: the same run's weights are W + (alpha / r) B A, every other tensor the base model's
    base = load_file(str(next(tiny_model.glob("*.safetensors"))))
    full = weights(merged, 2)
    assert losses(merged) == losses(one)
    for name, tensor in base.items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in DEFAULT_TARGETS:
            update = 2.0 * a2[tensor_name(module, "B")] @ a2[tensor_name(module, "A")]
            torch.testing.assert_close(full[name], tensor + update, rtol=0, atol=1e-6, msg=name)
            assert update.abs().max() > 1e-6, name
        else:
            assert torch.equal(full[name], tensor), name
    assert not (RunPaths(merged).weights(0)).exists()  # the base model is step 0: nothing to publish


def test_lora_resume_from_checkpoint_is_bit_exact_and_holds_the_adapter_only(tiny_model, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    schedule = ("--optim.schedule", "cosine", "--optim.warmup-steps", "1", "--ckpt.interval", "2",
                "--lora.dropout", "0.1")
    write_batches(straight, range(4), ranks=1)
    train(tiny_model, straight, 1, 4, *LORA, *schedule)
    write_batches(resumed, range(2, 4), ranks=1)
    shutil.copytree(RunPaths(straight).checkpoint(2), RunPaths(resumed).checkpoint(2))
    train(tiny_model, resumed, 1, 4, *LORA, *schedule, "--resume-step", "2", "--publish-in-background")
    expected, got = losses(straight), losses(resumed)
    assert [got[2], got[3]] == [expected[2], expected[3]]
    final = adapter(resumed, 4)
    assert all(torch.equal(t, adapter(straight, 4)[name]) for name, t in final.items())
    assert not RunPaths(resumed).weights(0).exists()  # a resumed run starts from its checkpointed step
    # the checkpoint holds A, B and their optimizer state: the frozen base model is its own files
    stored = SafeFileSystemReader(str(RunPaths(straight).checkpoint(2) / "trainer")).read_metadata().state_dict_metadata
    model_keys = {key.removeprefix("model.") for key in stored if key.startswith("model.")}
    assert model_keys and all(key.endswith((".lora_A", ".lora_B")) for key in model_keys), sorted(model_keys)[:5]
    assert len(model_keys) == len(final)


@pytest.mark.gpu
def test_lora_in_bf16_with_activation_checkpointing_on_cuda(tiny_model, tmp_path):
    """The GPU path (NCCL, bf16 compute over fp32 master weights, recomputed blocks): adapters train and publish
    in the dtype vLLM serves. `bash scripts/gpu-check.sh` runs it on a GPU host; skipped here."""
    out = tmp_path / "bf16"
    write_batches(out, range(2), ranks=1)
    train(tiny_model, out, 1, 2, *LORA, "--dtype", "bfloat16", "--activation-checkpointing", on_cuda=True)
    assert all(0 < abs(loss) < 10 for loss in losses(out).values()), losses(out)
    first, last = adapter(out, 0), adapter(out, 2)
    assert all(t.dtype == torch.bfloat16 for t in last.values())
    assert any(not torch.equal(last[n], first[n]) for n in first)
