"""Qwen3.5's linear attention (Gated DeltaNet) on both sides: the trainer keeps a packed row's samples apart
(trainer/linear_attention.py), and vLLM's CPU op computes float32 as transformers does (patches/gdn.py), prefill and
decode, from a slot's state or from zero."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl.tiny_model import build_tiny_model
from rl.trainer.attention import PACKED_SDPA
from rl.trainer.linear_attention import forward_by_sample, separate_samples


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("q35") / "m", arch="qwen3_5")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=PACKED_SDPA).eval()


def packed_logits(model, samples: list[torch.Tensor]) -> torch.Tensor:
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    lengths = tuple(len(s) for s in samples)
    with torch.no_grad():  # sample_lengths reach every layer, as in the trainer (attention: rl's packed sdpa)
        return model(input_ids=ids, position_ids=positions, sample_lengths=lengths).logits[0]


def test_a_packed_row_computes_each_sample_as_if_alone(qwen3_5):
    torch.manual_seed(0)
    samples = [torch.randint(3, 100, (n,)) for n in (7, 12, 5)]
    with torch.no_grad():
        alone = torch.cat([qwen3_5(input_ids=s[None]).logits[0] for s in samples])
    leaking = packed_logits(qwen3_5, samples)
    assert (leaking - alone)[7:].abs().max() > 1e-3  # the second sample starts from the first one's state
    assert separate_samples(qwen3_5) == 3  # three linear-attention layers of four
    assert torch.allclose(packed_logits(qwen3_5, samples), alone, atol=1e-5)


def test_a_row_that_its_lengths_do_not_describe_is_refused():
    with pytest.raises(ValueError, match=r"sample_lengths \[3, 3\] \(sum 6\) do not describe one packed row of 5"):
        forward_by_sample(lambda h, **kw: h, hidden_states=torch.zeros(1, 5, 8), sample_lengths=(3, 3))


def test_vllm_cpu_op_in_float32_equals_transformers_across_prefill_and_decode(qwen3_5):
    """A 9-token prefill into slot 2 then 3 one-token decodes, through `float32_core` with vLLM's own conv kernels,
    against transformers' layer on all 12 tokens at once."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from rl.patches.gdn import float32_core

    ref = qwen3_5.model.layers[0].linear_attn
    torch.manual_seed(1)
    x = torch.randn(1, 12, qwen3_5.config.hidden_size)
    with torch.no_grad():
        expected = core_of(ref, x)  # [12, heads, d_v]
        qkv = ref.in_proj_qkv(x)[0]
        b, a = ref.in_proj_b(x)[0], ref.in_proj_a(x)[0]
    heads, d = ref.num_v_heads, ref.head_v_dim
    layer = SimpleNamespace(
        conv1d=ref.conv1d, activation="silu", A_log=ref.A_log.detach(), dt_bias=ref.dt_bias.detach(),
        key_dim=ref.key_dim, value_dim=ref.value_dim, tp_size=1, head_k_dim=ref.head_k_dim, head_v_dim=d,
        kv_cache=(torch.zeros(4, ref.conv_kernel_size - 1, ref.conv_dim), torch.full((4, heads, d, d), float("nan"))))
    layer.rearrange_mixed_qkv = lambda t: QwenGatedDeltaNetAttention.rearrange_mixed_qkv(layer, t)
    slot = torch.tensor([2], dtype=torch.int32)
    out = torch.zeros(12, heads, d)
    with torch.no_grad():
        float32_core(layer, step(prefill=9), qkv[:9], b[:9], a[:9], out[:9])
        for t in range(9, 12):
            float32_core(layer, step(prefill=0, slot=slot), qkv[t:t + 1], b[t:t + 1], a[t:t + 1], out[t:t + 1])
    assert torch.allclose(out, expected, atol=1e-5), (out - expected).abs().max()


def step(prefill: int, slot=torch.tensor([2], dtype=torch.int32)):
    """vLLM's metadata for one sequence in `slot`: a prefill of that many tokens from zero, or (0) one decode."""
    return SimpleNamespace(
        spec_sequence_masks=None, num_accepted_tokens=None, non_spec_state_indices_tensor=slot,
        non_spec_query_start_loc=torch.tensor([0, prefill or 1], dtype=torch.int32),
        num_decodes=0 if prefill else 1, num_decode_tokens=0 if prefill else 1,
        num_prefills=1 if prefill else 0, num_prefill_tokens=prefill, has_initial_state=torch.tensor([False]))


def core_of(layer, x: torch.Tensor) -> torch.Tensor:
    """transformers' GDN layer up to its gated norm: the core attention output [T, heads, d_v]."""
    captured = {}
    original = layer.norm.forward
    layer.norm.forward = lambda core, z: captured.setdefault("core", core) * 0
    try:
        layer(x)
    finally:
        layer.norm.forward = original
    return captured["core"].reshape(x.shape[1], layer.num_v_heads, layer.head_v_dim)


def test_vllms_qwen3_5_module_imports_without_torchvision_only_with_the_plugin():
    """vLLM's Qwen3.5 module imports transformers' torchvision image processor; the CPU stack has no torchvision.
    Each import in a fresh process (the plugin binds a module name for the whole process)."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["rl-qwen2-vl-without-torchvision"] == "rl.patches:qwen2_vl_without_torchvision"
    assert plugins["rl-cpu-gdn-float32"] == "rl.patches:gdn_float32_on_cpu"
    module = "import vllm.model_executor.models.qwen3_5"
    bare = subprocess.run([sys.executable, "-c", module], capture_output=True, text=True)
    assert bare.returncode != 0 and "torchvision" in bare.stderr
    patched = subprocess.run([sys.executable, "-c", "from rl.patches import qwen2_vl_without_torchvision as p; p(); "
                              + module], capture_output=True, text=True)
    assert patched.returncode == 0, patched.stderr[-2000:]
