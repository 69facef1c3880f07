"""Serving a LoRA adapter step: what a worker refuses before vLLM loads it, and how it proves what vLLM then serves.
(rl/adapter.py has the files: `adapter_model.safetensors`, A [r, in] and B [out, r] per module, and
`adapter_config.json`.)

vLLM holds an adapter in one slot of every LoRA layer it serves; a packed layer (`qkv_proj`, `gate_up_proj`) has
one slice per checkpoint module (q/k/v_proj, gate/up_proj). For slice s of a layer, slot i holds

    lora_a_stacked[s][i, 0] = A                      zero-padded to [max_rank, in]
    lora_b_stacked[s][i, 0] = B * (lora_alpha / r)   zero-padded to [out, max_rank]

with A and B cast to the served dtype first and the product taken in that dtype (vLLM's `optimize()` folds the
scaling into B). The read-back (`slot_differences`) compares every slice of every layer with exactly that, and a
slice the adapter does not target with zeros: an adapter vLLM silently ignored (upstream serves the base model for
an adapter that matches no module), a module loaded into another slice, a scaling applied twice or not at all,
or bytes vLLM read that differ from those checked are all caught, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import re

import torch

from rl.adapter import adapter_checksum, parse_tensor_name, scaling
from rl.inference.sharding import Shard, input_shard, output_parts

# adapter_config.json fields that change what vLLM computes from the same tensors (or that it refuses);
# rl's trainer writes none of them, and the read-back assumes scaling = lora_alpha / r.
NOT_PLAIN_LORA = ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "lora_bias")
# Largest alpha / r served: B A is scaled by it in the served dtype. PEFT's defaults give 1-2 (alpha = r or 2r); at
# 1e30 / r the products overflow and the adapter answers nothing.
MAX_SCALING = 1024.0
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class AdapterMismatch(ValueError):
    """An adapter that does not fit the served model's LoRA layers; `problems` names each reason."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems[:5]))
        self.problems = problems


@dataclass(frozen=True)
class LoraSlice:
    """Where one checkpoint module's adapter is served: slice `index` of vLLM's LoRA layer `layer`, which holds the
    module's whole A [r, in] and B [out, r] but for the part a tensor-parallel worker serves: `a_cols` of A (a
    row-parallel layer's input columns), `b_rows` of B (a column-parallel layer's output rows); None: all of it."""

    layer: str
    index: int
    out_features: int
    in_features: int
    max_rank: int
    a_cols: Shard | None = None
    b_rows: Shard | None = None


@dataclass
class Adapter:
    """An adapter step as read and checked: module -> (A [r, in], B [out, r]) in the file's dtype."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    alpha: float
    checksum: str  # rl.adapter.adapter_checksum of the file's tensors

    @property
    def scaling(self) -> float:
        return scaling({"r": self.rank, "lora_alpha": self.alpha})


def lora_slices(layers: dict, packed: dict[str, list[str]]) -> dict[str, LoraSlice]:
    """Checkpoint module name -> where vLLM serves its adapter, for every LoRA layer (`layers`: name -> layer with
    `lora_a_stacked` [slots, 1, max_rank, in] and `lora_b_stacked` [slots, 1, out, max_rank] per slice, and the layer
    it adapts as `base_layer`). A packed layer `x.qkv_proj` (packed["qkv_proj"] = [q_proj, k_proj, v_proj]) serves
    `x.q_proj` as slice 0, and so on. A layer whose slices do not map one to one on checkpoint modules serves none,
    and neither do the embedding and logits layers (rl's adapters target projections): an adapter for them is refused.
    Module names are vLLM's, which are Hugging Face's for Llama-style models; a model whose vLLM names differ (a
    weights mapper) has its adapters refused rather than guessed at."""
    slices = {}
    for name, layer in layers.items():
        parent, _, leaf = name.rpartition(".")
        parts = packed.get(leaf, [leaf])
        if not isinstance(layer.lora_a_stacked, tuple) or len(parts) != len(layer.lora_a_stacked):
            continue
        outputs = output_parts(layer.base_layer)
        if len(outputs) != len(parts):
            continue
        in_local, in_shard = input_shard(layer.base_layer)
        for index, part in enumerate(parts):
            a, b = layer.lora_a_stacked[index], layer.lora_b_stacked[index]
            a_cols = in_shard if in_shard is not None and a.shape[3] == in_local else None
            b_rows = outputs[index].shard if b.shape[2] != outputs[index].full else None
            module = f"{parent}.{part}" if parent else part
            slices[module] = LoraSlice(name, index, out_features=outputs[index].full,
                                       in_features=layer.base_layer.input_size, max_rank=a.shape[2],
                                       a_cols=a_cols, b_rows=b_rows)
    return slices


def check_config(config: object, max_rank: int) -> tuple[int, float]:
    """(r, lora_alpha) of a plain LoRA's adapter_config.json; AdapterMismatch naming what vLLM would not serve
    as the read-back expects."""
    if not isinstance(config, dict):
        raise AdapterMismatch([f"adapter_config.json holds {type(config).__name__}, not an object"])
    rank, alpha = config.get("r"), config.get("lora_alpha")
    problems = []
    if type(rank) is not int or rank < 1:
        problems.append(f"adapter_config.json: r is {rank!r}, not a positive integer")
    elif rank > max_rank:
        problems.append(f"adapter_config.json: rank {rank} is above the server's max rank {max_rank} "
                        "(inference.lora.max_rank)")
    if type(alpha) not in (int, float) or not 0 < alpha < float("inf"):
        problems.append(f"adapter_config.json: lora_alpha is {alpha!r}, not a positive number")
    elif type(rank) is int and rank >= 1 and alpha / rank > MAX_SCALING:
        problems.append(f"adapter_config.json: lora_alpha / r is {alpha / rank:.3g}, above {MAX_SCALING:g}: the "
                        "scaled B would overflow what the server computes")
    if config.get("peft_type") != "LORA":
        problems.append(f"adapter_config.json: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    problems += [f"adapter_config.json sets {key}: not a plain LoRA" for key in NOT_PLAIN_LORA if config.get(key)]
    if config.get("bias", "none") != "none":
        problems.append("adapter_config.json: bias is not 'none': not a plain LoRA")
    if problems:
        raise AdapterMismatch(problems)
    return rank, float(alpha)


def parse_adapter(tensors: Iterable[tuple[str, torch.Tensor]], config: object, slices: dict[str, LoraSlice]) -> Adapter:
    """The adapter a step's tensors and config hold, checked against the served LoRA layers (`lora_slices`) before
    vLLM sees it; AdapterMismatch naming every tensor that is not PEFT LoRA, maps to no served layer, lacks its
    other half, has a shape that does not fit or a value that is not finite, a config whose target_modules or
    layers_to_transform disagree with the served layers or the tensors, and an adapter that targets nothing."""
    tensors = list(tensors)
    rank, alpha = check_config(config, min((s.max_rank for s in slices.values()), default=0))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    problems = _target_problems(config, slices, tensors)
    for name, tensor in tensors:
        try:
            module, part = parse_tensor_name(name)
        except ValueError as error:
            problems.append(str(error))
            continue
        if module not in slices:
            problems.append(f"{name}: module {module!r} maps to no LoRA layer the server serves")
            continue
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            problems.append(f"{name}: holds values that are not finite (inf or NaN)")
        halves.setdefault(module, {})[part] = tensor
    pairs = {}
    for module, parts in sorted(halves.items()):
        if len(parts) != 2:
            have = next(iter(parts))
            problems.append(f"{module}: lora_{have}.weight without its lora_{'B' if have == 'A' else 'A'}.weight")
            continue
        problems += _shape_problems(module, parts["A"], parts["B"], rank, slices[module])
        pairs[module] = (parts["A"], parts["B"])
    if not tensors:
        problems.append("the adapter targets nothing: adapter_model.safetensors holds no tensor")
    if problems:
        raise AdapterMismatch(problems)
    return Adapter(pairs, rank, alpha, adapter_checksum(tensors))


def _target_problems(config: dict, slices: dict[str, LoraSlice], tensors: list) -> list[str]:
    """Where the config's target_modules and layers_to_transform name what the server does not serve, or disagree
    with the tensors (vLLM would load what the tensors say, not what the config says)."""
    problems = []
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if re.fullmatch(r"[\w.]+", targets) else targets
    if isinstance(targets, str):  # PEFT: a regular expression that must match a module's whole name
        try:
            if not any(re.fullmatch(targets, module) for module in slices):
                problems.append(f"adapter_config.json: target_modules {targets!r} matches no LoRA layer served")
        except re.error as error:
            problems.append(f"adapter_config.json: target_modules {targets!r} is not a regular expression: {error}")
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        for target in targets:
            if not any(module == target or module.endswith(f".{target}") for module in slices):
                problems.append(f"adapter_config.json: target module {target!r} matches no LoRA layer the server "
                                "serves")
    else:
        problems.append(f"adapter_config.json: target_modules is {targets!r}, not a module name, a list of them "
                        "or a regular expression")
    layers = config.get("layers_to_transform")
    if layers is None:
        return problems
    layers = [layers] if type(layers) is int else layers
    served = {int(m.group(1)) for module in slices if (m := LAYER_INDEX.search(module))}
    if not isinstance(layers, list) or not layers or any(type(i) is not int or i not in served for i in layers):
        return problems + [f"adapter_config.json: layers_to_transform is {config['layers_to_transform']!r}, not "
                           f"indices of the served layers (0..{max(served, default=-1)})"]
    for name, _ in tensors:
        if (m := LAYER_INDEX.search(name)) and int(m.group(1)) not in layers:
            problems.append(f"{name}: layer {m.group(1)} is not in layers_to_transform {layers}")
    return problems


def _shape_problems(module: str, a: torch.Tensor, b: torch.Tensor, rank: int, where: LoraSlice) -> list[str]:
    problems = []
    if tuple(a.shape) != (rank, where.in_features):
        problems.append(f"{module}: lora_A is {list(a.shape)}, the layer takes [r={rank}, in={where.in_features}]")
    if tuple(b.shape) != (where.out_features, rank):
        problems.append(f"{module}: lora_B is {list(b.shape)}, the layer takes [out={where.out_features}, r={rank}]")
    for part, tensor in (("A", a), ("B", b)):
        if not tensor.is_floating_point():
            problems.append(f"{module}: lora_{part} is {tensor.dtype}, not a floating-point tensor")
    return problems


def expected_slot(a: torch.Tensor, b: torch.Tensor, alpha_over_r: float, dtype: torch.dtype, max_rank: int,
                  where: LoraSlice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM's slot must hold for (A [r, in], B [out, r]): A [max_rank, in] and B * alpha / r [out, max_rank],
    zero-padded, in `dtype`, each cut to the part this worker serves (`where`); B is cast first and scaled in place
    as vLLM's `optimize()` does, so equality is exact."""
    if where is not None:
        a = a if where.a_cols is None else where.a_cols.of(a)
        b = b if where.b_rows is None else where.b_rows.of(b)
    rank = a.shape[0]
    scaled_b = b.to("cpu", dtype, copy=True)
    scaled_b *= alpha_over_r
    slot_a = torch.zeros(max_rank, a.shape[1], dtype=dtype)
    slot_b = torch.zeros(b.shape[0], max_rank, dtype=dtype)
    slot_a[:rank] = a.to("cpu", dtype)
    slot_b[:, :rank] = scaled_b
    return slot_a, slot_b


def slot_differences(layers: dict, slices: dict[str, LoraSlice], adapter: Adapter, slot: int, dtype: torch.dtype
                     ) -> list[str]:
    """Every way slot `slot` of the LoRA layers differs from `adapter` (see the module docstring); [] if it is
    exactly what the adapter's files say."""
    targeted = {(where.layer, where.index): module for module, where in slices.items() if module in adapter.pairs}
    problems = []
    for name, layer in layers.items():
        for index, (a_stack, b_stack) in enumerate(zip(*_stacks(layer), strict=True)):
            module = targeted.get((name, index))
            if module is None:
                if a_stack[slot].any() or b_stack[slot].any():  # NaN counts as nonzero
                    problems.append(f"{name} slice {index}: not targeted by the adapter, yet nonzero")
                continue
            served_a, served_b = a_stack[slot, 0].cpu(), b_stack[slot, 0].cpu()
            a, b = adapter.pairs[module]
            want_a, want_b = expected_slot(a, b, adapter.scaling, dtype, a_stack.shape[2], slices[module])
            if not torch.equal(served_a, want_a):
                problems.append(f"{module}: lora_A served differs from the file's by {_max_diff(served_a, want_a):.3g}")
            if not torch.equal(served_b, want_b):
                problems.append(f"{module}: lora_B served differs from the file's B * alpha / r by "
                                f"{_max_diff(served_b, want_b):.3g}")
    return problems


def _stacks(layer) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A layer's A and B stacks per slice: vLLM's linear LoRA layers keep a tuple of slices, its embedding and
    logits layers one tensor (slot first in every layout)."""
    a, b = layer.lora_a_stacked, layer.lora_b_stacked
    return (a, b) if isinstance(a, tuple) else ((a,), (b,))


def _max_diff(served: torch.Tensor, wanted: torch.Tensor) -> float:
    return (served.float() - wanted.float()).abs().max().item()
