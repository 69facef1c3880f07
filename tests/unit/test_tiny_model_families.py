"""`tiny-model --arch`: each family users bring, built offline with the local tokenizer, in the layout and with the
traits of the real family (what publish, reload and verification must handle), and trainable by transformers."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rl.tiny_model import ARCHS, build_tiny_model

TRAITS = {  # model_type, tied head, q/k/v biases, q/k norms, experts per layer
    "qwen3": ("qwen3", True, False, True, 0),
    "qwen3_moe": ("qwen3_moe", True, False, True, 8),
    "llama": ("llama", False, False, False, 0),
    "qwen2": ("qwen2", True, True, False, 0),
    "gemma3": ("gemma3_text", True, False, True, 0),
    "qwen3_5": ("qwen3_5_text", True, False, True, 0),
    "qwen3_5_moe": ("qwen3_5_moe_text", True, False, True, 8),
}


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if arch != "qwen3_5_vl"])
def test_each_family_is_built_with_its_traits_and_trains_a_step(arch, tmp_path):
    out = build_tiny_model(tmp_path / arch, arch=arch)
    config = json.loads((out / "config.json").read_text())
    model_type, tied, biases, qk_norms, experts = TRAITS[arch]
    assert config["model_type"] == model_type and config["tie_word_embeddings"] is tied
    assert config["hidden_size"] % 32 == 0 and config["hidden_size"] // config["num_attention_heads"] >= 32
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) is not tied  # a tied head is the embedding, not a tensor of its own
    attention = config.get("layer_types", ["full_attention"]).index("full_attention")  # Qwen3.5: the 4th layer
    assert (f"model.layers.{attention}.self_attn.q_proj.bias" in names) is biases
    assert (f"model.layers.{attention}.self_attn.q_norm.weight" in names) is qk_norms
    assert sum(n.startswith("model.layers.0.mlp.experts.") for n in names) > 0 if experts else not any(
        ".experts." in n for n in names)
    if experts:
        # transformers 5 writes num_local_experts (and reads num_experts, the hub's name, as it)
        assert config.get("num_experts", config.get("num_local_experts")) == experts
        assert config["num_experts_per_tok"] == 2
    if arch == "gemma3":
        assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]  # both kinds, in 4 layers
    if arch.startswith("qwen3_5"):  # Gated DeltaNet in three layers of four, its every tensor in the files
        assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        gdn = {"A_log", "dt_bias", "conv1d.weight", "norm.weight", "in_proj_qkv.weight", "in_proj_z.weight",
               "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight"}
        assert {f"model.layers.0.linear_attn.{n}" for n in gdn} <= names
        assert ("model.layers.0.mlp.shared_expert_gate.weight" in names) is bool(experts)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, config["vocab_size"], (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert json.loads((out / "tiny_model.json").read_text())["arch"] == arch


def test_an_unknown_family_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="choose from qwen3, qwen3_moe, llama, qwen2, gemma3, qwen3_5, qwen3_5_moe, "
                                         "qwen3_5_vl"):
        build_tiny_model(tmp_path / "x", arch="mistral")


def test_qwen3_5_with_its_vision_tower_is_laid_out_as_its_checkpoints_and_trains_on_an_image(tmp_path):
    """`qwen3_5_vl`: Qwen3_5ForConditionalGeneration (the text model under `model.language_model`, the vision tower
    under `model.visual`, a tied head), 3-D rotary sections that fill its 16 frequencies, and the image processor's
    settings beside it: an image from its own processor goes through a forward and backward."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    out = build_tiny_model(tmp_path / "vl", arch="qwen3_5_vl")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["tie_word_embeddings"]
    assert config["text_config"]["rope_parameters"]["mrope_section"] == [6, 5, 5]  # 16 frequencies of head_dim 32
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.linear_attn.A_log" in names and "lm_head.weight" not in names
    assert "model.visual.blocks.0.attn.qkv.weight" in names and "model.visual.merger.linear_fc2.weight" in names
    processor = AutoImageProcessor.from_pretrained(out)
    pixels = processor(images=[Image.new("RGB", (64, 96), "blue")], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 6, 4]]  # 6 x 4 patches of 16 pixels: 6 tokens
    model = AutoModelForImageTextToText.from_pretrained(out)
    pad = config["image_token_id"]
    ids = torch.tensor([[config["vision_start_token_id"], *[pad] * 6, config["vision_end_token_id"], 40, 41]])
    loss = model(input_ids=ids, labels=ids, mm_token_type_ids=(ids == pad).int(), **pixels).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.visual.blocks[0].attn.qkv.weight.grad is not None
