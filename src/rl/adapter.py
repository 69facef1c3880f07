"""The LoRA adapter layout trainer and inference share: PEFT's `adapter_model.safetensors` (tensors
`base_model.model.<module>.lora_A.weight` [rank, in] and `...lora_B.weight` [out, rank]) beside a PEFT
`adapter_config.json`, as `peft.save_pretrained` writes them and vLLM loads them. A published step that
holds `adapter_config.json` is an adapter step; the served output is W x + (alpha / rank) B A x.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

import xxhash

if TYPE_CHECKING:  # imported where a checksum is taken: the launcher reads only this layout's names
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
# The attention and MLP projections of Llama-style models (Qwen3 among them).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# vLLM 0.32 takes only these as --max-lora-rank.
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def tensor_name(module: str, part: Literal["A", "B"]) -> str:
    """PEFT's file name of a module's A or B matrix: module `model.layers.0.self_attn.q_proj`."""
    return f"{PEFT_PREFIX}{module}.lora_{part}.weight"


def parse_tensor_name(name: str) -> tuple[str, Literal["A", "B"]]:
    """(module, "A" | "B") of a PEFT tensor name; ValueError naming it otherwise."""
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if name.startswith(PEFT_PREFIX) and name.endswith(suffix) and len(name) > len(PEFT_PREFIX) + len(suffix):
            return name[len(PEFT_PREFIX):-len(suffix)], part
    raise ValueError(f"{name!r} is not a LoRA tensor name ({PEFT_PREFIX}<module>.lora_A.weight or .lora_B.weight)")


def adapter_config(base_model: str, rank: int, alpha: float, dropout: float, targets: Iterable[str]) -> dict:
    """PEFT's adapter_config.json for a plain LoRA (no bias, no rsLoRA/DoRA, no extra trained modules)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def adapter_config_bytes(base_model: str, rank: int, alpha: float, dropout: float, targets: Iterable[str]) -> bytes:
    return json.dumps(adapter_config(base_model, rank, alpha, dropout, targets), indent=2).encode()


def scaling(config: dict) -> float:
    """What B A is multiplied by: lora_alpha / r (PEFT's rule without rsLoRA)."""
    return float(config["lora_alpha"]) / int(config["r"])


def adapter_checksum(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """xxh3-128 over every tensor's name, dtype, shape and bytes, in name order: the trainer takes it of what it
    writes, inference of what it read and verified served; equal checksums name the same adapter."""
    import torch

    digest = xxhash.xxh3_128()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def next_vllm_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for allowed in VLLM_MAX_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {VLLM_MAX_RANKS[-1]}")
