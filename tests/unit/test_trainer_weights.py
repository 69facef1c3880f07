"""Weight publication: shards of at most the configured size with a Hugging Face index, cast to the served
dtype, the step's own weights even when written in the background, the directory complete or absent."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rl.protocol import RunPaths, verify_stable
from rl.trainer.weights import WeightPublisher, shard_plan

ONE_RANK = SimpleNamespace(rank=0, world_size=1, is_main=True)


def publisher_for(
    model_dir, paths: RunPaths, dtype=torch.float32, shard_bytes=2**30, background=False
) -> WeightPublisher:
    config, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    return WeightPublisher(paths, config, tokenizer, ONE_RANK, dtype, shard_bytes, background)


class Embedding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(64, 64)
        torch.nn.init.ones_(self.model.embed_tokens.weight)


def test_background_write_keeps_the_step_weights_and_appears_complete(tiny_model, tmp_path):
    paths = RunPaths(tmp_path)
    publisher = publisher_for(tiny_model, paths, background=True)
    model = Embedding()
    publisher.publish(1, model)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3)  # the optimizer's next in-place update, while the write may still run
    publisher.publish(2, model)  # waits for step 1 first
    publisher.close()
    for step, value in ((1, 1.0), (2, 3.0)):
        verify_stable(paths.weights(step))
        written = load_file(str(paths.weights(step) / "model.safetensors"))
        assert torch.equal(written["model.embed_tokens.weight"], torch.full((64, 64), value))
        assert torch.equal(written["lm_head.weight"], torch.full((64, 64), value))  # tied head written too


def test_a_failed_background_write_is_raised(tiny_model, tmp_path):
    (tmp_path / "weights").write_text("a file where the weights directory belongs")
    publisher = publisher_for(tiny_model, RunPaths(tmp_path), background=True)
    with pytest.raises(OSError):
        publisher.publish(1, Embedding())
        publisher.close()


def test_shard_plan_keeps_order_and_size():
    sizes = [("a", 4), ("b", 4), ("c", 9), ("d", 1), ("e", 3)]
    assert shard_plan(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert shard_plan(sizes, 100) == [["a", "b", "c", "d", "e"]]


def test_a_sharded_bf16_step_loads_like_the_model(tiny_model, tmp_path):
    """Shards of at most the size asked for, an index, ~2 bytes per parameter in bf16, and from_pretrained
    gives the trainer's weights back (cast to bf16)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    paths = RunPaths(tmp_path)
    shard_bytes = params * 2 // 3  # bf16 -> at least 3 shards
    publisher = publisher_for(tiny_model, paths, torch.bfloat16, shard_bytes)
    publisher.publish(1, model)
    publisher.close()
    step = paths.weights(1)
    verify_stable(step)
    shards = sorted(step.glob("*.safetensors"))
    index = json.loads((step / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    written = sum(p.stat().st_size for p in shards)
    head = model.lm_head.weight.numel()  # the tied head is written as its own tensor
    assert 2 * (params + head) <= written < 2 * (params + head) * 1.05
    loaded = AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.bfloat16().float()), name


def test_a_step_is_marked_with_the_writers_crcs_without_reading_a_shard_again(tmp_path, monkeypatch):
    """Each writer takes its shard's CRC-32 as it writes it; rank 0 marks the step from the writers' records and
    reads no shard back (here: reading one would fail)."""
    import rl.manifest
    from rl.trainer.weights import publish_step, single_process_shards

    real_crc = rl.manifest.file_crc32

    def crc_of_small_files_only(path):
        assert not str(path).endswith(".safetensors"), f"{path} was read again to mark the step"
        return real_crc(path)

    monkeypatch.setattr(rl.manifest, "file_crc32", crc_of_small_files_only)
    state = {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)}
    paths = RunPaths(tmp_path / "run")
    side = {"config.json": b"{}"}
    publish_step(paths, 1, single_process_shards(state, 2 * 64 * 64 * 4), side)  # two tensors per shard
    monkeypatch.setattr(rl.manifest, "file_crc32", real_crc)
    manifest = verify_stable(paths.weights(1))  # every recorded CRC-32 is the file's
    assert sorted(manifest) == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                "model.safetensors.index.json"]  # the writers' records are gone
