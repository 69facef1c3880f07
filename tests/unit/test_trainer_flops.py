import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rl.trainer.flops import frozen_matmul_params, matmul_params, peak_flops, train_flops
from rl.trainer.lora import apply_lora


def test_train_flops_by_hand():
    # N = 10, L = 2, d = 4: a 3-token sample costs 6*10*3 + 12*2*4*3^2 = 180 + 864; a 1-token one 60 + 96
    assert train_flops(10, 2, 4, [3]) == 1044
    assert train_flops(10, 2, 4, [3, 1]) == 1044 + 156


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_count_the_head_once_and_not_the_embedding_lookup(tied):
    config = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=32, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(config)
    embedding, layers = 50 * 32, sum(p.numel() for p in model.model.layers.parameters())
    assert sum(p.numel() for p in model.parameters()) == (embedding if tied else 2 * embedding) + layers + 32
    # the head's matmul counts (tied or not), the embedding lookup does not
    assert matmul_params(model) == layers + 32 + embedding


@pytest.mark.parametrize("tied", [True, False])
def test_with_lora_only_the_adapter_has_weight_gradients(tied):
    config = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=32, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(config)
    assert frozen_matmul_params(model) == 0
    apply_lora(model, rank=2, alpha=4.0, dropout=0.0, targets=["q_proj", "down_proj"])
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert matmul_params(model) - frozen_matmul_params(model) == adapter  # the head is frozen, tied or not
    assert train_flops(10, 2, 4, [3], frozen=4) == 1044 - 2 * 4 * 3  # no weight gradient: 4 F T, not 6 F T


def test_no_peak_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


@pytest.mark.parametrize("name, sms, part", [
    ("NVIDIA H100 80GB HBM3", 132, "H100 SXM"),
    ("NVIDIA H100 PCIe", 114, "H100 PCIe"),
    ("NVIDIA H100", 114, "H100 PCIe"),  # the form factor told by the SM count
    ("NVIDIA H100 NVL", 132, "H100 NVL"),
    ("NVIDIA H200", 132, "H200 SXM"),
    ("NVIDIA H200 NVL", 132, "H200 NVL"),
    ("NVIDIA A100-SXM4-40GB", 108, "A100 (40 and 80 GB, SXM and PCIe)"),
    ("NVIDIA A100 80GB PCIe", 108, "A100 (40 and 80 GB, SXM and PCIe)"),
    ("NVIDIA L40S", 142, "L40S"),
    ("NVIDIA B200", 148, "B200"),
])
def test_the_peak_is_the_parts_own(monkeypatch, name, sms, part):
    """Any name holding "H100" once got the SXM peak: PCIe (756 TFLOP/s) and NVL (835) parts differ."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, multi_processor_count=sms))
    peak, found = peak_flops(torch.device("cuda", 0))
    assert found == part
    assert peak == {"H100 SXM": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200 SXM": 989e12,
                    "H200 NVL": 835e12, "L40S": 362e12, "B200": 2250e12}.get(part, 312e12)


def test_an_unknown_gpu_has_no_peak(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name="NVIDIA T4", multi_processor_count=40))
    assert peak_flops(torch.device("cuda", 0)) is None
