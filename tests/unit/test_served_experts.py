"""Reading an MoE's experts back from vLLM (rl/inference/experts.py): vLLM's CPU packing undone, every expert's
gate/up/down under its checkpoint name with a tensor-parallel worker's shard, and an expert whose kernel does not
compute with what was read back spoils its fingerprints, so verification fails naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl.inference.experts import kernel_disagreements, served_experts, unpack
from rl.inference.fingerprint import FileTally, _expert_prints, compare

EXPERTS, HIDDEN, INTER = 4, 64, 32


def packer():
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
    except (ImportError, AttributeError) as e:
        pytest.skip(f"vLLM's CPU MoE packing is not here: {e}")
    return cpu_prepack_moe_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER)])
def test_vllms_cpu_packing_is_undone_element_for_element(dtype, shape):
    w = torch.randn(shape).to(dtype)
    packed = packer()(w, "vec")
    assert not torch.equal(packed, w)  # the kernel's layout is not the checkpoint's
    assert torch.equal(unpack(packed, "vec"), w)


class Kernel:
    """A stand-in for vLLM's fused-MoE method: down(silu(gate x) * up x) of an expert, `wrong` experts off."""

    def __init__(self, layer, wrong=()):
        self.layer, self.wrong = layer, set(wrong)

    def apply(self, layer, x, weights, ids, *_):
        e = int(ids[0, 0])
        w13, w2 = layer.w13_weight[e], layer.w2_weight[e]
        gate, up = w13[:INTER // layer.moe_config.tp_size], w13[INTER // layer.moe_config.tp_size:]
        y = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ w2.T
        return y * 1.01 if e in self.wrong else y


def layer(tp_rank=0, tp_size=1, wrong=()):
    inter = INTER // tp_size
    module = SimpleNamespace(
        w13_weight=torch.randn(EXPERTS, 2 * inter, HIDDEN), w2_weight=torch.randn(EXPERTS, HIDDEN, inter),
        moe_config=SimpleNamespace(intermediate_size_per_partition_unpadded=inter, hidden_dim_unpadded=HIDDEN,
                                   tp_rank=tp_rank, tp_size=tp_size), expert_map=None)
    module.quant_method = Kernel(module, wrong)
    return module


def test_each_expert_is_read_under_its_checkpoint_name_with_its_shard():
    served = served_experts("model.layers.0.mlp.experts", layer(tp_rank=1, tp_size=2))
    assert len(served) == 3 * EXPERTS
    part, shape, shard = served["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert part.shape == (INTER // 2, HIDDEN) and shape == (INTER, HIDDEN) and (shard.dim, shard.start) == (0, 16)
    part, shape, shard = served["model.layers.0.mlp.experts.3.down_proj.weight"]
    assert part.shape == (HIDDEN, INTER // 2) and shape == (HIDDEN, INTER) and (shard.dim, shard.start) == (1, 16)


def test_an_expert_the_kernel_does_not_compute_with_fails_verification_by_name():
    served_layer = layer(wrong={2})
    served = served_experts("m.experts", served_layer)
    assert kernel_disagreements("m.experts", served_layer, served) == ["m.experts.2"]
    files = FileTally(torch.float32)
    for _ in files.through((name, part.clone()) for name, (part, _, _) in served.items()):
        pass
    report = compare(_expert_prints("m.experts", served_layer, torch.float32), files.prints, torch.float32)
    assert not report["ok"] and {d.split(":")[0] for d in report["differing"]} == {
        f"m.experts.2.{p}_proj.weight" for p in ("down", "gate", "up")}
    served_layer.quant_method.wrong.clear()  # the kernel computes with what is read back: every expert verifies
    assert compare(_expert_prints("m.experts", served_layer, torch.float32), files.prints, torch.float32)["ok"]


def test_the_cpu_moe_plugin_patches_vllm_only_where_the_server_asked(monkeypatch):
    """vLLM runs rl's plugin in every process it starts, forked or spawned; it patches only where the inference server
    set RL_VLLM_CPU_MOE (an MoE on a CPU host): the reload's packing, and with "record" the routed-experts recorder."""
    from vllm.config.vllm import VllmConfig
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from rl import patches

    for cls, name in ((UnquantizedFusedMoEMethod, "_setup_kernel"), (VllmConfig, "_verify_aux_output_compatibility"),
                      (CPUModelRunner, "load_model"), (CPUModelRunner, "execute_model"),
                      (CPUModelRunner, "sample_tokens")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # put back after the test
    monkeypatch.setattr(CPUModelRunner, "rl_routed_experts", False, raising=False)
    monkeypatch.delenv(patches.MOE_ENV, raising=False)
    patches.vllm_cpu_moe()
    assert not getattr(UnquantizedFusedMoEMethod._setup_kernel, "rl_packs_reloads", False)
    monkeypatch.setenv(patches.MOE_ENV, "reload")
    patches.vllm_cpu_moe()
    assert UnquantizedFusedMoEMethod._setup_kernel.rl_packs_reloads and not CPUModelRunner.rl_routed_experts
    monkeypatch.setenv(patches.MOE_ENV, "record")
    patches.vllm_cpu_moe()
    assert CPUModelRunner.rl_routed_experts
