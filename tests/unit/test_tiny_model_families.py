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


@pytest.mark.parametrize("arch", ARCHS)
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
    with pytest.raises(ValueError, match="choose from qwen3, qwen3_moe, llama, qwen2, gemma3, qwen3_5, qwen3_5_moe"):
        build_tiny_model(tmp_path / "x", arch="mistral")
