"""LoRA in the trainer: each target linear layer keeps its base weight, frozen, and gains A [rank, in] and
B [out, rank], so that y = W x + b + (alpha / rank) B A dropout(x). The layers are swapped in on the meta
device before FSDP2 shards the model, so A and B are sharded (dim 0) with the rest; only they get gradients
and optimizer state. A starts as nn.Linear's (and PEFT's) kaiming-uniform, B at zero: step 0 is the base model.

The base weight keeps its Hugging Face name (`...q_proj.weight`), so the model still loads from the base files
and merged weights publish under the names vLLM loads; A and B publish in PEFT's layout (rl/adapter.py).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from rl.adapter import tensor_name
from rl.config import ConfigError


class LoRALinear(nn.Module):
    """A linear layer with a low-rank update. `enabled = False` computes the base layer alone (the reference
    policy of the KL penalty)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **factory))
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        return out + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def matches(module_name: str, target: str) -> bool:
    """PEFT's rule for a list of target names: the module's name is the target or ends with `.<target>`."""
    return module_name == target or module_name.endswith(f".{target}")


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if type(module) is nn.Linear]


def check_targets(model: nn.Module, targets: list[str]) -> dict[str, list[str]]:
    """Target -> the linear layers it names; ConfigError naming every target that names none (LoRA on no
    layer would train nothing while looking like a run)."""
    linears = linear_names(model)
    found = {target: [name for name in linears if matches(name, target)] for target in targets}
    unmatched = [target for target, names in found.items() if not names]
    if unmatched:
        leaves = sorted({name.rpartition(".")[2] for name in linears})
        raise ConfigError(f"trainer.lora.target_modules {unmatched} match no linear layer of {type(model).__name__}; "
                          f"its linear layers are named {leaves}")
    return found


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str]) -> list[str]:
    """Swap every target linear layer for a LoRALinear and freeze everything but A and B; return the names of
    the adapted layers. Call before sharding (on the meta device: A and B are filled by `init_lora`)."""
    adapted = sorted({name for names in check_targets(model, targets).values() for name in names})
    model.requires_grad_(False)
    for name in adapted:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, LoRALinear(getattr(owner, leaf), rank, alpha, dropout))
    return adapted


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def lora_parameter_names(model: nn.Module) -> set[str]:
    """State-dict names of every A and B: the only tensors the base model's files lack."""
    return {f"{name}.{part}" for name in lora_layers(model) for part in ("lora_A", "lora_B")}


def _local_rows(param: torch.Tensor, rows: int) -> tuple[torch.Tensor, slice]:
    """This rank's tensor of `param` and the rows of the full tensor it holds (FSDP2: dim 0 in chunks of
    ceil(rows / world size))."""
    if not isinstance(param, DTensor):
        return param, slice(0, rows)
    world = param.device_mesh.size()
    chunk = -(-rows // world)
    start = min(param.device_mesh.get_local_rank() * chunk, rows)
    return param.to_local(), slice(start, min(start + chunk, rows))


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (nn.Linear's kaiming-uniform with a = sqrt(5)), B = 0. Every full A comes
    from one generator seeded with `seed`, layer by layer in name order, and each rank keeps its rows: the
    adapter is the same whatever the number of ranks."""
    generator = torch.Generator().manual_seed(seed)
    for _, layer in sorted(lora_layers(model).items()):
        bound = 1 / math.sqrt(layer.in_features)
        full = torch.empty(layer.rank, layer.in_features).uniform_(-bound, bound, generator=generator)
        local, rows = _local_rows(layer.lora_A, layer.rank)
        local.copy_(full[rows].to(local.dtype))
        _local_rows(layer.lora_B, layer.out_features)[0].zero_()


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model: every LoRALinear computes W x + b alone inside the block."""
    layers = lora_layers(model).values()
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.enabled = True


def full_tensor(tensor: torch.Tensor, dtype: torch.dtype, to_host: bool = True, on_device: bool = False
                ) -> torch.Tensor | None:
    """Collective for a DTensor: the whole tensor in `dtype` on the CPU, never sharing memory with the parameter
    (the optimizer updates it in place while a background write may still be reading). `to_host` False: the
    gather only (a rank that does not keep the tensor copies nothing to the host), None. `on_device`: the whole
    tensor where the gather left it (the parameter's device), for a broadcast from there."""
    tensor = tensor.detach()
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    cast = tensor.to(dtype)
    full = cast.full_tensor() if isinstance(cast, DTensor) else cast
    if not to_host and not on_device:
        return None
    if not on_device:
        full = full.cpu()
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.clone()
    return full.contiguous()


def adapter_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Collective: every A and B, whole, in `dtype`, under PEFT's names (every rank gets them; they are small)."""
    tensors = {}
    for name, layer in sorted(lora_layers(model).items()):
        tensors[tensor_name(name, "A")] = full_tensor(layer.lora_A, dtype)
        tensors[tensor_name(name, "B")] = full_tensor(layer.lora_B, dtype)
    return tensors


def merged_weight(layer: LoRALinear, dtype: torch.dtype) -> torch.Tensor:
    """Collective: W + scaling B A, whole, in `dtype` on the CPU, computed in float32."""
    weight = full_tensor(layer.weight, torch.float32)
    lora_a, lora_b = full_tensor(layer.lora_A, torch.float32), full_tensor(layer.lora_B, torch.float32)
    return torch.addmm(weight, lora_b, lora_a, alpha=layer.scaling).to(dtype)
