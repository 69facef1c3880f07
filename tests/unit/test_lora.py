"""LoRA in the trainer, in one process: the layer's arithmetic, which layers it adapts, what trains, and the
PEFT names it publishes under."""

import pytest
import torch
from torch import nn

from rl.adapter import adapter_checksum, next_vllm_rank, parse_tensor_name, tensor_name
from rl.config import ConfigError
from rl.trainer.config import OptimConfig, TrainerConfig
from rl.trainer.lora import (
    LoRALinear, adapter_tensors, adapters_disabled, apply_lora, init_lora, lora_parameter_names, merged_weight,
)
from rl.trainer.optim import build_optimizer, clip_gradients


def linear(out_features=6, in_features=5, bias=True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features, bias=bias).double()


def adapted(init_b) -> tuple[nn.Linear, LoRALinear, torch.Tensor]:
    """A base layer, its LoRA layer (rank 3, alpha 6: scaling 2) with random A and B set by `init_b`, an input."""
    base = linear()
    layer = LoRALinear(base, rank=3, alpha=6.0, dropout=0.0).double()
    nn.init.normal_(layer.lora_A)
    init_b(layer.lora_B)
    return base, layer, torch.randn(4, 5, dtype=torch.float64)


def test_zero_b_is_the_base_layer():
    base, layer, x = adapted(nn.init.zeros_)
    assert torch.equal(layer(x), base(x))


def test_random_b_is_the_merged_layer():
    base, layer, x = adapted(nn.init.normal_)
    merged = base.weight + 2.0 * layer.lora_B @ layer.lora_A  # scaling alpha / rank = 2
    torch.testing.assert_close(layer(x), x @ merged.T + base.bias, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_weight(layer, torch.float64), merged.detach(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(layer(x), base(x))
    with adapters_disabled(layer):
        assert torch.equal(layer(x), base(x))
    assert layer.enabled


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.v_proj, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        for block in self.layers:
            x = block.v_proj(block.q_proj(x)).relu()
        return self.layers[-1].out(self.norm(x))


def test_targets_by_name_suffix_and_unmatched_named():
    model = Tiny()
    adapted = apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=["q_proj", "layers.1.v_proj"])
    assert adapted == ["layers.0.q_proj", "layers.1.q_proj", "layers.1.v_proj"]
    assert lora_parameter_names(model) == {f"{n}.{p}" for n in adapted for p in ("lora_A", "lora_B")}
    refusal = r"\['gate_proj'\] match no linear layer of Tiny; .*\['out', 'q_proj', 'v_proj'\]"
    with pytest.raises(ConfigError, match=refusal):
        apply_lora(Tiny(), rank=2, alpha=4.0, dropout=0.0, targets=["q_proj", "gate_proj"])


def test_only_the_adapter_trains():
    torch.manual_seed(0)
    model = Tiny()
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=["q_proj", "v_proj"])
    init_lora(model, seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    for _ in range(2):  # the first step moves only B (A's gradient is B^T ... = 0); the second moves A too
        model(torch.randn(4, 8)).square().mean().backward()
        clip_gradients(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed == lora_parameter_names(model)
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
        id(p) for name, p in model.named_parameters() if name in changed
    }


def test_init_is_seeded_and_starts_at_the_base_model():
    models = [Tiny(), Tiny()]
    for model in models:
        apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=["q_proj"])
        init_lora(model, seed=3)
    a, b = (adapter_tensors(m, torch.float32) for m in models)
    assert a.keys() == b.keys() == {tensor_name(f"layers.{i}.q_proj", part) for i in (0, 1) for part in "AB"}
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert all(not t.any() for name, t in a.items() if name.endswith("lora_B.weight"))
    assert all(t.abs().max() <= 8**-0.5 and t.any() for name, t in a.items() if name.endswith("lora_A.weight"))
    assert adapter_checksum(a.items()) == adapter_checksum(reversed(b.items()))  # in name order, whatever given


def test_peft_names_round_trip_and_vllm_ranks():
    name = tensor_name("model.layers.0.self_attn.q_proj", "B")
    assert name == "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert parse_tensor_name(name) == ("model.layers.0.self_attn.q_proj", "B")
    for bad in ("model.layers.0.q_proj.weight", "base_model.model.lora_A.weight", "x.lora_A.weight"):
        with pytest.raises(ValueError, match="is not a LoRA tensor name"):
            parse_tensor_name(bad)
    assert [next_vllm_rank(r) for r in (1, 2, 8, 9, 320, 512)] == [1, 8, 8, 16, 320, 512]


def test_lora_section_on_from_the_command_line():
    assert TrainerConfig(lora="true").lora.rank == 16
    assert TrainerConfig(lora={"rank": 4, "target_modules": ["q_proj"]}).lora.target_modules == ["q_proj"]
    assert TrainerConfig().lora is None


def resolved(*argv: str):
    from rl.config import parse_config
    from rl.launcher.config import RLConfig
    from rl.launcher.resolve import resolve
    from rl.launcher.devices import cpu_plan
    from rl.launcher.placement import given_host

    config = parse_config(RLConfig, ["--model.name", "m", "--output-dir", "/tmp/x", *argv])
    return resolve(config, given_host(config, cpu_plan(2, 1)))


def test_the_launcher_derives_lora_serving_from_the_trainer():
    r = resolved("--trainer.lora.rank", "10")
    assert (r.inference.lora.max_rank, r.inference.lora.name) == (16, "policy-lora")  # vLLM takes 16, not 10
    assert r.orchestrator.adapter == "policy-lora"
    assert resolved().inference.lora is None and resolved().orchestrator.adapter is None
    merged = resolved("--trainer.lora.publish-merged", "true")
    assert merged.inference.lora is None and merged.orchestrator.adapter is None  # full weights are served


def test_lora_settings_that_cannot_serve_are_named():
    with pytest.raises(ConfigError, match="trainer.lora.rank = 32 is above inference.lora.max_rank = 16"):
        resolved("--trainer.lora.rank", "32", "--inference.lora.max-rank", "16")
    with pytest.raises(ConfigError, match="inference.lora.name = 'm' is the model's name"):
        resolved("--trainer.lora", "true", "--inference.lora.name", "m")
    with pytest.raises(ConfigError, match="inference.lora is set but the trainer publishes full weights"):
        resolved("--inference.lora.max-rank", "8")


def test_an_unmatched_target_is_refused_before_anything_starts(tiny_model):
    from rl.checks import check_lora_targets

    config = TrainerConfig(model={"name": str(tiny_model)}, lora={"target_modules": ["q_proj", "qkv_proj"]})
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\] match no linear layer of Qwen3ForCausalLM; its linear "
                                          r"layers are named \['down_proj', 'gate_proj', 'k_proj'"):
        check_lora_targets(config)
    check_lora_targets(TrainerConfig(model={"name": str(tiny_model)}, lora={}))


@pytest.mark.parametrize("arch, why", [("qwen3_moe", "MoE LoRA kernels need Triton"),
                                       ("qwen3_5", "linear-attention layers take no adapter")])
def test_lora_adapters_vllm_cannot_serve_on_cpu_are_refused_naming_the_way_out(arch, why, tmp_path):
    from rl.config import ModelConfig
    from rl.launcher.resolve import check_cpu_lora
    from rl.tiny_model import build_tiny_model
    from rl.trainer.config import LoraConfig

    model = build_tiny_model(tmp_path / arch, arch=arch)
    adapters = TrainerConfig(model=ModelConfig(name=str(model)), lora=LoraConfig())
    with pytest.raises(ConfigError, match=f"vLLM 0.32 on CPU cannot serve its adapters.*{why}.*publish_merged = true"):
        check_cpu_lora(adapters, "cpu")
    check_cpu_lora(adapters, "cuda")  # vLLM's GPU kernels (not run here)
    check_cpu_lora(TrainerConfig(model=ModelConfig(name=str(model)), lora=LoraConfig(publish_merged=True)), "cpu")
    dense = build_tiny_model(tmp_path / "dense")
    check_cpu_lora(TrainerConfig(model=ModelConfig(name=str(dense)), lora=LoraConfig()), "cpu")
