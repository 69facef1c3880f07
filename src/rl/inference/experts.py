"""An MoE's experts as vLLM serves them, read back under their checkpoint names for the fingerprint
(rl/inference/fingerprint.py).

vLLM keeps a layer's experts fused: `w13_weight` [E, 2I, H] (each expert's gate_proj rows, then its up_proj rows)
and `w2_weight` [E, H, I] (down_proj), on the module under `<layer>.mlp.experts`. With tensor parallel, every worker
holds every expert's rows [t I/T, (t + 1) I/T) of gate and up, and those columns of down. On CPU, vLLM 0.32 pads I to
a multiple of 32 and re-packs both tensors into its kernel's blocked layout (same shape, elements permuted): the
permutation is found by running vLLM's own packing on tensors of element indices (their base-256 digits, exact in
every float dtype), and inverted on the very buffers the kernel reads.

The fused kernel computes down(act(gate x) * up x), so gate and up cannot be read through it one by one, as the
fingerprint reads a linear layer. Instead each expert's kernel output on random inputs is compared with that
composite computed from the weights read back; where they disagree, the expert's fingerprints are spoiled (NaN):
what was read back is not what the kernel computes with, and verification fails naming the tensors.
"""

from __future__ import annotations

import functools
import math

import torch

from rl.inference.sharding import Shard

KERNEL_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
CHECK_TOKENS = 3


def is_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is vLLM's fused experts of an MoE layer (`<layer>.mlp.experts.routed_experts`)."""
    return hasattr(module, "w13_weight") and hasattr(module, "moe_config")


def served_experts(prefix: str, layer) -> dict[str, tuple[torch.Tensor, tuple[int, int], Shard | None]]:
    """Checkpoint name -> (this worker's part [out, in] as the kernel reads it, the whole tensor's shape, the part's
    shard) of every expert's gate_proj, up_proj and down_proj."""
    isa = kernel_isa(layer)
    w13, w2 = unpack(layer.w13_weight, isa), unpack(layer.w2_weight, isa)
    padded = w13.shape[1] // 2  # the intermediate size per worker after the CPU kernel's rounding up
    config = layer.moe_config
    inter = config.intermediate_size_per_partition_unpadded or padded
    hidden = config.hidden_dim_unpadded or w13.shape[2]
    rank, size = getattr(config, "tp_rank", 0), getattr(config, "tp_size", 1)
    full = inter * size
    rows = Shard(0, rank * inter, inter) if size > 1 else None
    cols = Shard(1, rank * inter, inter) if size > 1 else None
    out = {}
    for local in range(w13.shape[0]):
        base = f"{prefix}.{global_expert(layer, local)}"
        out[f"{base}.gate_proj.weight"] = (w13[local, :inter, :hidden], (full, hidden), rows)
        out[f"{base}.up_proj.weight"] = (w13[local, padded:padded + inter, :hidden], (full, hidden), rows)
        out[f"{base}.down_proj.weight"] = (w2[local, :hidden, :inter], (hidden, full), cols)
    return out


def kernel_disagreements(prefix: str, layer, served: dict) -> list[str]:
    """The experts whose kernel output on random inputs is not down(silu(gate x) * up x) of the weights read back
    (relative to the size of its terms, beyond rounding), by their checkpoint prefix."""
    tolerance = KERNEL_TOLERANCE.get(layer.w13_weight.dtype, 2e-2)
    hidden = layer.w13_weight.shape[2]
    x = torch.randn(CHECK_TOKENS, hidden, generator=torch.Generator().manual_seed(hidden))
    x = x.to(layer.w13_weight.device, layer.w13_weight.dtype)
    wrong = []
    for local in range(layer.w13_weight.shape[0]):
        base = f"{prefix}.{global_expert(layer, local)}"
        gate, up, down = (served[f"{base}.{p}_proj.weight"][0].double() for p in ("gate", "up", "down"))
        h = torch.nn.functional.silu(x.double() @ gate.T) * (x.double() @ up.T)
        scale = (h.abs() @ down.abs().T).max().item()
        y = kernel_output(layer, x, local).double()
        if not (y - h @ down.T).abs().max().item() <= tolerance * max(scale, 1e-30):  # NaN fails too
            wrong.append(base)
    return wrong


def kernel_output(layer, x: torch.Tensor, local: int) -> torch.Tensor:
    """The layer's own fused kernel on x [N, H], every token routed to its local expert `local` with weight 1."""
    ids = torch.full((len(x), 1), local, dtype=torch.int32, device=x.device)
    weights = torch.ones(len(x), 1, dtype=torch.float32, device=x.device)
    return layer.quant_method.apply(layer, x, weights, ids, None, None)


def kernel_isa(layer) -> str | None:
    """The CPU kernel's instruction set its weights are packed for; None where they are not packed (GPU)."""
    experts = getattr(getattr(layer.quant_method, "moe_kernel", None), "fused_experts", None)
    if experts is None or getattr(experts, "_use_zentorch", False) or layer.w13_weight.device.type != "cpu":
        return None
    return getattr(experts, "isa", None)


def global_expert(layer, local: int) -> int:
    expert_map = getattr(layer, "expert_map", None)  # global -> local id (-1: another rank's); None: no EP
    return local if expert_map is None else int((expert_map == local).nonzero()[0, 0])


def unpack(packed: torch.Tensor, isa: str | None) -> torch.Tensor:
    """[E, rows, cols] in the kernel's layout -> vLLM's logical layout."""
    if isa is None:
        return packed.detach()
    experts, rows, cols = packed.shape
    order = packing_order(rows, cols, packed.dtype, isa)
    out = torch.empty_like(packed)
    out.view(experts, -1)[:, order] = packed.detach().reshape(experts, -1)
    return out


@functools.lru_cache(maxsize=16)
def packing_order(rows: int, cols: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """order [rows * cols]: packed.flatten() == w.flatten()[order] for one expert's [rows, cols], found by packing
    each base-256 digit of the element indices with vLLM's own op; checked to be a permutation."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    n = rows * cols
    index = torch.arange(n, dtype=torch.int64)
    order = torch.zeros(n, dtype=torch.int64)
    for digit in range(max(1, math.ceil(math.log(n, 256)))):
        digits = ((index >> (8 * digit)) & 255).to(dtype).reshape(1, rows, cols)
        order |= cpu_prepack_moe_weight(digits, isa).reshape(-1).to(torch.int64) << (8 * digit)
    if not torch.equal(order.sort().values, index):
        raise RuntimeError(f"vLLM's MoE packing for {isa} is not a permutation of the elements: rl cannot read the "
                           "experts back")
    return order
